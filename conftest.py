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

# Compile for a short test run, not for a fast program: XLA's compile is about two thirds of the
# suite's time and the programs it compiles are tiny and run a few times. JAX's own switch (as
# flax's example tests use it) runs LLVM at -O0 without its expensive passes; the optimised HLO
# (sharding propagation, SPMD partitioning, collectives, fusion, buffer sizes) is the same
# program users compile, only its machine code is less tuned. The one visible difference is in
# the last bits of some float results, which then depend on how ops are grouped into
# programs: a test whose bit-for-bit claim between two differently built programs holds with
# JAX's defaults but not at -O0 (Haiku's eager init against a jitted one) is marked `bitwise`
# and compiles with JAX's defaults (the fixture below). A resumed run equals an uninterrupted
# one bit for bit at -O0 too: the same executables on the same state and batches.
# Processes the tests start inherit the setting.
# `JAX_DISABLE_MOST_OPTIMIZATIONS=0 python -m pytest ...` runs everything with JAX's defaults.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

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


@pytest.fixture(autouse=True)
def _bitwise_claims_compile_with_jax_defaults(request, monkeypatch):
  """Under ``@pytest.mark.bitwise``: JAX's default optimisation for this test and the
  processes it starts, and none of the executables earlier tests compiled at -O0."""
  if (request.node.get_closest_marker("bitwise") is None
      or not jax.config.read("jax_disable_most_optimizations")):
    yield
    return
  monkeypatch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "0")
  jax.config.update("jax_disable_most_optimizations", False)
  jax.clear_caches()
  try:
    yield
  finally:
    jax.config.update("jax_disable_most_optimizations", True)
