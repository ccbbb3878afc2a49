"""Compiling candidate plans ahead of time, for N virtual CPU devices.

JAX fixes the device count of a process when its backend starts, so the plans are compiled
in a child process that has N devices: :func:`compile_many` writes the configs to a job file
and runs ``python -m recipes.plan --compile-worker JOB``, whose :func:`run_worker` compiles
each one (:func:`compile_step`), printing ``START key`` before it and one ``RESULT {json}``
line after it.

XLA can abort the whole process on a plan it cannot compile (a C++ check failure, e.g.
XLA:CPU's AllReducePromotion on a bf16 pipeline). A worker that dies that way takes only the
config it had started with it: :func:`compile_many` records that config as failed
(:func:`crash_error`) and starts a fresh worker for the configs it had not reached.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from partition import PartitionError
from recipes._planner.candidates import PlanError, abstract_run, config_yaml

MAX_COMPILE_DEVICES = 512      # virtual CPU devices one compile may ask for
_RESULT = "RESULT "            # the prefix of a worker's result lines on its stdout
_START = "START "              # ... and of the line it prints before compiling a config
# test hooks: the worker aborts (as XLA's check failures do) before compiling this key, or
# is killed as the out-of-memory killer kills it
CRASH_ENV = "RECIPES_PLAN_WORKER_ABORT_ON"
KILL_ENV = "RECIPES_PLAN_WORKER_KILLED_ON"
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
    print(_START + key, flush=True)
    if os.environ.get(CRASH_ENV) == key:
      os.abort()
    if os.environ.get(KILL_ENV) == key:
      os.kill(os.getpid(), signal.SIGKILL)
    tmp = pathlib.Path(path).with_suffix(".one.yaml")
    tmp.write_text(text)
    try:
      out = {"key": key, **compile_step(load_config(tmp))}
    except Exception as e:  # noqa: BLE001 - a failed compile is reported, the search goes on
      out = {"key": key, "error": f"{type(e).__name__}: {e}"}
    print(_RESULT + json.dumps(out), flush=True)
  return 0


def compile_many(configs: dict[str, Any], devices: int, on_done=None,
                 labels: dict[str, str] | None = None) -> dict[str, dict]:
  """Compiles ``{key: config}`` in a subprocess with ``devices`` virtual CPU devices;
  ``on_done()`` after each. A worker that dies while compiling a config (an XLA crash)
  fails that config alone (``{"error": ...}``, named by ``labels[key]``, else the key) and
  a fresh worker compiles the rest.

  Raises:
    PlanError: a worker died before it started any config (it cannot start at all).
  """
  results: dict[str, dict] = {}
  labels = labels or {}
  pending = {k: config_yaml(c) for k, c in configs.items()}
  with tempfile.TemporaryDirectory() as tmp:
    while pending:
      started, code, err = _run_worker_process(pending, devices, pathlib.Path(tmp), results,
                                               on_done)
      if code == 0 and not pending:
        break
      if started is None or started not in pending:
        raise PlanError(f"the compile worker failed ({_exit_text(code)}) before compiling a "
                        f"plan:\n{err[-2000:]}")
      pending.pop(started)
      results[started] = {"error": crash_error(labels.get(started, started), code, err),
                          "crashed": code}
      if code == -signal.SIGKILL:
        results[started]["transient"] = True   # not the plan's fault: a rerun tries again
      if on_done:
        on_done()
  return results


def _run_worker_process(pending: dict[str, str], devices: int, tmp: pathlib.Path,
                        results: dict[str, dict], on_done) -> tuple[str | None, int, str]:
  """One worker over ``pending`` (``{key: yaml}``); each result moves from ``pending`` to
  ``results``. Returns the key it last started, its exit code and its stderr."""
  job, log = tmp / "job.json", tmp / "worker.err"
  job.write_text(json.dumps({"devices": devices, "configs": pending}))
  started = None
  with log.open("w+") as stderr:   # a file, not a pipe: a long trace cannot block the worker
    proc = subprocess.Popen([sys.executable, "-m", "recipes.plan", "--compile-worker",
                             str(job)], stdout=subprocess.PIPE, stderr=stderr,
                            text=True, env=_worker_env(), cwd=_REPO)
    for line in proc.stdout:
      if line.startswith(_START):
        started = line[len(_START):].strip()
      elif line.startswith(_RESULT):
        r = json.loads(line[len(_RESULT):])
        results[r["key"]] = {k: v for k, v in r.items() if k != "key"}
        pending.pop(r["key"], None)
        if on_done:
          on_done()
    code = proc.wait()
    stderr.seek(0)
    return started, code, stderr.read()


def crash_error(label: str, code: int, stderr: str) -> str:
  """The failure of a config whose compile killed the worker: what died and how, whose fault
  it is (an abort is XLA's crash; SIGKILL is most often the out-of-memory killer) and XLA's
  last message (stack frames dropped)."""
  last = [line.strip() for line in stderr.splitlines()
          if line.strip() and not line.lstrip().startswith("@")
          and not line.startswith("*** ")][-3:]
  if code == -signal.SIGKILL:
    cause = ("  On Linux that is most often the out-of-memory killer: compiling this plan "
             "needed more host memory than was free (or the worker was killed from outside). "
             "It is not a mistake in the config, and it is not cached: a rerun compiles it "
             "again.")
    fix = ("The other plans were compiled in a fresh worker. To compile this one, free host "
           "memory or compile fewer plans at once (--compile 1); --compile 0 ranks by the "
           "analytic memory.")
  else:
    cause = ("  This is a crash inside XLA:CPU's compiler, not a mistake in the config (it "
             "passed python -m recipes.train's checks); a GPU or TPU compiler may compile it.")
    fix = ("The other plans were compiled in a fresh worker. To compile this one, try another "
           "model.dtype or JAX version.")
  return "\n".join([
      f"WorkerCrash: the compile worker died ({_exit_text(code)}) while compiling {label}.",
      cause, *(f"  XLA: {line}" for line in last), fix])


def _exit_text(code: int) -> str:
  if code < 0:
    try:
      return f"killed by signal {-code}, {signal.Signals(-code).name}"
    except ValueError:
      return f"killed by signal {-code}"
  return f"exit code {code}"


def _worker_env() -> dict[str, str]:
  """This process's environment, on CPU, with this checkout first on the path."""
  env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "JAX_PLATFORMS": "cpu"}
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO), env.get("PYTHONPATH")]))
  return env
