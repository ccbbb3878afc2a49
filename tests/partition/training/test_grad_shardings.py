"""Gradients keep their parameters' shardings: every ``grad_reduction``, with and without
``param_axes``, micro-batched or not, over a T5X-style decoder and every preset's table.

The parameters here are plain arrays placed by ``partition.flax.init_sharded`` (T5X's
``param_with_axes`` puts the names in a separate ``params_axes`` collection, so the tree
itself carries none): without ``param_axes`` the only record of a parameter's layout is its
own ``.sharding``. The reference for the values is ``jax.value_and_grad`` on one device.
"""

import flax.core
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.linen import partitioning as nn_partitioning
from jax.sharding import AxisType, NamedSharding

import partition
import partition.flax
from recipes import config as recipes_config

SCHEDULES = ("auto", "per_microbatch", "once")
# T5X's standard_logical_axis_rules(activation_partitioning_dims=1,
# parameter_partitioning_dims=2), written out: the 2-D layout puts 'embed' on 'data' (FSDP
# over the batch's own mesh axis) and 'mlp' / 'heads' / 'vocab' on 'model'.
T5X_RULES = [
    ("batch", "data"), ("vocab", "model"), ("mlp", "model"), ("heads", "model"),
    ("kv", None), ("joined_kv", "model"), ("embed", "data"),
    ("relpos_buckets", None), ("abspos_buckets", None), ("length", None), ("layers", None),
    ("stack", None), ("mlp_activations", None),
]
VOCAB, EMBED, HEADS, HEAD_DIM, MLP, BUCKETS = 16, 8, 2, 4, 16, 8
INIT = nn.initializers.normal(0.3)


class DenseGeneral(nn.Module):
  """T5X's DenseGeneral: a kernel over the last ``len(axis)`` dims, named by kernel_axes."""

  features: tuple
  kernel_axes: tuple
  contract: int = 1

  @nn.compact
  def __call__(self, x):
    shape = x.shape[x.ndim - self.contract:] + self.features
    kernel = nn_partitioning.param_with_axes("kernel", INIT, shape, axes=self.kernel_axes)
    dims = tuple(range(x.ndim - self.contract, x.ndim)), tuple(range(self.contract))
    return jax.lax.dot_general(x, kernel, (dims, ((), ())))


class RMSNorm(nn.Module):
  @nn.compact
  def __call__(self, x):
    scale = nn_partitioning.param_with_axes("scale", nn.initializers.ones, (x.shape[-1],),
                                            axes=("embed",))
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale


class DecoderLayer(nn.Module):
  """The shape of T5X's decoder block: pre-norm self-attention with relative position
  biases, then a pre-norm gated MLP."""

  @nn.compact
  def __call__(self, x):
    length = x.shape[1]
    y = RMSNorm(name="pre_self_attention_layer_norm")(x)
    q, k, v = (DenseGeneral((HEADS, HEAD_DIM), ("embed", "heads", "kv"), name=n)(y)
               for n in ("query", "key", "value"))
    rel = nn_partitioning.param_with_axes("rel_embedding", INIT, (HEADS, BUCKETS),
                                          axes=("heads", "relpos_buckets"))
    pos = jnp.clip(jnp.arange(length)[None, :] - jnp.arange(length)[:, None], 0, BUCKETS - 1)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) + rel[:, pos][None]
    causal = jnp.tril(jnp.ones((length, length), bool))
    weights = jax.nn.softmax(jnp.where(causal, logits, -1e9), axis=-1)
    attended = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
    x = x + DenseGeneral((EMBED,), ("heads", "kv", "embed"), contract=2, name="out")(attended)
    y = RMSNorm(name="pre_mlp_layer_norm")(x)
    gate = DenseGeneral((MLP,), ("embed", "mlp"), name="wi_0")(y)
    up = DenseGeneral((MLP,), ("embed", "mlp"), name="wi_1")(y)
    return x + DenseGeneral((EMBED,), ("mlp", "embed"), name="wo")(nn.gelu(gate) * up)


