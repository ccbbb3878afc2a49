"""The search: screen every candidate analytically, compile the best, rank by predicted step.

:func:`search` runs the steps in order: check the arguments, list the candidates
(:mod:`recipes._planner.candidates`), price each with the analytic estimate
(:mod:`recipes.plan_model`), compile the best ones that fit (:mod:`.compile_pool`, through
the :mod:`.cache`), and price again those with compiled figures (:func:`evaluate`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any

from partition.internal import did_you_mean
from recipes import plan_model, roofline
from recipes._planner.cache import Cache, cache_key
from recipes._planner.candidates import (
  Candidate,
  PlanError,
  candidate_config,
  candidates,
  model_params,
  preset_rules,
)
from recipes._planner.compile_pool import MAX_COMPILE_DEVICES, compile_many
from recipes._planner.render import human

DEFAULT_REMATS = ("none", "dots", "full")


@dataclasses.dataclass
class Result:
  """A candidate with its figures: the estimate, the compiled measurement (or ``None``),
  the roofline, and whether it fits the chip's HBM."""

  candidate: Candidate
  estimate: plan_model.Estimate
  compiled: dict[str, Any] | None
  time: roofline.StepTime
  memory: float            # bytes per device: compiled peak, else the estimate
  fits: bool
  memory_source: str = "analytic"   # what ``memory`` is (see :func:`evaluate`)
  measured: dict[str, Any] | None = None   # --measure: step seconds, memory on the device
  error: str | None = None   # why its compile failed: train cannot run it, never the best

  @property
  def runnable(self) -> bool:
    """Fits the chip's HBM and, where it was compiled, compiled: a plan to write."""
    return self.fits and self.error is None

  @property
  def comm_bytes(self) -> dict[str, float]:
    """Ring bytes sent per device per step, per mesh-axis group (compiled if available)."""
    if self.compiled and self.compiled.get("collective_bytes") is not None:
      return self.compiled["collective_bytes"]
    return self.estimate.comm_bytes

  @property
  def source(self) -> str:
    return "compiled" if self.compiled else "analytic"

  def to_dict(self) -> dict[str, Any]:
    c = self.candidate
    return {"preset": c.preset, "mesh": c.mesh_dict, "microbatches": c.microbatches,
            "remat": c.remat, "source": self.source, "fits": self.fits, "error": self.error,
            "memory_per_device": self.memory, "collective_bytes": self.comm_bytes,
            "memory_source": self.memory_source, "attention": self.estimate.shape.attention
            if self.estimate.shape else None,
            "step_s": self.time.step_s, "band": self.time.band,
            "roofline_s": self.time.roofline_s, "measured": self.measured,
            "bound": self.time.bound, "bound_axes": self.time.bound_axes,
            "mfu": self.time.mfu, "roofline": self.time.to_dict(),
            "estimate": dataclasses.asdict(self.estimate), "compiled": self.compiled}


# -- pricing one candidate -------------------------------------------------------------------


def evaluate(c: Candidate, est: plan_model.Estimate, compiled: dict | None, chip,
             devices: int, hosts: int, roofline_only: bool = False) -> Result:
  """The predicted step of a candidate (:mod:`recipes.cost_model` priced by
  :func:`recipes.roofline.step_time`), with collectives from its compiled figures where it
  has them (each axis group's bytes split over the phases as the estimate splits them),
  else from the estimate. FLOPs and HBM traffic are always the estimate's, the compiled
  ones are kept in the JSON: ``cost_analysis`` counts a while-loop body once (scanned
  layers, the micro-batch loop), and XLA:CPU's ``bytes accessed`` follows its own fusions,
  not an accelerator's.

  Memory per device is the compiled peak when the compile ran the attention the chip will
  run (``xla``: the CPU compile's own), labelled ``compiled (cpu)``; otherwise (a fused
  kernel on the chip) the estimate, whose activations hold that kernel's working set,
  labelled ``analytic (+<kernel> attention)``. The compiled peak is kept in the JSON.
  ``roofline_only``: the bare roofline (datasheet peaks) as the step time, the Scaling
  Book's accounting."""
  mesh = c.mesh_dict
  links = roofline.axis_links(mesh, chip, hosts)
  comm_s = est.comm_s
  if compiled and compiled.get("collective_bytes") is not None:
    comm_s = _compiled_comm_seconds(compiled["collective_bytes"], est, mesh, links)
  t = roofline.step_time(
      flops=est.flops,  # cost_analysis counts a while-loop body once (scanned layers, k > 1)
      hbm_bytes=est.hbm_bytes,  # XLA:CPU's "bytes accessed" follows CPU fusion, not an HBM's
      comm_s=comm_s, chip=chip, model_flops=est.model_flops, devices=devices,
      terms=None if roofline_only else est.terms,
      dcn_axes={a for a, link in links.items() if link.dcn},
      serial_axes=est.serial_axes)
  memory, label = _memory_per_device(est, compiled)
  return Result(c, est, compiled, t, memory, memory <= chip.hbm_bytes, label)


