"""The flax side of the rules context: ``partition.axis_rules`` also sets flax's rules.

``nn.with_logical_constraint`` in existing linen models (T5X, MaxText) resolves through
``flax.core.spmd``'s rules context; this hook keeps that context equal to the
``partition.axis_rules`` table, and inside xmap bodies drops the mesh axes the body maps.
It touches flax only when flax is already imported: the core never imports it.
``partition/__init__.py`` registers :data:`FLAX_RULES_HOOK`.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

from partition._base.mesh import AnyMesh, to_spec_entry
from partition._base.resources import SerialLoop
from partition._rules.scope import RulesHook


def flax_rules(rules: Any, mesh: AnyMesh | None = None) -> tuple:
  """``rules`` (an :class:`~partition.AxisRules`) as flax's ``LogicalRules``.

  Loops are dropped; with a mesh, axes it lacks are dropped (size-1 axes are kept: flax's
  "already used" check must see them, as ``AxisRules`` does). A rule left without axes maps
  its name to ``None`` (replicated), never disappears: flax NNX resolves a name without a
  rule to *itself* (``rules.get(name, name)``), which would pass a logical name to
  ``NamedSharding`` as a mesh axis.

  Example:
    >>> import jax, partition
    >>> from partition._rules.flax_hook import flax_rules
    >>> mesh = jax.make_mesh((4, 2), ('data', 'fsdp'))
    >>> flax_rules(partition.AxisRules([('embed', 'fsdp'), ('mlp', 'tensor')]), mesh)
    (('embed', 'fsdp'), ('mlp', None))
  """
  sizes = None if mesh is None else dict(mesh.shape)
  out = []
  for name, value in rules.pairs:
    axes = [a for a in value or () if not isinstance(a, SerialLoop)]
    if sizes is not None:
      axes = [a for a in axes if a in sizes]
    out.append((name, to_spec_entry(axes)))
  return tuple(out)


def without_mesh_axes(flax_table: Any, mesh_axes: frozenset[str]) -> tuple:
  """A flax rules table with ``mesh_axes`` dropped from every rule (names kept, as above).

  >>> without_mesh_axes((('batch', ('data', 'fsdp')), ('embed', 'data')), frozenset({'data'}))
  (('batch', 'fsdp'), ('embed', None))
  """
  out = []
  for name, value in flax_table or ():
    axes = (value,) if isinstance(value, str) else tuple(value or ())
    out.append((name, to_spec_entry([a for a in axes if a not in mesh_axes])))
  return tuple(out)


def _flax_spmd():
  return sys.modules.get("flax.core.spmd")


def _on_rules(rules: Any, mesh: AnyMesh | None):
  spmd = _flax_spmd()
  if spmd is None:
    return contextlib.nullcontext()
  return spmd.logical_axis_rules(flax_rules(rules, mesh))


def _on_mapped(mesh_axes: frozenset[str]):
  """Inside an xmap body: flax's current rules (set by us or by the user) without the mesh
  axes the body maps, so ``nn.with_logical_constraint`` leaves those dims to the xmap."""
  spmd = _flax_spmd()
  if spmd is None:
    return contextlib.nullcontext()
  current = spmd.get_logical_axis_rules()
  if not current:
    return contextlib.nullcontext()
  return spmd.logical_axis_rules(without_mesh_axes(current, mesh_axes))


FLAX_RULES_HOOK = RulesHook("flax", _on_rules, _on_mapped)
