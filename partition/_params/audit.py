"""Never silently replicated: a placement audit shared by every adapter's ``init_sharded``.

After an adapter has resolved one ``PartitionSpec`` per parameter, it calls
:func:`audit_placement` before anything is allocated. The audit looks at what the user asked
for (logical axes, path patterns) next to what was placed:

* ``strict=True``: every name without a rule, path without axes (with a path table: one no
  pattern matches; without one: a parameter that declares none and would be fully
  replicated), unused path pattern, rule or spec naming a mesh axis the mesh lacks, and dim
  that no candidate divides is collected into ONE :class:`PlacementError` (paths written
  ``a/b/c``).
* ``strict=False``: one :class:`~partition.PartitionWarning` per distinct fallback among
  named dims (a name without a rule, a dim no rule divides), whatever the parameter's size;
  null rules replicate on purpose and warn nothing. Then ONE :class:`ReplicatedWarning`
  listing the parameters *without logical axes* left fully replicated on a mesh of more than
  one device, with the bytes that costs each device, emitted only if one of them holds
  ``warn_bytes`` or more (default :data:`WARN_BYTES`, 64 KiB, a 128 x 128 float32 kernel).
* A path pattern that matches no parameter is an error in both modes.

Specs that would make JAX fail anyway (a ``PartitionSpec`` leaf, e.g. from
``nn.with_partitioning``, naming a mesh axis the mesh lacks or not dividing its dim) are
errors in both modes, with the path and the fix instead of JAX's text.

The module is framework-free: trees are plain pytrees of arrays / ``ShapeDtypeStruct``s,
logical-axes tuples and ``PartitionSpec``s / ``NamedSharding``s.

>>> import warnings, jax, jax.numpy as jnp, partition
>>> from partition._params.audit import audit_placement
>>> mesh = jax.make_mesh((8,), ('fsdp',))
>>> rules = partition.AxisRules([('embed', 'fsdp')])
>>> tree = {'w': jax.ShapeDtypeStruct((256, 128), jnp.float32),
...         'v': jax.ShapeDtypeStruct((256, 128), jnp.float32)}
>>> axes = {'w': ('embd', 'mlp'), 'v': None}
>>> specs = rules.tree_specs(axes, tree, mesh)
>>> with warnings.catch_warnings(record=True) as caught:
...   warnings.simplefilter('always')
...   audit_placement(tree, axes, specs, rules, mesh, strict=False, api='demo')
>>> for w in caught:
...   print(w.category.__name__, w.message)  # doctest: +ELLIPSIS
PartitionWarning demo: logical axis 'embd' has no rule (did you mean 'embed'?), so w dim 0 is replicated.
Add a rule for 'embd' ...
PartitionWarning demo: logical axis 'mlp' has no rule, so w dim 1 is replicated.
Add a rule for 'mlp' ...
ReplicatedWarning demo: 1 parameter(s) are fully replicated on 8 devices, 128.00 KiB per device:
  * v f32[256,128]: no logical axes
Add rules for those names, ... or pass strict=True to make this an error.
>>> audit_placement(tree, axes, specs, rules, mesh, strict=True, api='demo')
Traceback (most recent call last):
...
partition._base.errors.PlacementError: demo(strict=True): 3 problem(s) in the placement of the parameters:
  mesh: mesh(fsdp=8 Explicit)
  * w dim 0: logical axis 'embd' has no rule (did you mean 'embed'?)
  * w dim 1: logical axis 'mlp' has no rule
  * v f32[256,128]: no logical axes, so it would be fully replicated
Add a rule for each name (or fix the typo), ... or pass strict=False.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from partition._base.errors import PlacementError, did_you_mean, format_message
from partition._base.logical_axes import dtype_shape
from partition._base.mesh import AnyMesh, axis_sizes, describe, entry_mesh_axes
from partition._params.path_rules import PathMatch, path_str
from partition._rules.explain import human_bytes
from partition._rules.fallbacks import PartitionWarning, warn_fallbacks
from partition._rules.resolve import INDIVISIBLE, Resolution
from partition._rules.table import AxisRules, is_axes_leaf

WARN_BYTES = 64 * 1024
"""Default ``warn_bytes``: a replicated parameter this large (bytes) triggers the warning."""

_SHOWN = 8  # bullets shown in the warning before "and N more"

STRICT_FIX = (
    "Add a rule for each name (or fix the typo), give unmatched parameters axes (a PathRules "
    "pattern, None to replicate on purpose), remove unused patterns, pad the dims or choose "
    "rules that divide them; or pass strict=False.")

PATTERN_FIX = ("Fix or remove the path patterns that match nothing, and put a shadowed "
               "pattern before the one that claims its parameters (print the paths with "
               "partition.PathRules(...).match(params) to see them).")

SPEC_FIX = ("Mesh axes given directly (nn.with_partitioning, a PartitionSpec) must be axes of "
            "the mesh and divide their dims: fix the name, use a logical name with a rule "
            "instead, or pad the dim.")


class ReplicatedWarning(PartitionWarning):
  """Large parameters without logical axes were left fully replicated on a multi-device
  mesh (``strict=False``)."""


def audit_placement(abstract_tree: Any, axes_tree: Any, specs_tree: Any, rules: AxisRules,
                    mesh: AnyMesh, *, strict: bool, api: str,
                    path_match: PathMatch | None = None,
                    warn_bytes: int = WARN_BYTES, stacklevel: int = 4) -> None:
  """Checks a resolved placement; raises (strict) or warns (replicated) as described above.

  Args:
    abstract_tree: the parameters, unboxed: arrays or ``jax.ShapeDtypeStruct``s. Nodes
      without a ``shape`` (e.g. optax's ``EmptyState``) are skipped.
    axes_tree: the matching tree of logical axes (``partition.AxisRules.tree_specs``'s
      input): a tuple of names per parameter (shorter than the rank: a prefix, trailing dims
      replicated), ``None`` for unannotated, or a ``PartitionSpec`` of mesh axes.
    specs_tree: the matching tree of resolved ``PartitionSpec``s or ``NamedSharding``s (what
      will be placed).
    rules: the rules the specs were resolved with.
    mesh: the mesh (concrete or abstract).
    strict: raise one :class:`PlacementError` listing every problem instead of warning.
    api: the public entry point, for the messages (e.g. ``'partition.flax.init_sharded'``).
    path_match: the :class:`partition.PathMatch` of the path table, if one was used; in
      strict mode its unmatched paths and unused patterns are problems too.
    warn_bytes: warn only if a replicated parameter has at least this many bytes.
    stacklevel: the frame the warnings name, counted from this function as
      ``warnings.warn`` counts (default 4: the user's call of an adapter's ``init_sharded``
      that calls ``adapt.place``, which calls this).

  Raises:
    PlacementError: with ``strict=True`` on any problem; in both modes for a
      ``PartitionSpec`` leaf that names a mesh axis the mesh lacks or does not divide a dim.

  Warns:
    ReplicatedWarning: with ``strict=False``, once, if a parameter of ``warn_bytes`` or
      more is fully replicated on a mesh of more than one device.
  """
  sizes = dict(axis_sizes(mesh))
  leaves = _leaves(abstract_tree, axes_tree, specs_tree)
  fatal, problems, replicated, resolutions = [], [], [], []
  for path, leaf, axes, spec in leaves:
    fatal += _spec_problems(path, leaf, axes, sizes)
    res = _resolution(rules, axes, leaf, mesh)
    if res is not None:
      resolutions.append((path, res))
    if strict:
      problems += _strict_problems(path, axes, res, rules, sizes)
    if _is_replicated(leaf, spec, sizes) and not _names_any(axes):
      replicated.append((path, leaf, axes, res))  # no logical axes at all
  spec_fatal = bool(fatal)
  if path_match is not None:
    # A pattern that matches no parameter cannot be intended: an error in both modes.
    # A shadowed one (every parameter it matches is claimed first) says by which pattern.
    fatal += path_match.unused_problems()
  if strict and path_match is not None:
    problems += [f"{p}: no declared axes and no path pattern matches it"
                 for p in path_match.unmatched]
  elif strict:  # no table to say "replicate on purpose": nothing declared is a problem
    problems += [f"{path} {dtype_shape(leaf.dtype, leaf.shape)}: no logical axes, so it "
                 "would be fully replicated" for path, leaf, axes, _ in replicated
                 if axes is None]
  if fatal or problems:
    fix = STRICT_FIX if problems else " ".join(
        [SPEC_FIX] * spec_fatal + [PATTERN_FIX] * (len(fatal) > spec_fatal))
    _raise(api, strict, fatal + problems, mesh, fix)
  if not strict and math.prod(sizes.values()) > 1:
    # Named dims left replicated for want of a rule or a divisor: one warning per cause,
    # whatever the size. Replicated by a null rule (data_parallel): on purpose, silent.
    warn_fallbacks(api, resolutions, rules, stacklevel=stacklevel)
    _warn(api, replicated, rules, sizes, warn_bytes, stacklevel + 1)


def _names_any(axes: Any) -> bool:
  """True if ``axes`` names at least one logical axis (or mesh axes, for a spec)."""
  return isinstance(axes, PartitionSpec) or any(a is not None for a in _names(axes))


def _leaves(abstract_tree, axes_tree, specs_tree) -> list[tuple[str, Any, Any, Any]]:
  """``(a/b/c path, array, axes, spec)`` per parameter that has a shape."""
  out = []

  def one(path, axes, leaf, spec):
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
      if isinstance(spec, NamedSharding):
        spec = spec.spec
      out.append((path_str(path) or "<root>", leaf, axes, spec))

  jax.tree_util.tree_map_with_path(one, axes_tree, abstract_tree, specs_tree,
                                   is_leaf=_is_axes_leaf)
  return out


def _is_axes_leaf(x: Any) -> bool:
  # An empty NamedTuple (optax's EmptyState) is a node of the params tree, not "no axes".
  if isinstance(x, tuple) and not x and type(x) is not tuple:
    return False
  return is_axes_leaf(x)


def _names(axes: Any) -> tuple:
  return tuple(axes) if isinstance(axes, (tuple, list)) else ()


def _resolution(rules: AxisRules, axes: Any, leaf: Any, mesh: AnyMesh) -> Resolution | None:
  """Non-strict resolution of logical axes (padded to the rank), or None for specs / None."""
  names = _names(axes)
  if not names or isinstance(axes, PartitionSpec) or len(names) > len(leaf.shape):
    return None
  names = names + (None,) * (len(leaf.shape) - len(names))
  return rules.resolve(names, tuple(leaf.shape), mesh)


def _spec_problems(path: str, leaf: Any, axes: Any, sizes: Mapping[str, int]) -> list[str]:
  """Problems of a ``PartitionSpec`` leaf (mesh axes given directly) that JAX would reject."""
  if not isinstance(axes, PartitionSpec):
    return []
  out = []
  for i, entry in enumerate(tuple(axes)):
    names = entry_mesh_axes(entry)
    if not names:
      continue
    missing = [a for a in names if a not in sizes]
    out += [f"{path} dim {i}: {axes} names mesh axis {a!r}, which the mesh lacks"
            f"{did_you_mean(a, list(sizes))}" for a in missing]
    factor = math.prod(sizes.get(a, 1) for a in names)
    if not missing and i < len(leaf.shape) and leaf.shape[i] % factor:
      out.append(f"{path} dim {i}: size {leaf.shape[i]} is not divisible by {factor} "
                 f"(mesh axes {names} of {axes})")
  return out


def _strict_problems(path: str, axes: Any, res: Resolution | None, rules: AxisRules,
                     sizes: Mapping[str, int]) -> list[str]:
  if res is None:
    return []
  out = []
  for d in res.dims:
    if not isinstance(d.logical, str) or not d.logical:
      continue
    if d.logical not in rules.names:
      hint = did_you_mean(d.logical, rules.names)
      if d.logical in sizes:
        hint += (f" ({d.logical!r} is a mesh axis: give mesh axes with nn.with_partitioning "
                 "/ a PartitionSpec, or add the rule")
        hint += f" [{d.logical}, {d.logical}])"
      out.append(f"{path} dim {d.index}: logical axis {d.logical!r} has no rule{hint}")
      continue
    for a in d.attempts:
      out += [f"{path} dim {d.index} {d.logical!r}: rule #{a.rule} names {m!r}, which is "
              f"not a mesh axis{did_you_mean(m, list(sizes))}"
              for m in _missing(a.value, sizes)]
    if d.rule is None and any(a.outcome == INDIVISIBLE for a in d.attempts):
      tried = "; ".join(a.detail for a in d.attempts if a.outcome == INDIVISIBLE)
      out.append(f"{path} dim {d.index} {d.logical!r}: no rule divides it ({tried})")
  return out


def _missing(value: Any, sizes: Mapping[str, int]) -> list[str]:
  return [r for r in value or () if isinstance(r, str) and r not in sizes]


def _is_replicated(leaf: Any, spec: Any, sizes: Mapping[str, int]) -> bool:
  if not leaf.shape or math.prod(sizes.values()) <= 1:
    return False
  for entry in tuple(spec) if isinstance(spec, PartitionSpec) else ():
    names = entry_mesh_axes(entry)
    if math.prod(sizes.get(a, 1) for a in names) > 1:
      return False
  return True


def _nbytes(leaf: Any) -> int:
  return math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize


def _reason(axes: Any, res: Resolution | None, rules: AxisRules) -> str:
  """Why a parameter ended up replicated, in a few words."""
  if axes is None or not _names(axes) or all(a is None for a in _names(axes)):
    return "no logical axes"
  if res is None:
    return f"{axes}"
  parts = []
  for d in res.dims:
    if not isinstance(d.logical, str):
      continue
    if d.logical not in rules.names:
      parts.append(f"no rule for {d.logical!r}{did_you_mean(d.logical, rules.names)}")
    elif d.rule is None and d.attempts:
      parts.append(f"{d.logical!r}: " + "; ".join(
          f"{a.outcome}" + (f" ({a.detail})" if a.detail else "") for a in d.attempts))
    else:
      parts.append(repr(d.logical))
  return ", ".join(parts)


def _warn(api: str, replicated: list, rules: AxisRules, sizes: Mapping[str, int],
          warn_bytes: int, stacklevel: int) -> None:
  if not any(_nbytes(leaf) >= warn_bytes for _, leaf, _, _ in replicated):
    return
  replicated = sorted(replicated, key=lambda r: -_nbytes(r[1]))
  total = sum(_nbytes(leaf) for _, leaf, _, _ in replicated)
  bullets = []
  for path, leaf, axes, res in replicated[:_SHOWN]:
    label = "" if axes is None else f" {tuple(axes)}"
    reason = _reason(axes, res, rules)
    bullets.append(f"{path} {dtype_shape(leaf.dtype, leaf.shape)}{label}: {reason}" if label
                   else f"{path} {dtype_shape(leaf.dtype, leaf.shape)}: {reason}")
  if len(replicated) > _SHOWN:
    bullets.append(f"... and {len(replicated) - _SHOWN} more")
  warnings.warn(format_message(
      f"{api}: {len(replicated)} parameter(s) are fully replicated on "
      f"{math.prod(sizes.values())} devices, {human_bytes(total)} per device:",
      bullets=bullets,
      fix="Add rules for those names, give the parameters logical axes "
          "(param_axes=partition.PathRules([...])), or pass strict=True to make this an "
          "error."), ReplicatedWarning, stacklevel=stacklevel)


def _raise(api: str, strict: bool, problems: list[str], mesh: AnyMesh, fix: str) -> None:
  head = f"{api}(strict=True)" if strict else api
  raise PlacementError(format_message(
      f"{head}: {len(problems)} problem(s) in the placement of the parameters:",
      context=[f"mesh: {describe(mesh)}"], bullets=problems, fix=fix))
