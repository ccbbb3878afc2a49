"""Finding the mesh in scope and describing its axes.

Explicit argument first, context second: ``mesh=`` wins, else the mesh set by
``jax.set_mesh`` (seen as a concrete ``Mesh`` outside ``jax.jit`` and as an
``AbstractMesh`` while tracing). The legacy ``with mesh:`` context sets nothing that public
JAX APIs can read, so it is not consulted.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Mapping
from typing import Any

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh, PartitionSpec

from partition._base.errors import MeshError

AnyMesh = Mesh | AbstractMesh


def current_mesh(mesh: AnyMesh | None = None, api: str = "partition") -> AnyMesh | None:
  """Returns ``mesh`` if given, else the mesh in context, else ``None``."""
  if mesh is not None:
    if not isinstance(mesh, (Mesh, AbstractMesh)):
      raise MeshError(
          f"{api}: mesh= must be a jax.sharding.Mesh or AbstractMesh, got "
          f"{type(mesh).__name__}. "
          "Build one with jax.make_mesh(shape, names).")
    return None if mesh.empty else mesh
  try:
    concrete = jax.sharding.get_mesh()
  except ValueError:  # inside jax.jit tracing: only the abstract mesh is visible
    concrete = None
  if concrete is not None and not concrete.empty:
    return concrete
  abstract = jax.sharding.get_abstract_mesh()
  return None if abstract.empty else abstract


def axis_sizes(mesh: AnyMesh | None) -> Mapping[str, int]:
  """``{mesh axis: size}``; empty for no mesh."""
  return {} if mesh is None else dict(mesh.shape)


def resource_size(mesh: AnyMesh | None, mesh_axes: Iterable[str]) -> int:
  sizes = axis_sizes(mesh)
  return math.prod(sizes[a] for a in mesh_axes)


def in_context(mesh: AnyMesh | None):
  """Makes ``mesh`` the context (abstract) mesh while tracing, if none is, so that
  bare-``PartitionSpec`` constraints in user code (``with_sharding_constraint(x,
  P('model'))``, flax's ``nn.with_logical_constraint``) see a ``mesh=`` argument as they
  would a ``jax.set_mesh`` mesh."""
  if mesh is None or not jax.sharding.get_abstract_mesh().empty:
    return contextlib.nullcontext()
  abstract = mesh if isinstance(mesh, AbstractMesh) else mesh.abstract_mesh
  return jax.sharding.use_abstract_mesh(abstract)


def with_unit_axes(mesh: AnyMesh, axes: Iterable[str]) -> AnyMesh:
  """``mesh`` (as an ``AbstractMesh``) with ``axes`` of size 1: what a rule sees of the mesh
  axes an enclosing xmap maps (they divide every dim and place none of the body's).

  >>> with_unit_axes(jax.sharding.AbstractMesh((4, 2), ('data', 'model')), {'data'})
  AbstractMesh('data': 1, 'model': 2, axis_types=(Auto, Auto))
  """
  axes = frozenset(axes) & frozenset(mesh.axis_names)
  if not axes:
    return mesh
  sizes = tuple(1 if a in axes else s for a, s in mesh.shape.items())
  return AbstractMesh(sizes, tuple(mesh.axis_names), axis_types=tuple(mesh.axis_types))


def explicit_axes(mesh: AnyMesh | None) -> frozenset[str]:
  """Mesh axes of type ``AxisType.Explicit`` (sharding-in-types axes)."""
  if mesh is None:
    return frozenset()
  return frozenset(
      name for name, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit)


def describe(mesh: AnyMesh | None) -> str:
  if mesh is None:
    return "no mesh"
  kinds = {name: t.name for name, t in zip(mesh.axis_names, mesh.axis_types)}
  return "mesh(" + ", ".join(f"{n}={s} {kinds[n]}" for n, s in mesh.shape.items()) + ")"


def entry_mesh_axes(entry: Any) -> tuple[str, ...]:
  """The mesh axes of one ``PartitionSpec`` entry (``None``/``UNCONSTRAINED``: none).

  >>> entry_mesh_axes(None), entry_mesh_axes('data'), entry_mesh_axes(('data', 'fsdp'))
  ((), ('data',), ('data', 'fsdp'))
  """
  if entry is None or entry is PartitionSpec.UNCONSTRAINED:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def to_spec_entry(axes: Iterable[str]) -> Any:
  """The ``PartitionSpec`` entry placing a dim on ``axes`` (the inverse of entry_mesh_axes).

  >>> to_spec_entry(()), to_spec_entry(['data']), to_spec_entry(['data', 'fsdp'])
  (None, 'data', ('data', 'fsdp'))
  """
  axes = tuple(axes)
  return None if not axes else axes[0] if len(axes) == 1 else axes
