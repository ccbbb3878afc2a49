"""What the planner shows: the ranked table, predicted against measured, and the plot of
predicted step time against memory per device with its Pareto frontier."""

from __future__ import annotations

import math
import pathlib
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # search.py uses human(): the arrow at run time points render <- search
  from recipes._planner.search import Result, Search


def human(n: float) -> str:
  """Bytes in binary units.

  >>> human(3 * 2**20)
  '3.00 MiB'
  """
  for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if abs(n) >= scale:
      return f"{n / scale:.2f} {unit}"
  return f"{n:.0f} B"


def seconds(s: float) -> str:
  """A duration in s, ms or µs, three significant digits.

  >>> seconds(0.0123)
  '12.3 ms'
  """
  if s >= 1:
    return f"{s:.3g} s"
  return f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} µs"


# -- the ranked table ------------------------------------------------------------------------

_RIGHT = ("#", "k", "memory/device", "step time", "MFU", "roofline", "measured step",
          "measured memory")


def render(found: Search, chip, devices: int, hosts: int, top: int, out=None) -> None:
  """The ranked rich table (the first ``top`` plans) and a one-line summary (on ``out``,
  default the current ``sys.stdout``, not the one at import)."""
  from rich.console import Console
  from rich.markup import escape
  from rich.table import Table
  console = Console(file=out or sys.stdout, width=220)
  table = Table(title=f"plans for {devices} x {chip.name} ({hosts} host domain"
                      f"{'s' if hosts > 1 else ''}), best first")
  measured = any(r.measured for r in found.results[:top])
  for name in _columns(measured):
    table.add_column(name, justify="right" if name in _RIGHT else "left")
  for i, r in enumerate(found.results[:top], 1):
    table.add_row(*_row(i, r, chip, measured))
  console.print(table)
  console.print(_summary(found, chip), highlight=False)
  for preset, why in found.skipped.items():
    console.print(f"note: preset {preset}: {why}", highlight=False)
  for label, why in found.failed.items():
    # escaped: a label's mesh ('[data2xstage4]') and the message are not rich markup
    console.print(f"[yellow]warning:[/yellow] compiling {escape(label)} failed, so it is "
                  "not a plan to run (its row shows the estimate):\n  "
                  + escape(why).replace("\n", "\n  "), highlight=False)


def _columns(measured: bool) -> list[str]:
  names = ["#", "preset", "mesh", "k", "remat", "attention", "memory/device", "fits",
           "step time", "bound", "MFU", "roofline", "collectives/device", "figures"]
  if measured:
    names[9:9] = ["measured step", "measured memory"]
  return names


def _row(i: int, r: Result, chip, measured: bool) -> list[str]:
  c = r.candidate
  fits = "yes" if r.fits else f"[red]no (> {human(chip.hbm_bytes)})[/red]"
  if r.error is not None:
    fits = "[red]compile failed[/red]"
  bound = r.time.bound
  if bound == "communication":
    bound = f"[yellow]communication ({r.time.bound_axes})[/yellow]"
  band = f" ±{100 * r.time.band:.0f}%" if r.time.band else ""
  row = [str(i), c.preset, ", ".join(f"{k}={v}" for k, v in c.mesh), str(c.microbatches),
         c.remat, r.estimate.shape.attention if r.estimate.shape else "-", human(r.memory),
         fits, seconds(r.time.step_s) + band, bound, f"{100 * r.time.mfu:.1f}%",
         seconds(r.time.roofline_s),
         ", ".join(f"{k} {human(v)}" for k, v in r.comm_bytes.items()) or "-",
         r.memory_source]
  if measured:
    m = r.measured or {}
    row[9:9] = [seconds(m["step_s"]) if "step_s" in m else m.get("error", "-")[:40],
                human(m["memory"]) if m.get("memory") else "-"]
  return row


