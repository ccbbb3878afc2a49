"""Section 1: ``partition.xmap`` vs hand-written ``jit(vmap)`` / ``lax.scan`` programs.

Three workloads, each pair with the same shardings, dtypes and shapes, checked equal before
anything is timed; rows: steady-state time and trace+compile time (ratios xmap / baseline).

* ``mlp_dp``: ``jit(value_and_grad(xmap(loss, Mean('batch'), {'batch': 'data'})))`` on an
  (8,) mesh vs ``jit(value_and_grad(mean ∘ vmap(loss, spmd_axis_name='data')))`` with the
  same in/out shardings;
* ``mlp_tp``: a Megatron MLP, batch on ``data`` and hidden units on ``model`` of a (4, 2)
  mesh, the second layer a ``psum`` over ``hidden``, vs two nested
  ``vmap(axis_name=, spmd_axis_name=)``, batch outermost;
* ``pex_loop``: ``xmap(value_and_grad(loss), Mean('batch'), {'batch': ('data',
  SerialLoop(4))})`` vs the batch reshaped mesh-major, ``vmap(spmd_axis_name='data')`` over
  devices and a ``lax.scan`` over the 4 chunks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks.common import (
  Budget,
  Pair,
  Section,
  auto_mesh,
  example_loss,
  log,
  mlp_params,
  time_pair,
)
from partition import Mean, SerialLoop, xmap

NAME = "xmap_vs_vmap"
TITLE = "1. xmap vs hand-written jit(vmap) + shardings"

MLP_TP_NOTE = (
    "xmap nests its vmaps in the order axes first appear in in_axes ('hidden', from the "
    "params, before 'batch'), so intermediates are laid out [hidden, batch, ...]; a "
    "hand-written hidden-outer nesting is as slow, and xmap with 'batch' first is as fast")


def mlp_data_parallel(quick: bool) -> Pair:
  """value_and_grad of the mean loss of an MLP; batch sharded over an (8,) mesh."""
  n, d, h, o = (64, 32, 64, 8) if quick else (1024, 256, 512, 32)
  mesh = auto_mesh((8,), ("data",))
  rng = np.random.default_rng(0)
  rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  params = jax.device_put(mlp_params(rng, d, h, o), rep)
  x = jax.device_put(jnp.asarray(rng.normal(size=(n, d)), jnp.float32), rows)
  y = jax.device_put(jnp.asarray(rng.normal(size=(n, o)), jnp.float32), rows)

  def make():
    loss = xmap(lambda p, x, y: example_loss(p, x, y), ([...], ["batch", ...], ["batch", ...]),
                Mean("batch"), axis_resources={"batch": "data"}, mesh=mesh)
    ours = jax.jit(jax.value_and_grad(loss))

    def base_loss(p, x, y):
      per_example = jax.vmap(lambda p, x, y: example_loss(p, x, y), (None, 0, 0),
                             spmd_axis_name="data")
      return per_example(p, x, y).mean()

    base = jax.jit(jax.value_and_grad(base_loss), in_shardings=(rep, rows, rows),
                   out_shardings=rep)
    return ours, base

  return Pair("mlp_dp", f"MLP value_and_grad, batch {n} on mesh (8,) 'data'",
              make, (params, x, y), mesh)


def mlp_tensor_parallel(quick: bool) -> Pair:
  """Megatron-style MLP on a (4, 2) mesh: batch on 'data', hidden units on 'model', the
  second layer a psum over 'hidden'; value_and_grad of the mean loss."""
  n, d, h, o = (32, 32, 64, 8) if quick else (512, 256, 512, 32)
  mesh = auto_mesh((4, 2), ("data", "model"))
  rng = np.random.default_rng(1)
  shard = {"w1": NamedSharding(mesh, P(None, "model")), "b1": NamedSharding(mesh, P("model")),
           "w2": NamedSharding(mesh, P("model", None))}
  rows, rep = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
  params = jax.device_put(mlp_params(rng, d, h, o), shard)
  x = jax.device_put(jnp.asarray(rng.normal(size=(n, d)), jnp.float32), rows)
  y = jax.device_put(jnp.asarray(rng.normal(size=(n, o)), jnp.float32), rows)

  def unit(p, x, y):  # one example, one hidden unit: w1 [D], b1 [], w2 [O]
    hid = jnp.tanh(x @ p["w1"] + p["b1"])
    out = lax.psum(hid * p["w2"], "hidden")
    return jnp.sum((out - y) ** 2)

  def make():
    p_axes = {"w1": {1: "hidden"}, "b1": {0: "hidden"}, "w2": {0: "hidden"}}
    loss = xmap(unit, (p_axes, ["batch", ...], ["batch", ...]), Mean("batch"),
                axis_resources={"batch": "data", "hidden": "model"}, mesh=mesh)
    ours = jax.jit(jax.value_and_grad(loss))

    def base_loss(p, x, y):
      over_hidden = jax.vmap(unit, ({"w1": 1, "b1": 0, "w2": 0}, None, None), out_axes=None,
                             axis_name="hidden", spmd_axis_name="model")
      over_batch = jax.vmap(over_hidden, (None, 0, 0), axis_name="batch",
                            spmd_axis_name="data")
      return over_batch(p, x, y).mean()

    base = jax.jit(jax.value_and_grad(base_loss), in_shardings=(shard, rows, rows),
                   out_shardings=(rep, shard))
    return ours, base

  return Pair("mlp_tp", f"MLP value_and_grad, batch {n} on 'data', hidden {h} on 'model', "
              "mesh (4,2)", make, (params, x, y), mesh, notes={"steady": MLP_TP_NOTE})


def per_example_grads_loop(quick: bool, k: int = 4) -> Pair:
  """Mean of per-example value_and_grad, batch on ('data', SerialLoop(k)); the baseline is
  the same accumulation written by hand: vmap over devices, lax.scan over k chunks."""
  n, d, h, o = (64, 32, 64, 8) if quick else (512, 256, 512, 32)
  m = 8
  mesh = auto_mesh((m,), ("data",))
  rng = np.random.default_rng(2)
  rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  params = jax.device_put(mlp_params(rng, d, h, o), rep)
  x = jax.device_put(jnp.asarray(rng.normal(size=(n, d)), jnp.float32), rows)
  y = jax.device_put(jnp.asarray(rng.normal(size=(n, o)), jnp.float32), rows)
  c = n // (m * k)

  def make():
    vg = jax.value_and_grad(lambda p, x, y: example_loss(p, x, y))
    ours = xmap(vg, ([...], ["batch", ...], ["batch", ...]), Mean("batch"),
                axis_resources={"batch": ("data", SerialLoop(k))}, mesh=mesh)

    def base_fn(p, x, y):
      xr = x.reshape(m, k, c, *x.shape[1:])  # mesh-major: each device keeps its rows
      yr = y.reshape(m, k, c, *y.shape[1:])

      def per_device(xd, yd):  # [k, c, ...]
        def step(acc, xy):
          vals = jax.vmap(vg, (None, 0, 0))(p, *xy)
          return jax.tree_util.tree_map(lambda a, v: a + v.sum(0), acc, vals), None

        zero = (jnp.zeros((), jnp.float32), jax.tree_util.tree_map(jnp.zeros_like, p))
        acc, _ = lax.scan(step, zero, (xd, yd))
        return acc

      acc = jax.vmap(per_device, spmd_axis_name="data")(xr, yr)
      return jax.tree_util.tree_map(lambda a: a.sum(0) / n, acc)

    base = jax.jit(base_fn, in_shardings=(rep, rows, rows), out_shardings=rep)
    return ours, base

  return Pair("pex_loop", f"per-example value_and_grad, Mean over batch {n} on "
              f"('data', SerialLoop({k})), mesh (8,)", make, (params, x, y), mesh)


def run(quick: bool) -> Section:
  section = Section(NAME, TITLE)
  budget = Budget.of(quick)
  for w in (mlp_data_parallel(quick), mlp_tensor_parallel(quick),
            per_example_grads_loop(quick)):
    log(f"  {w.name}: {w.description}")
    time_pair(section, w, budget)
  return section
