"""Section 3: ``partition.value_and_grad`` (FSDP+TP, k micro-batches) vs the same step by hand.

The hand-written step is what a user would write without this library: ``jax.jit`` with the
params' shardings, the batch split into ``k`` strided micro-batches (rows ``j, j+k, ...`` of
each device's block, so no row moves), and a ``lax.scan`` accumulating value and gradients
constrained to the params' shardings. Rows: steady-state time, trace+compile time, temp
memory (``memory_analysis``), for k = 1, 4, 8 on a (2, 2, 2) ``(data, fsdp, tensor)`` mesh.

Then the micro-batch overhead of a ``layers`` Transformer step (bf16 compute, fp32 params, one
device), from XLA's ``cost_analysis()`` of the compiled programs (XLA counts a loop body
once, so the ``k``-micro-batch program reads as the bytes of one micro-step plus what runs
once around the loop): its bytes beyond one ``k = 1`` step on the micro-batch alone, per
parameter, against the floor (the fp32 accumulator read and written per micro-step, zeroed
and divided by ``k`` once), and against the same loop written by hand (``lax.scan``); and
the work of a step that does not depend on the batch (the weights' bf16 casts, their
gradients' fp32 writes), which ``k`` micro-steps repeat ``k`` times.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import partition
from benchmarks.common import Budget, Pair, Section, auto_mesh, log, mlp_params, time_pair

NAME = "accumulation"
TITLE = "3. partition.value_and_grad (FSDP+TP, k micro-batches) vs jit + lax.scan"
RULES = partition.AxisRules([("batch", ("data", "fsdp")), ("embed", "fsdp"), ("mlp", "tensor")])
AXES = {"w1": ("embed", "mlp"), "b1": ("mlp",), "w2": ("mlp", "embed")}


def loss(p, b):
  return jnp.mean((jnp.tanh(b["x"] @ p["w1"] + p["b1"]) @ p["w2"] - b["y"]) ** 2)


def fsdp_tp_accumulation(quick: bool, k: int) -> Pair:
  n, d, h = (64, 32, 64) if quick else (256, 256, 512)
  mesh = auto_mesh((2, 2, 2), ("data", "fsdp", "tensor"))
  rng = np.random.default_rng(3)
  p = mlp_params(rng, d, h, d)
  shard = {name: NamedSharding(mesh, RULES.spec(a, p[name].shape, mesh))
           for name, a in AXES.items()}
  rows, rep = NamedSharding(mesh, P(("data", "fsdp"))), NamedSharding(mesh, P())
  params = jax.device_put(p, shard)
  batch = {"x": jax.device_put(jnp.asarray(rng.normal(size=(n, d)), jnp.float32), rows),
           "y": jax.device_put(jnp.asarray(rng.normal(size=(n, d)), jnp.float32), rows)}
  m = 4  # devices along the batch: data x fsdp

  def make():
    ours = jax.jit(partition.value_and_grad(
        loss, batch_axes=("batch", "embed"), param_axes=AXES, rules=RULES, mesh=mesh,
        microbatches=k))

    def base_fn(p, b):
      def micro(x):  # micro-batch j = rows j, j+k, ... of each device's block
        x = x.reshape(m, n // (m * k), k, *x.shape[1:])
        return jnp.moveaxis(x, 2, 0).reshape(k, n // k, *x.shape[3:])

      def step(acc, mb):
        mb = lax.with_sharding_constraint(mb, {"x": rows, "y": rows})
        value, grads = jax.value_and_grad(loss)(p, mb)
        grads = lax.with_sharding_constraint(grads, shard)
        return jax.tree_util.tree_map(jnp.add, acc, (value, grads)), None

      zero = (jnp.zeros((), jnp.float32),
              lax.with_sharding_constraint(jax.tree_util.tree_map(jnp.zeros_like, p), shard))
      (value, grads), _ = lax.scan(step, zero, jax.tree_util.tree_map(micro, b))
      return value / k, jax.tree_util.tree_map(lambda g: g / k, grads)

    base = jax.jit(base_fn, in_shardings=(shard, {"x": rows, "y": rows}),
                   out_shardings=(rep, shard))
    return ours, base

  return Pair(f"fsdp_tp k={k}", f"FSDP+TP MLP, batch {n} in {k} micro-batch(es), mesh (2,2,2)",
              make, (params, batch), mesh)


def transformer_microstep_bytes(quick: bool, k: int = 4) -> dict:
  """Bytes and FLOPs (``cost_analysis``) of a layers Transformer's value-and-grad at ``k``
  micro-batches against ``k = 1`` on the whole batch and on one micro-batch."""
  import layers
  import layers.linen

  cfg = layers.TransformerConfig(
      vocab_size=256, embed_dim=64 if quick else 256, mlp_dim=128 if quick else 1024,
      num_heads=4, num_kv_heads=2, head_dim=16 if quick else 64, num_layers=2,
      max_len=1024, dtype="bfloat16", param_dtype="float32",
      scan_layers=False)  # no loop over layers: XLA would count one layer
  batch, length = 8, 128
  model = layers.linen.Transformer(cfg)
  params = partition.unbox(model.init(jax.random.key(0), jnp.zeros((1, length), jnp.int32)))
  n = sum(x.size for x in jax.tree_util.tree_leaves(params))

  def loss(p, b):
    logp = jax.nn.log_softmax(model.apply(p, b["tokens"]).astype(jnp.float32)[:, :-1])
    return -jnp.mean(jnp.take_along_axis(logp, b["tokens"][:, 1:, None], -1))

  def ours(k):
    return partition.value_and_grad(loss, batch_axes={"tokens": ("batch", "length")},
                                    param_axes=jax.tree_util.tree_map(lambda _: None, params),
                                    microbatches=k)

  def by_hand(p, b):  # rows j, j+k, ... as micro-batch j, as value_and_grad cuts them
    mb = jax.tree_util.tree_map(lambda x: jnp.moveaxis(x.reshape(-1, k, *x.shape[1:]), 1, 0), b)

    def step(acc, m):
      return jax.tree_util.tree_map(jnp.add, acc, jax.value_and_grad(loss)(p, m)), None

    zero = (jnp.zeros((), jnp.float32), jax.tree_util.tree_map(jnp.zeros_like, p))
    total, _ = lax.scan(step, zero, mb)
    return jax.tree_util.tree_map(lambda x: x / k, total)

  def cost(f, rows):
    tokens = {"tokens": jnp.zeros((rows, length), jnp.int32)}
    c = jax.jit(f).lower(params, tokens).compile().cost_analysis()
    c = c[0] if isinstance(c, (list, tuple)) else c
    return float(c["bytes accessed"]), float(c["flops"])

  whole, micro = cost(ours(1), batch), cost(ours(1), batch // k)
  looped, hand = cost(ours(k), batch), cost(by_hand, batch)
  # What k = 1 does once per step whatever the batch (the weights' casts, their gradients'
  # writes, ...): the part of k single steps on 1/k of the batch beyond one whole step.
  fixed = (k * micro[0] - whole[0]) / (k - 1)
  return {"k": k, "params": n, "batch": batch, "length": length,
          "bytes_k1": whole[0], "bytes_k1_microbatch": micro[0], "bytes_ours_loop": looped[0],
          "bytes_hand_loop": hand[0], "flops_ours_loop": looped[1],
          "flops_k1_microbatch": micro[1],
          "extra_bytes_per_param": (looped[0] - micro[0]) / n,
          "hand_extra_bytes_per_param": (hand[0] - micro[0]) / n,
          # the fp32 accumulator: read + written per micro-step (8 B), zeroed (4 B) and
          # divided by k (read + write, 8 B) once
          "floor_bytes_per_param": 8 + 4 + 8,
          "step_fixed_bytes_per_param": fixed / n,
          # the weights' bf16 casts alone: read fp32 (4 B) + write bf16 (2 B)
          "cast_bytes_per_param": 6}


def _log_microstep(m: dict) -> None:
  log(f"  layers Transformer ({m['params']} params, batch {m['batch']} x {m['length']}), "
      f"k={m['k']}, XLA cost_analysis: the loop program's bytes beyond one k=1 step on the "
      f"micro-batch: {m['extra_bytes_per_param']:.1f} B/param (a hand-written lax.scan: "
      f"{m['hand_extra_bytes_per_param']:.1f}; the accumulator floor: "
      f"{m['floor_bytes_per_param']} B/param); FLOPs of the loop program / one micro-step: "
      f"{m['flops_ours_loop'] / m['flops_k1_microbatch']:.4f}")
  log(f"  batch-independent bytes of one step (k single steps on 1/k of the batch beyond one "
      f"whole step): {m['step_fixed_bytes_per_param']:.1f} B/param, repeated per micro-step "
      f"(on CPU: the weights' bf16 casts, {m['cast_bytes_per_param']} B/param, and the "
      "weight gradients' transposes into the parameters' layouts)")


def run(quick: bool) -> Section:
  section = Section(NAME, TITLE)
  budget = Budget.of(quick)
  for k in ((4,) if quick else (1, 4, 8)):
    w = fsdp_tp_accumulation(quick, k)
    log(f"  {w.name}: {w.description}")
    time_pair(section, w, budget, memory_row=True)
  section.series["transformer_microstep_bytes"] = m = transformer_microstep_bytes(quick)
  _log_microstep(m)
  return section