def _compiled_comm_seconds(wire_bytes: dict[str, float], est: plan_model.Estimate,
                           mesh: dict[str, int], links) -> dict[str, dict[str, float]]:
  """Seconds per phase and axis group of the compiled collectives: each group's bytes split
  over the phases as the estimate splits that group's (all in the backward if it has none)."""
  comm_s = {p: {} for p in roofline.PHASES}
  for key, wire in wire_bytes.items():
    axes = tuple(key.split(",")) if key != "?" else tuple(a for a, v in mesh.items() if v > 1)
    per_phase = {p: est.comm_phase[p].get(key, 0.0) for p in roofline.PHASES}
    total = sum(per_phase.values())
    split = ({p: v / max(total, 1e-30) for p, v in per_phase.items()} if total > 0
             else {"forward": 0.0, "backward": 1.0})
    for p in roofline.PHASES:
      comm_s[p][key] = roofline.wire_seconds(axes, wire * split[p], mesh, links)
  return comm_s


def _memory_per_device(est: plan_model.Estimate, compiled: dict | None) -> tuple[float, str]:
  """The bytes per device a plan is judged by, and where they come from (see
  :func:`evaluate`)."""
  impl = est.shape.attention if est.shape else "xla"
  if compiled and impl == "xla":
    return compiled["memory"]["peak"], "compiled (cpu)"
  label = "analytic" + (f" (+{impl} attention)" if impl != "xla" else
                        f" (+{human(est.attention_temp)} xla scores)")
  return est.memory["total"], label


def rank(results: list[Result]) -> list[Result]:
  """The plans that fit first, by predicted step time (to 4 significant digits), then by
  the bare roofline (of two plans the cost model ties, the one with more headroom over
  its collectives at datasheet rates), then by memory per device; then those that do not
  fit, closest to fitting first (least memory per device); last those whose compile
  failed (by step time)."""
  def key(r: Result) -> tuple:
    if r.error is not None:
      return (2, r.time.step_s, r.memory, 0.0)
    if not r.fits:
      return (1, r.memory, r.time.step_s, 0.0)
    return (0, float(f"{r.time.step_s:.4g}"), float(f"{r.time.roofline_s:.4g}"), r.memory)
  return sorted(results, key=key)


# -- the search ------------------------------------------------------------------------------


@dataclasses.dataclass
class Search:
  """What :func:`search` found: ranked results, how many candidates, and timings."""

  results: list[Result]
  num_candidates: int
  num_compiled: int
  num_cached: int
  seconds: float
  skipped: dict[str, str]
  hosts: int
  failed: dict[str, str]      # plan label -> why its compile failed (shown with its estimate)

  @property
  def best(self) -> Result | None:
    """The first plan that fits and did not fail to compile (``None``: no plan fits)."""
    return next((r for r in self.results if r.runnable), None)


def search(config, *, devices: int, chip, hosts: int | None = None,
           presets: Sequence[str] | None = None, remats: Sequence[str] = DEFAULT_REMATS,
           max_microbatches: int = 8, compile_top: int = 4, cache: Cache | None = None,
           progress: bool = False, attention: str | None = None,
           roofline_only: bool = False) -> Search:
  """Ranks every candidate plan of ``config`` on ``devices`` chips of kind ``chip``.

  Args:
    config: a ``TrainConfig`` (model, batch size and sequence length are kept; preset,
      mesh, micro-batches and remat are searched).
    devices: number of chips N.
    chip: a :class:`recipes.chips.Chip`.
    hosts: high-bandwidth domains (slices / nodes) the chips form; ``None``: as few as the
      chip's domain size allows.
    presets: preset names to search (default: every preset whose mesh axes the model uses).
    remats: remat policies to search.
    max_microbatches: the largest micro-batch count.
    compile_top: compile this many of the best analytic plans that fit (0: none).
    cache: compiled results by plan.
    progress: show rich progress bars.
    attention: the attention implementation to price (``None``: ``model.attention`` where
      the config has it, else ``'auto'``: cuDNN on GPUs, Pallas on TPUs).
    roofline_only: rank by the bare roofline (``--roofline``) instead of the cost model.

  Returns:
    A :class:`Search`.

  Raises:
    PlanError: ``devices < 1``, an unknown preset or remat, or no candidate at all.
  """
  start = time.perf_counter()
  _check_arguments(devices, remats, attention)
  presets = _presets_to_search(config, presets)
  hosts = max(1, math.ceil(devices / chip.domain_chips)) if hosts is None else hosts
  params = model_params(config)
  cands, skipped = candidates(config, params, presets, devices, remats, max_microbatches)
  if not cands:
    raise PlanError(f"no plan for {devices} devices: " + "; ".join(
        f"preset {p}: {why}" for p, why in skipped.items())
        + f". Choose a device count that divides batch_size={config.batch_size} (or "
          "--batch-tokens) into whole rows per device, e.g. a power of two.")
  estimates = _screen(config, params, cands, chip, hosts, attention, progress)
  price = lambda c, compiled: evaluate(c, estimates[c], compiled, chip, devices, hosts,
                                       roofline_only)
  results = {c: price(c, None) for c in cands}
  cache = cache or Cache(None)
  keys = {c: cache_key(candidate_config(config, c), devices) for c in cands}
  # the best K of the screen are compiled, those the cache holds (results and failures) are
  # not compiled again: a rerun with the same arguments compiles nothing
  chosen = []
  if compile_top > 0 and devices <= MAX_COMPILE_DEVICES:
    chosen = [r.candidate for r in rank(list(results.values())) if r.fits][:compile_top]
  fresh = [c for c in chosen if keys[c] not in cache.data]
  cached = [c for c in cands if keys[c] in cache.data and c not in fresh]
  _compile_into(cache, {keys[c]: candidate_config(config, c) for c in fresh}, devices,
                progress, {keys[c]: c.label() for c in fresh})
  results.update({c: price(c, cache.good(keys[c])) for c in cands if cache.good(keys[c])})
  failed = {}
  for c in chosen:
    if error := cache.data.get(keys[c], {}).get("error"):
      failed[c.label()] = _error_text(error)
      results[c] = dataclasses.replace(results[c], error=failed[c.label()])
  return Search(rank(list(results.values())), len(cands), len(fresh),
                len([c for c in cached if cache.good(keys[c])]),
                time.perf_counter() - start, skipped, hosts, failed)


