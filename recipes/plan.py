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
import functools
import hashlib
import json
import math
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

if __name__ == "__main__":
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from partition import PartitionError  # noqa: E402
from partition.internal import did_you_mean  # noqa: E402
from recipes import chips as chips_lib  # noqa: E402
from recipes import plan_model, report, roofline  # noqa: E402

DEFAULT_REMATS = ("none", "dots", "full")
MAX_COMPILE_DEVICES = 512      # virtual CPU devices one compile may ask for
DEFAULT_OUT = "runs/plan/best.yaml"
DEFAULT_CACHE = "runs/plan/cache.json"


class PlanError(PartitionError, ValueError):
  """The plan command was given arguments it cannot plan with."""


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One plan: a preset, a mesh (axis -> size, outermost first), micro-batches and remat."""

  preset: str
  mesh: tuple[tuple[str, int], ...]
  microbatches: int
  remat: str

  @property
  def mesh_dict(self) -> dict[str, int]:
    return dict(self.mesh)

  def label(self) -> str:
    mesh = "x".join(f"{k}{v}" for k, v in self.mesh if v > 1) or "1"
    return f"{self.preset} [{mesh}] k={self.microbatches} remat={self.remat}"

  def __repr__(self) -> str:
    return f"Candidate({self.label()})"


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
            "remat": c.remat, "source": self.source, "fits": self.fits,
            "memory_per_device": self.memory, "collective_bytes": self.comm_bytes,
            "memory_source": self.memory_source, "attention": self.estimate.shape.attention
            if self.estimate.shape else None,
            "step_s": self.time.step_s, "band": self.time.band,
            "roofline_s": self.time.roofline_s, "measured": self.measured,
            "bound": self.time.bound, "bound_axes": self.time.bound_axes,
            "mfu": self.time.mfu, "roofline": self.time.to_dict(),
            "estimate": dataclasses.asdict(self.estimate), "compiled": self.compiled}


# -- candidates ------------------------------------------------------------------------------


def factorisations(n: int, k: int) -> list[tuple[int, ...]]:
  """Every ordered ``k``-tuple of positive ints whose product is ``n``.

  >>> factorisations(4, 2)
  [(1, 4), (2, 2), (4, 1)]
  """
  if k == 1:
    return [(n,)]
  return [(d,) + rest for d in range(1, n + 1) if n % d == 0
          for rest in factorisations(n // d, k - 1)]


def powers_of_two(limit: int) -> list[int]:
  """1, 2, 4, ... up to ``limit``."""
  return [2 ** i for i in range(int(math.log2(max(1, limit))) + 1)]


def candidates(config, params, presets: Sequence[str], devices: int,
               remats: Sequence[str], max_microbatches: int) -> tuple[list[Candidate], dict]:
  """Distinct candidates (two plans whose every spec matches after dropping size-1 axes
  are one), and per preset why none was kept (``{}`` if some were)."""
  out, seen, empty = [], set(), {}
  for preset in presets:
    rules = _rules(config, preset)
    axes = plan_model.mesh_axes_of(rules)
    kept = valid = 0
    for sizes in factorisations(devices, len(axes)):
      mesh = dict(zip(axes, sizes))
      rows, seq = plan_model.batch_groups(rules, mesh, config.batch_size, config.seq_len)
      sig = plan_model.sharding_signature(params, rules, mesh, config.batch_size,
                                          config.seq_len)
      used = {a for spec in sig[:-1] for dim in spec for a in dim}
      if any(v > 1 and a not in used for a, v in mesh.items()):
        continue  # devices that neither split the batch nor hold a shard: idle copies
      per_device_rows = config.batch_size // math.prod(mesh[a] for a in rows)
      valid += 1
      for k in powers_of_two(min(max_microbatches, per_device_rows)):
        if per_device_rows % k:
          continue
        for remat in remats:
          key = (sig, k, remat)
          if key in seen:
            continue
          seen.add(key)
          out.append(Candidate(preset, tuple(mesh.items()), k, remat))
          kept += 1
    if valid and not kept:
      empty[preset] = "every plan is one an earlier preset already gives (same shardings)"
    elif not kept:
      empty[preset] = (f"no factorisation of {devices} over its mesh axes {axes} splits "
                       f"batch_size={config.batch_size} x seq_len={config.seq_len} evenly")
  return out, empty


# -- model shapes (the one place that builds a run) ------------------------------------------


def model_params(config) -> list[plan_model.ParamShape]:
  """The model's parameters (shapes, dtypes, logical axes) without allocating them: the
  run is traced under ``jax.eval_shape`` on a one-device mesh (shapes do not depend on it)."""
  import jax
  import numpy as np
  one = dataclasses.replace(config, preset="data_parallel", mesh={"data": 1}, rules=(),
                            microbatches=1)
  run, state = _abstract_run(one)
  axes = run.state_axes["params"]
  is_axes = lambda a: a is None or (type(a) is tuple and all(
      n is None or isinstance(n, str) for n in a))
  flat_axes = jax.tree.leaves(axes, is_leaf=is_axes)
  flat = jax.tree_util.tree_flatten_with_path(state["params"])[0]
  return [plan_model.ParamShape("/".join(str(getattr(k, "key", k)) for k in path),
                                tuple(leaf.shape), int(np.dtype(leaf.dtype).itemsize), ax)
          for (path, leaf), ax in zip(flat, flat_axes)]


def _abstract_run(config):
  """``recipes.explain.abstract_run``: the run traced without allocation (wrapped here so a
  move of that function touches one line)."""
  from recipes import explain
  return explain.abstract_run(config)


def candidate_config(config, c: Candidate):
  """``config`` with the candidate's preset, mesh, micro-batches and remat."""
  model = dataclasses.replace(config.model, remat=c.remat)
  return dataclasses.replace(config, preset=c.preset, mesh=c.mesh_dict,
                             microbatches=c.microbatches, model=model)


