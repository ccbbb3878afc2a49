"""The root pytest conftest: 8 virtual CPU devices, compile settings for a short test run, the
``slow``, ``bitwise`` and ``accelerator`` markers, ``child_env`` and ``start_processes`` for the
processes tests start, and ``user_env`` for those that run on the real backend
(``tests/accelerator``). It also puts ``tests/`` on ``sys.path``: ``from mesh_testlib import
make_mesh`` is how every test builds a mesh.

It sits at the repository root so that doctests in ``partition/``, ``layers/`` and ``recipes/``
and every test under ``tests/`` get the same setup.

Compile settings, in short. The suite is compile-bound, so it compiles the way flax's example
tests do: ``JAX_DISABLE_MOST_OPTIMIZATIONS=1`` runs LLVM at -O0 (a third off the suite's time);
the optimised HLO (sharding, SPMD partitioning, collectives, fusion, buffer sizes) is the one
JAX's defaults give, only the last bits of some float results differ, and they then depend on
how ops are grouped into programs. The few bit-for-bit claims between two differently built
programs that -O0 breaks are marked ``bitwise`` and compile with JAX's defaults. Two more
settings go with -O0: every compile goes to the session's compilation cache (one folder per
session, shared by xdist workers and child processes), not only those over 1 s; and XLA's CPU
backend uses its older LLVM fusion emitters (``--xla_cpu_use_fusion_emitters=false``, 12% less
compile time, the same partitioned program) where the jaxlib accepts the flag. Child processes
and notebook kernels inherit all of it (``child_env``), so they compute what the test process
computes, bit for bit. ``JAX_DISABLE_MOST_OPTIMIZATIONS=0 python -m pytest ...`` runs
everything with JAX's defaults (about twice as long; the tests pass either way).
"""

import atexit
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

# The environment pytest was started with, before the CPU settings below: the accelerator
# tests (tests/accelerator) start their processes from it, on the machine's real backend.
_USER_ENV = dict(os.environ)

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

import jax  # noqa: E402  (after the settings above; XLA reads XLA_FLAGS when a backend starts)
import pytest  # noqa: E402


def _xla_accepts(xla_flags: str) -> bool:
  """Whether this jaxlib's XLA starts with ``xla_flags`` (an unknown flag aborts the process
  that starts a backend, so ask a throwaway one)."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags}
  try:
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                           capture_output=True, timeout=120)
  except subprocess.TimeoutExpired:
    return False
  return probe.returncode == 0


# Two more settings for a short test run, on while the suite compiles at -O0 (JAX's own
# reading of the variable decides, so JAX_DISABLE_MOST_OPTIMIZATIONS=0 turns them off too):
if jax.config.read("jax_disable_most_optimizations"):
  # Cache every compile, not only those over JAX's 1 s default: at -O0 most take less, and
  # xdist workers, the processes tests start and runs that rebuild the same step (a new closure
  # per run, the same program) compile them again otherwise (7% of a compile-heavy subset).
  # The variable is for those processes; JAX read it for this one when it was imported.
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  jax.config.update("jax_persistent_cache_min_compile_time_secs",
                    float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
  # XLA's CPU backend generates fusions' code through MLIR "fusion emitters" by default; its
  # older direct-to-LLVM emitters compile the same partitioned program (shardings,
  # collectives, buffers; fusion groups a few elementwise ops differently) in 12% less time on
  # the compile-heavy tests, with the same results up to float32 rounding. The bitwise tests
  # hold with either. Decided once, in the process that starts pytest: xdist workers and
  # subprocesses inherit XLA_FLAGS.
  xla_flags = os.environ.get("XLA_FLAGS", "")
  if "xla_cpu_use_fusion_emitters" not in xla_flags:
    with_legacy_emitters = f"{xla_flags} --xla_cpu_use_fusion_emitters=false".strip()
    if _xla_accepts(with_legacy_emitters):
      os.environ["XLA_FLAGS"] = with_legacy_emitters

jax.config.update("jax_num_cpu_devices", 8)

# Whole files that compile full training steps, execute notebooks, start processes, run a CLI
# or large property suites, and modules whose doctests build whole Transformers. `pytest -m
# "not slow"` skips them, and every test marked `slow` in its own file: the rule is a test that
# takes over about 1.5 s on 2 cores (compiling a model, not checking a rule or a message).
SLOW_FILES = frozenset({
  "tests/test_notebooks.py",
  "tests/test_benchmarks.py",
  "tests/recipes/test_readme_commands.py",
  "tests/partition/xmap/test_multiprocess.py",
  "tests/partition/rules/test_fuzz_rules.py",
  "tests/partition/xmap/test_fuzz_xmap.py",
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
# The tests' shared helpers (tests/mesh_testlib.py: ``make_mesh``) import from every test folder.
sys.path.insert(0, str(_ROOT / "tests"))


# Every test in this folder runs its work in a process on the real backend (a GPU or TPU) and
# is skipped without one (tests/accelerator/conftest.py): marked `accelerator` and `slow`.
ACCELERATOR_DIR = "tests/accelerator/"


def pytest_collection_modifyitems(config, items):
  for item in items:
    path = item.path.relative_to(_ROOT).as_posix()
    if path in SLOW_FILES:
      item.add_marker(pytest.mark.slow)
    if path.startswith(ACCELERATOR_DIR):
      item.add_marker(pytest.mark.accelerator)
      item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def user_env() -> dict[str, str]:
  """The environment pytest was started with (no forced CPU platform, device count, -O0 or
  CPU-only XLA flags), with this checkout first on ``PYTHONPATH`` and this session's
  compilation cache: for processes that run on the machine's own backend."""
  env = dict(_USER_ENV)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_ROOT), env.get("PYTHONPATH")) if p)
  env["JAX_COMPILATION_CACHE_DIR"] = os.environ["JAX_COMPILATION_CACHE_DIR"]
  return env


