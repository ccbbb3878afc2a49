"""A run's directory over its lifetime: fresh runs never mix with old ones, resumed runs only
continue a checkpoint of the same model, and a signal ends a run with a checkpoint.

* A fresh run (``resume=false``) into an ``out_dir`` that holds another run (its
  ``metrics.jsonl``, ``summary.json`` or a checkpoint) is refused before anything is written;
  the message names both ways on: ``resume=true``, or a new ``out_dir=...``. Without an
  ``out_dir`` of the user's a fresh run takes the first unused one of ``runs/default``,
  ``runs/default-2``, ... (``recipes.config.load_config``) and says so.
* ``resume=true`` restores the last checkpoint after checking that it was written for the
  same model (framework, ``model.*``, and the state's arrays by path and shape); preset, mesh
  and micro-batches may differ (the state is resharded on restore), and so may the ``model.*``
  fields that change how the step is computed but not the weights (:func:`runtime_fields`:
  ``model.attention``, ``model.remat``, ...). It says ``resumed from step N of DIR`` (with
  what changed) and drops the metrics the old run logged after step N.
* SIGTERM / SIGINT (:class:`StopSignals`) ask the loop to stop after the current step; in a
  multi-process run all processes agree on that step (an all-gather of every process's flag
  after each step, ``jax.experimental.multihost_utils.process_allgather``), since a scheduler
  may signal one host first.
"""

from __future__ import annotations

import pathlib
import signal
import threading
from collections.abc import Sequence
from typing import Any

from partition.internal import format_message
from recipes.config import TrainConfigError

RUN_FILES = ("metrics.jsonl", "summary.json")


def holds_run(out_dir: pathlib.Path) -> list[str]:
  """What in ``out_dir`` belongs to a run (``[]``: nothing, a fresh run may start there)."""
  found = [name for name in RUN_FILES if (out_dir / name).exists()]
  checkpoints = out_dir / "checkpoints"
  steps = sorted(int(p.name) for p in checkpoints.glob("*") if p.name.isdigit()) \
      if checkpoints.is_dir() else []
  if steps:
    found.append(f"checkpoints at steps {', '.join(map(str, steps))}")
  return found


def unused(out_dir: pathlib.Path) -> pathlib.Path:
  """``out_dir`` itself if it holds no run, else :func:`free_name`."""
  return free_name(out_dir) if holds_run(out_dir) else out_dir


def free_name(out_dir: pathlib.Path) -> pathlib.Path:
  """``out_dir-2``, ``out_dir-3``, ...: the first that holds no run."""
  n = 2
  while holds_run(out_dir.with_name(f"{out_dir.name}-{n}")):
    n += 1
  return out_dir.with_name(f"{out_dir.name}-{n}")


def numbered_note(config) -> str | None:
  """For a fresh run into ``NAME-N`` beside a ``NAME`` that holds a run, where it writes."""
  out_dir = pathlib.Path(config.out_dir)
  base, sep, number = out_dir.name.rpartition("-")
  if config.resume or not sep or not number.isdigit() or not holds_run(out_dir.with_name(base)):
    return None
  return (f"{out_dir.with_name(base)} holds an earlier run, so this one writes to {out_dir} "
          f"(continue it later with resume=true out_dir={out_dir})")


def check_fresh(config) -> None:
  """A fresh run may not start in a directory that holds another run.

  Raises:
    TrainConfigError: naming what is there, ``resume=true`` and a free ``out_dir=``.
  """
  out_dir = pathlib.Path(config.out_dir)
  found = holds_run(out_dir) if not config.resume else []
  if found:
    raise TrainConfigError(
        f"out_dir={config.out_dir} already holds a run ({'; '.join(found)}); a new run would "
        "mix with it, so nothing was written. Continue that run with resume=true, or start a "
        f"new one elsewhere with out_dir={free_name(out_dir)}.")


def _state_shapes(tree: Any) -> dict[str, tuple[int, ...]]:
  import jax

  from recipes.checkpoint import path_of
  flat = jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))[0]
  return {path_of(p): tuple(x.shape) for p, x in flat}


