"""Transformers in linen, NNX and Haiku: same logits, logical axes, masks, scan and remat."""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from layers_testlib import (
    FRAMEWORKS,
    TARGETS,
    TOKENS,
    VOCAB,
    build,
    canonical_axes,
    config,
    value_and_grad,
)

import layers
import partition
import partition.haiku
from layers._canonical import _value, canonical_name

# Two programs computing the same float32 values (scanned vs unrolled, remat, other framework)
# differ only in how XLA fuses and reassociates the sums. Each output element is a sum of
# terms as large as the output's largest magnitude, so its rounding error is a few float32
# ulps of that magnitude, not of the element itself (logits near 0 get the same absolute
# error as the largest ones): atol = 16 ulps x max|expected|, rtol for the large elements.
ULPS = 16


def _close(a, b):
  b = np.asarray(b)
  atol = ULPS * np.finfo(np.float32).eps * max(float(np.abs(b).max()), 1e-30)
  np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=atol)


def _close_trees(a, b):
  assert sorted(a) == sorted(b)
  for name in a:
    _close(a[name], b[name])


# (scanned, dense) is implied: unrolled dense logits agree across frameworks here, and
# test_scanned_equals_unrolled checks scanned == unrolled within each framework.
@pytest.mark.parametrize("scan,experts", [(False, 0), (False, 4), (True, 4)])
@pytest.mark.slow
def test_three_frameworks_give_the_same_logits_from_canonical_weights(scan, experts):
  cfg = config(scan_layers=scan, num_experts=experts)
  models = {f: build(f, cfg, seed=i) for i, f in enumerate(FRAMEWORKS)}
  weights = layers.to_canonical(models["linen"].params)
  ref = models["linen"].apply(models["linen"].params, TOKENS)
  for name in ("nnx", "haiku"):
    m = models[name]
    assert sorted(layers.to_canonical(m.params)) == sorted(weights)
    params = layers.from_canonical(weights, like=m.params)
    _close(m.apply(params, TOKENS), ref)


def _axes(framework, cfg):
  m = build(framework, cfg)
  if framework == "haiku":
    return partition.haiku.eval_axes(m.init, jax.random.key(0), TOKENS), m.params
  return partition.logical_axes(m.params), m.params