@pytest.fixture
def child_env() -> dict[str, str]:
  """The environment for a Python process a test starts: CPU only, this checkout first on
  ``PYTHONPATH``, and this run's settings (-O0, the compilation cache, XLA_FLAGS) except a
  forced device count, which the child chooses itself. A child compiled differently from the
  test process would not give its results bit for bit."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                              if not f.startswith("--xla_force_host_platform_device_count"))
  env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_ROOT), env.get("PYTHONPATH")) if p)
  return env


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Processes(list):
  """Python processes a test started together (``start_processes``), in process-id order."""

  def wait(self, timeout_s: float, what: str) -> list[tuple[str, str]]:
    """Each process's ``(stdout, stderr)`` once all have exited; the test fails, with every
    process's output, if one exits non-zero or they are not done within ``timeout_s``."""
    outs, logs, failed = [], [], False
    for i, p in enumerate(self):
      try:
        stdout, stderr = p.communicate(timeout=timeout_s)
      except subprocess.TimeoutExpired:
        for q in self:
          q.kill()
        stdout, stderr = p.communicate()
        failed = True
        logs.append(f"--- process {i}: TIMEOUT after {timeout_s} s")
      outs.append((stdout, stderr))
      # gloo logs a line per connection; the end of stderr holds the error
      shown = "\n".join(line for line in stderr.splitlines() if "[Gloo]" not in line)
      logs.append(f"--- process {i} (rc={p.returncode}) stdout:\n{stdout}\n--- stderr:\n"
                  f"{shown[-4000:]}")
      failed |= p.returncode != 0
    if failed:
      pytest.fail(f"{what} failed:\n" + "\n".join(logs), pytrace=False)
    return outs


@pytest.fixture
def start_processes(child_env):
  """``start_processes(n, argv, cwd=None)`` starts ``n`` Python processes in ``child_env``,
  process ``i`` with arguments ``argv(i, port)`` (``port``: a free loopback port for their
  coordinator), stdout and stderr piped, and returns them as ``Processes``; any still running
  when the test ends are killed."""
  started = []

  def start(n: int, argv, cwd=None) -> Processes:
    port = _free_port()
    procs = Processes(subprocess.Popen([sys.executable, *argv(i, port)], cwd=cwd, env=child_env,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                      for i in range(n))
    started.extend(procs)
    return procs

  yield start
  for p in started:
    if p.poll() is None:
      p.kill()
      p.communicate()


@pytest.fixture(autouse=True)
def _bitwise_claims_compile_with_jax_defaults(request, monkeypatch):
  """Under ``@pytest.mark.bitwise``: JAX's default optimisation for this test and the
  processes it starts, and none of the executables earlier tests compiled at -O0. (XLA reads
  XLA_FLAGS once per process, so the emitters flag above stays; these claims hold with
  either emitters.)"""
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
