"""What is in scope while a program is traced: the rules context and the mapped mesh axes.

A leaf module (it imports only :mod:`partition._base.mesh`), so that the rules table
(``_rules``), the ``axis_rules`` context manager (``_context``) and the xmap engine can all
read the scope without importing each other.

- ``(rules, mesh)``: set by ``partition.axis_rules``; explicit arguments win over it.
- mapped mesh axes: the mesh axes that the xmap bodies being traced map their named axes
  to. Inside such a body a constraint may not name them (JAX: "vmap spmd_axis_name cannot
  appear in with_sharding_constraint spec"), so ``partition.constrain`` and the framework
  hooks drop them: the enclosing xmap already places that dim.
- hooks: framework adapters' context managers, entered when rules are set and when mesh
  axes become mapped (the flax one sets flax's ``nn.logical_axis_rules``). The core never
  imports an adapter; ``partition/__init__.py`` registers the hooks it ships.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

from partition._base.mesh import AnyMesh, current_mesh

RULES: contextvars.ContextVar[tuple[Any, AnyMesh | None]] = contextvars.ContextVar(
    "partition_axis_rules", default=(None, None))

# None outside xmap bodies; inside, the mesh axes they map (possibly none).
MAPPED_MESH_AXES: contextvars.ContextVar[frozenset[str] | None] = contextvars.ContextVar(
    "partition_mapped_mesh_axes", default=None)


@dataclasses.dataclass(frozen=True)
class RulesHook:
  """A framework's side of the rules context.

  Attributes:
    name: the framework, for reprs and tests.
    on_rules: ``(rules, mesh) -> context manager``, entered by every ``axis_rules``.
    on_mapped: ``(mesh_axes) -> context manager``, entered while an xmap body that maps
      ``mesh_axes`` is traced: the framework's own constraints must drop those axes.
  """
  name: str
  on_rules: Callable[[Any, AnyMesh | None], Any]
  on_mapped: Callable[[frozenset[str]], Any]


_HOOKS: list[RulesHook] = []


def register_rules_hook(hook: RulesHook) -> None:
  """Registers ``hook``; registering the same hook twice keeps one."""
  if hook not in _HOOKS:
    _HOOKS.append(hook)


def rules_hooks() -> tuple[RulesHook, ...]:
  return tuple(_HOOKS)


def current_rules_mesh(mesh: AnyMesh | None = None) -> AnyMesh | None:
  """``mesh`` if given, else the ``axis_rules`` mesh, else the ``jax.set_mesh`` mesh."""
  if mesh is not None:
    return current_mesh(mesh)
  ctx_mesh = rules_mesh()
  return ctx_mesh if ctx_mesh is not None else current_mesh()


def rules_mesh() -> AnyMesh | None:
  """The mesh given to the innermost ``axis_rules`` (``None`` outside one or without)."""
  return RULES.get()[1]


def mapped_mesh_axes() -> frozenset[str]:
  """Mesh axes mapped by the xmap bodies being traced (empty outside them)."""
  return MAPPED_MESH_AXES.get() or frozenset()


def inside_xmap() -> bool:
  """True while an xmap body is traced (on Explicit meshes it runs with Auto axes)."""
  return MAPPED_MESH_AXES.get() is not None


@contextlib.contextmanager
def mapping(mesh_axes: frozenset[str]) -> Iterator[None]:
  """Marks ``mesh_axes`` as mapped while an xmap body is traced (nested bodies add up)."""
  new = mapped_mesh_axes() | frozenset(mesh_axes)
  token = MAPPED_MESH_AXES.set(new)
  try:
    with contextlib.ExitStack() as stack:
      if mesh_axes:
        for hook in _HOOKS:
          stack.enter_context(hook.on_mapped(new))
      yield
  finally:
    MAPPED_MESH_AXES.reset(token)
