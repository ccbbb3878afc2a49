"""The rules context: ``with partition.axis_rules(rules, mesh=None): ...``.

Code that resolves logical axes (``constrain``, ``explain``, ``AxisRules.sharding``, the
framework adapters) takes ``rules=None, mesh=None`` and falls back to this context: explicit
argument first, context second. The context is a ``contextvars.ContextVar``, so each thread
(and each asyncio task) sees only the contexts it entered; contexts nest and restore on exit.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Callable, Iterator
from typing import Any

from partition._mesh import AnyMesh, current_mesh
from partition._rules import AxisRules

# Context managers entered by axis_rules, registered by framework adapters on import (the
# flax adapter sets flax's own nn.logical_axis_rules): the core never imports an adapter.
_HOOKS: list[Callable[[AxisRules, AnyMesh | None], Any]] = []

_STATE: contextvars.ContextVar[tuple[AxisRules | None, AnyMesh | None]] = (
    contextvars.ContextVar("partition_axis_rules", default=(None, None)))


def register_rules_hook(hook: Callable[[AxisRules, AnyMesh | None], Any]) -> None:
  """Registers ``hook(rules, mesh) -> context manager``, entered by every ``axis_rules``.

  For framework adapters: ``partition._adapt`` registers one that sets flax's rules. A hook
  registered twice runs once.
  """
  if hook not in _HOOKS:
    _HOOKS.append(hook)


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
  old_rules, old_mesh = _STATE.get()
  new_rules = old_rules if rules is None else as_rules(rules)
  new_mesh = old_mesh if mesh is None else current_mesh(mesh, "partition.axis_rules")
  token = _STATE.set((new_rules, new_mesh))
  try:
    with contextlib.ExitStack() as stack:
      if new_rules is not None:
        # Adapters' hooks, e.g. flax's own rules so that nn.with_logical_constraint in
        # existing linen models resolves through the same table.
        hook_mesh = new_mesh if new_mesh is not None else current_mesh()
        for hook in _HOOKS:
          stack.enter_context(hook(new_rules, hook_mesh))
      yield new_rules
  finally:
    _STATE.reset(token)


def current_rules(rules: Any = None) -> AxisRules | None:
  """``rules`` if given (converted to AxisRules), else the ``axis_rules`` context, else None."""
  if rules is not None:
    return as_rules(rules)
  return _STATE.get()[0]


def current_rules_mesh(mesh: AnyMesh | None = None) -> AnyMesh | None:
  """``mesh`` if given, else the ``axis_rules`` mesh, else the ``jax.set_mesh`` mesh."""
  if mesh is not None:
    return current_mesh(mesh)
  ctx_mesh = _STATE.get()[1]
  return ctx_mesh if ctx_mesh is not None else current_mesh()
