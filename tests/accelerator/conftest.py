"""The accelerator smoke tests: each runs its work in a process on the machine's real JAX
backend, and every test in this folder is skipped when that backend is the CPU.

The test process itself runs on 8 virtual CPU devices (the root conftest), so nothing here
computes in it: a test asks for the ``accelerator`` fixture and starts ``python`` with
``accelerator.run(...)`` (the environment pytest was started with: no forced platform,
device count or -O0; this checkout on ``PYTHONPATH``). The root conftest marks every test in
this folder ``accelerator`` and ``slow``, and the skip below applies to all of them, so a new
``tests/accelerator/test_accelerator_*.py`` needs nothing else. On a GPU or TPU machine::

    python -m pytest -m accelerator -n0 tests/accelerator      # about 3 minutes on one GPU

Without an accelerator they are skipped after one probe (a process that imports JAX and
lists its devices, about 2 s). ``ACCELERATOR_STANDIN=cpu`` runs them on the CPU backend
instead: a check of this harness and of the tests' own logic, not of a device.

What a float32 matmul computes at JAX's default precision differs by backend, and the tests'
tolerances follow from it (``Accelerator.unit_roundoff``): NVIDIA GPUs since Ampere round
float32 matmul inputs to TF32 (10 explicit mantissa bits: relative rounding ``2**-11``), TPUs
to bfloat16 (7 bits: ``2**-8``), the CPU keeps float32 (``2**-24``).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STANDIN = "ACCELERATOR_STANDIN"
UNIT_ROUNDOFF = {"gpu": 2.0**-11, "tpu": 2.0**-8, "cpu": 2.0**-24}
_PROBE = ("import json, jax; d = jax.devices(); print(json.dumps({'backend': "
          "jax.default_backend(), 'count': len(d), 'kind': d[0].device_kind, "
          "'jax': jax.__version__}))")


@dataclasses.dataclass(frozen=True)
class Accelerator:
  """The machine's JAX backend as a fresh process sees it, and how to run processes on it."""

  backend: str              # jax.default_backend(): 'gpu', 'tpu' ('cpu' only as a stand-in)
  count: int                # jax.devices() in a fresh process
  kind: str                 # device_kind of the first device, e.g. 'NVIDIA H200'
  jax_version: str          # jax.__version__ there
  env: dict[str, str]

  @property
  def unit_roundoff(self) -> float:
    """Relative rounding of a float32 matmul's inputs at JAX's default precision here."""
    return UNIT_ROUNDOFF.get(self.backend, UNIT_ROUNDOFF["tpu"])  # unknown: the coarsest

  def run(self, *args: str, timeout: float, env: dict[str, str] | None = None
          ) -> subprocess.CompletedProcess:
    """``python *args`` in the repository root on this backend (``env`` adds variables)."""
    return subprocess.run([sys.executable, *args], cwd=ROOT, env={**self.env, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def accelerator_env(user_env: dict[str, str]) -> dict[str, str]:
  """``user_env`` on the real backend: JAX_PLATFORMS unset unless it names one other than
  the CPU (or the stand-in's ``cpu``), and JAX's default matmul precision."""
  env = dict(user_env)
  env.pop("JAX_DEFAULT_MATMUL_PRECISION", None)
  standin = env.get(STANDIN, "").strip()
  if standin:
    env["JAX_PLATFORMS"] = standin
  elif env.get("JAX_PLATFORMS", "").strip() in ("", "cpu"):
    env.pop("JAX_PLATFORMS", None)
  return env


def probe(env: dict[str, str]) -> Accelerator:
  """What a fresh process on ``env`` finds. A process that cannot start JAX is a failure
  (a broken driver or plugin), not a missing accelerator."""
  proc = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=300)
  if proc.returncode != 0:
    pytest.fail(f"JAX could not start on this machine's backend (rc={proc.returncode}):\n"
                f"{proc.stderr[-3000:]}", pytrace=False)
  found = json.loads(proc.stdout.strip().splitlines()[-1])
  return Accelerator(found["backend"], found["count"], found["kind"], found["jax"], env)


@pytest.fixture(scope="session")
def accelerator(user_env) -> Accelerator:
  env = accelerator_env(user_env)
  found = probe(env)
  if found.backend == "cpu" and not env.get(STANDIN):
    pytest.skip("no accelerator: JAX's default backend is the CPU (set ACCELERATOR_STANDIN=cpu "
                "to run these tests on it anyway)")
  return found


@pytest.fixture(autouse=True)
def _needs_accelerator(accelerator):
  """Every test in this folder is skipped without an accelerator, asked for or not."""
