"""Section 3: ``partition.value_and_grad`` (FSDP+TP, k micro-batches) vs the same step by hand.

The hand-written step is what a user would write without this library: ``jax.jit`` with the
params' shardings, the batch split into ``k`` strided micro-batches (rows ``j, j+k, ...`` of
each device's block, so no row moves), and a ``lax.scan`` accumulating value and gradients
constrained to the params' shardings. Rows: steady-state time, trace+compile time, temp
memory (``memory_analysis``), for k = 1, 4, 8 on a (2, 2, 2) ``(data, fsdp, tensor)`` mesh.
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


def run(quick: bool) -> Section:
  section = Section(NAME, TITLE)
  budget = Budget.of(quick)
  for k in ((4,) if quick else (1, 4, 8)):
    w = fsdp_tp_accumulation(quick, k)
    log(f"  {w.name}: {w.description}")
    time_pair(section, w, budget, memory_row=True)
  return section