def model_changes(config, saved_config: dict[str, Any], free: Sequence[str] = ()
                  ) -> list[tuple[str, Any, Any]]:
  """``(key, saved, now)`` for the framework and each ``model.`` field a checkpoint's
  recorded config (``saved_config``) and ``config`` disagree on, ``free`` fields apart."""
  now = config.to_dict()
  changes = []
  if saved_config.get("framework", now["framework"]) != now["framework"]:
    changes.append(("framework", saved_config["framework"], now["framework"]))
  for key, value in saved_config.get("model", {}).items():
    if key not in free and now["model"].get(key) != value:
      changes.append((f"model.{key}", value, now["model"].get(key)))
  return changes


def runtime_fields() -> tuple[str, ...]:
  """The ``model.`` fields a resumed run may change: those the checkpoint's weights and their
  shapes do not depend on (how the step is computed: the attention kernel, rematerialisation,
  the compute dtype, ...). The list ``recipes.generate`` accepts for a checkpoint, so
  generating from a run and continuing it agree on what "the same model" means."""
  from recipes.init_from import checkpoint_free_fields
  return checkpoint_free_fields()


def runtime_changes(config, saved_config: dict[str, Any]) -> list[tuple[str, Any, Any]]:
  """``(key, saved, now)`` for each :func:`runtime_fields` field that ``config`` changes."""
  free = runtime_fields()
  return [change for change in model_changes(config, saved_config)
          if change[0].removeprefix("model.") in free]


def mismatches(config, saved_config: dict[str, Any], saved_shapes: dict, shapes: dict
               ) -> list[str]:
  """Why a checkpoint cannot continue as ``config`` (``[]``: it can)."""
  problems = [f"{key}={saved} there, {now} here"
              for key, saved, now in model_changes(config, saved_config, runtime_fields())]
  if not problems and saved_shapes != shapes:
    differ = sorted(set(saved_shapes) ^ set(shapes)) or sorted(
        p for p in shapes if saved_shapes.get(p) != shapes[p])
    problems.append("the train state differs (e.g. optimizer.clip_norm on or off), first at "
                    f"{differ[0]}: {saved_shapes.get(differ[0])} there, "
                    f"{shapes.get(differ[0])} here")
  return problems


def resume(config, run, ckpt, metrics_log, say) -> int:
  """Restores ``run.state`` from the last checkpoint of ``ckpt`` after checking it fits;
  returns the step to continue from (0: there was no checkpoint).

  The last checkpoint is the latest complete step (``recipes.checkpoint.complete_steps``: a
  step folder without its metadata files is skipped with a warning naming it).

  Raises:
    TrainConfigError: the checkpoint belongs to another model.
    CheckpointError: the latest step's arrays cannot be read; the message names its folder
      and says to move it away to resume from the step before.
  """
  step = ckpt.latest_step()
  if step is None:
    say(f"resume=true: no checkpoint in {ckpt.directory}; starting at step 0")
    metrics_log.truncate_after(0)
    return 0
  meta = ckpt.meta(step)
  saved_config = meta.get("config", {})
  fix = move_aside_fix(ckpt.directory, step)
  saved_shapes = _state_shapes(ckpt.state_metadata(step, fix=fix))
  problems = mismatches(config, saved_config, saved_shapes, _state_shapes(run.state))
  if problems:
    raise TrainConfigError(format_message(
        f"resume=true: the checkpoint at step {step} of {ckpt.directory} is of another "
        "model:", bullets=problems,
        fix="Use that run's framework and model.* (preset, mesh and microbatches may change: "
        "the state is resharded; so may "
        f"{', '.join('model.' + f for f in runtime_fields())}: they change how the step is "
        "computed, not the weights), or start a new run with resume=false "
        f"out_dir={free_name(pathlib.Path(config.out_dir))}."))
  run.state = ckpt.restore_like(step, run.state, fix=fix)
  metrics_log.truncate_after(step)
  changed = [f"{k} {saved_config[k]} -> {getattr(config, k)}"
             for k in ("preset", "mesh", "microbatches")
             if k in saved_config and saved_config[k] != getattr(config, k)]
  runtime = [f"{key} {saved} -> {now}" for key, saved, now in runtime_changes(config,
                                                                                saved_config)]
  changes = [f"resharded: {', '.join(changed)}"] if changed else []
  if runtime:  # the restored weights are the checkpoint's; only the step's program differs
    changes.append(f"same weights, computed differently: {', '.join(runtime)}")
  done = ""
  if step > config.steps:
    done = (f"; it is already past steps={config.steps}, so nothing is trained (steps="
            f"{step + 1} or more trains on)")
  elif step == config.steps:
    done = f"; the run is complete (steps={config.steps})"
  say(f"resumed from step {step} of {ckpt.directory}"
      + (f" ({'; '.join(changes)})" if changes else "") + done)
  if note := schedule_note(saved_config.get("steps"), config.steps, step, run, metrics_log):
    say(note)
  return step


