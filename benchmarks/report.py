"""The outputs of a run: ``results.json``, a markdown table and PNG plots (matplotlib, Agg)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.common import Row, Section, fmt_value

HEADER = ["section", "workload", "metric", "ours", "baseline", "ratio", "target", "status",
          "note"]


def results(sections: list[Section], meta: dict[str, Any]) -> dict[str, Any]:
  return {
      "meta": meta,
      "sections": [{"name": s.name, "title": s.title, "seconds": round(s.seconds, 2),
                    "rows": [r.to_dict() for r in s.rows],
                    "checks": [c.to_dict() for c in s.checks], "series": s.series}
                   for s in sections],
  }


def merged(path: Path, new: dict[str, Any], order: list[str]) -> dict[str, Any]:
  """``new``'s sections replacing those of the same name in the results at ``path`` (others
  kept; sections in ``order``); ``meta`` records which sections this run measured."""
  if not path.exists():
    return new
  old = json.loads(path.read_text())
  by_name = {s["name"]: s for s in old.get("sections", [])}
  by_name.update({s["name"]: s for s in new["sections"]})
  meta = dict(old.get("meta", {}), last_run=dict(new["meta"], sections=[
      s["name"] for s in new["sections"]]))
  return {"meta": meta, "sections": [by_name[n] for n in order if n in by_name]}


def write_json(data: dict[str, Any], path: Path) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(data, indent=1, default=float) + "\n")


def _cells(r: Row) -> list[str]:
  target = "info" if r.target is None else f"≤ {r.target:g}"
  return [r.section.split("_")[0], r.workload, r.metric, fmt_value(r.ours, r.unit),
          fmt_value(r.baseline, r.unit), f"{r.ratio:.3f}", target, r.status,
          r.note.replace("|", "/")]


def markdown(sections: list[Section]) -> str:
  lines = []
  for s in sections:
    lines += ["", f"**{s.title}**", "",
              "| workload | metric | ours | baseline | ratio | target | status | note |",
              "|---|---|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(_cells(r)[1:]) + " |" for r in s.rows]
  return "\n".join(lines).lstrip("\n") + "\n"


# --------------------------------------------------------------------------------- plots


def plots(sections: list[Section], out: Path) -> list[Path]:
  """Writes the PNGs; returns their paths (none if matplotlib is missing)."""
  try:
    import matplotlib
  except ImportError:
    return []
  matplotlib.use("Agg")  # no display needed
  import matplotlib.pyplot as plt

  out.mkdir(parents=True, exist_ok=True)
  written = [_ratios(plt, sections, out / "ratios.png")]
  by_name = {s.name: s for s in sections}
  if "serial_loop_memory" in by_name:
    written.append(_memory(plt, by_name["serial_loop_memory"].series["memory_vs_k"],
                           out / "serial_loop_memory.png"))
  if "collectives" in by_name:
    written.append(_collectives(plt, by_name["collectives"].series["collective_bytes"],
                                out / "collectives.png"))
  return written


def _ratios(plt, sections: list[Section], path: Path) -> Path:
  rows = [r for s in sections for r in s.rows if r.target is not None]
  labels = [f"{r.workload[:24]} / {r.metric[:44]}" for r in rows]
  fig, ax = plt.subplots(figsize=(10, 0.22 * len(rows) + 1.2))
  y = range(len(rows))
  colors = ["tab:green" if r.status == "PASS" else "tab:red" for r in rows]
  ax.barh(y, [min(r.ratio, 3.0) for r in rows], color=colors)
  ax.scatter([r.target for r in rows], y, marker="|", color="black", s=80, label="target")
  ax.set_yticks(list(y), labels, fontsize=6)
  ax.invert_yaxis()
  ax.set_xlabel("ratio ours / baseline (clipped at 3)")
  ax.legend(loc="lower right", fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def _memory(plt, data: dict[str, Any], path: Path) -> Path:
  fig, ax = plt.subplots(figsize=(5.5, 4))
  mib = lambda xs: [x / 2**20 for x in xs]
  ax.loglog(data["k"], mib(data["serial_loop"]), "o-", label="SerialLoop(k)", base=2)
  ax.loglog(data["k"], mib(data["lax_map"]), "x--", label="lax.map(batch_size=N/k)", base=2)
  ax.loglog(data["k"], mib(data["vmap_over_k"]), ":", label="jit(vmap) / k", base=2)
  ax.set_xlabel("k (sequential chunks)")
  ax.set_ylabel("compiled temp memory (MiB)")
  ax.set_title(f"sin(outer(x, x)) per example, N={data['n']} D={data['d']}", fontsize=9)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def _collectives(plt, data: dict[str, Any], path: Path) -> Path:
  names = list(data)
  fig, ax = plt.subplots(figsize=(5.5, 4))
  width = 0.27
  for i, (key, label) in enumerate([("ours", "partition.value_and_grad"),
                                    ("hand_written", "hand-written jit"),
                                    ("analytic", "analytic minimum")]):
    ax.bar([j + (i - 1) * width for j in range(len(names))],
           [data[n][key] / 2**20 for n in names], width, label=label)
  ax.set_xticks(range(len(names)), names)
  ax.set_ylabel("bytes sent per device per step (MiB, ring model)")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def compact_markdown(data: dict[str, Any]) -> str:
  """One compact table from ``results.json``: every targeted row, the
  SerialLoop(k) memory rows folded into their worst ratio per target."""
  lines = ["| # | workload | metric | ratio | target | status | note |",
           "|---|---|---|---|---|---|---|"]
  for i, s in enumerate(data["sections"], 1):
    rows = [r for r in s["rows"] if r["target"] is not None]
    if s["name"] == "serial_loop_memory":
      rows = _fold_memory(rows)
    for r in rows:
      lines.append(f"| {i} | {r['workload']} | {r['metric']} | {r['ratio']:.3f} | "
                   f"≤ {r['target']:g} | {r['status']} | {r['note'].replace('|', '/')} |")
  return "\n".join(lines) + "\n"


def _fold_memory(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
  floor = [r for r in rows if "lax.map" in r["metric"]]
  vector = [r for r in rows if "vmap" in r["metric"]]
  ks = [r["workload"].split("k=")[1] for r in floor]
  worst_floor = max(floor, key=lambda r: r["ratio"] / r["target"])
  worst_vec = max(vector, key=lambda r: r["ratio"] * int(r["workload"].split("k=")[1]))
  n_d = worst_floor["workload"].split(" k=")[0]
  return [
      dict(worst_floor, workload=f"{n_d}, k = {ks[0]}..{ks[-1]}",
           metric="SerialLoop(k) temp / lax.map(batch_size=N/k), worst k",
           status="PASS" if all(r["status"] == "PASS" for r in floor) else "MISS"),
      dict(worst_vec, workload=f"{n_d}, k = {ks[0]}..{ks[-1]}",
           metric=f"SerialLoop(k) temp x k / jit(vmap), worst k "
                  f"({worst_vec['workload'].split(' ')[-1]})",
           ratio=worst_vec["ratio"] * int(worst_vec["workload"].split("k=")[1]), target=1.3,
           status="PASS" if all(r["status"] == "PASS" for r in vector) else "MISS"),
  ]
