"""Sharding constraints on activations, by logical name.

``partition.constrain(x, ('batch', 'length', 'embed'))`` resolves the names through the rules
in scope and pins ``x``'s sharding: ``jax.lax.with_sharding_constraint`` on ``Auto`` mesh
axes, ``jax.sharding.reshard`` on ``Explicit`` ones (JAX rejects the former there). Unlike
``flax.linen.with_logical_constraint``, it is a no-op only when there is no mesh at all
(single-device code); a mesh without rules is an error, never a silent no-op.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from partition._base.errors import MeshError, PartitionError, format_message, short
from partition._base.logical_axes import path_str
from partition._base.mesh import (
  AnyMesh,
  describe,
  entry_mesh_axes,
  explicit_axes,
  to_spec_entry,
  with_unit_axes,
)
from partition._rules.context import current_rules, current_rules_mesh
from partition._rules.errors import RulesError, RulesTypeError
from partition._rules.fallbacks import PartitionWarning, warn_fallbacks
from partition._rules.scope import inside_xmap, mapped_mesh_axes
from partition._rules.table import LogicalAxes, _check_mesh, is_axes_leaf, map_axes_tree


class NoRulesError(PartitionError, ValueError):
  """Sharding by logical name was asked for under a mesh, but no rules are in scope."""


def constrain(x: Any, logical_axes: LogicalAxes | Any, *, rules: Any = None,
              mesh: AnyMesh | None = None, strict: bool = False) -> Any:
  """Constrains ``x`` to the sharding its logical axes resolve to.

  Args:
    x: an array (or tracer), or a pytree of them.
    logical_axes: one name (or ``None``) per dim of ``x``, e.g. ``('batch', None, 'embed')``;
      for a pytree ``x``, a matching pytree of such tuples (``None`` leaf = replicated).
    rules: an :class:`AxisRules` (or pairs / a file path); default: ``axis_rules`` context.
    mesh: default: the ``axis_rules`` mesh, else the ``jax.set_mesh`` mesh.
    strict: resolve with ``strict=True`` (unknown names and indivisible dims raise).

  The context is read at trace time: ``jax.jit`` does not re-trace a function when only the
  ``axis_rules`` context changes (as with flax's ``logical_axis_rules``).

  Returns:
    ``x`` with its sharding constrained; ``x`` itself when no mesh is in scope.

  Raises:
    NoRulesError: a mesh is in scope but no rules are.
    MeshError: ``mesh=`` is not a mesh, the rules mesh and the ``jax.set_mesh`` mesh use
      different devices, or JAX rejects the sharding (its message is the ``__cause__``).
    RulesError: logical axes that do not fit ``x`` (all leaves reported together).

  Example:
    >>> import jax, jax.numpy as jnp, partition
    >>> mesh = jax.make_mesh((4, 2), ('data', 'tensor'),
    ...                      axis_types=(jax.sharding.AxisType.Auto,) * 2)
    >>> rules = partition.AxisRules([('batch', 'data'), ('embed', 'tensor')])
    >>> @jax.jit
    ... def f(x):
    ...   return partition.constrain(x * 2, ('batch', 'embed'))
    >>> with partition.axis_rules(rules, mesh):
    ...   y = f(jnp.ones((8, 4)))
    >>> y.sharding.spec
    P('data', 'tensor')
    >>> partition.constrain(jnp.ones(3), ('batch',)).shape  # no mesh: no-op
    (3,)
  """
  return constrain_as(x, logical_axes, rules=rules, mesh=mesh, strict=strict)


def constrain_as(x: Any, logical_axes: Any, *, rules: Any = None, mesh: AnyMesh | None = None,
                 strict: bool = False, name: str = "x", api: str = "partition.constrain",
                 stacklevel: int = 3, warn: bool = True) -> Any:
  """:func:`constrain`, its warnings naming the array ``name`` (a param's path) for the
  entry point ``api``, pointing ``stacklevel`` frames up; ``warn=False`` leaves the rules'
  fallbacks to a caller that reports them itself (an init's placement audit)."""
  if not isinstance(strict, bool):
    raise RulesTypeError(
        f"partition.constrain(strict=...) takes True or False, got {short(strict)}.")
  _check_mesh(mesh, "partition.constrain")
  found_mesh = current_rules_mesh(mesh)
  if found_mesh is None:
    if current_rules(rules) is not None and jax.device_count() > 1:
      warnings.warn(format_message(
          f"partition.constrain(x, {short(logical_axes)}) has axis rules but no mesh, so it "
          f"does nothing on these {jax.device_count()} devices (a legacy `with mesh:` block "
          "sets no mesh that JAX's public API can read).",
          fix="Run under `with jax.set_mesh(mesh):`, or pass the mesh: "
              "`with partition.axis_rules(rules, mesh):` / mesh=."),
          PartitionWarning, stacklevel=stacklevel)
    return x
  _check_context_mesh(found_mesh, x)
  found_rules = current_rules(rules)
  if found_rules is None:
    raise NoRulesError(format_message(
        f"partition.constrain(x, {logical_axes!r}) found a mesh but no axis rules, so it "
        "cannot tell where the logical axes live.",
        context=[describe(found_mesh)],
        fix="Wrap the code in `with partition.axis_rules(rules):`, or pass "
            "rules=partition.AxisRules([...]) (or a rules file path)."))
  fallbacks: list = []  # (where, Resolution) of every array, for the fallback warnings
  # The mesh axes an enclosing xmap maps already place the body's dim: size 1 to the rules.
  placing = with_unit_axes(found_mesh, mapped_mesh_axes())
  if is_axes_leaf(logical_axes) or _flat_sequence(logical_axes) or (
      jax.tree_util.all_leaves([logical_axes])):  # one array's axes, even malformed ones
    spec = _one_spec(found_rules, logical_axes, x, placing, strict)
    _note(fallbacks, name, found_rules, logical_axes, x.shape, placing, strict)
    out = _apply(x, spec, found_mesh)
  else:
    def one(path, axes, leaf):
      spec = found_rules.spec(axes, leaf.shape, placing, strict)
      _note(fallbacks, f"{name}/{path_str(path)}" if path else name, found_rules, axes,
            leaf.shape, placing, strict)
      return spec

    specs = map_axes_tree(one, logical_axes, x, "partition.constrain")
    out = jax.tree.map(lambda s, leaf: _apply(leaf, s, found_mesh), specs, x,
                       is_leaf=lambda s: isinstance(s, PartitionSpec))
  if warn:
    warn_fallbacks(api, fallbacks, found_rules, stacklevel=stacklevel)
  return out


def _note(fallbacks: list, where: str, rules: Any, axes: Any, shape: Any, mesh: AnyMesh,
          strict: bool) -> None:
  """Records the resolution of named axes (not specs, not strict: those raise instead)."""
  if not strict and isinstance(axes, (tuple, list)) and not isinstance(axes, PartitionSpec):
    fallbacks.append((where, rules.resolve(tuple(axes), tuple(shape), mesh)))


def _one_spec(rules: Any, logical_axes: Any, x: Any, mesh: AnyMesh, strict: bool
              ) -> PartitionSpec:
  """The spec of one array, errors prefixed with the call (no keypath: there is no tree)."""
  head = f"partition.constrain(x, {short(logical_axes)})"
  if not hasattr(x, "shape"):
    raise RulesTypeError(f"{head}: x must be an array (or a pytree of arrays with a matching "
                         f"tree of logical axes), got {type(x).__name__} {short(x)}.")
  try:
    return rules.spec(logical_axes, x.shape, mesh, strict)
  except RulesError as e:
    raise type(e)(f"{head}: {e}") from None


def _flat_sequence(x: Any) -> bool:
  """A plain tuple/list with no containers inside: one array's (possibly bad) axes."""
  return type(x) in (tuple, list) and not any(
      isinstance(e, (tuple, list, dict)) for e in x)


def _only(spec: PartitionSpec, axes: frozenset[str]) -> PartitionSpec:
  """The part of ``spec`` that uses only mesh axes in ``axes``."""
  def keep(entry):
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
      return entry
    return to_spec_entry(a for a in entry_mesh_axes(entry) if a in axes)
  return PartitionSpec(*(keep(e) for e in spec))


def _device_ids(mesh: AnyMesh) -> frozenset[int] | None:
  if not isinstance(mesh, jax.sharding.Mesh):  # an AbstractMesh has no devices
    return None
  return frozenset(d.id for d in mesh.devices.flat)


def _check_context_mesh(mesh: AnyMesh, x: Any) -> None:
  """The mesh we constrain on must agree with the ``jax.set_mesh`` mesh, if any.

  Otherwise JAX fails deep inside ``reshard``/``jit``: "incompatible devices" for other
  devices, a bare ``AssertionError`` for other axis types, and "Length of device assignment
  1" for Explicit axes traced without any ``jax.set_mesh``.
  """
  try:
    context = jax.sharding.get_mesh()
  except ValueError:  # inside jax.jit only the abstract mesh is visible
    context = None
  if context is None or context.empty:
    context = jax.sharding.get_abstract_mesh()
  if context is None or context.empty:
    traced = any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(x))
    if explicit_axes(mesh) and traced:
      raise MeshError(format_message(
          "partition.constrain: the rules mesh has Explicit axes "
          f"{sorted(explicit_axes(mesh))}, but the function is traced outside jax.set_mesh.",
          context=[f"rules mesh (axis_rules or mesh=): {describe(mesh)}",
                   "JAX places Explicit-sharded values only under a mesh context."],
          fix="Call the jitted function inside `with jax.set_mesh(mesh):` (with the same mesh "
              "as axis_rules), or use a mesh with AxisType.Auto axes."))
    return
  if context is mesh:
    return
  ours, theirs = _device_ids(mesh), _device_ids(context)
  differ = (ours != theirs) if ours is not None and theirs is not None else (
      mesh.size != context.size)
  if differ:
    raise MeshError(format_message(
        "partition.constrain: the rules mesh and the jax.set_mesh mesh use different devices.",
        context=[f"rules mesh (axis_rules or mesh=): {describe(mesh)}, {mesh.size} devices",
                 f"jax.set_mesh mesh: {describe(context)}, {context.size} devices"],
        fix="Use one mesh: `with jax.set_mesh(mesh), partition.axis_rules(rules, mesh):`, or "
            "leave the mesh out of axis_rules so the jax.set_mesh mesh is used."))
  # Same devices in another shape is fine (placed as asked); Explicit axes on one side only
  # are not (JAX: a bare AssertionError). xmap bodies run Explicit axes as Auto on purpose.
  if explicit_axes(mesh) != explicit_axes(context) and not inside_xmap():
    raise MeshError(format_message(
        "partition.constrain: the rules mesh and the jax.set_mesh mesh differ in which axes "
        "are Explicit.",
        context=[f"rules mesh (axis_rules or mesh=): {describe(mesh)}",
                 f"jax.set_mesh mesh: {describe(context)}"],
        fix="Use one mesh for both: `with jax.set_mesh(mesh), partition.axis_rules(rules, "
            "mesh):`, or leave the mesh out of axis_rules so the jax.set_mesh mesh is used."))


def _apply(x: Any, spec: PartitionSpec, mesh: AnyMesh) -> Any:
  # Inside an xmap body the mesh axes it maps are not ours to constrain: xmap places that
  # dim (and JAX rejects them in a constraint under vmap(spmd_axis_name=)).
  mapped = mapped_mesh_axes()
  explicit = explicit_axes(mesh) - mapped
  auto = frozenset(mesh.axis_names) - explicit_axes(mesh) - mapped
  try:
    if explicit:
      x = jax.sharding.reshard(x, NamedSharding(mesh, _only(spec, explicit)))
    if auto:
      x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, _only(spec, auto)))
  except ValueError as e:  # JAX's device/mesh mismatches; its text stays the __cause__
    raise MeshError(format_message(
        f"partition.constrain: JAX rejected the sharding {spec} of a value of shape "
        f"{getattr(x, 'shape', '?')}.", context=[describe(mesh)],
        bullets=[str(e).splitlines()[0][:300]],
        fix="Put the value on the mesh's devices (jax.device_put) and run under "
            "`with jax.set_mesh(mesh):` with the same mesh as axis_rules.")) from e
  return x
