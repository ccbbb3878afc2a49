"""What a run shows and leaves behind: progress (a bar or log lines), ``metrics.jsonl``,
``summary.json``, ``loss.png`` (unless ``plot=false``), a summary table that names exactly
the files the run left.

Every file is written atomically (``partition._base.io.atomic_write``): a crash never leaves a
half-written metrics file or plot.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import sys
import time
from collections.abc import Iterator
from typing import Any

from partition.internal import atomic_write


def plain(text: str) -> str:
  """A docstring line for a terminal (``--help``): no reStructuredText literal markers.

  >>> plain('Train (``python -m recipes.train``).')
  'Train (python -m recipes.train).'
  """
  return text.replace("``", "")


def write_json(path: pathlib.Path, obj: Any) -> None:
  atomic_write(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


class MetricsLog:
  """``metrics.jsonl``: one JSON object per step (``step``, ``loss``, ... and, on eval steps,
  ``eval_loss``, ``accuracy``, ``exact_match``; the training batch's own are
  ``train_accuracy``, ``train_exact_match``). Kept in memory and rewritten atomically every
  ``every`` records and at the end; on resume, records after the checkpoint are dropped."""

  def __init__(self, path: pathlib.Path, every: int = 10, write: bool = True):
    self.path = pathlib.Path(path)
    self.write = write  # False on every process but the first of a multi-process run
    self.every = every
    self.records: list[dict[str, Any]] = []
    self._pending = 0

  def reset(self) -> None:
    self.records = []
    self.flush()

  def truncate_after(self, step: int) -> None:
    if self.path.exists():
      lines = self.path.read_text().splitlines()
      self.records = [r for r in map(json.loads, filter(None, lines)) if r["step"] <= step]
    self.flush()

  def append(self, record: dict[str, Any]) -> None:
    self.records.append(record)
    self._pending += 1
    if self._pending >= self.every:
      self.flush()

  def flush(self) -> None:
    if not self.write:
      return
    atomic_write(self.path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in self.records))
    self._pending = 0

  def last(self, key: str) -> float | None:
    return next((r[key] for r in reversed(self.records) if key in r), None)


class Throughput:
  """Tokens per second over the steps after the first (which includes compilation)."""

  def __init__(self, tokens_per_step: int):
    self.tokens_per_step = tokens_per_step
    self.start: tuple[int, float] | None = None
    self.rate = 0.0

  def tick(self, step: int, block: Any = None) -> None:
    if block is not None and hasattr(block, "block_until_ready"):
      block.block_until_ready()
    now = time.perf_counter()
    if self.start is None:
      self.start = (step, now)
    elif step > self.start[0]:
      self.rate = (step - self.start[0]) * self.tokens_per_step / (now - self.start[1])


def _fields(record: dict[str, Any]) -> str:
  fields = f"loss {record['loss']:.4f}  {record.get('tokens_per_s', 0):,.0f} tok/s"
  if "accuracy" in record and "eval_loss" in record:
    fields += f"  eval acc {record['accuracy']:.3f}"
  return fields


class _Bar:
  """A rich progress bar (a terminal)."""

  def __init__(self, progress, task):
    self.progress, self.task = progress, task

  def update(self, step: int, record: dict[str, Any]) -> None:
    self.progress.update(self.task, completed=step, fields=_fields(record))


class _Silent:
  def update(self, step: int, record: dict[str, Any]) -> None:
    pass


class _Lines:
  """A line every ``every`` steps and at the last (CI logs, ``| tee``): step, loss,
  tokens/s, ETA from the steps/s since the first logged step (compilation excluded)."""

  def __init__(self, total: int, start: int, every: int, stream):
    self.total, self.every, self.stream = total, every, stream
    self.since: tuple[int, float] | None = None

  def update(self, step: int, record: dict[str, Any]) -> None:
    now = time.perf_counter()
    if self.since is None:
      self.since = (step, now)
    if step % self.every and step != self.total:
      return
    done, elapsed = step - self.since[0], now - self.since[1]
    eta = "-"
    if done > 0 and elapsed > 0:
      seconds = round((self.total - step) * elapsed / done)
      eta = f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
    print(f"step {step}/{self.total}  {_fields(record)}  ETA {eta}", file=self.stream,
          flush=True)


@contextlib.contextmanager
def progress(total: int, start: int = 0, *, mode: str | None = "bar", every: int = 10,
             stream=None) -> Iterator[Any]:
  """Training progress: ``mode='bar'`` a rich bar (for a terminal), ``'log'`` a line on
  ``stream`` every ``every`` steps, ``None`` nothing. Yields an object with
  ``update(step, record)``.

  Example:
    >>> import io
    >>> out = io.StringIO()
    >>> with progress(4, mode='log', every=2, stream=out) as p:
    ...   for step in range(1, 5):
    ...     p.update(step, {'loss': 1.0 / step, 'tokens_per_s': 100.0})
    >>> [line.split('  ETA')[0] for line in out.getvalue().splitlines()]
    ['step 2/4  loss 0.5000  100 tok/s', 'step 4/4  loss 0.2500  100 tok/s']
  """
  if mode is None:
    yield _Silent()
    return
  if mode == "log":
    yield _Lines(total, start, every, stream)
    return
  if mode != "bar":
    raise ValueError(f"progress mode={mode!r} must be 'bar', 'log' or None")
  from rich.console import Console
  from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

  columns = [TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
             TextColumn("{task.fields[fields]}")]
  # On the log stream (stderr), whose terminal chose the bar: on rich's default stdout a
  # `| tee` or `> log.txt` hid the bar from the terminal for the whole run
  console = Console(file=stream if stream is not None else sys.stderr)
  with Progress(*columns, console=console) as bar:
    task = bar.add_task("train", total=total, completed=start, fields="")
    yield _Bar(bar, task)


def plot_losses(records: list[dict[str, Any]], path: pathlib.Path) -> None:
  """``loss.png``: training loss per step, eval loss and accuracy at eval steps."""
  import io

  from matplotlib.figure import Figure  # no pyplot: leaves a notebook's backend alone

  fig = Figure(figsize=(7, 4))
  ax = fig.add_subplot()
  steps = [r["step"] for r in records]
  ax.plot(steps, [r["loss"] for r in records], label="train loss", lw=1)
  evals = [r for r in records if "eval_loss" in r]
  if evals:
    ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-",
            label="eval loss")
    acc = ax.twinx()
    acc.plot([r["step"] for r in evals], [r["accuracy"] for r in evals], "s--", color="C2",
             label="eval accuracy")
    acc.set_ylabel("accuracy")
    acc.set_ylim(0, 1)
    acc.legend(loc="center right")
  ax.set_xlabel("step")
  ax.set_ylabel("cross-entropy")
  ax.set_yscale("log")
  ax.legend(loc="upper right")
  ax.grid(alpha=0.3)
  fig.tight_layout()
  buffer = io.BytesIO()
  fig.savefig(buffer, format="png", dpi=100)
  atomic_write(path, buffer.getvalue())


def _bytes(n: int | None) -> str:
  if n is None:
    return "-"
  for unit in ("B", "KiB", "MiB", "GiB"):
    if n < 1024 or unit == "GiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
    n /= 1024
  return str(n)


def step_fields(steps: int, start: int) -> dict[str, Any]:
  """The summary's step counts for a run asked for ``steps`` that started at step ``start``
  (a resumed run's checkpoint; 0: a new run): ``steps`` the step its state is at,
  ``steps_requested`` the config's, ``steps_trained`` by this invocation, ``resumed_from``.
  A run resumed past its ``steps`` trains nothing and keeps its step count.

  >>> step_fields(30, 40)
  {'steps': 40, 'steps_requested': 30, 'steps_trained': 0, 'resumed_from': 40}
  """
  return {"steps": max(steps, start), "steps_requested": steps,
          "steps_trained": max(0, steps - start), "resumed_from": start or None}


def steps_text(summary: dict[str, Any]) -> str:
  """The summary table's ``steps`` cell: ``300``, ``40 (resumed from 20)``, or for a run
  resumed at or past its ``steps``, ``40 (already past steps=30: nothing trained)``.

  >>> steps_text(step_fields(40, 20)), steps_text(step_fields(30, 40))
  ('40 (resumed from 20)', '40 (already past steps=30: nothing trained)')
  """
  start = summary.get("resumed_from") or 0
  requested = summary.get("steps_requested", summary["steps"])
  reached = max(summary["steps"], start)
  if start and start > requested:
    return f"{reached} (already past steps={requested}: nothing trained)"
  if start and start == requested:
    return f"{reached} (already at steps={requested}: nothing trained)"
  return f"{reached}" + (f" (resumed from {start})" if start else "")


OUTPUTS = ("metrics.jsonl", "summary.json", "loss.png", "checkpoints/")  # a run's files, in order


def pipeline_fields(stages: int, microbatches: int, repeats: int = 1) -> dict[str, Any]:
  """The summary's ``pipeline`` entry for ``stages`` stages (``p``), ``microbatches``
  pipeline micro-batches (``m``) and ``repeats`` (``r``; 1 is GPipe): with the idle share of
  stage-iterations, ``bubble = (p - 1) / (r m + p - 1)`` (``docs/pipeline.md``).

  >>> pipeline_fields(4, 8, 2)
  {'stages': 4, 'microbatches': 8, 'repeats': 2, 'iterations': 19, 'bubble': 0.15789473684210525}
  """
  from partition import pipeline_bubble, pipeline_iterations
  return {"stages": stages, "microbatches": microbatches, "repeats": repeats,
          "iterations": pipeline_iterations(stages, microbatches, repeats),
          "bubble": pipeline_bubble(stages, microbatches, repeats)}


def pipeline_text(fields: dict[str, Any]) -> str:
  """The summary table's ``pipeline`` cell.

  >>> pipeline_text(pipeline_fields(4, 4))
  '4 stages x 4 micro-batches x 1 repeat: 7 iterations, bubble 42.9%'
  """
  r = fields["repeats"]
  return (f"{fields['stages']} stages x {fields['microbatches']} micro-batches x {r} "
          f"repeat{'s' if r != 1 else ''}: {fields['iterations']} iterations, "
          f"bubble {fields['bubble']:.1%}")


def finish(summary: dict[str, Any], records: list[dict[str, Any]], out_dir: pathlib.Path, *,
           plot: bool, checkpoints: bool = True, out=None) -> dict[str, Any]:
  """Ends a run: writes ``summary.json`` and, with ``plot``, ``loss.png`` into ``out_dir``,
  then prints the summary. ``summary['outputs']`` lists exactly the run's files there
  (``metrics.jsonl`` is written during the run, ``checkpoints/`` by the checkpointer when
  ``checkpoints``). Returns the summary as written."""
  out_dir = pathlib.Path(out_dir)
  written = {"metrics.jsonl": True, "summary.json": True, "loss.png": plot,
             "checkpoints/": checkpoints and (out_dir / "checkpoints").is_dir()}
  summary = {**summary, "outputs": [name for name in OUTPUTS if written[name]]}
  write_json(out_dir / "summary.json", summary)
  if plot:
    plot_losses(records, out_dir / "loss.png")
  if out is not None:
    print_summary(summary, out)
  return summary


def print_summary(summary: dict[str, Any], out) -> None:
  """A one-screen summary of the run (rich table): its ``outputs`` row names the files
  :func:`finish` recorded in ``summary['outputs']``, a pipelined run's ``pipeline`` entry
  (:func:`pipeline_fields`) gets a row with the stages, micro-batches, repeats and bubble."""
  from rich.console import Console
  from rich.table import Table

  fmt = lambda v, spec: "-" if v is None else format(v, spec)
  table = Table(title="training summary", show_header=False)
  table.add_column(style="bold")
  table.add_column()
  mesh = " x ".join(f"{k}={v}" for k, v in summary["mesh"].items())
  rows = [
      ("framework / preset", f"{summary['framework']} / {summary['preset']}"),
      ("mesh", mesh + (f" on {summary['devices']}" if summary.get("devices") else "")),
      ("micro-batches", str(summary["microbatches"])),
      ("steps", steps_text(summary)),
      ("final train loss", fmt(summary["final_loss"], ".4f")),
      ("eval loss", fmt(summary["eval_loss"], ".4f")),
      ("eval token accuracy", fmt(summary["accuracy"], ".3f")),
      ("eval exact match", fmt(summary["exact_match"], ".3f")),
      ("tokens / s", fmt(summary["tokens_per_s"], ",.0f")),
      ("params per device", f"{_bytes(summary['param_bytes_per_device'])} of "
                            f"{_bytes(summary['param_bytes_total'])}"),
      ("optimizer state per device", _bytes(summary["optimizer_bytes_per_device"])),
      ("outputs", f"{summary['out_dir']}/ ({', '.join(summary['outputs'])})"),
  ]
  if summary.get("pipeline"):
    rows.insert(3, ("pipeline", pipeline_text(summary["pipeline"])))
  for k, v in rows:
    table.add_row(k, v)
  Console(file=out, width=100).print(table)