def _summary(found: Search, chip) -> str:
  cal = chip.cal
  return (f"{found.num_candidates} distinct candidates screened, "
          f"{found.num_compiled} compiled now, {found.num_cached} from the cache, "
          f"in {found.seconds:.1f} s. Step time: the calibrated cost model "
          f"(recipes/cost_model.py; matmuls at most {100 * cal.matmul_efficiency:.0f}% "
          f"of {chip.name}'s peak, so MFU never exceeds it), ± its calibration band "
          "(docs/planning.md); 'roofline' is the bare bound at datasheet peaks. "
          "Overlap: FSDP and data-parallel collectives hide behind their phase's "
          "compute; tensor-parallel and cross-node ones do not.")


# -- predicted against measured --------------------------------------------------------------


def render_measured(chosen: Sequence[Result], chip, out=None) -> None:
  """Predicted against measured, one line per measured plan (on ``out``, default stdout)."""
  from rich.console import Console
  from rich.markup import escape
  from rich.table import Table
  table = Table(title=f"predicted (for {chip.name}) vs measured (on this machine)")
  for name in ("plan", "predicted step", "measured step", "error", "predicted memory",
               "measured memory", "memory error", "device"):
    table.add_column(name, justify="left" if name in ("plan", "device") else "right")
  for r in chosen:
    m = r.measured or {}
    if "step_s" not in m:
      table.add_row(escape(r.candidate.label()), seconds(r.time.step_s),
                    escape(m.get("error", "-")),
                    "", human(r.memory), "", "", "")
      continue
    table.add_row(escape(r.candidate.label()),
                  f"{seconds(r.time.step_s)} ±{100 * r.time.band:.0f}%",
                  seconds(m["step_s"]), f"{100 * (r.time.step_s / m['step_s'] - 1):+.0f}%",
                  human(r.memory), human(m["memory"]),
                  f"{100 * (r.memory / m['memory'] - 1):+.0f}%", m["device"])
  console = Console(file=out or sys.stdout, width=200)
  console.print(table)
  kinds = {str((r.measured or {}).get("platform")) for r in chosen}
  if chip.kind not in kinds:
    console.print(f"note: measured on {', '.join(sorted(kinds))}, predicted for {chip.name}: "
                  "the columns compare only when --chip names the chips measured on.",
                  highlight=False)


# -- the plot --------------------------------------------------------------------------------


def pareto(results: Sequence[Result]) -> list[Result]:
  """The fitting plans no other fitting plan beats on both step time and memory."""
  fit = sorted((r for r in results if r.fits), key=lambda r: (r.memory, r.time.step_s))
  front, best = [], math.inf
  for r in fit:
    if r.time.step_s < best:
      front.append(r)
      best = r.time.step_s
  return front


def plot(found: Search, chip, path: pathlib.Path) -> None:
  """Predicted step time vs memory per device; the Pareto frontier and HBM highlighted."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(8, 5))
  for fits, marker, label in ((True, "o", "fits"), (False, "x", "does not fit")):
    pts = [r for r in found.results if r.fits == fits]
    if pts:
      ax.scatter([r.memory / 2**30 for r in pts], [r.time.step_s * 1e3 for r in pts],
                 marker=marker, alpha=0.5, label=label,
                 c=["tab:orange" if r.time.bound == "communication" else "tab:blue"
                    for r in pts])
  front = pareto(found.results)
  if front:
    ax.plot([r.memory / 2**30 for r in front], [r.time.step_s * 1e3 for r in front], "k-o",
            label="Pareto frontier")
    best = found.results[0]
    ax.annotate(best.candidate.label(), (best.memory / 2**30, best.time.step_s * 1e3),
                fontsize=7, xytext=(5, 5), textcoords="offset points")
  ax.axvline(chip.hbm_bytes / 2**30, color="red", ls="--", label=f"{chip.name} HBM")
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("memory per device (GiB)")
  ax.set_ylabel("predicted step time (ms)")
  ax.set_title("plans (orange: communication-bound)")
  ax.legend(fontsize=8)
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)
