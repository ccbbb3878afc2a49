"""From specs, shapes and resources to an evaluation layout: sizes, checks, levels.

Every named axis of size ``N`` with resources ``(mesh axes..., loops...)`` is split, mesh-major,
into sub-dims ``(M, n_1, ..., n_k, c)``: ``M`` devices (the product of its mesh axes), one
sub-dim per loop, and a chunk ``c = N / (M * n_1 * ... * n_k)`` vectorised inside the loop
body. An axis without loops stays one dim of size ``N`` (vectorised and, if it has mesh
axes, sharded over them by ``spmd_axis_name``), bound under its own name so ``jax.lax``
collectives see it.

Levels run outermost first: whole-axis vmaps and the mesh parts of looped axes, then one
``lax.scan`` per loop, then the chunk vmaps. Each sub-dim has a *label* ``(axis, part)``;
positional dims are labelled ``(None, i)``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from partition._base import mesh as _mesh
from partition._base.errors import (
    AxisNameError,
    AxisSizeError,
    MeshError,
    ResourceError,
    format_message,
)
from partition._base.resources import SerialLoop, named_loops
from partition._xmap.specs import AxisSpec, Reduction, spec_names

Label = tuple[Any, Any]
_private_ids = itertools.count()


@dataclasses.dataclass(frozen=True)
class Loop:
  """One serial loop resource: a named ``serial_loop`` or one anonymous ``SerialLoop``."""

  uid: str
  length: int
  named: bool = False  # bound by serial_loop(name, n) (shareable), else one SerialLoop(n)

  def __repr__(self) -> str:
    return self.uid if self.named else f"SerialLoop({self.length})"


@dataclasses.dataclass(frozen=True)
class AxisLayout:
  name: str
  size: int
  mesh_axes: tuple[str, ...]
  loops: tuple[Loop, ...]
  mesh_size: int

  @property
  def chunk(self) -> int:
    return self.size // (self.mesh_size * math.prod(lp.length for lp in self.loops))

  def sub_dims(self) -> tuple[tuple[Label, int], ...]:
    if not self.loops:
      return (((self.name, "all"), self.size),)
    dims = [((self.name, "mesh"), self.mesh_size)] if self.mesh_axes else []
    dims += [((self.name, lp.uid), lp.length) for lp in self.loops]
    dims.append(((self.name, "chunk"), self.chunk))
    return tuple(dims)

  def resources_repr(self) -> str:
    items = [repr(a) for a in self.mesh_axes] + [repr(lp) for lp in self.loops]
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


@dataclasses.dataclass(frozen=True)
class Level:
  kind: str  # "vmap" or "scan"
  size: int
  labels: tuple[Label, ...]  # one for a vmap; one per axis sharing the loop for a scan
  bound_name: str | None = None  # vmap axis_name
  spmd: tuple[str, ...] | None = None  # vmap spmd_axis_name

  def label_for(self, axis: str) -> Label | None:
    return next((lab for lab in self.labels if lab[0] == axis), None)


@dataclasses.dataclass(frozen=True)
class MapLayout:
  axes: Mapping[str, AxisLayout]
  levels: tuple[Level, ...]
  mesh: Any

  @property
  def loop_axes(self) -> frozenset[str]:
    return frozenset(n for n, a in self.axes.items() if a.loops)

  def label_size(self, label: Label) -> int:
    return dict(self.axes[label[0]].sub_dims())[label]

  @property
  def mesh_axes(self) -> frozenset[str]:
    """The mesh axes any named axis is placed on (empty: nothing is sharded)."""
    return frozenset(a for ax in self.axes.values() for a in ax.mesh_axes)

  def mesh_spec_entry(self, name: str) -> Any:
    """The PartitionSpec entry of a dim carrying axis ``name`` (None if unsharded)."""
    return self.axes[name].mesh_axes or None


# ----------------------------------------------------------------------------- sizes


def infer_sizes(leaves: Sequence[Any], specs: Sequence[AxisSpec], paths: Sequence[str],
                axis_sizes: Mapping[str, int], names: Sequence[str], fun: str
                ) -> tuple[dict[str, int], dict[str, str]]:
  """Sizes of all axes, from ``axis_sizes`` and the inputs; also where each came from."""
  sizes: dict[str, int] = {}
  source: dict[str, str] = {}
  for name, size in axis_sizes.items():
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 0:
      raise AxisSizeError(f"xmap({fun}): axis_sizes[{name!r}] must be a non-negative int, "
                          f"got {size!r}.")
    sizes[name], source[name] = int(size), f"axis_sizes[{name!r}]"
  rank_errors, size_errors = [], []
  for leaf, spec, path in zip(leaves, specs, paths):
    shape = np.shape(leaf)
    where = f"argument{path}"
    if spec.rank is not None and spec.rank != len(shape):
      rank_errors.append(f"{where} has shape {shape} (rank {len(shape)}), but its in_axes "
                         f"{spec.user_repr} asserts rank {spec.rank}")
      continue
    if spec.dims and max(spec.dims) >= len(shape):
      rank_errors.append(f"{where} has shape {shape}, but its in_axes {spec.user_repr} "
                         f"names dim {max(spec.dims)} (needs rank >= {max(spec.dims) + 1})")
      continue
    for name, dim in zip(spec.names, spec.dims):
      if name in sizes and sizes[name] != shape[dim]:
        size_errors.append(f"{where} has size {shape[dim]} along axis {name!r} (dim {dim} of "
                           f"shape {shape}), but {source[name]} gives size {sizes[name]}")
      elif name not in sizes:
        sizes[name] = shape[dim]
        source[name] = f"argument{path} (dim {dim} of shape {shape})"
  if rank_errors:
    raise AxisSizeError(format_message(
        f"xmap({fun}): some arguments do not have the rank their in_axes expect.",
        bullets=rank_errors,
        fix="Fix the argument's shape, or its in_axes entry (end a list with ... to accept "
            "any rank)."))
  if size_errors:
    raise AxisSizeError(format_message(
        f"xmap({fun}): inconsistent sizes for named axes.", bullets=size_errors,
        fix="All dims mapped to one axis name must have the same size."))
  missing = [n for n in names if n not in sizes]
  if missing:
    raise AxisSizeError(format_message(
        f"xmap({fun}): failed to infer the size of axes {missing}.",
        context=["They appear in no argument's in_axes (or only in empty containers)."],
        fix=f"Provide the sizes explicitly, e.g. axis_sizes={{{missing[0]!r}: 4}}."))
  return sizes, source


# ------------------------------------------------------------------------- resources


def normalize_resources(axis_resources: Any, names: Sequence[str], sizes: Mapping[str, int],
                        mesh: Any, fun: str) -> dict[str, tuple[tuple[str, ...], tuple[Loop, ...]]]:
  """``{axis: (mesh_axes, loops)}`` for every defined axis, validated against the mesh."""
  if axis_resources is None:
    axis_resources = {}
  elif hasattr(axis_resources, "xmap_resources"):  # an AxisRules table
    axis_resources = axis_resources.xmap_resources(tuple(names), mesh=mesh, sizes=dict(sizes))
  if not isinstance(axis_resources, Mapping):
    raise ResourceError(
        f"xmap({fun}): axis_resources must be a dict {{axis name: resources}} or an "
        f"AxisRules table, got {type(axis_resources).__name__}.")
  undefined = [a for a in axis_resources if a not in names]
  if undefined:
    raise AxisNameError(format_message(
        f"xmap({fun}): axis_resources assigns resources to axes that this xmap does not "
        f"define: {undefined}.",
        context=[f"defined axes (from in_axes and axis_sizes): {list(names)}"],
        fix="Remove them, or define them through in_axes or axis_sizes."))
  loops_in_scope = named_loops()
  mesh_sizes = _mesh.axis_sizes(mesh)
  out = {}
  for name in names:
    raw = axis_resources.get(name, ())
    entries = tuple(raw) if isinstance(raw, (tuple, list)) else (() if raw is None else (raw,))
    mesh_axes: list[str] = []
    loops: list[Loop] = []
    for i, r in enumerate(entries):
      if isinstance(r, SerialLoop):
        loops.append(Loop(f"#{name}.{i}", r.length))
      elif isinstance(r, str) and r in loops_in_scope:
        if r in mesh_sizes:
          raise ResourceError(f"xmap({fun}): resource {r!r} of axis {name!r} is both a mesh "
                              "axis and a serial_loop name; rename the loop.")
        loops.append(Loop(r, loops_in_scope[r], named=True))
      elif isinstance(r, str):
        if loops:
          raise ResourceError(format_message(
              f"xmap({fun}): axis {name!r} lists mesh axis {r!r} after a serial loop in "
              f"axis_resources {raw!r}.",
              fix="Put mesh axes first, then loops: e.g. ('data', SerialLoop(4))."))
        mesh_axes.append(r)
      else:
        raise ResourceError(format_message(
            f"xmap({fun}): axis_resources[{name!r}] contains {r!r}, which is not a resource.",
            fix="A resource is a mesh axis name (str), a SerialLoop(n), a name bound by "
                "serial_loop(name, n), or a tuple of them (mesh axes first)."))
    keys = mesh_axes + [lp.uid for lp in loops if lp.named]
    if len(set(keys)) != len(keys):
      raise ResourceError(f"xmap({fun}): axis_resources[{name!r}] = {raw!r} repeats a resource; "
                          "each resource may appear once per axis.")
    out[name] = (tuple(mesh_axes), tuple(loops))
  _check_mesh_axes(out, mesh, mesh_sizes, fun)
  return out


def _check_mesh_axes(resources, mesh, mesh_sizes, fun):
  used = sorted({a for mesh_axes, _ in resources.values() for a in mesh_axes})
  if used and mesh is None:
    raise MeshError(format_message(
        f"xmap({fun}): axis_resources uses mesh axes {used}, but there is no mesh.",
        context=["The legacy `with mesh:` context is not visible to public JAX APIs.",
                 "A name bound by `with partition.serial_loop(name, n):` counts as a loop only "
                 "inside that block."],
        fix="Pass mesh=jax.make_mesh(...) to xmap, or call it under `with jax.set_mesh(mesh):`"
            "; or, for a serial loop, call the xmap inside its serial_loop block."))
  missing = [a for a in used if a not in mesh_sizes]
  if missing:
    raise MeshError(format_message(
        f"xmap({fun}): axis_resources uses mesh axes {missing} that the mesh does not have.",
        context=[f"mesh: {_mesh.describe(mesh)}"],
        fix="Use one of the mesh's axis names, or build a mesh with those axes."))


def check_divisible(resources, sizes, source, mesh, fun) -> dict[str, AxisLayout]:
  mesh_sizes = _mesh.axis_sizes(mesh)
  layouts, errors = {}, []
  for name, (mesh_axes, loops) in resources.items():
    msize = math.prod(mesh_sizes[a] for a in mesh_axes)
    layout = AxisLayout(name, sizes[name], mesh_axes, loops, msize)
    total = msize * math.prod(lp.length for lp in loops)
    if sizes[name] % total:
      errors.append(f"axis {name!r} has size {sizes[name]} (from {source[name]}), not divisible "
                    f"by the {total} slices of its resources {layout.resources_repr()}")
    layouts[name] = layout
  if errors:
    raise AxisSizeError(format_message(
        f"xmap({fun}): axis sizes are not divisible by their resources.",
        context=[f"mesh: {_mesh.describe(mesh)}"], bullets=errors,
        fix="Pad the inputs to a multiple of the resource count, or choose resources (mesh "
            "axes, loop lengths) whose product divides the size."))
  return layouts


def check_cooccurrence(specs: Sequence[AxisSpec | Reduction], where: Sequence[str],
                       axes: Mapping[str, AxisLayout], fun: str) -> None:
  """Two axes that share a mesh axis or a named loop must never appear in one value."""
  errors = []
  for spec, w in zip(specs, where):
    owner: dict[str, str] = {}
    for name in spec_names(spec):
      layout = axes[name]
      for res in layout.mesh_axes + tuple(lp.uid for lp in layout.loops if lp.named):
        if res in owner and owner[res] != name:
          errors.append(f"{w} carries axes {owner[res]!r} and {name!r}, both on resource {res!r}")
        owner.setdefault(res, name)
  if errors:
    raise ResourceError(format_message(
        f"xmap({fun}): two axes mapped to the same resource appear in one value.",
        bullets=sorted(set(errors)),
        fix="Give those axes different mesh axes / loops, or keep them out of one value."))


# ---------------------------------------------------------------------------- levels


def build_layout(axes: Mapping[str, AxisLayout], mesh: Any) -> MapLayout:
  tag = next(_private_ids)
  outer, chunks, loops = [], [], {}
  for name, ax in axes.items():
    if not ax.loops:
      outer.append(Level("vmap", ax.size, ((name, "all"),), name, ax.mesh_axes or None))
      continue
    if ax.mesh_axes:
      outer.append(Level("vmap", ax.mesh_size, ((name, "mesh"),),
                         f"__xmap{tag}_mesh__{name}", ax.mesh_axes))
    for lp in ax.loops:
      loops.setdefault(lp, []).append((name, lp.uid))
    chunks.append(Level("vmap", ax.chunk, ((name, "chunk"),), f"__xmap{tag}_chunk__{name}"))
  scans = [Level("scan", lp.length, tuple(labels)) for lp, labels in loops.items()]
  return MapLayout(dict(axes), tuple(outer + scans + chunks), mesh)
