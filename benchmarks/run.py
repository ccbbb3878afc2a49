"""Runs the benchmark sections; writes ``results.json``, prints a markdown table, plots.

``python -m benchmarks`` (the full run, < 10 min on 2 cores) or ``--quick`` (tiny shapes,
a smoke run); ``--only xmap_vs_vmap,collectives`` picks sections; ``--out DIR`` writes
``DIR/results.json`` and ``DIR/plots/*.png`` (default: this folder); ``--merge`` replaces
only the sections run in an existing ``results.json``.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

from benchmarks.common import log, setup_devices

setup_devices()  # before any JAX computation

import jax  # noqa: E402

from benchmarks import (  # noqa: E402
    accumulation,
    collectives,
    decode,
    loss_memory,
    papers,
    pipeline,
    report,
    rules_resolution,
    serial_loop_memory,
    sharded_init,
    train_step,
    xmap_vs_vmap,
)

SECTIONS = (xmap_vs_vmap, serial_loop_memory, accumulation, rules_resolution, sharded_init,
            train_step, collectives, papers, pipeline, decode, loss_memory)
HERE = Path(__file__).resolve().parent


def run_sections(names: list[str], quick: bool) -> list:
  done = []
  for module in SECTIONS:
    if module.NAME not in names:
      continue
    log(f"[{module.TITLE}]")
    start = time.perf_counter()
    section = module.run(quick)
    section.seconds = time.perf_counter() - start
    log(f"  ... {section.seconds:.0f} s")
    done.append(section)
  return done


def meta(quick: bool, seconds: float) -> dict:
  import flax
  import optax

  return {"jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__,
          "python": platform.python_version(), "backend": jax.default_backend(),
          "devices": jax.device_count(), "cpu_cores": os.cpu_count(), "quick": quick,
          "seconds": round(seconds, 1)}


def parse(argv: list[str] | None) -> argparse.Namespace:
  names = [m.NAME for m in SECTIONS]
  p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
  p.add_argument("--quick", action="store_true", help="tiny shapes, few repeats (smoke run)")
  p.add_argument("--only", default=",".join(names),
                 help=f"comma-separated sections, of: {', '.join(names)}")
  p.add_argument("--out", type=Path, default=HERE, help="folder for results.json and plots/")
  p.add_argument("--merge", action="store_true",
                 help="keep the other sections of an existing results.json (with --only)")
  args = p.parse_args(argv)
  args.only = [s.strip() for s in args.only.split(",") if s.strip()]
  unknown = [s for s in args.only if s not in names]
  if unknown:
    p.error(f"unknown section(s) {unknown}; choose from {names}")
  return args


def main(argv: list[str] | None = None) -> int:
  args = parse(argv)
  start = time.perf_counter()
  sections = run_sections(args.only, args.quick)
  seconds = time.perf_counter() - start
  info = meta(args.quick, seconds)
  data = report.results(sections, info)
  if args.merge:
    data = report.merged(args.out / "results.json", data, [m.NAME for m in SECTIONS])
  report.write_json(data, args.out / "results.json")
  pngs = report.plots(sections, args.out / "plots")
  print(f"named-partition / hand-written (jax {info['jax']}, {info['devices']} "
        f"{info['backend']} devices on {info['cpu_cores']} cores"
        f"{', --quick' if args.quick else ''}; {seconds:.0f} s)\n")
  print(report.markdown(sections))
  rows = [r for s in sections for r in s.rows]
  misses = sum(r.status == "MISS" for r in rows)
  disagree = sum(not c.agreed for s in sections for c in s.checks)
  log(f"{sum(r.status == 'PASS' for r in rows)} PASS, {misses} MISS, {disagree} check(s) "
      f"disagreed; wrote {args.out / 'results.json'} and {len(pngs)} plot(s)")
  return 1 if disagree else 0


if __name__ == "__main__":
  sys.exit(main())
