"""Each layer equals the framework's stock layer on identical weights (flax linen, Haiku).

The NNX wrappers are checked against the same flax linen stock layers: a wrapper's weights
are read out of it and loaded into the stock layer, so any difference in the math shows.
"""

import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import layers.haiku
import layers.linen
import layers.nnx
from layers import _core

KEY = jax.random.key(0)
X = jax.random.normal(jax.random.key(1), (2, 8, 16))
TOL = dict(rtol=1e-5, atol=1e-6)


def _close(a, b):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL)


def _randomize(tree, seed=7):
  """Random values in place of every leaf (so ones/zeros inits cannot hide a bug), at a
  scale that keeps activations O(1), where fp32 rounding is ~1e-7 relative."""
  leaves, treedef = jax.tree.flatten(tree)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return treedef.unflatten([0.25 * jax.random.normal(k, x.shape, x.dtype)
                            for k, x in zip(keys, leaves)])


# -- run a wrapper in each framework and return (output, its params as a plain dict) ---------


def _run_linen(module, *args):
  params = _randomize(nn.unbox(module.init(KEY, *args))["params"])
  return module.apply({"params": params}, *args), params


def _run_nnx(module, *args):
  graphdef, state = nnx.split(module)
  state = _randomize(state)
  module = nnx.merge(graphdef, state)
  return module(*args), nnx.to_pure_dict(nnx.state(module, nnx.Param))


def _run_haiku(fn, *args):
  f = hk.transform(fn)
  params = _randomize(f.init(KEY, *args))
  return f.apply(params, None, *args), params


# -- linen stock ----------------------------------------------------------------------------


def _dense_cases():
  rngs = nnx.Rngs(0)
  return {
      "linen": lambda feats, ax, bias: _run_linen(
          layers.linen.Dense(feats, ax, ("mlp",) * len(np.atleast_1d(feats)),
                             use_bias=bias), X),
      "nnx": lambda feats, ax, bias: _run_nnx(
          layers.nnx.Dense(X.shape[-1], feats, ax, ("mlp",) * len(np.atleast_1d(feats)),
                           use_bias=bias, rngs=rngs), X),
  }


@pytest.mark.parametrize("framework", ["linen", "nnx"])
@pytest.mark.slow
def test_dense_equals_nn_dense(framework):
  y, p = _dense_cases()[framework](24, ("embed",), True)
  ref = nn.Dense(24).apply({"params": {"kernel": p["kernel"], "bias": p["bias"]}}, X)
  _close(y, ref)


@pytest.mark.parametrize("framework", ["linen", "nnx"])
@pytest.mark.slow
def test_dense_general_equals_nn_dense_general(framework):
  y, p = _dense_cases()[framework]((4, 6), ("embed",), False)
  assert y.shape == (2, 8, 4, 6)
  ref = nn.DenseGeneral((4, 6), use_bias=False).apply({"params": {"kernel": p["kernel"]}}, X)
  _close(y, ref)


@pytest.mark.slow
def test_dense_contracting_two_dims_equals_dense_general():
  x = X.reshape(2, 8, 4, 4)
  module = layers.linen.Dense(5, ("heads", "head_dim"), ("embed",))
  y, p = _run_linen(module, x)
  ref = nn.DenseGeneral(5, axis=(-2, -1), use_bias=False).apply(
      {"params": {"kernel": p["kernel"]}}, x)
  _close(y, ref)


def _embed_module(framework):
  if framework == "linen":
    return lambda: _run_linen(layers.linen.Embed(32, 16), jnp.arange(16).reshape(2, 8))
  return lambda: _run_nnx(layers.nnx.Embed(32, 16, rngs=nnx.Rngs(0)),
                          jnp.arange(16).reshape(2, 8))


