"""The one pytest conftest: 8 virtual CPU devices and the ``slow`` marker.

It sits at the repository root so that doctests in ``partition/``, ``layers/`` and ``recipes/``
and every test under ``tests/`` get the same setup.
"""

import atexit
import os
import shutil
import tempfile
from pathlib import Path

# Must happen before JAX initialises its backends.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One compilation cache per test session, shared by the xdist workers and by the subprocesses
# the tests start (they inherit the environment): many tests compile the same training step
# (the README's commands, the notebooks, the job's own tests) and XLA's compile is most of
# their time. A hit is the executable a fresh compile gives, so nothing a test checks changes;
# a session starts empty, as CI does, and removes the folder when it ends.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="named-partition-jax-cache-")
  atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

# Whole files that compile full training steps, execute notebooks, start processes, run a CLI
# or large property suites, and modules whose doctests build whole Transformers. `pytest -m
# "not slow"` skips them, and every test marked `slow` in its own file: the rule is a test that
# takes over about 1.5 s on 2 cores (compiling a model, not checking a rule or a message).
SLOW_FILES = frozenset({
  "tests/test_notebooks.py",
  "tests/test_benchmarks.py",
  "tests/test_readme.py",
  "tests/recipes/test_readme_commands.py",
  "tests/partition/test_multiprocess.py",
  "tests/partition/test_fuzz_rules.py",
  "tests/partition/test_fuzz_xmap.py",
  "tests/recipes/test_multiprocess_train.py",
  "tests/recipes/test_export.py",
  "tests/recipes/test_explain_cli.py",
  # doctests that build and run whole Transformers
  "layers/_canonical.py",
  "layers/_model.py",
  "layers/haiku.py",
  "layers/linen.py",
  "layers/nnx.py",
})
_ROOT = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
  for item in items:
    if item.path.relative_to(_ROOT).as_posix() in SLOW_FILES:
      item.add_marker(pytest.mark.slow)