class Decoder(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    embedding = nn_partitioning.param_with_axes("token_embedder", INIT, (VOCAB, EMBED),
                                                axes=("vocab", "embed"))
    x = embedding[tokens]
    x = DecoderLayer(name="layers_0")(x)
    x = RMSNorm(name="decoder_norm")(x)
    return DenseGeneral((VOCAB,), ("embed", "vocab"), name="logits_dense")(x)


MODEL = Decoder()


def decoder_loss(params, batch):
  logits = MODEL.apply({"params": params}, batch["inputs"])
  labels = jax.nn.one_hot(batch["targets"], VOCAB)
  return -jnp.mean(jnp.sum(labels * jax.nn.log_softmax(logits), -1))


def _batch(rows=16, length=4):
  rng = np.random.default_rng(0)
  return {"inputs": rng.integers(0, VOCAB, (rows, length), dtype=np.int32),
          "targets": rng.integers(0, VOCAB, (rows, length), dtype=np.int32)}


def assert_grads_like_params(grads, params, reference):
  flat = jax.tree_util.tree_leaves_with_path(grads)
  assert len(flat) == len(jax.tree.leaves(params)) > 0
  for (path, g), p, ref in zip(flat, jax.tree.leaves(params), jax.tree.leaves(reference)):
    assert g.sharding.is_equivalent_to(p.sharding, p.ndim), (
        jax.tree_util.keystr(path), g.sharding.spec, p.sharding.spec)
    np.testing.assert_allclose(g, ref, rtol=2e-4, atol=2e-6, err_msg=jax.tree_util.keystr(path))


@pytest.fixture(scope="module")
def t5x():
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  rules = partition.AxisRules(T5X_RULES)
  batch = _batch()
  with jax.set_mesh(mesh), partition.axis_rules(rules, mesh):
    variables = partition.flax.init_sharded(MODEL, jax.random.key(0), batch["inputs"])
  params = variables["params"]
  names = nn_partitioning.get_axis_names(variables["params_axes"])
  param_axes = jax.tree.map(tuple, flax.core.unfreeze(names),
                            is_leaf=lambda x: isinstance(x, jax.P))
  host = jax.tree.map(np.asarray, params)
  reference = jax.value_and_grad(decoder_loss)(host, batch)
  return mesh, rules, params, param_axes, batch, reference


def test_t5x_params_are_laid_out_2d_as_t5x_lays_them_out(t5x):
  mesh, _, params, *_ = t5x
  # An independent reference for the layout itself: flax's resolver over T5X's rules.
  abstract = jax.eval_shape(MODEL.init, jax.random.key(0), _batch()["inputs"])
  names = nn_partitioning.get_axis_names(abstract["params_axes"])
  want = nn.logical_to_mesh_sharding(names, mesh, T5X_RULES)
  for p, w in zip(jax.tree.leaves(params),
                  jax.tree.leaves(want, is_leaf=lambda x: isinstance(x, NamedSharding))):
    assert p.sharding.is_equivalent_to(w, p.ndim)
  specs = {p.sharding.spec for p in jax.tree.leaves(params)}
  assert {jax.P("data", "model"), jax.P("model", "data"), jax.P("data")} <= specs


@pytest.mark.parametrize("with_param_axes", [False, True], ids=["no_param_axes", "param_axes"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_t5x_microbatched_grads_keep_the_params_shardings(t5x, schedule, with_param_axes):
  mesh, rules, params, param_axes, batch, (ref_loss, ref_grads) = t5x
  with jax.set_mesh(mesh), partition.axis_rules(rules, mesh):
    step = partition.value_and_grad(
        decoder_loss, batch_axes=("batch", "length"), rules=rules, mesh=mesh, microbatches=2,
        grad_reduction=schedule, param_axes=param_axes if with_param_axes else None)
    loss, grads = step(params, batch)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_grads_like_params(grads, params, ref_grads)


def test_t5x_grads_keep_the_params_shardings_without_microbatches(t5x):
  mesh, rules, params, _, batch, (_, ref_grads) = t5x
  with jax.set_mesh(mesh), partition.axis_rules(rules, mesh):
    step = partition.value_and_grad(decoder_loss, batch_axes=("batch", "length"))
    _, grads = step(params, batch)
  assert_grads_like_params(grads, params, ref_grads)


def test_inside_jit_without_axes_auto_keeps_the_shardings_and_once_says_why_not(t5x):
  # Inside the caller's jit a parameter on Auto axes is a tracer whose type shows no
  # sharding: 'auto' leaves such gradients to propagation from the parameter (the
  # per-micro-batch loop); 'once' cannot put them back, and says so.
  mesh, rules, params, _, batch, (_, ref_grads) = t5x
  with jax.set_mesh(mesh), partition.axis_rules(rules, mesh):
    step = partition.value_and_grad(decoder_loss, batch_axes=("batch", "length"),
                                    microbatches=2)
    _, grads = jax.jit(step)(params, batch)
    assert_grads_like_params(grads, params, ref_grads)
    once = partition.value_and_grad(decoder_loss, batch_axes=("batch", "length"),
                                    microbatches=2, grad_reduction="once")
    with pytest.raises(partition.GradSpecError,
                       match=r"(?s)shardings of some parameters are unknown.*"
                             r"params\['layers_0'\]\['wo'\]\['kernel'\].*Give param_axes="):
      jax.jit(once)(params, batch)


# Every preset's table on its README mesh, over a model whose params are plain arrays placed
# by the table (no axes declared anywhere the step could read them).
PRESET_PARAM_AXES = {"embedding": ("vocab", "embed"), "scale": ("embed",),
                     "wi": ("embed", "mlp"), "wo": ("mlp", "embed"),
                     "query": ("embed", "heads", "head_dim")}


def preset_loss(params, batch):
  x = params["embedding"][batch["inputs"]] * params["scale"]
  q = jnp.einsum("ble,ehd->blhd", x, params["query"])
  x = x + jnp.einsum("blhd,ehd->ble", jnp.tanh(q), params["query"])
  x = x + jnp.tanh(x @ params["wi"]) @ params["wo"]
  logits = x @ params["embedding"].T
  labels = jax.nn.one_hot(batch["targets"], VOCAB)
  return -jnp.mean(jnp.sum(labels * jax.nn.log_softmax(logits), -1))


@pytest.mark.slow
@pytest.mark.parametrize("preset", sorted(recipes_config.PRESET_MESHES))
def test_every_preset_keeps_grad_shardings_in_every_schedule(preset):
  sizes = recipes_config.PRESET_MESHES[preset]
  mesh = jax.make_mesh(tuple(sizes.values()), tuple(sizes),
                       axis_types=(AxisType.Auto,) * len(sizes))
  rules = recipes_config.preset_rules(preset)
  rng = np.random.default_rng(1)
  shapes = {"embedding": (VOCAB, EMBED), "scale": (EMBED,), "wi": (EMBED, MLP),
            "wo": (MLP, EMBED), "query": (EMBED, HEADS, HEAD_DIM)}
  host = {n: np.asarray(rng.normal(size=s) / 3, np.float32) for n, s in shapes.items()}
  params = {n: jax.device_put(p, NamedSharding(mesh, rules.spec(PRESET_PARAM_AXES[n], p.shape,
                                                                 mesh)))
            for n, p in host.items()}
  batch = _batch(rows=32, length=4)
  ref_loss, ref_grads = jax.value_and_grad(preset_loss)(host, batch)
  loops = recipes_config.serial_loops(rules)
  assert any(p.sharding.spec != jax.P() for p in params.values()) or preset == "microbatch"
  for schedule in SCHEDULES:
    step = partition.value_and_grad(preset_loss, batch_axes=("batch", "length"), rules=rules,
                                    mesh=mesh, microbatches=None if loops else 2,
                                    grad_reduction=schedule)
    loss, grads = step(params, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, err_msg=schedule)
    assert_grads_like_params(grads, params, ref_grads)