def move_aside_fix(directory: pathlib.Path, step: int) -> str:
  """The fix for a damaged latest step on ``resume=true``: which folder to move away so that
  the run resumes from the step before it (``resume=true`` has no step to choose)."""
  from recipes.checkpoint import complete_steps
  folder = pathlib.Path(directory).absolute() / str(step)
  earlier = [s for s in complete_steps(directory, warn=False) if s < step]
  then = (f"to resume from step {earlier[-1]}, the latest step before it." if earlier else
          "to start again from step 0 (there is no complete step before it).")
  return (f"resume=true continues from the latest step: delete {folder} or move it out of "
          f"{folder.parent} {then}")


def schedule_note(saved_steps: int | None, steps: int, step: int, run, metrics_log
                  ) -> str | None:
  """A warning for a resumed run whose ``steps`` differ from its checkpoint's and that still
  trains: the learning-rate schedule (warmup, then cosine decay to ``steps``) spans ``steps``,
  so the rest of the run follows another schedule and the rate jumps at the first step."""
  if saved_steps is None or saved_steps == steps or step >= steps:
    return None
  was = metrics_log.last("learning_rate")
  jump = "" if was is None else (f": the learning rate goes from {was:.3g} at step {step} to "
                                 f"{float(run.schedule(step)):.3g} at step {step + 1}")
  keep = f"resume with steps={saved_steps} to keep it" if step < saved_steps else \
      f"a steps={steps} run from scratch follows one schedule throughout"
  return (f"warning: resume=true with steps={steps}, but the checkpoint's run had "
          f"steps={saved_steps}. The learning-rate schedule (optimizer.warmup_steps, then "
          f"cosine decay to step {steps}) spans steps, so from step {step + 1} on the run "
          f"follows the schedule of a steps={steps} run{jump}; {keep} "
          "(docs/training.md#resuming).")


class StopSignals:
  """SIGTERM and SIGINT ask the training loop to stop after the current step.

  A second SIGINT (Ctrl-C twice) interrupts at once. Handlers are installed only in the main
  thread (Python's rule); elsewhere the run is not signal-aware.

  Example:
    >>> import os, signal
    >>> with StopSignals() as signals:
    ...   os.kill(os.getpid(), signal.SIGTERM)
    ...   print(signals.agreed().name)
    SIGTERM
  """

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __enter__(self) -> StopSignals:
    self.received: signal.Signals | None = None
    self.previous = {}
    if threading.current_thread() is threading.main_thread():
      self.previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
    return self

  def _handle(self, signum, frame) -> None:
    if signum == signal.SIGINT and self.received == signal.SIGINT:
      raise KeyboardInterrupt
    self.received = signal.Signals(signum)

  def __exit__(self, *exc) -> None:
    for s, handler in self.previous.items():
      signal.signal(s, handler)

  def agreed(self) -> signal.Signals | None:
    """The signal to stop on, the same in every process (``None``: go on)."""
    import jax
    local = 0 if self.received is None else int(self.received)
    if jax.process_count() > 1:
      import numpy as np
      from jax.experimental import multihost_utils
      local = int(np.max(multihost_utils.process_allgather(np.int32(local))))
    return signal.Signals(local) if local else None
