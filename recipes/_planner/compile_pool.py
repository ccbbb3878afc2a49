"""Compiling candidate plans ahead of time, for N virtual CPU devices.

JAX fixes the device count of a process when its backend starts, so the plans are compiled
in a child process that has N devices: :func:`compile_many` writes the configs to a job file
and runs ``python -m recipes.plan --compile-worker JOB``, whose :func:`run_worker` compiles
each one (:func:`compile_step`) and prints one ``RESULT {json}`` line per config.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Any

from partition import PartitionError
from recipes._planner.candidates import PlanError, abstract_run, config_yaml

MAX_COMPILE_DEVICES = 512      # virtual CPU devices one compile may ask for
_RESULT = "RESULT "            # the prefix of a worker's result lines on its stdout
_REPO = pathlib.Path(__file__).resolve().parents[2]


def compile_step(config) -> dict[str, Any]:
  """Compiles ``config``'s train step on the devices this process has; per device: memory
  (``recipes.explain.Memory``), FLOPs, bytes accessed and collectives per mesh-axis group."""
  from recipes import explain
  start = time.perf_counter()
  run, state = abstract_run(config)
  compiled = explain.compile_train_step(run, state)
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return {"memory": explain.memory_of(compiled).to_dict(),
          "flops": float(cost.get("flops", 0.0)),
          "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
          **_collectives(compiled, run.mesh),
          "compile_s": time.perf_counter() - start}


def _collectives(compiled, mesh) -> dict[str, Any]:
  """``collective_bytes`` (ring bytes per mesh-axis group, ``'?'``: axes unknown),
  ``collectives`` (``partition.CollectiveStats.as_dict``) and ``collectives_error``."""
  import partition
  try:
    stats = partition.collective_stats(compiled, mesh)
  except PartitionError as e:   # an HLO spelling the parser does not read: keep the rest
    return {"collective_bytes": None, "collectives": None,
            "collectives_error": str(e).splitlines()[0]}
  groups: dict[str, float] = {}
  for op in stats.ops:
    if op.axes == ():
      continue   # a group of one device sends nothing
    key = "?" if op.axes is None else ",".join(op.axes)
    groups[key] = groups.get(key, 0.0) + op.bytes
  return {"collective_bytes": groups, "collectives": stats.as_dict(), "collectives_error": ""}


def run_worker(path: str) -> int:
  """``--compile-worker FILE``: compile each config of FILE, print one JSON line each."""
  job = json.loads(pathlib.Path(path).read_text())
  import jax
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", job["devices"])
  from recipes.config import load_config
  for key, text in job["configs"].items():
    tmp = pathlib.Path(path).with_suffix(".one.yaml")
    tmp.write_text(text)
    try:
      out = {"key": key, **compile_step(load_config(tmp))}
    except Exception as e:  # noqa: BLE001 - a failed compile is reported, the search goes on
      out = {"key": key, "error": f"{type(e).__name__}: {e}"}
    print(_RESULT + json.dumps(out), flush=True)
  return 0


def compile_many(configs: dict[str, Any], devices: int, on_done=None) -> dict[str, dict]:
  """Compiles ``{key: config}`` in one subprocess with ``devices`` virtual CPU devices;
  ``on_done()`` after each."""
  results: dict[str, dict] = {}
  if not configs:
    return results
  with tempfile.TemporaryDirectory() as tmp:
    job = pathlib.Path(tmp) / "job.json"
    job.write_text(json.dumps({"devices": devices,
                               "configs": {k: config_yaml(c) for k, c in configs.items()}}))
    proc = subprocess.Popen([sys.executable, "-m", "recipes.plan", "--compile-worker",
                             str(job)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_worker_env(), cwd=_REPO)
    for line in proc.stdout:
      if line.startswith(_RESULT):
        r = json.loads(line[len(_RESULT):])
        results[r.pop("key")] = r
        if on_done:
          on_done()
    err = proc.stderr.read()
    if proc.wait() != 0:
      raise PlanError(f"the compile worker failed (exit {proc.returncode}):\n{err[-2000:]}")
  return results


def _worker_env() -> dict[str, str]:
  """This process's environment, on CPU, with this checkout first on the path."""
  env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "JAX_PLATFORMS": "cpu"}
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO), env.get("PYTHONPATH")]))
  return env
