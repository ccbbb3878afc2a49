"""`python -m partition` (the README's main command until the training recipe exists)."""

import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import AxisType
from mesh_testlib import make_mesh

from partition import _selfcheck


@pytest.mark.slow
@pytest.mark.parametrize("devices", [8, 1])
def test_python_m_partition_reports_environment_and_passes_selfcheck(child_env, devices):
  env = {**child_env, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run([sys.executable, "-m", "partition", "--devices", str(devices)],
                        capture_output=True, text=True, env=env, timeout=300)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "jax" in proc.stdout and f"devices          {devices} x cpu" in proc.stdout
  assert "[ok] Mean over ('data', SerialLoop(4))" in proc.stdout
  assert "precision='highest'" in proc.stdout
  assert "all checks passed" in proc.stdout


@pytest.mark.parametrize("default", ["bfloat16", "tensorfloat32"])
def test_selfcheck_matmuls_are_highest_precision_whatever_the_default(default):
  # A GPU multiplies float32 in TF32 and a TPU in bfloat16 at JAX's default precision; the
  # self-check compares with float64 numpy at 1e-5, which only true float32 meets. The CPU
  # ignores the setting, so what is checked here is the program: every dot asks for HIGHEST.
  mesh = make_mesh((4, 2), ("data", "model"), AxisType.Explicit)
  w, x = np.ones((8, 16), np.float32), np.ones((32, 16), np.float32)
  with jax.default_matmul_precision(default):
    for program in _selfcheck.programs(mesh):
      text = jax.jit(program).lower(w, x).as_text()
      dots = re.findall(r"stablehlo.dot_general.*", text)
      assert dots and all("precision = [HIGHEST, HIGHEST]" in d for d in dots), dots