@pytest.mark.parametrize("framework", ["linen", "nnx"])
def test_embed_and_attend_equal_nn_embed(framework):
  y, p = _embed_module(framework)()
  stock = nn.Embed(32, 16)
  v = {"params": {"embedding": p["embedding"]}}
  _close(y, stock.apply(v, jnp.arange(16).reshape(2, 8)))
  if framework == "linen":
    logits = layers.linen.Embed(32, 16).apply({"params": p}, X, method="attend")
  else:
    module = layers.nnx.Embed(32, 16, rngs=nnx.Rngs(0))
    module.embedding[...] = p["embedding"]
    logits = module.attend(X)
  _close(logits, stock.apply(v, X, method="attend"))


@pytest.mark.parametrize("framework", ["linen", "nnx"])
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_norms_equal_flax_norms(framework, kind):
  if framework == "linen":
    module = layers.linen.RMSNorm() if kind == "rms" else layers.linen.LayerNorm()
    y, p = _run_linen(module, X)
  else:
    cls = layers.nnx.RMSNorm if kind == "rms" else layers.nnx.LayerNorm
    y, p = _run_nnx(cls(16, rngs=nnx.Rngs(0)), X)
  stock = nn.RMSNorm(epsilon=1e-6) if kind == "rms" else nn.LayerNorm(epsilon=1e-6)
  _close(y, stock.apply({"params": dict(p)}, X))


def _attention(framework, heads, kv_heads, head_dim):
  mask = nn.make_causal_mask(jnp.ones((2, 8)))
  if framework == "linen":
    module = layers.linen.Attention(heads, kv_heads, head_dim, use_rope=False)
    return (*_run_linen(module, X, mask), mask)
  module = layers.nnx.Attention(16, heads, kv_heads, head_dim, use_rope=False,
                                rngs=nnx.Rngs(0))
  return (*_run_nnx(module, X, mask), mask)


def _unfused(p):
  """Stock attention's separate query/key/value kernels from our fused ``qkv`` kernel."""
  q, k, v = _core.split_qkv(p["qkv"]["kernel"])
  return {"query": {"kernel": q}, "key": {"kernel": k}, "value": {"kernel": v},
          "out": {"kernel": p["out"]["kernel"]}}


@pytest.mark.parametrize("framework", ["linen", "nnx"])
@pytest.mark.slow
def test_attention_equals_flax_multi_head_attention(framework):
  y, p, mask = _attention(framework, 4, 4, 8)
  stock = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=32, out_features=16,
                                          use_bias=False)
  _close(y, stock.apply({"params": _unfused(p)}, X, X, mask=mask))


@pytest.mark.parametrize("framework", ["linen", "nnx"])
@pytest.mark.slow
def test_gqa_equals_mha_with_repeated_kv_heads(framework):
  y, p, mask = _attention(framework, 4, 2, 8)
  # Query heads 0,1 share kv head 0; 2,3 share kv head 1: repeat kv kernels per group.
  rep = lambda k: jnp.repeat(k, 2, axis=1)
  params = _unfused(p)
  params["key"]["kernel"] = rep(params["key"]["kernel"])
  params["value"]["kernel"] = rep(params["value"]["kernel"])
  stock = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=32, out_features=16,
                                          use_bias=False)
  _close(y, stock.apply({"params": params}, X, X, mask=mask))


# -- Haiku stock ----------------------------------------------------------------------------


def test_haiku_dense_equals_hk_linear():
  y, p = _run_haiku(lambda x: layers.haiku.Dense(24, use_bias=True, name="d")(x), X)
  ref = hk.transform(lambda x: hk.Linear(24, name="d")(x)).apply(
      {"d": {"w": p["d"]["kernel"], "b": p["d"]["bias"]}}, None, X)
  _close(y, ref)


def test_haiku_embed_equals_hk_embed():
  tokens = jnp.arange(16).reshape(2, 8)
  y, p = _run_haiku(lambda t: layers.haiku.Embed(32, 16, name="e")(t), tokens)
  ref = hk.transform(lambda t: hk.Embed(32, 16, name="e")(t)).apply(
      {"e": {"embeddings": p["e"]["embedding"]}}, None, tokens)
  _close(y, ref)


