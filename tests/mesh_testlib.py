"""The one way the tests build a mesh: ``make_mesh(shape, names, axis_type)``.

A plain function rather than a fixture, so that modules can build their mesh at import time and
in ``parametrize``; importable from every test folder because the root ``conftest.py`` puts
``tests/`` on ``sys.path``.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh


def make_mesh(shape: Sequence[int], names: Sequence[str],
              axis_type: AxisType | Sequence[AxisType] = AxisType.Auto, *,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A mesh of ``shape`` whose axes are all of type ``axis_type`` (Auto unless said: JAX's own
  default is Explicit; a sequence gives one type per axis), over the first ``prod(shape)``
  devices or exactly ``devices``, in their order.

  >>> mesh = make_mesh((4, 2), ("data", "model"))
  >>> dict(mesh.shape), mesh.axis_types
  ({'data': 4, 'model': 2}, (Auto, Auto))
  >>> make_mesh((4, 2), ("data", "model"), (AxisType.Explicit, AxisType.Auto)).axis_types
  (Explicit, Auto)
  >>> make_mesh((2,), ("x",), devices=jax.devices()[6:]).devices.tolist()[0].id
  6
  """
  shape, names = tuple(shape), tuple(names)
  axis_types = ((axis_type,) * len(names) if isinstance(axis_type, AxisType)
                else tuple(axis_type))
  if devices is None:
    return jax.make_mesh(shape, names, axis_types=axis_types)
  return Mesh(np.asarray(devices).reshape(shape), names, axis_types=axis_types)
