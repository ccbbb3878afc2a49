"""xmap on a mesh spanning two local processes (2 x 4 CPU devices), against one process.

The children are separate Python processes started with ``subprocess``; this test process
(8 CPU devices from conftest) only launches them and checks what they write.
"""

import json
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

WORKER = Path(__file__).with_name("_multiprocess_worker.py")
TIMEOUT_S = 120


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _load_worker_module():
  import importlib.util
  spec = importlib.util.spec_from_file_location("_multiprocess_worker", WORKER)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _run_cluster(env, tmp_path, axis_type):
  port = _free_port()
  outs = [tmp_path / f"out{i}.json" for i in range(2)]
  procs = [subprocess.Popen([sys.executable, str(WORKER), str(i), str(port), axis_type,
                             str(outs[i])], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for i in range(2)]
  logs, failed = [], False
  for i, p in enumerate(procs):
    try:
      stdout, stderr = p.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      stdout, stderr = p.communicate()
      failed = True
      logs.append(f"--- process {i}: TIMEOUT after {TIMEOUT_S} s")
    logs.append(f"--- process {i} (rc={p.returncode}) stdout:\n{stdout}\n--- stderr:\n{stderr}")
    failed |= p.returncode != 0
  if failed or not all(o.exists() for o in outs):
    pytest.fail("multi-process xmap run failed:\n" + "\n".join(logs), pytrace=False)
  return [json.loads(o.read_text()) for o in outs]


def _assemble(results, name):
  shape = tuple(results[0][name]["shape"])
  full = np.full(shape, np.nan, np.float32)
  seen = np.zeros(shape, bool)
  for r in results:
    for s in r[name]["shards"]:
      idx = tuple(slice(a, b) for a, b in s["index"])
      data = np.asarray(s["data"], np.float32)
      if seen[idx].any():  # replicated shards must agree across devices and processes
        np.testing.assert_array_equal(full[idx][seen[idx]], data[seen[idx]])
      full[idx], seen[idx] = data, True
  assert seen.all(), f"{name}: the shards of both processes do not cover the array"
  return full


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_two_processes_match_one(tmp_path, axis_type, child_env):
  results = _run_cluster(child_env, tmp_path, axis_type)
  assert sorted(r["process_id"] for r in results) == [0, 1]
  worker = _load_worker_module()
  x, w = worker.global_inputs()
  np.testing.assert_allclose(_assemble(results, "normalized"), x / np.sum(x**2),
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(_assemble(results, "mean_loop"), np.tanh(x @ w).mean(0),
                             rtol=1e-5, atol=1e-6)
