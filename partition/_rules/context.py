"""The rules context: ``with partition.axis_rules(rules, mesh=None): ...``.

Code that resolves logical axes (``constrain``, ``explain``, ``AxisRules.sharding``, the
framework adapters) takes ``rules=None, mesh=None`` and falls back to this context: explicit
argument first, context second. The context is a ``contextvars.ContextVar``, so each thread
(and each asyncio task) sees only the contexts it entered; contexts nest and restore on exit.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from partition._base.mesh import AnyMesh, current_mesh
from partition._rules import scope as _scope
from partition._rules.scope import current_rules_mesh as current_rules_mesh
from partition._rules.table import AxisRules


def as_rules(rules: Any) -> AxisRules:
  """``rules`` as an :class:`AxisRules`: a table, a list of pairs, a mapping or a file path."""
  if isinstance(rules, AxisRules):
    return rules
  if isinstance(rules, (str, bytes, os.PathLike)):
    return AxisRules.from_file(rules)
  return AxisRules(rules)


@contextlib.contextmanager
def axis_rules(rules: Any, mesh: AnyMesh | None = None) -> Iterator[AxisRules]:
  """Makes ``rules`` (and optionally ``mesh``) the defaults inside the ``with`` block.

  Args:
    rules: an :class:`AxisRules`, anything ``AxisRules(...)`` accepts, or a path to a rules
      file. ``None`` keeps the enclosing rules (to set only a mesh).
    mesh: a ``jax.sharding.Mesh`` used by ``constrain``/``explain``; ``None`` keeps the
      enclosing one (and, if none, the ``jax.set_mesh`` mesh is used). This does not call
      ``jax.set_mesh``: programs on Explicit meshes still need that.

  If flax is in use, flax's ``nn.logical_axis_rules`` is set to the same table, so
  ``nn.with_logical_constraint`` in existing linen models takes effect too (flax applies it
  only under ``jax.set_mesh`` and on Auto mesh axes).

  Yields:
    The rules in effect.

  Example:
    >>> import partition
    >>> with partition.axis_rules([('batch', 'data')]):
    ...   with partition.axis_rules([('batch', None)]):
    ...     inner = partition.current_rules()
    ...   outer = partition.current_rules()
    >>> inner, outer, partition.current_rules()
    (AxisRules([('batch', None)]), AxisRules([('batch', 'data')]), None)
  """
  old_rules, old_mesh = _scope.RULES.get()
  new_rules = old_rules if rules is None else as_rules(rules)
  new_mesh = old_mesh if mesh is None else current_mesh(mesh, "partition.axis_rules")
  token = _scope.RULES.set((new_rules, new_mesh))
  try:
    with contextlib.ExitStack() as stack:
      if new_rules is not None:
        # Adapters' hooks, e.g. flax's own rules so that nn.with_logical_constraint in
        # existing linen models resolves through the same table.
        hook_mesh = new_mesh if new_mesh is not None else current_mesh()
        mapped = _scope.mapped_mesh_axes()
        for hook in _scope.rules_hooks():
          stack.enter_context(hook.on_rules(new_rules, hook_mesh))
          if mapped:  # inside an xmap body: its mapped mesh axes stay dropped
            stack.enter_context(hook.on_mapped(mapped))
      yield new_rules
  finally:
    _scope.RULES.reset(token)


def current_rules(rules: Any = None) -> AxisRules | None:
  """``rules`` if given (converted to AxisRules), else the ``axis_rules`` context, else None."""
  if rules is not None:
    return as_rules(rules)
  return _scope.RULES.get()[0]