def test_haiku_norms_equal_hk_norms():
  y, p = _run_haiku(lambda x: layers.haiku.RMSNorm(name="n")(x), X)
  ref = hk.transform(lambda x: hk.RMSNorm(-1, eps=1e-6, name="n")(x)).apply(p, None, X)
  _close(y, ref)
  y, p = _run_haiku(lambda x: layers.haiku.LayerNorm(name="n")(x), X)
  ref = hk.transform(lambda x: hk.LayerNorm(-1, True, True, eps=1e-6, name="n")(x)).apply(
      {"n": {"scale": p["n"]["scale"], "offset": p["n"]["bias"]}}, None, X)
  _close(y, ref)


@pytest.mark.slow
def test_haiku_attention_equals_hk_multi_head_attention():
  mask = nn.make_causal_mask(jnp.ones((2, 8)))
  y, p = _run_haiku(lambda x, m: layers.haiku.Attention(4, 4, 8, use_rope=False,
                                                        name="a")(x, m), X, mask)
  unfused = _unfused({"qkv": p["a/qkv"], "out": p["a/out"]})
  flat = lambda k: unfused[k]["kernel"].reshape(16, 32)
  zeros = lambda n: jnp.zeros((n,))
  params = {f"mha/{k}": {"w": flat(k), "b": zeros(32)} for k in ("query", "key", "value")}
  params["mha/linear"] = {"w": p["a/out"]["kernel"].reshape(32, 16), "b": zeros(16)}
  stock = hk.transform(lambda x, m: hk.MultiHeadAttention(
      4, 8, w_init=hk.initializers.VarianceScaling(1.0), model_size=16, name="mha")(
          x, x, x, mask=m))
  _close(y, stock.apply(params, None, X, mask))


# -- parts with no stock layer: independent numpy references --------------------------------


@pytest.mark.parametrize("activation,act", [("silu", lambda v: v / (1 + np.exp(-v))),
                                            ("relu", lambda v: np.maximum(v, 0))])
@pytest.mark.slow
def test_gated_mlp_equals_numpy(activation, act):
  w = _randomize({"g": jnp.zeros((16, 32)), "u": jnp.zeros((16, 32)),
                  "o": jnp.zeros((32, 16))})
  y = _core.gated_mlp(X, jnp.stack([w["g"], w["u"]], axis=1), w["o"], activation=activation)
  x = np.asarray(X, np.float64)
  ref = (act(x @ np.asarray(w["g"])) * (x @ np.asarray(w["u"]))) @ np.asarray(w["o"])
  _close(y, ref)


@pytest.mark.slow
def test_rope_is_a_rotation_that_depends_on_relative_position():
  q = jax.random.normal(jax.random.key(2), (1, 8, 2, 8))
  k = jax.random.normal(jax.random.key(3), (1, 1, 2, 8))
  pos = jnp.arange(8)[None]
  rq = _core.rope(q, pos)
  _close(jnp.linalg.norm(rq, axis=-1), jnp.linalg.norm(q, axis=-1))
  # <rope(q, m), rope(k, n)> depends only on m - n: shift both positions by 5.
  same_q = jnp.broadcast_to(q[:, :1], q.shape)
  dots = lambda s: jnp.einsum("blhd,bhd->blh", _core.rope(same_q, pos + s),
                              _core.rope(jnp.broadcast_to(k, q.shape), pos * 0 + s)[:, 0])
  _close(dots(0), dots(5))
  # Independent reference: complex rotation of (x_i, x_{i+d/2}) pairs.
  x = np.asarray(q, np.float64)
  z = x[..., :4] + 1j * x[..., 4:]
  angle = np.arange(8)[None, :, None, None] * 10_000.0 ** (-np.arange(4) * 2 / 8)
  z = z * np.exp(1j * angle)
  _close(rq, np.concatenate([z.real, z.imag], axis=-1))
