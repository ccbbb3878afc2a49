"""Helpers shared by the tests of ``partition``."""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh


def mesh_of(shape: Sequence[int], names: Sequence[str], kind: AxisType = AxisType.Auto) -> Mesh:
  """A mesh over the first ``prod(shape)`` devices whose axes are all of type ``kind``.

  >>> dict(mesh_of((4, 2), ("data", "model")).shape)
  {'data': 4, 'model': 2}
  """
  return jax.make_mesh(tuple(shape), tuple(names), axis_types=(kind,) * len(names))
