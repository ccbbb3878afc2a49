"""The one pytest conftest: 8 virtual CPU devices and the ``slow`` marker.

It sits at the repository root so that doctests in ``partition/``, ``layers/`` and ``recipes/``
and every test under ``tests/`` get the same setup.
"""

import os
from pathlib import Path

# Must happen before JAX initialises its backends.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

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
