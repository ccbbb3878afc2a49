"""``--measure K``: time the best plans on the devices this process sees (the calibration
loop on one's own hardware), to put the measured step beside the predicted one."""

from __future__ import annotations

import time
from collections.abc import Sequence

from recipes._planner.candidates import PlanError, candidate_config
from recipes._planner.search import Result


def measure(config, results: Sequence[Result], *, top: int, steps: int = 5,
            devices: int) -> list[Result]:
  """Compiles and times the first ``top`` fitting plans on the devices this process sees (the
  calibration loop on one's own hardware): per plan, the step's memory per device from the
  compile on this backend (XLA ``memory_analysis``) and the median of ``steps`` timed steps
  after one warm-up step, stored in ``Result.measured``. A plan that fails to build or run
  gets ``{'error': ...}`` and the others go on.

  Raises:
    PlanError: when this process does not see ``devices`` devices.
  """
  import jax
  if jax.device_count() != devices:
    raise PlanError(f"--measure times the plans on the devices this process sees: "
                    f"{jax.device_count()} {jax.default_backend()} device(s), but --devices "
                    f"is {devices}. Plan for --devices {jax.device_count()}, or run where "
                    f"{devices} are visible (on CPU: XLA_FLAGS="
                    f"--xla_force_host_platform_device_count={devices}).")
  chosen = [r for r in results if r.fits][:top]
  for r in chosen:
    try:
      r.measured = _time_one(candidate_config(config, r.candidate), steps)
    except Exception as e:  # noqa: BLE001 - one failed plan does not end the measurement
      r.measured = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
  return chosen


def _time_one(config, steps: int) -> dict:
  """Builds ``config``'s run, compiles its step, runs one warm-up step and times ``steps``
  more: the median step seconds and the compiled peak memory per device."""
  import jax
  import numpy as np

  from recipes import explain, train
  run = train.build_run(config)
  batch = run.data.batch(0)
  compiled = run.train_step.lower(run.state, batch).compile()
  memory = explain.memory_of(compiled).peak
  state, metrics = compiled(run.state, batch)     # warm-up (the state is donated)
  jax.block_until_ready(metrics)
  del run    # its state was donated to the warm-up step
  times = []
  for _ in range(max(1, steps)):
    start = time.perf_counter()
    state, metrics = compiled(state, batch)
    jax.block_until_ready((state, metrics))
    times.append(time.perf_counter() - start)
  return {"step_s": float(np.median(times)), "memory": float(memory), "steps": len(times),
          "platform": jax.default_backend(), "device": str(jax.devices()[0].device_kind)}
