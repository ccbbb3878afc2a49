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

A fourth row runs FSDP with 4 micro-batches (the minimum is the same: gather once, reduce
once). Ops in loop bodies count once per iteration (``known_trip_count``). The hand-written
``jax.jit`` program with the same shardings (a ``lax.scan`` over micro-batches with the
gradients constrained to the parameters' shardings, for k > 1) is measured the same way.
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
    "with k={k} micro-batches and every parameter sharded over the batch axis (FSDP), "
    "grad_reduction='auto' keeps the per-micro-batch schedule: the loop carry holds each "
    "gradient's 1/n shard, so every micro-batch's gradient is reduce-scattered (k x the "
    "reduction bytes; the all-gathers are hoisted out of the loop); grad_reduction='once' "
    "reduces once for a full-size carry per device (section 8, fsdp k=4 once); the "
    "hand-written scan with the same carry sharding does the same as 'auto'")


def loss(params, batch):
  x = batch["x"]
  for i in range(2):
    p = params[f"block_{i}"]
    x = x + partition.constrain(jnp.tanh(x @ p["w1"]), ("batch", "mlp")) @ p["w2"]
  return jnp.mean((x - batch["y"]) ** 2)


def analytic(strategy: str, n_params: int, b: int, d: int) -> float:
  frac = (N - 1) / N
  if strategy == "DP":
    return 2 * (n_params + 1) * 4 * frac
  if strategy == "FSDP":
    return 2 * n_params * 4 * frac + 2 * 4 * frac
  return 3 * 2 * b * d * 4 * frac


def strategy_programs(strategy: str, quick: bool, k: int = 1):
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
                                          microbatches=k))
  m = mesh.shape[axis] if rows.spec and rows.spec[0] else 1
  by_hand = micro_scan(loss, k, m, shard, rows) if k > 1 else jax.value_and_grad(loss)

  def base_fn(params, batch):
    with partition.axis_rules(rules, mesh):
      return by_hand(params, batch)

  base = jax.jit(base_fn, in_shardings=(shard, rows),
                 out_shardings=(NamedSharding(mesh, P()), shard))
  n_params = sum(x.size for x in jax.tree.leaves(params))
  return mesh, ours, base, (params, batch), n_params, (b, d)


def run(quick: bool) -> Section:
  section = Section(NAME, TITLE)
  series = {}
  for strategy, k in [(s, 1) for s in STRATEGIES] + [("FSDP", 4)]:
    mesh, ours, base, args, n_params, (b, d) = strategy_programs(strategy, quick, k)
    with jax.set_mesh(mesh):
      section.check(strategy + (f" k={k}" if k > 1 else ""), ours(*args), base(*args))
      c_ours, c_base = (partition.collective_stats(f.lower(*args).compile(), mesh)
                        for f in (ours, base))
    minimum = analytic(strategy, n_params, b, d)
    label = strategy + (f" k={k}" if k > 1 else "")
    workload = f"{label} P={n_params / 1e6:.2f}M B={b} D={d}"
    log(f"  {workload}: {_ops(c_ours)}")
    note = MICRO_NOTE.format(k=k) if k > 1 else ""
    wire = c_ours.total_bytes
    section.rows.append(Row(NAME, workload, f"collective bytes/device vs analytic ({_ops(c_ours)})",
                            wire, minimum, "bytes", BYTES_TARGET,
                            note if wire / minimum > BYTES_TARGET else "",
                            baseline_label="analytic minimum"))
    section.rows.append(Row(NAME, workload, f"collective bytes/device vs hand-written jit "
                            f"({_ops(c_base)})", wire, c_base.total_bytes, "bytes",
                            BYTES_TARGET))
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

