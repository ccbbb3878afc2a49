"""xmap on a mesh spanning two local processes (2 x 4 CPU devices), against one process.

The children are separate Python processes started with ``subprocess``; this test process
(8 CPU devices from conftest) only launches them and checks what they write.
"""

import json
from pathlib import Path

import numpy as np
import pytest

WORKER = Path(__file__).with_name("_multiprocess_worker.py")
TIMEOUT_S = 120


def _load_worker_module():
  import importlib.util
  spec = importlib.util.spec_from_file_location("_multiprocess_worker", WORKER)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _run_cluster(start_processes, tmp_path, axis_type):
  outs = [tmp_path / f"out{i}.json" for i in range(2)]
  procs = start_processes(2, lambda i, port: [str(WORKER), str(i), str(port), axis_type,
                                              str(outs[i])])
  procs.wait(TIMEOUT_S, "multi-process xmap run")
  assert all(o.exists() for o in outs), "a process exited 0 without writing its results"
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
def test_two_processes_match_one(tmp_path, axis_type, start_processes):
  results = _run_cluster(start_processes, tmp_path, axis_type)
  assert sorted(r["process_id"] for r in results) == [0, 1]
  worker = _load_worker_module()
  x, w = worker.global_inputs()
  np.testing.assert_allclose(_assemble(results, "normalized"), x / np.sum(x**2),
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(_assemble(results, "mean_loop"), np.tanh(x @ w).mean(0),
                             rtol=1e-5, atol=1e-6)
