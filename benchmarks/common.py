"""What every benchmark section shares: devices, timing, memory, HLO collectives, records.

* **devices**: :func:`setup_devices` gives JAX 8 virtual CPU devices (before any JAX
  computation) unless an accelerator platform was chosen with ``JAX_PLATFORMS``.
* **timing**: :func:`steady_state` calls two (or more) programs alternately, order flipped
  every round, GC off, and returns the median of each; :func:`compile_times` does the same for
  ``lower(*args).compile()`` on fresh function objects after ``jax.clear_caches()``. Noise on
  a shared machine then hits both sides alike.
* **memory**: :func:`memory` reads ``compiled.memory_analysis()`` (per device for an SPMD
  program).
* **collectives**: ``partition.collective_stats(compiled, mesh)`` (the library's public
  utility) counts every collective of the compiled HLO per kind and mesh axis, with the
  ring-algorithm bytes each device sends (ops in loops x their trip count).
* **records**: a section returns :class:`Row` s (one measured ratio against its target, with a
  ``note`` saying why when a target is missed) and :class:`Check` s (the two programs of a pair
  agreed numerically).
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

STEADY_TARGET = 1.03
COMPILE_TARGET = 1.25
MEMORY_TARGET = 1.05
BYTES_TARGET = 1.05


def setup_devices(n: int = 8) -> None:
  """``n`` virtual CPU devices (a no-op once JAX's backends exist, e.g. under pytest)."""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax

  try:
    jax.config.update("jax_num_cpu_devices", n)
  except RuntimeError:  # backends already initialised: the caller chose the devices
    pass


def log(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ records


@dataclasses.dataclass
class Row:
  """One measurement: ``ours`` against ``baseline`` (ratio ``ours / baseline``)."""

  section: str
  workload: str
  metric: str
  ours: float
  baseline: float
  unit: str            # 's' | 'bytes'
  target: float | None  # the ratio must be <= target; None: informational
  note: str = ""
  ours_label: str = "named-partition"
  baseline_label: str = "hand-written"

  @property
  def ratio(self) -> float:
    return self.ours / self.baseline if self.baseline else math.inf

  @property
  def status(self) -> str:
    if self.target is None:
      return "info"
    return "PASS" if self.ratio <= self.target + 1e-9 else "MISS"

  def to_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d.update(ratio=self.ratio, status=self.status)
    return d


@dataclasses.dataclass
class Check:
  """Two programs of a pair computed the same thing (``max_abs_err`` within tolerance)."""

  section: str
  workload: str
  max_abs_err: float
  rtol: float
  atol: float
  agreed: bool

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


@dataclasses.dataclass
class Section:
  """A section's rows, checks and plot data (``series``: name -> plottable dict)."""

  name: str
  title: str
  rows: list[Row] = dataclasses.field(default_factory=list)
  checks: list[Check] = dataclasses.field(default_factory=list)
  series: dict[str, Any] = dataclasses.field(default_factory=dict)
  seconds: float = 0.0

  def check(self, workload: str, ours: Any, baseline: Any, rtol: float = 2e-4,
            atol: float = 2e-5) -> Check:
    """Records whether two pytrees of arrays agree (leaf structure must match too)."""
    c = compare(self.name, workload, ours, baseline, rtol, atol)
    self.checks.append(c)
    if not c.agreed:
      log(f"    !! {workload}: ours and baseline disagree (max abs err {c.max_abs_err:.3g})")
    return c


def compare(section: str, workload: str, a: Any, b: Any, rtol: float, atol: float) -> Check:
  import jax
  import numpy as np

  la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
  if len(la) != len(lb) or not la:
    return Check(section, workload, math.inf, rtol, atol, False)
  err, ok = 0.0, True
  for u, v in zip(la, lb):
    u, v = np.asarray(u, np.float64), np.asarray(v, np.float64)
    if u.shape != v.shape:
      return Check(section, workload, math.inf, rtol, atol, False)
    err = max(err, float(np.max(np.abs(u - v), initial=0.0)))
    ok = ok and bool(np.allclose(u, v, rtol=rtol, atol=atol))
  return Check(section, workload, err, rtol, atol, ok)


# ------------------------------------------------------------------------------- timing


def _time_call(f: Callable, args: Sequence[Any]) -> float:
  import jax

  t = time.perf_counter()
  jax.block_until_ready(f(*args))
  return time.perf_counter() - t


def steady_state(programs: Sequence[Callable], args: Sequence[Any], repeats: int,
                 warmup: int = 2) -> list[float]:
  """Median seconds per call of each program, calls interleaved (order rotated per round)."""
  for _ in range(warmup):
    for f in programs:
      _time_call(f, args)
  times: list[list[float]] = [[] for _ in programs]
  order = list(range(len(programs)))
  gc.disable()
  try:
    for i in range(repeats):
      for j in (order if i % 2 == 0 else order[::-1]):
        times[j].append(_time_call(programs[j], args))
  finally:
    gc.enable()
  return [statistics.median(t) for t in times]


def interleaved(thunks: Sequence[Callable[[], Any]], repeats: int,
                warm: bool = True) -> list[float]:
  """Median seconds of each thunk (run alternately, order flipped each round)."""
  if warm:
    for th in thunks:
      th()
  times: list[list[float]] = [[] for _ in thunks]
  for i in range(repeats):
    for j in (range(len(thunks)) if i % 2 == 0 else reversed(range(len(thunks)))):
      t = time.perf_counter()
      thunks[j]()
      times[j].append(time.perf_counter() - t)
  return [statistics.median(t) for t in times]


def compile_times(make: Callable[[], Sequence[Any]], args: Sequence[Any], repeats: int,
                  context: Callable[[], Any] | None = None, warm: bool = True) -> list[float]:
  """Median trace+compile seconds of each program ``make()`` returns (fresh each time)."""
  import contextlib

  import jax

  def once(which: int) -> Callable[[], Any]:
    def run():
      jax.clear_caches()
      gc.collect()
      with context() if context else contextlib.nullcontext():
        program = make()[which]  # fresh function objects: nothing cached
        program.lower(*args).compile()
    return run

  n = len(make())
  return interleaved([once(i) for i in range(n)], repeats, warm=warm)


# ------------------------------------------------------------------------------- memory


def memory(compiled: Any) -> dict[str, int]:
  """``memory_analysis()`` of a compiled program: temp, argument, output, peak bytes."""
  m = compiled.memory_analysis()
  temp, arg, out = m.temp_size_in_bytes, m.argument_size_in_bytes, m.output_size_in_bytes
  alias = m.alias_size_in_bytes
  return {"temp": temp, "argument": arg, "output": out,
          "peak": temp + arg + out - alias}


# ------------------------------------------------------------------------------ formats


def fmt_value(value: float, unit: str) -> str:
  if unit == "s":
    return f"{value * 1e3:.2f} ms" if value >= 1e-3 else f"{value * 1e6:.1f} µs"
  if unit == "bytes":
    if value >= 2**20:
      return f"{value / 2**20:.2f} MiB"
    return f"{value / 2**10:.1f} KiB" if value >= 2**10 else f"{value:.0f} B"
  return f"{value:.4g}"


# ------------------------------------------------------------------------------- models


def auto_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
  """A mesh with ``AxisType.Auto`` axes (the type every baseline here is written for)."""
  import jax
  from jax.sharding import AxisType

  return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


def mlp_params(rng: Any, d: int, h: int, o: int) -> dict[str, Any]:
  """A 2-layer MLP's weights ``w1 [d, h]``, ``b1 [h]``, ``w2 [h, o]`` (float32)."""
  import jax.numpy as jnp
  import numpy as np

  return {
      "w1": jnp.asarray(rng.normal(size=(d, h)) / np.sqrt(d), jnp.float32),
      "b1": jnp.asarray(rng.normal(size=(h,)) * 0.1, jnp.float32),
      "w2": jnp.asarray(rng.normal(size=(h, o)) / np.sqrt(h), jnp.float32),
  }


def example_loss(p: dict[str, Any], x: Any, y: Any) -> Any:
  """Squared error of the MLP on ONE example (``x [d]``, ``y [o]``)."""
  import jax.numpy as jnp

  h = jnp.tanh(x @ p["w1"] + p["b1"])
  return jnp.sum((h @ p["w2"] - y) ** 2)


# ---------------------------------------------------------------------------- pairs


@dataclasses.dataclass
class Pair:
  """``make()`` returns fresh ``(ours, baseline)`` programs (callables with ``.lower``);
  ``args`` are placed on the shardings both expect; ``notes`` explain known misses by
  metric (``'steady'``, ``'compile'``, ``'memory'``)."""

  name: str
  description: str
  make: Callable[[], tuple[Any, Any]]
  args: tuple
  mesh: Any
  notes: dict[str, str] = dataclasses.field(default_factory=dict)
  context: Callable[[], Any] | None = None  # default: jax.set_mesh(mesh)

  def enter(self) -> Any:
    import jax

    return self.context() if self.context else jax.set_mesh(self.mesh)


@dataclasses.dataclass(frozen=True)
class Budget:
  """How hard to measure: steady-state repeats/warm-up, compile repeats."""

  repeats: int
  warmup: int
  compile_repeats: int

  @staticmethod
  def of(quick: bool) -> Budget:
    return Budget(3, 1, 0) if quick else Budget(50, 3, 7)


def time_pair(section: Section, w: Pair, budget: Budget, *, memory_row: bool = False,
              steady_target: float = STEADY_TARGET,
              compare: Callable[[Any], Any] = lambda out: out) -> None:
  """Checks ``w``'s programs agree, then adds steady-state, compile (and temp memory) rows.

  A timing that misses its target is measured once more (shared cores are noisy); the row
  then reports the second measurement and its note the first ratio. With
  ``budget.compile_repeats == 0`` (quick mode) the trace+compile row is the first call of
  each program (trace + compile + one run), which the check makes anyway, and nothing is
  remeasured.
  """
  ours, base = w.make()
  with w.enter():
    first, results = [], []
    for f in (ours, base):
      t = time.perf_counter()
      results.append(f(*w.args))
      first.append(time.perf_counter() - t)
    section.check(w.name, *map(compare, results))
    steady = lambda: steady_state((ours, base), w.args, budget.repeats, budget.warmup)
    row = _timed_row(section, w, "steady-state time", "steady", steady, steady_target,
                     budget.compile_repeats > 0)
    if row.status == "MISS" and budget.compile_repeats:
      row.note += f"; A/A {_noise(w, base, budget):.3f}"
    section.rows.append(row)
  if budget.compile_repeats:
    # The check above already warmed imports and XLA's one-time setup.
    compile_ = lambda: compile_times(w.make, w.args, budget.compile_repeats,
                                     context=w.enter, warm=False)
    section.rows.append(_timed_row(section, w, "trace+compile time", "compile", compile_,
                                   COMPILE_TARGET, True))
  else:
    section.rows.append(Row(section.name, w.name, "first call (trace+compile+run)", *first,
                            "s", COMPILE_TARGET))
  if memory_row:
    with w.enter():
      m_ours, m_base = (memory(f.lower(*w.args).compile())["temp"] for f in w.make())
    section.rows.append(Row(section.name, w.name, "temp memory", m_ours, m_base, "bytes",
                            MEMORY_TARGET,
                            _note(w, "memory", m_ours / max(m_base, 1), MEMORY_TARGET)))


def _noise(w: Pair, base: Callable, budget: Budget) -> float:
  """The baseline against a second copy of itself, measured like a pair: how far from 1 a
  ratio moves on this machine right now (a miss by less is measurement noise)."""
  twin = w.make()[1]
  twin(*w.args)  # compile the copy before timing
  a, b = steady_state((twin, base), w.args, budget.repeats, budget.warmup)
  return a / b


def _timed_row(section: Section, w: Pair, metric: str, kind: str,
               measure: Callable[[], Sequence[float]], target: float, rerun: bool) -> Row:
  ours, base = measure()
  note = ""
  if rerun and ours / base > target:
    log(f"    {w.name} {metric}: ratio {ours / base:.3f} > {target}, measuring again")
    note = f"remeasured (first run {ours / base:.3f})"
    ours, base = measure()
  miss = _note(w, kind, ours / base, target,
               "no cause found (the remeasured ratio still misses)" if note else "")
  return Row(section.name, w.name, metric, ours, base, "s", target,
             "; ".join(x for x in (miss, note) if x))


def _note(w: Pair, metric: str, ratio: float, target: float,
          unknown: str = "no cause found") -> str:
  """The workload's explanation of a miss, only when the target is actually missed."""
  if ratio <= target:
    return ""
  return w.notes.get(metric, unknown)


def flax_rules(rules: Any) -> tuple:
  """An ``AxisRules`` table as flax's ``LogicalRules`` (serial loops dropped: arrays only)."""
  from partition import SerialLoop

  out = []
  for name, value in rules.pairs:
    axes = [a for a in value or () if not isinstance(a, SerialLoop)]
    out.append((name, None if not axes else axes[0] if len(axes) == 1 else tuple(axes)))
  return tuple(out)
