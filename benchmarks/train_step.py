"""Section 6: a training step of the layers Transformer under each preset vs flax + ``jit``.

For every preset in ``recipes/presets/*.yaml`` (data_parallel, fsdp, fsdp_tp, microbatch)
the same small ``layers.linen.Transformer`` takes one AdamW step on next-token cross-entropy:

* ours: params from ``partition.flax.init_sharded``, optimizer state from
  ``partition.optimizer_init``, gradients from ``partition.value_and_grad`` (which also runs
  the preset's micro-batch loop), all inside one ``jax.jit``;
* hand-written: the flax way, ``nn.logical_to_mesh_sharding(nn.get_partition_spec(...))``
  for the params, ``jax.jit(step, in_shardings=..., out_shardings=...)`` and
  ``jax.value_and_grad`` (a ``lax.scan`` over strided micro-batches for the microbatch
  preset), with gradients constrained to the params' shardings.

Both trace under the same rules context, so the model's activation constraints are the
same; both get the same arrays. Checked: the flax shardings equal ours, and the loss and
the new optimizer moments agree (Adam's normalised update would amplify float noise in
near-zero gradients, so the moments, linear and quadratic in the gradients, are compared).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import layers
import layers.linen
import partition
import partition.flax
from benchmarks.common import Budget, Check, Pair, Section, auto_mesh, flax_rules, log, time_pair

NAME = "train_step"
TITLE = "6. train step per preset: layers Transformer + partition vs flax + jit"
PRESETS = Path(__file__).resolve().parents[1] / "recipes" / "presets"
MESHES = {
    "data_parallel": ((8,), ("data",)),
    "fsdp": ((2, 4), ("data", "fsdp")),
    "fsdp_tp": ((2, 2, 2), ("data", "fsdp", "tensor")),
    "microbatch": ((8,), ("data",)),
}
BATCH_AXES = ("batch", "length")
K1_NOTE = (
    "real, 4-6% on every k=1 preset: the compiled executables alone run 1.02-1.06x on a "
    "quieter machine; value_and_grad keeps a size-1 micro-batch dim at k=1 (a vmap of size 1), "
    "which changes the HLO's layouts (4/24/39 more copies for data_parallel/fsdp/fsdp_tp, a "
    "pad of the embedding-gradient scatter indices); same collectives and memory. Fix "
    "requested in partition/_training/grad.py: no micro-batch xmap when k=1")


def config(quick: bool) -> layers.TransformerConfig:
  if quick:
    return layers.TransformerConfig(vocab_size=64, embed_dim=16, mlp_dim=32, num_heads=2,
                                    num_kv_heads=2, head_dim=8, num_layers=1)
  return layers.TransformerConfig(vocab_size=512, embed_dim=128, mlp_dim=512, num_heads=4,
                                  num_kv_heads=2, head_dim=32, num_layers=2)


def presets() -> list[str]:
  """The presets that exist (and that this section knows a mesh for)."""
  return [p.stem for p in sorted(PRESETS.glob("*.yaml")) if p.stem in MESHES]


def cross_entropy(model):
  def loss(params, batch):
    logits = model.apply({"params": params}, batch["tokens"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
  return loss


def micro_scan(loss, k: int, m: int, grad_shardings, row_sharding):
  """By hand: value_and_grad accumulated over k strided micro-batches (rows j, j+k, ... of
  each of the m devices' blocks) in a lax.scan, gradients kept in their shardings."""
  def value_and_grad(params, batch):
    def micro(x):
      n = x.shape[0]
      x = x.reshape(m, n // (m * k), k, *x.shape[1:])
      return jnp.moveaxis(x, 2, 0).reshape(k, n // k, *x.shape[3:])

    def step(acc, mb):
      mb = lax.with_sharding_constraint(mb, row_sharding)
      value, grads = jax.value_and_grad(loss)(params, mb)
      grads = lax.with_sharding_constraint(grads, grad_shardings)
      return jax.tree.map(jnp.add, acc, (value, grads)), None

    zero = (jnp.zeros((), jnp.float32),
            lax.with_sharding_constraint(jax.tree.map(jnp.zeros_like, params), grad_shardings))
    (value, grads), _ = lax.scan(step, zero, jax.tree.map(micro, batch))
    return value / k, jax.tree.map(lambda g: g / k, grads)
  return value_and_grad


def sharded_inputs(model, tokens, tx, rules, mesh):
  """Ours: ``(params, param axes, AdamW state, batch, the batch's sharding)``, params from
  ``init_sharded``, the state from ``optimizer_init``, ``tokens[:, :-1]`` -> ``[:, 1:]``."""
  variables = partition.flax.init_sharded(model, jax.random.key(0), tokens[:, :-1],
                                          rules=rules, mesh=mesh)
  axes = partition.logical_axes(variables)["params"]
  params = nn.unbox(variables)["params"]
  opt_state = partition.optimizer_init(tx, params, param_axes=axes, rules=rules, mesh=mesh)
  rows = NamedSharding(mesh, rules.spec(BATCH_AXES, tokens[:, :-1].shape, mesh))
  batch = jax.device_put({"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}, rows)
  return params, axes, opt_state, batch, rows


def preset_pair(name: str, quick: bool, section: Section) -> Pair:
  rules = partition.AxisRules.from_file(PRESETS / f"{name}.yaml")
  mesh = auto_mesh(*MESHES[name])
  cfg = config(quick)
  model = layers.linen.Transformer(cfg)
  n, length = 32, (8 if quick else 32)
  rng = np.random.default_rng(6)
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (n, length + 1)), jnp.int32)
  tx = optax.adamw(1e-3)
  loss = cross_entropy(model)

  params, axes, opt_state, batch, rows = sharded_inputs(model, tokens, tx, rules, mesh)
  batch_spec = rows.spec

  # The flax way to the params' shardings, checked equal to ours.
  with partition.axis_rules(rules, mesh):
    abstract = jax.eval_shape(model.init, jax.random.key(0), tokens[:, :-1])
  shard = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh,
                                      flax_rules(rules))["params"]
  same = [s.spec for s in jax.tree.leaves(shard)] == \
         [x.sharding.spec for x in jax.tree.leaves(params)]
  section.checks.append(Check(NAME, f"{name}: flax shardings equal ours", 0.0 if same else
                              float("inf"), 0.0, 0.0, same))
  opt_shard = jax.tree.map(lambda x: x.sharding, opt_state)
  rep = NamedSharding(mesh, P())
  k = rules.serial_loops.get("batch", partition.SerialLoop(1)).length  # micro-batches
  m = int(np.prod([mesh.shape[a] for a in jax.tree.leaves(tuple(batch_spec))]))

  def make():
    vg = partition.value_and_grad(loss, batch_axes=BATCH_AXES, param_axes=axes, rules=rules,
                                  mesh=mesh)

    def ours(params, opt_state, batch):
      value, grads = vg(params, batch)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, value

    base_vg = (micro_scan(loss, k, m, shard, rows) if k > 1 else jax.value_and_grad(loss))

    def base(params, opt_state, batch):
      value, grads = base_vg(params, batch)
      grads = lax.with_sharding_constraint(grads, shard)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, value

    return jax.jit(ours), jax.jit(base, in_shardings=(shard, opt_shard, rows),
                                  out_shardings=(shard, opt_shard, rep))

  @contextlib.contextmanager
  def context():
    with jax.set_mesh(mesh), partition.axis_rules(rules, mesh):
      yield

  n_params = sum(x.size for x in jax.tree.leaves(params))
  micro = f", {k} micro-batches" if k > 1 else ""
  return Pair(name, f"Transformer {n_params / 1e6:.2f}M params, batch {n}x{length}, mesh "
              f"{MESHES[name][0]}{micro}, AdamW", make, (params, opt_state, batch), mesh,
              notes={"steady": K1_NOTE} if k == 1 else {}, context=context)


def _compared(out):
  """Loss and optimizer moments of a step's output (see the module docstring)."""
  _, opt_state, value = out
  return value, opt_state


def run(quick: bool) -> Section:
  section = Section(NAME, TITLE)
  budget = Budget.of(quick)
  if not quick:
    budget = Budget(20, 2, 3)
  names = presets()
  if quick:  # the one that exercises the most: the preset's micro-batch loop
    names = [n for n in names if n == "microbatch"]
  for name in names:
    w = preset_pair(name, quick, section)
    log(f"  {name}: {w.description}")
    time_pair(section, w, budget, compare=_compared)
  return section
