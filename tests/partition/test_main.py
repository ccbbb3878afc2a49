"""`python -m partition` (the README's main command until the training recipe exists)."""

import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_python_m_partition_reports_environment_and_passes_selfcheck():
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run([sys.executable, "-m", "partition"], capture_output=True, text=True,
                        env=env, timeout=300)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "jax" in proc.stdout and "devices          8 x cpu" in proc.stdout
  assert "[ok] Mean over ('data', SerialLoop(4))" in proc.stdout
  assert "all checks passed" in proc.stdout