def _error_text(error: str, lines: int = 12, chars: int = 2000) -> str:
  """A failed compile's message as the user needs it: the headline and the lines after it
  (``TrainConfigError``'s bullets, ``MicrobatchError``'s fix), at most ``lines`` lines."""
  kept = [line for line in error.strip().splitlines() if line.strip()][:lines]
  text = "\n".join(kept)
  return text if len(text) <= chars else text[:chars - 3] + "..."


def _check_arguments(devices: int, remats: Sequence[str], attention: str | None) -> None:
  from recipes import cost_model
  if devices < 1:
    raise PlanError(f"--devices {devices}: give a positive number of chips, e.g. --devices 64.")
  unknown = [r for r in remats if r not in plan_model.REMATS]
  if unknown:
    raise PlanError(f"--remat {unknown[0]!r} is not a remat policy; use some of "
                    f"{', '.join(plan_model.REMATS)}.")
  if attention is not None and attention not in cost_model.ATTENTIONS:
    raise PlanError(f"--attention {attention!r} is not an attention implementation"
                    f"{did_you_mean(attention, cost_model.ATTENTIONS)}; use one of "
                    f"{', '.join(cost_model.ATTENTIONS)}.")


def _presets_to_search(config, presets: Sequence[str] | None) -> list[str]:
  """``presets`` checked against ``recipes/presets``; ``None``: every preset the model can
  use (``expert_parallel`` only with experts)."""
  from recipes.config import PRESETS
  all_presets = sorted(p.stem for p in PRESETS.glob("*.yaml"))
  if presets is None:
    return [p for p in all_presets
            if not (p == "expert_parallel" and config.model.num_experts == 0)]
  for p in presets:
    if p not in all_presets:
      raise PlanError(f"--preset {p!r} is not a preset{did_you_mean(p, all_presets)}. Presets: "
                      f"{', '.join(all_presets)}.")
  return list(presets)


def _screen(config, params, cands: Sequence[Candidate], chip, hosts: int,
            attention: str | None, progress: bool) -> dict[Candidate, plan_model.Estimate]:
  """The analytic estimate of every candidate."""
  rules_of, estimates = {}, {}
  with _progress(progress) as bar:
    task = bar.add_task("analytic screen", total=len(cands))
    for c in cands:
      if c.preset not in rules_of:
        rules_of[c.preset] = preset_rules(config, c.preset)
      estimates[c] = plan_model.estimate(
          params, config.model, rules_of[c.preset], c.mesh_dict, batch=config.batch_size,
          seq_len=config.seq_len, microbatches=c.microbatches, remat=c.remat, chip=chip,
          hosts=hosts, attention=attention)
      bar.advance(task)
  return estimates


def _compile_into(cache: Cache, configs: dict[str, Any], devices: int, progress: bool,
                  labels: dict[str, str]) -> None:
  """Compiles ``{key: config}`` (nothing if empty) and stores the results in ``cache``
  (a config that crashed the compile worker as a failure, named by ``labels``)."""
  if not configs:
    return
  with _progress(progress) as bar:
    task = bar.add_task(f"compiling for {devices} CPU devices", total=len(configs))
    fresh = compile_many(configs, devices, on_done=lambda: bar.advance(task),
                         labels=labels)
  cache.data.update(fresh)
  cache.save()


class _Quiet:
  """The part of ``rich.progress.Progress`` the search uses, doing nothing."""

  def add_task(self, *a, **k):
    return 0

  def advance(self, *a, **k):
    pass

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False


def _progress(enabled: bool):
  if not enabled:
    return _Quiet()
  from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
  return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), transient=True)