def config_yaml(config) -> str:
  """``config`` as a YAML document ``load_config`` reads back to an equal config."""
  import yaml
  d = config.to_dict()
  if all(v is None for v in d.get("distributed", {}).values()):
    d.pop("distributed", None)
  return yaml.safe_dump(d, sort_keys=False)


# -- compiling (in a subprocess with N virtual devices) --------------------------------------


def compile_step(config) -> dict[str, Any]:
  """Compiles ``config``'s train step on the devices this process has; per device: memory
  (``recipes.explain.Memory``), FLOPs, bytes accessed and collectives per mesh-axis group."""

  import partition
  from recipes import explain
  start = time.perf_counter()
  run, state = _abstract_run(config)
  compiled = explain.compile_train_step(run, state)
  memory = explain.memory_of(compiled)
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  groups: dict[str, float] | None = {}
  try:
    collectives = partition.collective_stats(compiled, run.mesh)
    kinds, note = collectives.as_dict(), ""
  except PartitionError as e:   # an HLO spelling the parser does not read: keep the rest
    collectives, kinds, groups, note = None, None, None, str(e).splitlines()[0]
  for op in collectives.ops if collectives else ():
    if op.axes == ():
      continue
    key = "?" if op.axes is None else ",".join(op.axes)
    groups[key] = groups.get(key, 0.0) + op.bytes
  return {"memory": memory.to_dict(), "flops": float(cost.get("flops", 0.0)),
          "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
          "collective_bytes": groups, "collectives": kinds, "collectives_error": note,
          "compile_s": time.perf_counter() - start}


def _worker(path: str) -> int:
  """``--compile-worker FILE``: compile each config of FILE, print one JSON line each."""
  job = json.loads(pathlib.Path(path).read_text())
  import jax
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", job["devices"])
  from recipes.config import load_config
  for key, text in job["configs"].items():
    tmp = pathlib.Path(path).with_suffix(".one.yaml")
    tmp.write_text(text)
    try:
      out = {"key": key, **compile_step(load_config(tmp))}
    except Exception as e:  # noqa: BLE001 - a failed compile is reported, the search goes on
      out = {"key": key, "error": f"{type(e).__name__}: {e}"}
    print("RESULT " + json.dumps(out), flush=True)
  return 0


