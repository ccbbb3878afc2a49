"""Choose the sharding for N chips before renting them (``python -m recipes.plan``).

Every preset x every factorisation of ``N`` over the preset's mesh axes x micro-batch
counts x remat policies is a candidate. An analytic screen (:mod:`recipes.plan_model`:
parameter, optimizer, gradient and activation bytes per device, FLOPs and collectives from
the parameter shapes and the rules) ranks them all; the best ``--compile K`` that fit are
then compiled ahead of time for N virtual CPU devices (in a subprocess that has N of them),
and their figures replace the estimate: per-device memory (XLA ``memory_analysis``), FLOPs
(``cost_analysis``) and collective bytes per mesh axis (``partition.collective_stats``,
loops counted by trip count). Only the step *time* is a model: a roofline over the chip
table (:mod:`recipes.roofline`, :mod:`recipes.chips`). Compiled results are cached by plan.

  python -m recipes.plan --devices 8 --chip v5e                 # the default model
  python -m recipes.plan --devices 64 --chip h100 --batch-tokens 65536 model.num_layers=8
  python -m recipes.plan --devices 8960 --chip v5p --compile 0 --json ...   # analytic only

Output: a ranked table (what does not fit, what is communication-bound and on which mesh
axes), a plot of predicted step time against memory per device with the Pareto frontier
(PNG next to ``--out``), and the best plan as a config ``python -m recipes.train --config``
runs unchanged (``--out``, default ``runs/plan/best.yaml``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
from collections.abc import Callable, Sequence

if __name__ == "__main__":
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# The planner lives in recipes/_planner (one module per job: candidates, compile_pool,
# cache, search, measure, render); these are the names callers and tests use.
from partition import PartitionError  # noqa: E402
from recipes import chips as chips_lib  # noqa: E402
from recipes import report  # noqa: E402
from recipes._planner.cache import Cache as Cache  # noqa: E402
from recipes._planner.cache import cache_key as cache_key  # noqa: E402
from recipes._planner.cache import code_version as code_version  # noqa: E402
from recipes._planner.candidates import Candidate as Candidate  # noqa: E402
from recipes._planner.candidates import PlanError as PlanError  # noqa: E402
from recipes._planner.candidates import candidate_config as candidate_config  # noqa: E402
from recipes._planner.candidates import candidates as candidates  # noqa: E402
from recipes._planner.candidates import config_yaml as config_yaml  # noqa: E402
from recipes._planner.candidates import factorisations as factorisations  # noqa: E402
from recipes._planner.candidates import model_params as model_params  # noqa: E402
from recipes._planner.candidates import powers_of_two as powers_of_two  # noqa: E402
from recipes._planner.candidates import refusals as refusals  # noqa: E402
from recipes._planner.compile_pool import MAX_COMPILE_DEVICES as MAX_COMPILE_DEVICES  # noqa: E402
from recipes._planner.compile_pool import compile_many as compile_many  # noqa: E402
from recipes._planner.compile_pool import compile_step as compile_step  # noqa: E402
from recipes._planner.compile_pool import run_worker  # noqa: E402
from recipes._planner.measure import measure as measure  # noqa: E402
from recipes._planner.render import human, seconds  # noqa: E402
from recipes._planner.render import pareto as pareto  # noqa: E402
from recipes._planner.render import plot as plot  # noqa: E402
from recipes._planner.render import render as render  # noqa: E402
from recipes._planner.render import render_measured as render_measured  # noqa: E402
from recipes._planner.search import DEFAULT_REMATS as DEFAULT_REMATS  # noqa: E402
from recipes._planner.search import Result as Result  # noqa: E402
from recipes._planner.search import Search as Search  # noqa: E402
from recipes._planner.search import evaluate as evaluate  # noqa: E402
from recipes._planner.search import rank as rank  # noqa: E402
from recipes._planner.search import search as search  # noqa: E402

DEFAULT_OUT = "runs/plan/best.yaml"
DEFAULT_CACHE = "runs/plan/cache.json"
_HEADER = "# written by python -m recipes.plan"   # a best plan's first line


# -- command line ----------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      prog="python -m recipes.plan", description=report.plain(__doc__.splitlines()[0]),
      epilog="Overrides are key=value with dotted keys, as for python -m recipes.train "
             "(model.num_layers=16 ...).")
  parser.add_argument("--devices", type=int, metavar="N", help="number of chips")
  parser.add_argument("--chip", help=f"chip kind: {', '.join(sorted(chips_lib.CHIPS))}")
  parser.add_argument("--hosts", type=int, default=None, metavar="H",
                      help="high-bandwidth domains (TPU slices / GPU nodes) the chips form; "
                           "the outermost mesh axes that span them run at DCN speed, an "
                           "axis larger than the domains it spans is hierarchical (ICI "
                           "inside each, DCN across) (default: N / the chip's domain size, "
                           "rounded up)")
  parser.add_argument("--ici-dims", type=int, default=None, metavar="D",
                      help="torus dimensions the slice uses (default: the chip's, 3 for "
                           "v4/v5p, 2 for v5e/v6e); 1 models a one-axis ring, as the Scaling "
                           "Book's 2,550 tokens per chip for 1-D data parallelism on v5p")
  parser.add_argument("--batch-tokens", type=int, default=None, metavar="T",
                      help="global batch in tokens (sets batch_size = T / seq_len)")
  parser.add_argument("--config", help="a YAML config (default: recipes/configs/default.yaml)")
  parser.add_argument("--preset", action="append", default=None,
                      help="search only this preset (repeatable)")
  parser.add_argument("--remat", action="append", default=None,
                      help=f"remat policies to search (default: {', '.join(DEFAULT_REMATS)})")
  parser.add_argument("--max-microbatches", type=_microbatches, default=_MICROBATCHES,
                      metavar="K",
                      help="the most micro-batches per step to search (gradient accumulation, "
                           "the config's microbatches): 1, 2, 4, ... up to K, dividing the "
                           "rows per device; 1 or more (default %(default)s; 1: no accumulation)")
  parser.add_argument("--compile", type=int, default=4, metavar="K", dest="compile_top",
                      help="compile the best K plans that fit the screen (default 4; 0: "
                           f"analytic only; never above {MAX_COMPILE_DEVICES} devices)")
  parser.add_argument("--top", type=_rows, default=_ROWS, metavar="K",
                      help="rows to show (and plans in --json), 1 or more (default %(default)s)")
  parser.add_argument("--json", action="store_true", help="print the ranked plans as JSON")
  parser.add_argument("--out", default=DEFAULT_OUT,
                      help=f"where to write the best plan's config (default {DEFAULT_OUT}); "
                           "the plot goes next to it (.png)")
  parser.add_argument("--cache", default=DEFAULT_CACHE,
                      help=f"compiled results by plan (default {DEFAULT_CACHE}; '' disables)")
  parser.add_argument("--attention", default=None,
                      help="the attention implementation to price: auto (cuDNN on GPUs, Pallas "
                           "on TPUs), xla, cudnn, pallas, blockwise (default: model.attention, "
                           "else auto)")
  parser.add_argument("--roofline", action="store_true",
                      help="rank by the bare roofline (datasheet peaks, perfect overlap: the "
                           "Scaling Book's accounting) instead of the calibrated cost model")
  parser.add_argument("--measure", type=int, default=0, metavar="K",
                      help="compile and time the best K plans on the devices this process "
                           "sees and print predicted vs measured (0: off)")
  parser.add_argument("--measure-steps", type=int, default=5, metavar="S",
                      help="timed steps per measured plan, after one warm-up (default 5)")
  parser.add_argument("--no-plot", action="store_true")
  parser.add_argument("--compile-worker", help=argparse.SUPPRESS)
  parser.add_argument("overrides", nargs="*", help="key=value overrides")
  args = parser.parse_args(argv)
  if args.compile_worker is None and (args.devices is None or args.chip is None):
    parser.error("--devices N and --chip NAME are required, e.g. --devices 8 --chip v5e")
  return args


def _at_least_one(option: str, unit: str, refusal: str, default: int,
                  one: str = "") -> Callable[[str], int]:
  """An argparse ``type`` for a count ``option`` that must be >= 1: a word that is not a
  number, or a count below 1, is an argument error that says what the count would have done
  (``refusal``) and the fix; ``one`` says what 1 means, where that helps."""
  def parse(value: str) -> int:
    try:
      count = int(value)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{value!r} is not a number of {unit}: use {option} 1 "
                                       f"or more (default {default})") from None
    if count < 1:
      raise argparse.ArgumentTypeError(f"{count} {refusal}: use {option} 1 or more "
                                       f"({one + ', ' if one else ''}default {default})")
    return count
  parse.__name__ = option
  return parse


# --top 0 printed an empty table and exited 0; a negative K dropped rows from the end.
_ROWS, _MICROBATCHES = 15, 8   # the defaults of --top and --max-microbatches
_rows = _at_least_one("--top", "rows", "shows no plans", _ROWS)
# --max-microbatches 0 or below searched no micro-batch count at all, silently.
_microbatches = _at_least_one("--max-microbatches", "micro-batches", "allows no micro-batch "
                              "count", _MICROBATCHES, one="1: one micro-batch per step")


def _attention_override(overrides: list[str], flag: str | None) -> tuple[list[str], str | None]:
  """``model.attention=X`` among the overrides: kept for the config when the model has that
  field, else taken out and used as ``--attention`` (which wins over it)."""
  import layers
  has_field = "attention" in {f.name for f in dataclasses.fields(layers.TransformerConfig)}
  found = [o for o in overrides if o.split("=", 1)[0].strip() == "model.attention"]
  if not found or has_field:
    return overrides, flag
  return [o for o in overrides if o not in found], flag or found[-1].split("=", 1)[1].strip()


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  if args.compile_worker:
    return run_worker(args.compile_worker)
  try:
    chip = _chip(args)
    config, attention = _config(args)
    found = search(config, devices=args.devices, chip=chip, hosts=args.hosts,
                   presets=args.preset, remats=args.remat or DEFAULT_REMATS,
                   max_microbatches=args.max_microbatches, compile_top=args.compile_top,
                   cache=Cache(args.cache or None), progress=sys.stderr.isatty(),
                   attention=attention, roofline_only=args.roofline)
    measured = (measure(config, found.results, top=args.measure, steps=args.measure_steps,
                        devices=args.devices) if args.measure > 0 else [])
  except PartitionError as e:   # TrainConfigError is one too: config, rules, chip, devices
    print(f"error: {e}", file=sys.stderr)
    return 2
  out = pathlib.Path(args.out)
  best = found.best
  if best is not None:
    _write_best(out, best, config, chip, args, sys.argv[1:] if argv is None else argv)
  else:
    kept = _remove_stale(out)
  if not args.no_plot:
    plot(found, chip, out.with_suffix(".png"))
  if args.json:
    print(json.dumps(_json_report(found, chip, args, out if best else None), indent=1))
  else:
    render(found, chip, args.devices, found.hosts, args.top)
    if measured:
      render_measured(measured, chip)
  if best is not None:
    if not args.json:
      print(f"best plan written to {out}: python -m recipes.train --config {out}")
    return 0
  print(_no_fit_message(found, chip, args, out, kept), file=sys.stderr)
  return 1


def _no_fit_message(found: Search, chip, args, out: pathlib.Path, kept: bool) -> str:
  """Why nothing was written, what the closest plan needs, and how to get one that fits."""
  closest = next((r for r in found.results if r.error is None), None)
  need = (f"; the closest, {closest.candidate.label()}, needs {human(closest.memory)} per "
          f"device against {chip.name}'s {human(chip.hbm_bytes)}" if closest else "")
  failed = (f"; {len(found.failed)} compiled plan(s) failed (warnings above)"
            if found.failed else "")
  stale = (f" {out} is not the planner's, so it was left as it is." if kept else
           f" No config was written to {out} (nor is an earlier plan's left there).")
  return (f"error: no plan fits {args.devices} x {chip.name}{need}{failed}. Use more devices "
          "(--devices), remat (--remat full), more micro-batches (--max-microbatches), "
          f"sharded weights (--preset fsdp) or a smaller batch (--batch-tokens).{stale}")


def _remove_stale(out: pathlib.Path) -> bool:
  """Removes a best plan an earlier run wrote to ``out`` (it would read as this run's);
  ``True`` when ``out`` exists and is not the planner's (kept: a user's own config)."""
  try:
    head = out.read_text().splitlines()[:1]
  except (FileNotFoundError, IsADirectoryError, UnicodeDecodeError):
    return out.exists()
  if head and head[0].startswith(_HEADER):
    out.unlink()
    return False
  return True


def _chip(args: argparse.Namespace):
  """``--chip``, with ``--ici-dims`` torus dimensions when given."""
  chip = chips_lib.get_chip(args.chip)
  if args.ici_dims is None:
    return chip
  if args.ici_dims < 1:
    raise PlanError(f"--ici-dims {args.ici_dims} must be at least 1.")
  return dataclasses.replace(chip, torus_dims=args.ici_dims)


def _config(args: argparse.Namespace):
  """The config to plan (``--config`` and the overrides, ``--batch-tokens`` applied) and the
  attention implementation to price; checks ``--hosts``."""
  from recipes import train
  from recipes.config import load_config
  overrides, attention = _attention_override(list(args.overrides), args.attention)
  config = load_config(args.config or train.default_config_path(), overrides)
  if args.batch_tokens is not None:
    if args.batch_tokens < config.seq_len or args.batch_tokens % config.seq_len:
      raise PlanError(f"--batch-tokens {args.batch_tokens} is not a multiple of "
                      f"seq_len={config.seq_len}; give whole sequences, e.g. "
                      f"--batch-tokens {config.seq_len * config.batch_size}.")
    config = dataclasses.replace(config, batch_size=args.batch_tokens // config.seq_len)
  if args.hosts is not None and (args.hosts < 1 or args.devices % args.hosts):
    raise PlanError(f"--hosts {args.hosts} must be a positive divisor of --devices "
                    f"{args.devices}.")
  return config, attention


def _write_best(out: pathlib.Path, best: Result, config, chip, args, argv) -> None:
  """The best plan as a config ``python -m recipes.train --config`` runs, with a header
  saying how it was chosen."""
  out.parent.mkdir(parents=True, exist_ok=True)
  header = (f"{_HEADER} {' '.join(argv)}\n"
            f"# {best.candidate.label()}: {seconds(best.time.step_s)} predicted on "
            f"{args.devices} x {chip.name}, {human(best.memory)} per device "
            f"({best.source})\n")
  config = dataclasses.replace(candidate_config(config, best.candidate),
                               out_dir=str(out.parent / "train"))
  out.write_text(header + config_yaml(config))


def _json_report(found: Search, chip, args, written: pathlib.Path | None) -> dict:
  return {"devices": args.devices, "chip": dataclasses.asdict(chip), "hosts": found.hosts,
          "candidates": found.num_candidates, "compiled": found.num_compiled,
          "cached": found.num_cached, "seconds": found.seconds,
          "config": None if written is None else str(written),
          "compile_failures": found.failed,
          "plans": [r.to_dict() for r in found.results[:args.top]]}


if __name__ == "__main__":
  sys.exit(main())