def _framework_shapes(params):
  """``{name: shape}`` under the framework's own (fused) names, blocks stacked: the names
  ``canonical_axes`` reads the axes under."""
  layer_counts, shapes = {}, {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(
      params, is_leaf=lambda x: hasattr(x, "unbox") or hasattr(x, "get_value"))[0]:
    parts = [q for k in path
             for q in str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
             .split("/")]
    name, index = canonical_name(parts)
    shapes[name] = np.shape(_value(leaf))
    if index is not None:
      layer_counts[name] = layer_counts.get(name, 0) + 1
  return {n: (layer_counts[n], *s) if n in layer_counts else s for n, s in shapes.items()}


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.slow
def test_every_parameter_has_logical_axes_of_the_right_rank(scan):
  cfg = config(scan_layers=scan, num_experts=4)
  per_framework = {}
  for framework in FRAMEWORKS:
    axes, params = _axes(framework, cfg)
    shapes = _framework_shapes(params)
    named = canonical_axes(axes)
    assert sorted(named) == sorted(shapes), framework
    for name, a in named.items():
      assert a is not None and len(a) == len(shapes[name]), (framework, name, a)
      assert set(a) - {None} <= set(VOCAB), (framework, name, a)   # None: fused q/k/v, gate/up
      assert (a[0] == "layers") == name.startswith("blocks/"), (framework, name, a)
    per_framework[framework] = named
  assert per_framework["linen"] == per_framework["nnx"] == per_framework["haiku"]
  named = per_framework["linen"]
  # Canonical names are unfused; the axes are those of the fused framework params.
  assert named["blocks/attn/qkv/kernel"] == ("layers", "embed", "kv_heads", None, "head_dim")
  assert named["blocks/moe/wi"] == ("layers", "expert", "embed", None, "mlp")
  assert named["embed/embedding"] == ("vocab", "embed")


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.slow
def test_changing_a_future_token_never_changes_earlier_logits(framework):
  m = build(framework, config())
  logits = m.apply(m.params, TOKENS)
  changed = m.apply(m.params, TOKENS.at[:, 5].set((TOKENS[:, 5] + 1) % 64))
  _close(changed[:, :5], logits[:, :5])
  assert np.abs(np.asarray(changed[:, 5:] - logits[:, 5:])).min(axis=-1).max() > 1e-4


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_padding_mask_hides_padded_tokens(framework):
  m = build(framework, config())
  valid = jnp.arange(8)[None, :] >= 3            # left padding: positions 0..2 are pads
  valid = jnp.broadcast_to(valid, TOKENS.shape)
  logits = m.apply(m.params, TOKENS, valid=valid)
  other = m.apply(m.params, TOKENS.at[:, :3].set(7), valid=valid)
  _close(other[:, 3:], logits[:, 3:])
  unmasked = m.apply(m.params, TOKENS.at[:, :3].set(7))
  assert np.abs(np.asarray(unmasked[:, 3:] - logits[:, 3:])).max() > 1e-4


def _value_and_canonical_grad(m, params):
  loss, grads = value_and_grad(m)(params, TOKENS, TARGETS)
  return loss, layers.to_canonical(grads)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.slow
def test_scanned_equals_unrolled(framework):
  unrolled, scanned = build(framework, config()), build(framework, config(scan_layers=True))
  weights = layers.to_canonical(unrolled.params)
  loaded = layers.from_canonical(weights, like=scanned.params)
  _close(scanned.apply(loaded, TOKENS), unrolled.apply(unrolled.params, TOKENS))
  loss_u, grads_u = _value_and_canonical_grad(unrolled, unrolled.params)
  loss_s, grads_s = _value_and_canonical_grad(scanned, loaded)
  _close(loss_s, loss_u)
  _close_trees(grads_s, grads_u)


@pytest.mark.parametrize("framework,scan,remat", [
    ("linen", True, "full"), ("nnx", True, "full"), ("haiku", True, "full"),
    ("linen", False, "dots"), ("haiku", False, "dots_no_batch")])
@pytest.mark.slow
def test_remat_equals_no_remat(framework, scan, remat):
  plain = build(framework, config(scan_layers=scan))
  rematted = build(framework, config(scan_layers=scan, remat=remat))
  loaded = layers.from_canonical(layers.to_canonical(plain.params), like=rematted.params)
  loss_p, grads_p = _value_and_canonical_grad(plain, plain.params)
  loss_r, grads_r = _value_and_canonical_grad(rematted, loaded)
  _close(loss_r, loss_p)
  _close_trees(grads_r, grads_p)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.slow
def test_moe_transformer_reports_aux_losses(framework):
  cfg = config(num_experts=4, experts_per_token=2, scan_layers=framework == "nnx")
  m = build(framework, cfg)
  logits, aux = m.apply(m.params, TOKENS, return_aux=True)
  assert logits.shape == (4, 8, 64)
  assert aux["dropped_tokens"].dtype == jnp.int32
  assert 0 <= int(aux["dropped_tokens"]) <= 2 * 4 * 8 * 2     # layers x tokens x k
  assert float(aux["load_balance_loss"]) >= 1.0 - 1e-6        # >= 1, == 1 when balanced


def test_haiku_transformer_is_named_transformer():
  f = hk.transform(lambda t: layers.haiku.Transformer(config())(t))
  params = jax.eval_shape(f.init, jax.random.key(0), TOKENS)
  assert "transformer/embed" in params and "transformer/blocks_1/attn/qkv" in params


@pytest.mark.slow
def test_bfloat16_compute_with_float32_params():
  fp32 = build("linen", config())
  weights = layers.to_canonical(fp32.params)
  ref = np.asarray(fp32.apply(fp32.params, TOKENS))
  outs = {}
  for framework in FRAMEWORKS:
    m = build(framework, config(dtype="bfloat16"))
    params = layers.from_canonical(weights, like=m.params)
    assert {np.dtype(v.dtype) for v in layers.to_canonical(params).values()} == {
        np.dtype("float32")}
    logits = m.apply(params, TOKENS)
    assert logits.dtype == jnp.bfloat16
    outs[framework] = np.asarray(logits, np.float32)
  # One core: the three frameworks round identically.
  np.testing.assert_array_equal(outs["nnx"], outs["linen"])
  np.testing.assert_array_equal(outs["haiku"], outs["linen"])
  # bf16 rounds to 2**-8 relative per op; a 2-layer model stays within a few percent.
  assert np.linalg.norm(outs["linen"] - ref) / np.linalg.norm(ref) < 0.03