def compile_many(configs: dict[str, Any], devices: int, on_done=None) -> dict[str, dict]:
  """Compiles ``{key: config}`` in one subprocess with ``devices`` virtual CPU devices;
  ``on_done(key, result)`` after each."""
  import tempfile
  results: dict[str, dict] = {}
  if not configs:
    return results
  with tempfile.TemporaryDirectory() as tmp:
    job = pathlib.Path(tmp) / "job.json"
    job.write_text(json.dumps({"devices": devices,
                               "configs": {k: config_yaml(c) for k, c in configs.items()}}))
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "JAX_PLATFORMS": "cpu"}
    root = pathlib.Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    proc = subprocess.Popen([sys.executable, "-m", "recipes.plan", "--compile-worker",
                             str(job)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=root)
    for line in proc.stdout:
      if line.startswith("RESULT "):
        r = json.loads(line[len("RESULT "):])
        results[r.pop("key")] = r
        if on_done:
          on_done()
    err = proc.stderr.read()
    if proc.wait() != 0:
      raise PlanError(f"the compile worker failed (exit {proc.returncode}):\n{err[-2000:]}")
  return results


@functools.cache
def code_version() -> str:
  """A hash of the code the compiled step is made of (``partition``, ``layers``, the
  train step and the presets), so a cached result never outlives a change to it."""
  root = pathlib.Path(__file__).resolve().parent.parent
  files = sorted([*root.glob("partition/**/*.py"), *root.glob("layers/**/*.py"),
                  *root.glob("recipes/presets/*.yaml"),
                  *(root / "recipes" / f for f in ("train.py", "model.py", "explain.py"))])
  digest = hashlib.sha256()
  for f in files:
    digest.update(f.read_bytes())
  return digest.hexdigest()[:12]


def cache_key(config, devices: int) -> str:
  """The cache key of a compiled plan: everything the compiled step depends on."""
  import jax
  d = config.to_dict()
  relevant = {k: d[k] for k in ("framework", "preset", "rules", "mesh", "microbatches",
                                "batch_size", "seq_len", "model", "optimizer")}
  text = json.dumps({"config": relevant, "devices": devices, "jax": jax.__version__,
                     "code": code_version()}, sort_keys=True, default=str)
  return hashlib.sha256(text.encode()).hexdigest()[:20]


class Cache:
  """Compiled results by :func:`cache_key`, in one JSON file."""

  def __init__(self, path: str | os.PathLike | None):
    self.path = pathlib.Path(path) if path else None
    self.data: dict[str, dict] = {}
    if self.path and self.path.exists():
      try:
        self.data = json.loads(self.path.read_text())
      except (OSError, json.JSONDecodeError):
        self.data = {}

  def save(self) -> None:
    if self.path:
      self.path.parent.mkdir(parents=True, exist_ok=True)
      self.path.write_text(json.dumps(self.data, indent=1, sort_keys=True))

  def __repr__(self) -> str:
    return f"Cache({self.path}, {len(self.data)} plans)"


# -- the search ------------------------------------------------------------------------------


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
  dcn = {a for a, link in links.items() if link.dcn}
  comm_s = est.comm_s
  if compiled and compiled.get("collective_bytes") is not None:
    share = lambda part: {p: part[p] / max(sum(part.values()), 1e-30) for p in part}
    comm_s = {p: {} for p in roofline.PHASES}
    for key, wire in compiled["collective_bytes"].items():
      axes = tuple(key.split(",")) if key != "?" else tuple(a for a, v in mesh.items() if v > 1)
      per_phase = {p: est.comm_phase[p].get(key, 0.0) for p in roofline.PHASES}
      split = share(per_phase) if sum(per_phase.values()) > 0 else {"forward": 0.0,
                                                                     "backward": 1.0}
      for p in roofline.PHASES:
        comm_s[p][key] = roofline.wire_seconds(axes, wire * split[p], mesh, links)
  t = roofline.step_time(
      flops=est.flops,  # cost_analysis counts a while-loop body once (scanned layers, k > 1)
      hbm_bytes=est.hbm_bytes,  # XLA:CPU's "bytes accessed" follows CPU fusion, not an HBM's
      comm_s=comm_s, chip=chip, model_flops=est.model_flops, devices=devices,
      terms=None if roofline_only else est.terms, dcn_axes=dcn,
      serial_axes=est.serial_axes, bubble=est.bubble)
  impl = est.shape.attention if est.shape else "xla"
  if compiled and impl == "xla":
    peak = compiled["memory"]["peak"]
    return Result(c, est, compiled, t, peak, peak <= chip.hbm_bytes, "compiled (cpu)")
  memory = est.memory["total"]
  label = "analytic" + (f" (+{impl} attention)" if impl != "xla" else
                        f" (+{_human(est.attention_temp)} xla scores)")
  return Result(c, est, compiled, t, memory, memory <= chip.hbm_bytes, label)


def rank(results: list[Result]) -> list[Result]:
  """Fitting plans first, then by predicted step time (to 4 significant digits), then by
  the bare roofline (of two plans the cost model ties, the one with more headroom over
  its collectives at datasheet rates), then by memory per device."""
  return sorted(results, key=lambda r: (not r.fits, float(f"{r.time.step_s:.4g}"),
                                        float(f"{r.time.roofline_s:.4g}"), r.memory))


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
  from recipes.config import PRESETS
  start = time.perf_counter()
  if devices < 1:
    raise PlanError(f"--devices {devices}: give a positive number of chips, e.g. --devices 64.")
  unknown = [r for r in remats if r not in plan_model.REMATS]
  if unknown:
    raise PlanError(f"--remat {unknown[0]!r} is not a remat policy; use some of "
                    f"{', '.join(plan_model.REMATS)}.")
  from recipes import cost_model
  if attention is not None and attention not in cost_model.ATTENTIONS:
    raise PlanError(f"--attention {attention!r} is not an attention implementation"
                    f"{did_you_mean(attention, cost_model.ATTENTIONS)}; use one of "
                    f"{', '.join(cost_model.ATTENTIONS)}.")
  if hosts is None:
    hosts = max(1, math.ceil(devices / chip.domain_chips))
  all_presets = sorted(p.stem for p in PRESETS.glob("*.yaml"))
  if presets is None:
    presets = [p for p in all_presets
               if not (p == "expert_parallel" and config.model.num_experts == 0)]
  for p in presets:
    if p not in all_presets:
      raise PlanError(f"--preset {p!r} is not a preset{did_you_mean(p, all_presets)}. Presets: "
                      f"{', '.join(all_presets)}.")
  params = model_params(config)
  cands, skipped = candidates(config, params, presets, devices, remats, max_microbatches)
  if not cands:
    raise PlanError(f"no plan for {devices} devices: " + "; ".join(
        f"preset {p}: {why}" for p, why in skipped.items())
        + f". Choose a device count that divides batch_size={config.batch_size} (or "
          "--batch-tokens) into whole rows per device, e.g. a power of two.")
  rules_of = {}
  estimates = {}
  with _progress(progress) as bar:
    task = bar.add_task("analytic screen", total=len(cands))
    for c in cands:
      if c.preset not in rules_of:
        rules_of[c.preset] = _rules(config, c.preset)
      estimates[c] = plan_model.estimate(
          params, config.model, rules_of[c.preset], c.mesh_dict, batch=config.batch_size,
          seq_len=config.seq_len, microbatches=c.microbatches, remat=c.remat, chip=chip,
          hosts=hosts, attention=attention)
      bar.advance(task)
  results = {c: evaluate(c, e, None, chip, devices, hosts, roofline_only)
             for c, e in estimates.items()}
  cache = cache or Cache(None)
  keys = {c: cache_key(candidate_config(config, c), devices) for c in cands}
  cached = [c for c in cands if keys[c] in cache.data and "error" not in cache.data[keys[c]]]
  chosen = []
  if compile_top > 0 and devices <= MAX_COMPILE_DEVICES:
    chosen = [r.candidate for r in rank(list(results.values()))
              if r.fits and "error" in cache.data.get(keys[r.candidate], {"error": 1})
              ][:compile_top]
  if chosen:
    with _progress(progress) as bar:
      task = bar.add_task(f"compiling for {devices} CPU devices", total=len(chosen))
      fresh = compile_many({keys[c]: candidate_config(config, c) for c in chosen}, devices,
                           on_done=lambda: bar.advance(task))
    cache.data.update(fresh)
    cache.save()
  for c in cands:
    got = cache.data.get(keys[c])
    if got and "error" not in got:
      results[c] = evaluate(c, estimates[c], got, chip, devices, hosts, roofline_only)
  failed = {c.label(): cache.data[keys[c]]["error"].splitlines()[0] for c in chosen
            if "error" in cache.data.get(keys[c], {})}
  return Search(rank(list(results.values())), len(cands), len(chosen), len(cached),
                time.perf_counter() - start, skipped, hosts, failed)


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
  import numpy as np

  from recipes import explain, train
  if jax.device_count() != devices:
    raise PlanError(f"--measure times the plans on the devices this process sees: "
                    f"{jax.device_count()} {jax.default_backend()} device(s), but --devices "
                    f"is {devices}. Plan for --devices {jax.device_count()}, or run where "
                    f"{devices} are visible (on CPU: XLA_FLAGS="
                    f"--xla_force_host_platform_device_count={devices}).")
  chosen = [r for r in results if r.fits][:top]
  for r in chosen:
    try:
      run = train.build_run(candidate_config(config, r.candidate))
      batch = run.data.batch(0)
      compiled = run.train_step.lower(run.state, batch).compile()
      memory = explain.memory_of(compiled).peak
      state, metrics = compiled(run.state, batch)     # warm-up (the state is donated)
      jax.block_until_ready(metrics)
      times = []
      for _ in range(max(1, steps)):
        start = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - start)
      r.measured = {"step_s": float(np.median(times)), "memory": float(memory),
                    "steps": len(times), "platform": jax.default_backend(),
                    "device": str(jax.devices()[0].device_kind)}
      del run, state
    except Exception as e:  # noqa: BLE001 - one failed plan does not end the measurement
      r.measured = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
  return chosen


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
      table.add_row(escape(r.candidate.label()), _seconds(r.time.step_s),
                    escape(m.get("error", "-")),
                    "", _human(r.memory), "", "", "")
      continue
    table.add_row(escape(r.candidate.label()),
                  f"{_seconds(r.time.step_s)} ±{100 * r.time.band:.0f}%",
                  _seconds(m["step_s"]), f"{100 * (r.time.step_s / m['step_s'] - 1):+.0f}%",
                  _human(r.memory), _human(m["memory"]),
                  f"{100 * (r.memory / m['memory'] - 1):+.0f}%", m["device"])
  console = Console(file=out or sys.stdout, width=200)
  console.print(table)
  kinds = {str((r.measured or {}).get("platform")) for r in chosen}
  if chip.kind not in kinds:
    console.print(f"note: measured on {', '.join(sorted(kinds))}, predicted for {chip.name}: "
                  "the columns compare only when --chip names the chips measured on.",
                  highlight=False)


