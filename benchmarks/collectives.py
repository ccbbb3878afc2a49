"""Section 7: HLO collective bytes per training step vs the analytic minimum.

A two-block residual MLP (``x + W2 tanh(W1 x)`` twice, no biases, ``P`` parameters) takes
one ``partition.value_and_grad`` step on an 8-device mesh under each strategy; the compiled
HLO is read by ``partition.collective_stats``: every all-reduce / all-gather /
reduce-scatter / all-to-all / collective-permute, converted to the bytes one device sends
with ring algorithms (all-reduce ``2 S (n-1)/n``, all-gather and reduce-scatter
``S (n-1)/n`` of the full array ``S``); XLA:CPU's all-reduce + dynamic-slice counts as the
reduce-scatter it stands for. The analytic minimum per strategy, ``n = 8``, 4-byte
floats:

* DP (batch on ``data``): one all-reduce of the gradients and the loss:
  ``2 (P + 1) 4 (n-1)/n``;
* FSDP (batch and ``embed`` on ``fsdp``): all-gather the weights once, reduce-scatter the
  gradients, all-reduce the loss: ``2 P 4 (n-1)/n + 2 * 4 (n-1)/n``;
* TP (``mlp`` on ``tensor``, batch replicated): Megatron's per-layer all-reduces of the
  ``[B, D]`` activations, forward one per block and backward one per block whose input
  needs a gradient (the second): ``3 * 2 B D 4 (n-1)/n``.

With ``k`` micro-batches FSDP has two schedules, and the minimum depends on the memory each
keeps (``S = 4 P`` bytes of parameters, ``f = (n-1)/n``):

* per micro-batch (``grad_reduction='auto'`` for parameters sharded over the batch axis):
  the gradient carry is each device's ``1/n`` shard, so every micro-batch's gradient must
  leave the device before the next one is added: ``k`` reduce-scatters, ``k S f``. The
  weights are all-gathered once, before the loop, and kept for all ``k`` micro-batches
  (forward and backward): ``S f``. The loss is all-reduced per micro-batch. Minimum
  ``(1 + k) S f + k * 2 * 4 f`` (with ``k = 4``: 2.5 x the one-batch figure). ZeRO-3
  proper, which also frees the gathered weights between uses, would gather twice per
  micro-batch (forward and backward): ``(2k + k) S f``; keeping them costs ``S (n-1)/n``
  more parameter memory per device, which XLA spends here;
* once (``grad_reduction='once'``): each device accumulates its rows' gradients in a
  full-size carry (``S (n-1)/n`` more memory per device than the shard) and one
  reduce-scatter follows the loop: ``2 S f + 2 * 4 f``, the one-batch figure.

``'auto'`` does not trade that memory for traffic by itself: it cannot know the memory
budget, and the full-size carry doubles the gradient memory the gathered weights already
take. Both rows are measured against their own minimum. Ops in loop bodies count once per
iteration (``known_trip_count``). The hand-written ``jax.jit`` program with the same
shardings (a ``lax.scan`` over micro-batches with the gradients constrained to the
parameters' shardings, for k > 1) is measured the same way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import partition
from benchmarks.common import BYTES_TARGET, Row, Section, auto_mesh, log
from benchmarks.train_step import micro_scan

NAME = "collectives"
TITLE = "7. HLO collective bytes per step vs the analytic minimum"
N = 8
AXES = {f"block_{i}": {"w1": ("embed", "mlp"), "w2": ("mlp", "embed")} for i in range(2)}
STRATEGIES = {
    "DP": ("data", [("batch", "data")]),
    "FSDP": ("fsdp", [("batch", "fsdp"), ("embed", "fsdp")]),
    "TP": ("tensor", [("mlp", "tensor")]),
}
MICRO_NOTE = (
    "grad_reduction='auto' with k={k} micro-batches: every parameter is sharded over the "
    "batch axis, so the carry is each gradient's 1/n shard and every micro-batch's gradient "
    "is reduce-scattered; the weights are gathered once, before the loop, and kept. "
    "Analytic: (1 + k) S (n-1)/n + k loss all-reduces (ZeRO-3 that frees the gathered "
    "weights: (3k) S (n-1)/n)")
ONCE_NOTE = (
    "grad_reduction='once' with k={k}: a full-size gradient carry per device (S (n-1)/n more "
    "memory than the shard) and one reduce-scatter after the loop. Analytic: 2 S (n-1)/n + "
    "one loss all-reduce, the k=1 figure; the hand-written scan reduces per micro-batch")


def loss(params, batch):
  x = batch["x"]
  for i in range(2):
    p = params[f"block_{i}"]
    x = x + partition.constrain(jnp.tanh(x @ p["w1"]), ("batch", "mlp")) @ p["w2"]
  return jnp.mean((x - batch["y"]) ** 2)


def analytic(strategy: str, n_params: int, b: int, d: int, k: int = 1,
             grad_reduction: str = "auto") -> float:
  """The fewest bytes one device sends per step (module docstring): for FSDP with ``k > 1``
  per micro-batch, one gather of the kept weights and ``k`` reduce-scatters into the
  ``1/n`` carry; once, the one-batch figure."""
  frac = (N - 1) / N
  if strategy == "DP":
    return 2 * (n_params + 1) * 4 * frac
  if strategy == "FSDP":
    reductions = 1 if grad_reduction == "once" else k
    return (1 + reductions) * n_params * 4 * frac + reductions * 2 * 4 * frac
  return 3 * 2 * b * d * 4 * frac


def strategy_programs(strategy: str, quick: bool, k: int = 1, grad_reduction: str = "auto"):
  axis, pairs = STRATEGIES[strategy]
  b, d, h = (32, 32, 64) if quick else (256, 512, 1024)
  mesh = auto_mesh((N,), (axis,))
  rules = partition.AxisRules(pairs)
  rng = np.random.default_rng(7)
  params = {k: {"w1": jnp.asarray(rng.normal(size=(d, h)) / np.sqrt(d), jnp.float32),
                "w2": jnp.asarray(rng.normal(size=(h, d)) / np.sqrt(h), jnp.float32)}
            for k in AXES}
  shard = rules.tree_shardings(AXES, mesh, shapes=params)
  rows = NamedSharding(mesh, rules.spec(("batch", "embed"), (b, d), mesh))
  params = jax.device_put(params, shard)
  batch = jax.device_put({"x": jnp.asarray(rng.normal(size=(b, d)), jnp.float32),
                          "y": jnp.asarray(rng.normal(size=(b, d)), jnp.float32)}, rows)
  ours = jax.jit(partition.value_and_grad(loss, batch_axes=("batch", "embed"),
                                          param_axes=AXES, rules=rules, mesh=mesh,
                                          microbatches=k, grad_reduction=grad_reduction))
  m = mesh.shape[axis] if rows.spec and rows.spec[0] else 1
  by_hand = micro_scan(loss, k, m, shard, rows) if k > 1 else jax.value_and_grad(loss)

  def base_fn(params, batch):
    with partition.axis_rules(rules, mesh):
      return by_hand(params, batch)

  base = jax.jit(base_fn, in_shardings=(shard, rows),
                 out_shardings=(NamedSharding(mesh, P()), shard))
  n_params = sum(x.size for x in jax.tree.leaves(params))
  return mesh, ours, base, (params, batch), n_params, (b, d)


CASES = [(s, 1, "auto") for s in STRATEGIES] + [("FSDP", 4, "auto"), ("FSDP", 4, "once")]


def run(quick: bool) -> Section:
  section = Section(NAME, TITLE)
  series = {}
  for strategy, k, grad_reduction in CASES:
    mesh, ours, base, args, n_params, (b, d) = strategy_programs(strategy, quick, k,
                                                                 grad_reduction)
    label = strategy + (f" k={k}" if k > 1 else "") + (
        f" {grad_reduction}" if grad_reduction != "auto" else "")
    with jax.set_mesh(mesh):
      section.check(label, ours(*args), base(*args))
      c_ours, c_base = (partition.collective_stats(f.lower(*args).compile(), mesh)
                        for f in (ours, base))
    minimum = analytic(strategy, n_params, b, d, k, grad_reduction)
    workload = f"{label} P={n_params / 1e6:.2f}M B={b} D={d}"
    log(f"  {workload}: {_ops(c_ours)}")
    note = (ONCE_NOTE if grad_reduction == "once" else MICRO_NOTE).format(k=k) if k > 1 else ""
    wire = c_ours.total_bytes
    section.rows.append(Row(NAME, workload, f"collective bytes/device vs analytic ({_ops(c_ours)})",
                            wire, minimum, "bytes", BYTES_TARGET, note,
                            baseline_label="analytic minimum"))
    section.rows.append(Row(NAME, workload, f"collective bytes/device vs hand-written jit "
                            f"({_ops(c_base)})", wire, c_base.total_bytes, "bytes",
                            BYTES_TARGET))
    if grad_reduction == "auto":  # the plot's series: one bar group per strategy
      series[label] = {"ours": wire, "hand_written": c_base.total_bytes,
                       "analytic": minimum, "ops_ours": _counts(c_ours),
                       "ops_hand_written": _counts(c_base)}
  section.series["collective_bytes"] = series
  return section


def _counts(stats) -> dict[str, int]:
  out: dict[str, int] = {}
  for op in stats.ops:
    out[op.kind] = out.get(op.kind, 0) + op.count
  return out


def _ops(c) -> str:
  return ", ".join(f"{n} {op}" for op, n in _counts(c).items()) or "none"

