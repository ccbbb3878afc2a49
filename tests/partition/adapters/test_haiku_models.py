"""partition.haiku on real Haiku code: a transformer in the style of dm-haiku's
examples/transformer/model.py (unrolled and in hk.layer_stack) and stock hk.nets.ResNet with
transform_with_state. Every param/state value is compared with plain f.init, every sharding with
flax's own resolver on the same table, and apply outputs with single-device runs."""

import contextlib
import dataclasses
import functools
import re

import flax.linen as nn
import haiku as hk
import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from mesh_testlib import make_mesh

import partition
import partition.haiku


def _layer_norm(x):
  return hk.LayerNorm(axis=-1, create_scale=True, create_offset=True)(x)


@dataclasses.dataclass
class Transformer(hk.Module):
  """A transformer stack: attention + MLP blocks, unrolled or in an hk.layer_stack."""

  num_heads: int
  num_layers: int
  attn_size: int
  dropout_rate: float
  widening_factor: int = 4
  stacked: bool = False
  name: str | None = None

  def __call__(self, embeddings, mask, is_training):
    initializer = hk.initializers.VarianceScaling(2 / self.num_layers)
    _, seq_len, model_size = embeddings.shape
    mask = mask[:, None, None, :]
    mask = mask * np.tril(np.ones((1, 1, seq_len, seq_len)))
    rate = self.dropout_rate if is_training else 0.0

    def block(h):
      attn = hk.MultiHeadAttention(num_heads=self.num_heads, key_size=self.attn_size,
                                   model_size=model_size, w_init=initializer)
      h_norm = _layer_norm(h)
      h_attn = attn(h_norm, h_norm, h_norm, mask=mask)
      if rate:
        h_attn = hk.dropout(hk.next_rng_key(), rate, h_attn)
      h = h + h_attn
      dense = hk.Sequential([hk.Linear(self.widening_factor * model_size, w_init=initializer),
                             jax.nn.gelu, hk.Linear(model_size, w_init=initializer)])
      h_dense = dense(_layer_norm(h))
      if rate:
        h_dense = hk.dropout(hk.next_rng_key(), rate, h_dense)
      return h + h_dense

    h = embeddings
    if self.stacked:
      h = hk.layer_stack(self.num_layers)(block)(h)
    else:
      for _ in range(self.num_layers):
        h = block(h)
    return _layer_norm(h)


@dataclasses.dataclass
class LanguageModel(hk.Module):
  transformer: Transformer
  model_size: int
  vocab_size: int
  pad_token: int
  name: str | None = None

  def __call__(self, tokens, is_training):
    input_mask = tokens != self.pad_token
    _, seq_len = tokens.shape
    embed_init = hk.initializers.TruncatedNormal(stddev=0.02)
    token_embeddings = hk.Embed(self.vocab_size, embed_dim=self.model_size,
                                w_init=embed_init)(tokens)
    positional = hk.get_parameter('positional_embeddings', [seq_len, self.model_size],
                                  init=embed_init)
    embeddings = self.transformer(token_embeddings + positional, input_mask, is_training)
    return hk.Linear(self.vocab_size)(embeddings)


def lm(tokens, is_training, stacked=False):
  t = Transformer(num_heads=2, num_layers=2, attn_size=4, dropout_rate=0.1, stacked=stacked)
  return LanguageModel(t, model_size=8, vocab_size=16, pad_token=0)(tokens, is_training)


# -- the rule table and path tables (FSDP + TP on a (data, fsdp, tensor) mesh) ----------------

RULES = [("batch", "data"), ("embed", "fsdp"), ("heads", "tensor"), ("mlp", "tensor"),
         ("vocab", "tensor"), ("layers", None), ("length", None)]

LM_TABLE = [
    (r"^language_model/linear/w$", ("embed", "vocab")),
    (r"^language_model/linear/b$", ("vocab",)),
    (r"embed/embeddings$", ("vocab", "embed")),
    (r"positional_embeddings$", (None, "embed")),
    (r"multi_head_attention(_\d+)?/(query|key|value)/w$", ("embed", "heads")),
    (r"multi_head_attention(_\d+)?/(query|key|value)/b$", ("heads",)),
    (r"multi_head_attention(_\d+)?/linear/w$", ("heads", "embed")),
    (r"multi_head_attention(_\d+)?/linear/b$", ("embed",)),
    (r"transformer/(.*/)?linear(_2)?/w$", ("embed", "mlp")),
    (r"transformer/(.*/)?linear(_2)?/b$", ("mlp",)),
    (r"transformer/(.*/)?linear_[13]/w$", ("mlp", "embed")),
    (r"/(scale|offset|b)$", ("embed",)),
]

