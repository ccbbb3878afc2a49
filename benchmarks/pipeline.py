"""Section: pipeline parallelism (``partition.pipeline``) against its analytic numbers.

A residual tanh MLP stack of ``L`` layers (``h + tanh(h W_l + b_l)``, stacked along
``layers``) takes one ``jax.value_and_grad`` step, pipelined over ``stage`` (``p`` stages)
with the batch on ``data``, on 8 devices. From the compiled program (Auto mesh):

* **parameter bytes per device** / ``total / p`` (target 1.01): the stage holds its layers
  only (``memory_analysis().argument_size_in_bytes`` less the device's batch shard);
* **loop trip count** / ``r m + p - 1`` (target 1.0): the ``known_trip_count`` of the
  schedule's while loop in the HLO (forward; its transpose runs as many);
* **collective-permute bytes per step** / ``2 (r m + p - 1) x`` one micro-batch's
  activations per device (target 1.05): one shift per iteration forward and one backward
  (the transpose); circular schedules also move ``(r - 1) / r`` of each stage's parameters
  to their ring position and their gradients back (counted in the analytic number);
* **gradient all-reduce bytes over data per step** / one reduction of a stage's gradients,
  ``2 S (n - 1) / n`` for ``S`` bytes of the stage's parameters over ``n`` data devices
  (target 1.05): each device pipelines its own rows and the stage's gradients are summed over
  ``data`` once per step, not once per iteration;
* **step time** / the same step without pipelining (layers replicated, batch on all 8
  devices; informational): XLA:CPU runs the 8 virtual devices on shared host cores, so it
  cannot show the bubble or the overlap honestly; the row is reported, not targeted.

``python -m benchmarks.pipeline --plot docs/images/pipeline_schedule.png`` draws the
schedules (``PipelineShape.schedule``) for the docs.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import partition
from benchmarks.common import (
  BYTES_TARGET,
  Row,
  Section,
  auto_mesh,
  log,
  memory,
  steady_state,
)

NAME = "pipeline"
TITLE = "9. pipeline over 'stage': parameter bytes, trip count, shift bytes vs analytic"
N = 8
PARAM_TARGET = 1.01
CPU_TIME_NOTE = ("XLA:CPU: 8 virtual devices share the host's cores, so neither the bubble "
                 "nor compute/transfer overlap shows; reported, not targeted")
# (layers, stages, repeats, microbatches)
CONFIGS = ((8, 4, 1, 4), (8, 4, 1, 8), (8, 2, 2, 4), (8, 4, 2, 4))


def layer(lp, h):
  return h + jnp.tanh(h @ lp["w"] + lp["b"])


def _stack(num_layers: int, d: int) -> dict:
  rng = np.random.default_rng(0)
  return {"w": jnp.asarray(rng.normal(size=(num_layers, d, d)) / np.sqrt(d), jnp.float32),
          "b": jnp.asarray(rng.normal(size=(num_layers, d)) * 0.1, jnp.float32)}


RULES = partition.AxisRules([("layers", "stage"), ("batch", "data")])


def _programs(mesh, microbatches: int, repeats: int):
  def pipelined(params, x):
    with partition.axis_rules(RULES, mesh=mesh):
      y = partition.pipeline(layer, params, x, microbatches=microbatches, repeats=repeats)
    return jnp.mean(y ** 2)

  def sequential(params, x):
    y = jax.lax.scan(lambda h, lp: (layer(lp, h), None), x, params)[0]
    return jnp.mean(y ** 2)

  return jax.jit(jax.value_and_grad(pipelined)), jax.jit(jax.value_and_grad(sequential))


def _trip_counts(hlo: str) -> list[int]:
  return [int(n) for n in re.findall(r'"known_trip_count":\{"n":"(\d+)"', hlo)]


def _layers_leaving(plan) -> int:
  """Most layers one stage must send so the circular schedule finds each where it runs:
  the ``layers -> stage`` sharding stores contiguous blocks of ``L / p`` (0 for GPipe)."""
  per_stage = plan.num_layers // plan.stages
  return max(sum(1 for layer in range(a * per_stage, (a + 1) * per_stage)
                 if layer not in plan.stage_layers(a)) for a in range(plan.stages))


def run(quick: bool) -> Section:
  section = Section(NAME, TITLE)
  rows, d = (32, 32) if quick else (256, 256)
  for num_layers, p, r, m in CONFIGS:
    plan = partition.PipelineShape("stage", p, r, m, num_layers)
    workload = f"L={num_layers} p={p} r={r} m={m} B={rows} D={d}"
    log(f"  {workload}")
    mesh = auto_mesh((p, N // p), ("stage", "data"))
    flat = auto_mesh((N,), ("data",))
    params = _stack(num_layers, d)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(rows, d)), jnp.float32)
    total = sum(a.nbytes for a in jax.tree.leaves(params))
    with jax.set_mesh(mesh):
      placed = jax.device_put(params, NamedSharding(mesh, P("stage")))
      xs = jax.device_put(x, NamedSharding(mesh, P("data")))
      ours, _ = _programs(mesh, m, r)
      compiled = ours.lower(placed, xs).compile()
      result = ours(placed, xs)
    with jax.set_mesh(flat):
      flat_params = jax.device_put(params, NamedSharding(flat, P()))
      flat_x = jax.device_put(x, NamedSharding(flat, P("data")))
      _, baseline = _programs(flat, m, r)
      expected = baseline(flat_params, flat_x)
    section.check(workload, result, expected, rtol=1e-5, atol=1e-6)

    x_shard = x.nbytes // (N // p)
    param_bytes = memory(compiled)["argument"] - x_shard
    section.rows.append(Row(NAME, workload, "parameter bytes per device / (total / p)",
                            param_bytes, total / p, "bytes", PARAM_TARGET,
                            ours_label="pipeline", baseline_label="total / stages"))

    hlo = compiled.as_text()
    trips = _trip_counts(hlo)
    loop = max(trips) if trips else 0
    section.rows.append(Row(NAME, workload, "schedule loop trip count / (r m + p - 1)", loop,
                            plan.iterations, "iterations", 1.0, ours_label="HLO while",
                            baseline_label="r m + p - 1"))

    micro_bytes = (rows // m) // (N // p) * d * 4  # one micro-batch, this device's rows
    relayout = 2 * _layers_leaving(plan) * total / num_layers
    analytic = 2 * plan.iterations * micro_bytes + relayout
    permute = partition.collective_stats(compiled).bytes("collective-permute")
    note = ("" if r == 1 else f"analytic includes the circular relayout of the parameters "
            f"and gradients ({relayout / 1024:.1f} KiB)")
    section.rows.append(Row(NAME, workload, "collective-permute bytes / shift volume", permute,
                            analytic, "bytes", BYTES_TARGET, note, ours_label="pipeline",
                            baseline_label="2 (r m + p - 1) x micro-batch"))

    data = N // p
    once = 2 * (total / p) * (data - 1) / data
    reduced = partition.collective_stats(compiled, mesh).bytes("all-reduce", ("data",))
    section.rows.append(Row(NAME, workload, "gradient all-reduce bytes over data / once per "
                            "step", reduced, once, "bytes", BYTES_TARGET, ours_label="pipeline",
                            baseline_label="2 S (n-1)/n"))

    with jax.set_mesh(mesh):
      t_ours = steady_state([lambda: ours(placed, xs)], (),  # noqa: B023 (runs here)
                            repeats=5 if quick else 20)[0]
    with jax.set_mesh(flat):
      t_base = steady_state([lambda: baseline(flat_params, flat_x)], (),  # noqa: B023
                            repeats=5 if quick else 20)[0]
    section.rows.append(Row(NAME, workload, "step time / unpipelined (data x 8)", t_ours,
                            t_base, "s", None, CPU_TIME_NOTE, ours_label="pipeline",
                            baseline_label="data parallel"))
  return section


def plot_schedule(path: str, stages: int = 4, microbatches: int = 8, repeats: int = 2) -> None:
  """Draws GPipe and circular forward schedules (stage x iteration) to ``path`` (PNG)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  plans = [partition.PipelineShape("stage", stages, 1, microbatches, stages),
           partition.PipelineShape("stage", stages, repeats, microbatches, stages * repeats)]
  # x is time in units of one GPipe stage step (L/p layers): a circular cell applies
  # L/(p r) layers, so it is 1/r wide; the picture shows the shorter bubble directly.
  width = max(p.iterations / p.repeats for p in plans)
  fig, axes = plt.subplots(len(plans), 1, figsize=(0.5 * width + 1.5, 1.9 * len(plans) + 0.4))
  colors = plt.get_cmap("tab10")
  for ax, plan in zip(axes, plans):
    w = 1 / plan.repeats
    for t, step in enumerate(plan.schedule()):
      for s, cell in enumerate(step):
        if cell is None:
          ax.add_patch(plt.Rectangle((t * w, s), w, 1, color="0.92"))
          continue
        micro, rep = cell
        ax.add_patch(plt.Rectangle((t * w, s), w, 1, facecolor=colors(micro % 10),
                                   alpha=1.0 if rep == 0 else 0.55, edgecolor="white"))
        label = str(micro) if plan.repeats == 1 else f"{micro}{chr(ord('a') + rep)}"
        ax.text((t + 0.5) * w, s + 0.5, label, ha="center", va="center", fontsize=7)
    kind = ("GPipe, each cell L/p layers" if plan.repeats == 1 else
            f"circular, repeats={plan.repeats}, each cell L/({plan.repeats}p) layers")
    ax.set_title(f"{kind}: p={plan.stages}, m={plan.microbatches}, {plan.iterations} "
                 f"iterations, bubble {plan.bubble:.0%}", fontsize=10)
    ax.set_xlim(0, width)
    ax.set_ylim(plan.stages, 0)
    ax.set_yticks([s + 0.5 for s in range(plan.stages)],
                  [f"stage {s}" for s in range(plan.stages)])
    ax.set_xticks(range(int(width) + 1))
    ax.tick_params(axis="x", labelsize=7)
    ax.set_xlabel("time in GPipe stage steps (forward; the backward pass runs the grid "
                  "right to left)", fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


if __name__ == "__main__":
  import argparse

  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--plot", help="write the schedule picture to this PNG and exit")
  parser.add_argument("--quick", action="store_true")
  args = parser.parse_args()
  if args.plot:
    plot_schedule(args.plot)
  else:
    from benchmarks.common import setup_devices
    setup_devices()
    for row in run(args.quick).rows:
      print(f"{row.workload:32s} {row.metric:45s} {row.ours:12.4g} {row.baseline:12.4g} "
            f"{row.ratio:6.3f} {row.status} {row.note}")
