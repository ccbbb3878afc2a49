"""Where each leaf of an xmap lives: named dims on their planned mesh axes, positional dims
as stated by the spec, else as the data already is.

Named dims are the *mapped* ones; their placement comes from the layout. Every other dim is
positional, and its sharding belongs to the data, not to xmap:

* a spec may state it (``PartitionSpec`` or ``Logical`` leaf): that is used for the input
  placement, the loop carries and the output constraint;
* otherwise a committed input keeps its sharding on positional dims (minus mesh axes its
  named dims now take), a traced input keeps whatever it has (``UNCONSTRAINED``), and an
  output is left to XLA's propagation (``UNCONSTRAINED``; replicated on Explicit meshes,
  whose types need a concrete spec).

This module computes PartitionSpec entries; it does not trace.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from partition._base import mesh as _mesh
from partition._base.errors import ResourceError, format_message
from partition._base.mesh import entry_mesh_axes, to_spec_entry
from partition._xmap.layout import MapLayout
from partition._xmap.specs import AxisSpec, Logical

UNCONSTRAINED = PartitionSpec.UNCONSTRAINED
Entry = Any  # a PartitionSpec entry: None, a mesh axis, a tuple of mesh axes, UNCONSTRAINED


def named_mesh_axes(layout: MapLayout, spec: AxisSpec) -> set[str]:
  return {a for name in spec.names for a in layout.axes[name].mesh_axes}


def stated_entries(layout: MapLayout, spec: AxisSpec, positional_shape: Sequence[int], rules: Any,
                   where: str, fun: str) -> tuple[Entry, ...] | None:
  """The positional entries a spec states (``None`` if it states none), checked."""
  sharding = spec.sharding
  if sharding is None:
    return None
  n = len(positional_shape)
  if isinstance(sharding, Logical):
    if rules is None and any(sharding.names):
      raise ResourceError(format_message(
          f"xmap({fun}): {where} is {sharding!r}, but there are no rules to resolve "
          "logical axes.",
          fix="Pass axis_resources=<AxisRules>, or call under `with partition.axis_rules("
              "rules, mesh):`, or state mesh axes with a PartitionSpec leaf instead."))
    if len(sharding.names) > n:
      raise ResourceError(format_message(
          f"xmap({fun}): {where} is {sharding!r} with {len(sharding.names)} logical axes, but "
          f"the value has {n} positional dims (shape {tuple(positional_shape)}).",
          fix="Give one logical name (or None) per positional dim (named dims excluded)."))
    names = sharding.names + (None,) * (n - len(sharding.names))
    entries = tuple(rules.spec(names, tuple(positional_shape), layout.mesh)) if any(names) else ()
  else:
    if len(sharding) > n:
      raise ResourceError(format_message(
          f"xmap({fun}): {where} is {sharding!r} with {len(sharding)} entries, but the value "
          f"has {n} positional dims (shape {tuple(positional_shape)}).",
          fix="Give at most one entry per positional dim (named dims excluded)."))
    entries = tuple(sharding)
  entries = entries + (None,) * (n - len(entries))
  _check_stated(layout, spec, entries, positional_shape, where, fun)
  return entries


def _check_stated(layout, spec, entries, shape, where, fun) -> None:
  sizes = _mesh.axis_sizes(layout.mesh)
  taken = named_mesh_axes(layout, spec)
  problems, seen = [], set()
  for d, entry in enumerate(entries):
    axes = entry_mesh_axes(entry)
    missing = [a for a in axes if a not in sizes]
    if missing:
      problems.append(f"positional dim {d} uses mesh axes {missing} that the mesh "
                      f"({_mesh.describe(layout.mesh)}) does not have")
      continue
    clash = [a for a in axes if a in taken or a in seen]
    if clash:
      problems.append(f"positional dim {d} uses mesh axes {clash} that another dim of the "
                      "same value (a named axis or a positional dim) already uses")
    seen.update(axes)
    total = _mesh.resource_size(layout.mesh, axes)
    if shape[d] % total:
      problems.append(f"positional dim {d} has size {shape[d]}, not divisible by the {total} "
                      f"devices of {entry!r}")
  if problems:
    raise ResourceError(format_message(
        f"xmap({fun}): {where} states a sharding that does not fit.",
        context=[f"spec: {spec.user_repr}", f"positional shape: {tuple(shape)}"],
        bullets=problems,
        fix="Use each mesh axis once per value, only mesh axes the mesh has, and ones whose "
            "size divides the dim."))


def inherited_entries(layout: MapLayout, spec: AxisSpec, x: Any) -> tuple[Entry, ...] | None:
  """Positional entries of a committed input (``None`` if it has no NamedSharding on this
  mesh's devices); mesh axes its named dims now take are dropped from them."""
  sharding = getattr(x, "sharding", None)
  if not isinstance(sharding, NamedSharding) or layout.mesh is None:
    return None
  if isinstance(layout.mesh, jax.sharding.Mesh) and (
      sharding.mesh.shape_tuple != layout.mesh.shape_tuple
      or sharding.mesh.devices.tolist() != layout.mesh.devices.tolist()):
    return None
  return typed_entries(layout, spec, sharding.spec, x.ndim)


def typed_entries(layout: MapLayout, spec: AxisSpec, pspec: PartitionSpec, ndim: int
                  ) -> tuple[Entry, ...]:
  """Positional entries of a value whose sharding is ``pspec``, minus the mesh axes its
  named dims now take."""
  taken = named_mesh_axes(layout, spec)
  full = tuple(pspec) + (None,) * (ndim - len(pspec))
  return tuple(to_spec_entry([a for a in entry_mesh_axes(full[d]) if a not in taken])
               for d in range(ndim) if d not in spec.dims)


def full_spec(layout: MapLayout, spec: AxisSpec, ndim: int, positional: Sequence[Entry] | None,
              default: Entry = UNCONSTRAINED) -> PartitionSpec:
  """One entry per dim: named dims on their mesh axes, positional ones from ``positional``
  (or ``default`` when not known)."""
  pos = iter(positional if positional is not None else [default] * (ndim - len(spec.dims)))
  entries = [layout.mesh_spec_entry(spec.names[spec.dims.index(d)]) if d in spec.dims
             else next(pos) for d in range(ndim)]
  return PartitionSpec(*entries)


def concrete(spec: PartitionSpec) -> PartitionSpec:
  """``spec`` with ``UNCONSTRAINED`` entries replicated (for in_shardings and Explicit
  types, which need a definite sharding)."""
  return PartitionSpec(*(None if e is UNCONSTRAINED else e for e in spec))


def is_trivial(spec: PartitionSpec) -> bool:
  """Whether a constraint with ``spec`` would state nothing at all."""
  return all(e is UNCONSTRAINED for e in spec)