def _rules(config, preset: str):
  import partition
  from recipes.config import preset_path
  rules = partition.AxisRules.from_file(preset_path(preset))
  return rules.override(*config.rules) if config.rules else rules


class _Quiet:
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


# -- output ----------------------------------------------------------------------------------


def _human(n: float) -> str:
  for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if abs(n) >= scale:
      return f"{n / scale:.2f} {unit}"
  return f"{n:.0f} B"


def _seconds(s: float) -> str:
  if s >= 1:
    return f"{s:.3g} s"
  return f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} µs"


def render(found: Search, chip, devices: int, hosts: int, top: int, out=sys.stdout) -> None:
  """The ranked rich table (the first ``top`` plans) and a one-line summary."""
  from rich.console import Console
  from rich.table import Table
  console = Console(file=out, width=220)
  table = Table(title=f"plans for {devices} x {chip.name} ({hosts} host domain"
                      f"{'s' if hosts > 1 else ''}), best first")
  measured = any(r.measured for r in found.results[:top])
  names = ["#", "preset", "mesh", "k", "remat", "attention", "memory/device", "fits",
           "step time", "bound", "MFU", "roofline", "collectives/device", "figures"]
  if measured:
    names[9:9] = ["measured step", "measured memory"]
  right = ("#", "k", "memory/device", "step time", "MFU", "roofline", "measured step",
           "measured memory")
  for name in names:
    table.add_column(name, justify="right" if name in right else "left")
  for i, r in enumerate(found.results[:top], 1):
    c = r.candidate
    mesh = ", ".join(f"{k}={v}" for k, v in c.mesh)
    fits = "yes" if r.fits else f"[red]no (> {_human(chip.hbm_bytes)})[/red]"
    bound = r.time.bound
    if bound == "communication":
      bound = f"[yellow]communication ({r.time.bound_axes})[/yellow]"
    band = f" ±{100 * r.time.band:.0f}%" if r.time.band else ""
    attn = r.estimate.shape.attention if r.estimate.shape else "-"
    row = [str(i), c.preset, mesh, str(c.microbatches), c.remat, attn, _human(r.memory),
           fits, _seconds(r.time.step_s) + band, bound, f"{100 * r.time.mfu:.1f}%",
           _seconds(r.time.roofline_s),
           ", ".join(f"{k} {_human(v)}" for k, v in r.comm_bytes.items()) or "-",
           r.memory_source]
    if measured:
      m = r.measured or {}
      row[9:9] = [_seconds(m["step_s"]) if "step_s" in m else m.get("error", "-")[:40],
                  _human(m["memory"]) if m.get("memory") else "-"]
    table.add_row(*row)
  console.print(table)
  cal = chip.cal
  console.print(f"{found.num_candidates} distinct candidates screened, "
                f"{found.num_compiled} compiled now, {found.num_cached} from the cache, "
                f"in {found.seconds:.1f} s. Step time: the calibrated cost model "
                f"(recipes/cost_model.py; matmuls at most {100 * cal.matmul_efficiency:.0f}% "
                f"of {chip.name}'s peak, so MFU never exceeds it), ± its calibration band "
                "(docs/planning.md); 'roofline' is the bare bound at datasheet peaks. "
                "Overlap: FSDP and data-parallel collectives hide behind their phase's "
                "compute; tensor-parallel and cross-node ones do not.", highlight=False)
  for preset, why in found.skipped.items():
    console.print(f"note: preset {preset}: {why}", highlight=False)
  for label, why in found.failed.items():
    console.print(f"[yellow]warning:[/yellow] compiling {label} failed ({why}); its row "
                  "shows the estimate", highlight=False)


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
                           "the outermost mesh axes that span them run at DCN speed "
                           "(default: N / the chip's domain size, rounded up)")
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
  parser.add_argument("--max-microbatches", type=int, default=8, metavar="K")
  parser.add_argument("--compile", type=int, default=4, metavar="K", dest="compile_top",
                      help="compile the best K plans that fit the screen (default 4; 0: "
                           f"analytic only; never above {MAX_COMPILE_DEVICES} devices)")
  parser.add_argument("--top", type=int, default=15, metavar="K", help="rows to show")
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
  from recipes import train
  from recipes.config import TrainConfigError, load_config
  args = parse_args(argv)
  if args.compile_worker:
    return _worker(args.compile_worker)
  try:
    chip = chips_lib.get_chip(args.chip)
    if args.ici_dims is not None:
      if args.ici_dims < 1:
        raise PlanError(f"--ici-dims {args.ici_dims} must be at least 1.")
      chip = dataclasses.replace(chip, torus_dims=args.ici_dims)
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
    found = search(config, devices=args.devices, chip=chip, hosts=args.hosts,
                   presets=args.preset, remats=args.remat or DEFAULT_REMATS,
                   max_microbatches=args.max_microbatches, compile_top=args.compile_top,
                   cache=Cache(args.cache or None), progress=sys.stderr.isatty(),
                   attention=attention, roofline_only=args.roofline)
    measured = (measure(config, found.results, top=args.measure, steps=args.measure_steps,
                        devices=args.devices) if args.measure > 0 else [])
  except (TrainConfigError, PartitionError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  hosts = found.hosts
  out = pathlib.Path(args.out)
  best = found.results[0]
  if best.fits:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("# written by python -m recipes.plan "
                   + " ".join(sys.argv[1:] if argv is None else argv) + "\n"
                   + f"# {best.candidate.label()}: {_seconds(best.time.step_s)} predicted on "
                     f"{args.devices} x {chip.name}, {_human(best.memory)} per device "
                     f"({best.source})\n"
                   + config_yaml(dataclasses.replace(
                       candidate_config(config, best.candidate),
                       out_dir=str(out.parent / "train"))))
  if not args.no_plot:
    plot(found, chip, out.with_suffix(".png"))
  if args.json:
    print(json.dumps({"devices": args.devices, "chip": dataclasses.asdict(chip),
                      "hosts": hosts, "candidates": found.num_candidates,
                      "compiled": found.num_compiled, "cached": found.num_cached,
                      "seconds": found.seconds, "config": str(out) if best.fits else None,
                      "compile_failures": found.failed,
                      "plans": [r.to_dict() for r in found.results[:args.top]]}, indent=1))
  else:
    render(found, chip, args.devices, hosts, args.top)
    if measured:
      render_measured(measured, chip)
    if best.fits:
      print(f"best plan written to {out}: python -m recipes.train --config {out}")
    else:
      print("no plan fits: see the memory column (more devices, remat, a smaller batch)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