# Activation constraints on stock modules, by module path (the MLP's hidden layer, the
# attention output projection, the logits).
# Inside hk.layer_stack module paths are relative to the stacked function ('linear').
OUTPUTS = {r"multi_head_attention(_\d+)?/linear$": ("batch", "length", "embed"),
           r"^(transformer/)?linear(_2)?$": ("batch", "length", "mlp"),
           r"^language_model/linear$": ("batch", "length", "vocab")}


def expected_axes(path, shape, table, stacked_dims):
  """Logical axes by re.search over the path (the test's own reading of the table); params
  under hk.layer_stack get 'layers' for their leading stacked dims."""
  for pattern, axes in table:
    if re.search(pattern, path):
      if axes is None:
        return None
      lead = stacked_dims if "__layer_stack" in path else 0
      assert len(axes) + lead == len(shape), (path, axes, shape)
      return ("layers",) * lead + tuple(axes)
  return None


def assert_placed_like_flax(tree, table, mesh, stacked_dims=0):
  """Every leaf's sharding equals flax's logical_to_mesh_axes on the same rules."""
  checked = 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    name = "/".join(str(k.key) for k in path)
    axes = expected_axes(name, leaf.shape, table, stacked_dims)
    spec = P() if axes is None else nn.logical_to_mesh_axes(axes, RULES)
    want = NamedSharding(mesh, spec)
    assert leaf.sharding.is_equivalent_to(want, leaf.ndim), (name, leaf.sharding.spec, spec)
    checked += 1
  return checked


def assert_same_values(tree, ref):
  assert jax.tree.structure(tree) == jax.tree.structure(ref)
  for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(ref)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


TOKENS = np.array([[3, 5, 7, 0], [1, 2, 9, 4], [6, 6, 0, 0], [8, 1, 3, 5]], np.int32)


def _lm_fn(stacked, inside):
  def fn(tokens, is_training):
    with contextlib.ExitStack() as stack:
      if inside:  # annotate inside the transform (custom creator + getter)
        stack.enter_context(partition.haiku.param_axes_from(LM_TABLE))
      stack.enter_context(partition.haiku.constrain_outputs(OUTPUTS))
      return lm(tokens, is_training, stacked=stacked)
  return fn


@functools.cache
def _plain_init(stacked):
  """Plain Haiku ``init`` at key 0, outside init_sharded and without the path table (which
  only records axes): one reference per stack kind for both ways of annotating (its eager
  hk.layer_stack scans compile anew on each call)."""
  return hk.transform(_lm_fn(stacked, inside=False)).init(jax.random.key(0), TOKENS, True)


@pytest.mark.parametrize("stacked", [False, True], ids=["unrolled", "layer_stack"])
@pytest.mark.parametrize("inside", [False, True], ids=["param_axes", "param_axes_from"])
@pytest.mark.slow
@pytest.mark.bitwise  # Haiku's eager init against a jitted, sharded one
def test_transformer_init_sharded_on_explicit_mesh(stacked, inside):
  f = hk.transform(_lm_fn(stacked, inside))
  mesh = make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), AxisType.Explicit)
  rng = jax.random.key(0)
  params = partition.haiku.init_sharded(f, rng, TOKENS, True, rules=RULES, mesh=mesh,
                                        param_axes=None if inside else LM_TABLE)
  n = assert_placed_like_flax(params, LM_TABLE, mesh, stacked_dims=1)
  assert n == (22 if stacked else 38)
  assert_same_values(params, _plain_init(stacked))  # independent: plain Haiku init
  # Something is really sharded (not everything replicated).
  w = params["transformer/multi_head_attention/query" if not stacked else
             "transformer/__layer_stack_no_per_layer/multi_head_attention/query"]["w"]
  assert w.addressable_shards[0].data.size == w.size // 4


