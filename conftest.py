"""The one pytest conftest: 8 virtual CPU devices, shared mesh fixtures, the ``slow`` marker.

It sits at the repository root so that doctests in ``partition/``, ``layers/`` and ``recipes/``
and every test under ``tests/`` get the same setup.
"""

import functools
import os
from pathlib import Path

# Must happen before JAX initialises its backends.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

# Whole files that compile full training steps, execute notebooks, start processes or run large
# property suites. `pytest -m "not slow"` skips them (and every test marked `slow` in its file).
SLOW_FILES = frozenset({
  "tests/test_notebooks.py",
  "tests/test_benchmarks.py",
  "tests/test_readme.py",
  "tests/partition/test_multiprocess.py",
  "tests/partition/test_fuzz_rules.py",
  "tests/partition/test_fuzz_xmap.py",
  "tests/recipes/test_multiprocess_train.py",
})
_ROOT = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
  for item in items:
    if item.path.relative_to(_ROOT).as_posix() in SLOW_FILES:
      item.add_marker(pytest.mark.slow)


@functools.cache
def _mesh(shape: tuple[int, ...], names: tuple[str, ...], axis_type: AxisType) -> jax.sharding.Mesh:
  return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names),
                       devices=jax.devices()[: _size(shape)])


def _size(shape: tuple[int, ...]) -> int:
  total = 1
  for n in shape:
    total *= n
  return total


@pytest.fixture
def mesh_factory():
  """``mesh_factory(shape, names, axis_type=AxisType.Auto)``: a cached mesh over the first
  devices, e.g. ``mesh_factory((4, 2), ('data', 'tensor'))``."""
  def make(shape, names, axis_type=AxisType.Auto):
    return _mesh(tuple(shape), tuple(names), axis_type)
  return make


@pytest.fixture(params=[AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def axis_type(request):
  """Both mesh axis types, for tests where Auto and Explicit meshes behave differently."""
  return request.param


@pytest.fixture
def default_mesh(mesh_factory, axis_type):
  """The default recipe's ``(data=2, fsdp=2, tensor=2)`` mesh, Auto and Explicit."""
  return mesh_factory((2, 2, 2), ("data", "fsdp", "tensor"), axis_type)
