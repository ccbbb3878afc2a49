"""A mistake in what attention is given is a clear error naming the argument, its shape and
the shape expected, from the Transformer of each framework and from the attention functions;
never a broadcasting error from deep inside JAX or a ZeroDivisionError."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from layers_testlib import FRAMEWORKS, TOKENS, build, config

import layers
from layers import _core


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("kw,names", [
    ({"valid": np.ones((4, 5), bool)}, ["valid has shape (4, 5)", "(4, 8)"]),
    ({"valid": np.ones((8, 4), bool)}, ["valid has shape (8, 4)", "(4, 8)"]),
    ({"valid": np.full((3,), 8, np.int32)}, ["valid has shape (3,)", "(4,)"]),
    ({"valid": np.full((4,), 8.0)}, ["valid has dtype float", "integer"]),
    ({"valid": np.ones((4, 8, 1), bool)}, ["valid has shape (4, 8, 1)"]),
    ({"segment_ids": np.ones((4, 7), np.int32)}, ["segment_ids has shape (4, 7)", "(4, 8)"]),
    ({"segment_ids": np.ones((4, 8), np.float32)}, ["segment_ids has dtype float32",
                                                    "integer"]),
])
def test_a_transformer_given_a_mask_that_does_not_fit_its_tokens_names_it(framework, kw, names):
  model = build(framework, config())
  with pytest.raises(layers.LayerArgumentError, match="bad mask") as e:
    model.apply(model.params, TOKENS, **kw)
  for name in names:
    assert name in str(e.value)
  assert "Pass valid=" in str(e.value)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_the_mask_forms_the_transformer_documents_are_accepted(framework):
  """An HF-style int (batch, length) attention mask is a padding mask like the bool one."""
  model = build(framework, config())
  valid = np.ones((4, 8), bool)
  valid[:, 6:] = False
  want = model.apply(model.params, TOKENS, valid=valid)
  got = model.apply(model.params, TOKENS, valid=valid.astype(np.int64))
  np.testing.assert_allclose(np.asarray(got[0] if isinstance(got, tuple) else got),
                             np.asarray(want[0] if isinstance(want, tuple) else want),
                             rtol=1e-6, atol=1e-6)
  lengths = model.apply(model.params, TOKENS, valid=np.full((4,), 6, np.int32))
  full = lambda out: np.asarray(out[0] if isinstance(out, tuple) else out)[:, :6]
  np.testing.assert_allclose(full(lengths), full(want), rtol=1e-6, atol=1e-6)


def _qkv(b=2, length=8, heads=4, kv_heads=2, d=16, kv_length=None):
  ks = jax.random.split(jax.random.key(0), 3)
  kv_length = length if kv_length is None else kv_length
  return (jax.random.normal(ks[0], (b, length, heads, d)),
          jax.random.normal(ks[1], (b, kv_length, kv_heads, d)),
          jax.random.normal(ks[2], (b, kv_length, kv_heads, d)))


Q, K, V = _qkv()


@pytest.mark.parametrize("args,says", [
    ((Q[0], K, V), "q has shape (8, 4, 16); expected (batch, q_length, heads, head_dim)"),
    ((Q, K[..., :1, :], V[..., :1, :]), None),  # 4 heads on 1 kv head: legal, no error
    ((Q, jnp.ones((2, 8, 3, 16)), jnp.ones((2, 8, 3, 16))),
     "heads=4 is not a multiple of kv_heads=3"),
    ((Q, jnp.ones((2, 8, 2, 8)), jnp.ones((2, 8, 2, 8))), "head_dim 16 of q and 8 of k"),
    ((Q, jnp.ones((3, 8, 2, 16)), jnp.ones((3, 8, 2, 16))), "batch 2 of q and 3 of k"),
    ((Q, K, V[:, :7]), "k has shape (2, 8, 2, 16) and v (2, 7, 2, 16)"),
])
@pytest.mark.parametrize("implementation", ["auto", "xla", "blockwise"])
def test_attention_inputs_that_do_not_fit_together_are_named(args, says, implementation):
  if says is None:
    out = _core.dot_product_attention(*args, layers.Mask(), implementation=implementation)
    assert out.shape == Q.shape
    return
  with pytest.raises(layers.AttentionError, match="do not fit") as e:
    _core.dot_product_attention(*args, layers.Mask(), implementation=implementation)
  assert says in str(e.value)


@pytest.mark.parametrize("mask,says", [
    (layers.Mask(valid=jnp.ones((2, 5), bool)), "mask.valid has shape (2, 5); expected (2, 8)"),
    (layers.Mask(lengths=jnp.ones((3,), jnp.int32)), "mask.lengths has shape (3,); expected (2,)"),
    (layers.Mask(lengths=jnp.ones((2,))), "mask.lengths has dtype float32"),
    (layers.Mask(segment_ids=jnp.ones((2, 8, 1), jnp.int32)),
     "mask.segment_ids has shape (2, 8, 1); expected (2, 8)"),
    (jnp.ones((3, 1, 8, 8), bool), "the dense mask has shape (3, 1, 8, 8)"),
])
def test_a_mask_that_does_not_fit_the_queries_is_named(mask, says):
  implementation = "xla" if not isinstance(mask, layers.Mask) else "blockwise"
  with pytest.raises(layers.AttentionError, match="do not fit") as e:
    _core.dot_product_attention(Q, K, V, mask, implementation=implementation)
  assert says in str(e.value)


def test_a_padding_mask_across_queries_and_keys_of_different_lengths_is_refused():
  q, k, v = _qkv(length=4, kv_length=8)
  with pytest.raises(layers.AttentionError, match="one valid array for queries and keys"):
    _core.dot_product_attention(q, k, v, layers.Mask(valid=jnp.ones((2, 8), bool)),
                                implementation="xla")
  # Lengths count the same real tokens of both sides: legal.
  out = _core.dot_product_attention(q, k, v, layers.Mask(causal=False, lengths=jnp.array([3, 4])),
                                    implementation="blockwise", block=4)
  ref = _core.dot_product_attention(q, k, v, layers.Mask(causal=False, lengths=jnp.array([3, 4])),
                                    implementation="xla")
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("block", [0, -4, 2.5, True])
@pytest.mark.parametrize("fn", ["dot_product_attention", "blockwise_attention"])
def test_a_block_that_is_not_a_positive_int_is_named(fn, block):
  with pytest.raises(layers.AttentionError, match=f"block={block!r} must be a positive int"):
    if fn == "blockwise_attention":
      layers.blockwise_attention(Q, K, V, layers.Mask(), block=block)
    else:
      layers.dot_product_attention(Q, K, V, layers.Mask(), implementation="blockwise", block=block)