@pytest.mark.parametrize("stacked", [False, True], ids=["unrolled", "layer_stack"])
@pytest.mark.slow
def test_transformer_apply_matches_single_device(stacked):
  f = hk.transform(_lm_fn(stacked, inside=True))
  mesh = make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), AxisType.Auto)
  rng = jax.random.key(1)
  params = partition.haiku.init_sharded(f, rng, TOKENS, False, rules=RULES, mesh=mesh)
  ref_params = f.init(rng, TOKENS, False)
  ref = f.apply(ref_params, None, TOKENS, False)  # one device, no rules: constraints no-op
  apply = jax.jit(f.apply, static_argnums=3)
  with partition.axis_rules(RULES, mesh):
    lowered = apply.lower(params, None, TOKENS, False)
    out = apply(params, None, TOKENS, False)
  text = lowered.as_text()
  # Each output constraint and each annotated param shows up as a sharding constraint.
  n_layers = 1 if stacked else 2
  assert text.count("sharding_constraint") >= 3 * n_layers + 1 + 10
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-6)


# -- hk.nets.ResNet with state (BatchNorm EMAs) and an is_training flag ---------------------

RESNET_TABLE = [
    (r"initial_conv/w$", (None, None, None, "mlp")),
    (r"conv(_\d+)?/w$", (None, None, "embed", "mlp")),
    (r"logits/w$", ("embed", "vocab")),
    (r"logits/b$", ("vocab",)),
    (r"/(scale|offset)$", (None, None, None, "mlp")),
    (r"_ema/(average|hidden)$", (None, None, None, "mlp")),
    (r"_ema/counter$", None),
]


def resnet(images, is_training):
  net = hk.nets.ResNet(blocks_per_group=(1, 1, 1, 1), num_classes=4, bottleneck=False,
                       channels_per_group=(8, 8, 8, 8), initial_conv_config={
                           "output_channels": 8}, strides=(1, 2, 1, 1))
  return net(images, is_training)


IMAGES = np.random.RandomState(0).normal(size=(4, 8, 8, 3)).astype(np.float32)


@pytest.mark.slow
@pytest.mark.bitwise  # Haiku's eager init against a jitted, sharded one
def test_resnet_params_and_state_sharded_by_the_table():
  f = hk.transform_with_state(resnet)
  mesh = make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), AxisType.Explicit)
  rng = jax.random.key(0)
  params, state = partition.haiku.init_sharded(f, rng, IMAGES, True, rules=RULES, mesh=mesh,
                                               param_axes=RESNET_TABLE)
  assert assert_placed_like_flax(params, RESNET_TABLE, mesh) == 41
  assert assert_placed_like_flax(state, RESNET_TABLE, mesh) == 78
  ref_params, ref_state = f.init(rng, IMAGES, True)
  assert_same_values(params, ref_params)  # drawn from the same keys: bit-identical
  # BatchNorm's EMAs start from the first batch's statistics: computed, so float-close.
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  ema = state["res_net/~/initial_batchnorm/~/mean_ema"]["average"]
  assert ema.sharding.spec == P(None, None, None, "tensor")  # state is not replicated


@pytest.mark.slow
def test_resnet_apply_matches_single_device():
  f = hk.transform_with_state(resnet)
  mesh = make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), AxisType.Auto)
  rng = jax.random.key(0)
  params, state = partition.haiku.init_sharded(f, rng, IMAGES, True, rules=RULES, mesh=mesh,
                                               param_axes=RESNET_TABLE)
  ref_params, ref_state = f.init(rng, IMAGES, True)
  x = jax.device_put(IMAGES, NamedSharding(mesh, P("data")))
  apply = jax.jit(f.apply, static_argnums=4)
  for is_training in (True, False):
    ref_out, ref_new = f.apply(ref_params, ref_state, None, IMAGES, is_training)
    with partition.axis_rules(RULES, mesh):
      out, new = apply(params, state, None, x, is_training)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=1e-5, atol=1e-5)
    # BatchNorm's statistics are sums over the batch, split across devices here: an entry
    # near zero carries the rounding of its O(1) tensor, so atol scales with the tensor.
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(ref_new)):
      b = np.asarray(b)
      np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-5 * np.abs(b).max())
