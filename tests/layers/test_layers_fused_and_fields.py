"""Fused QKV / gate+up layout round trips through unfused canonical weights, and the
architecture fields (tie_embeddings, rope_theta, norm_eps, qkv_bias) in all three frameworks
against a float64 numpy Transformer written from the canonical weights alone."""

import numpy as np
import pytest
from layers_testlib import FRAMEWORKS, TOKENS, build, config

import layers
from layers._canonical import FUSED

# -- an independent reference: the model in numpy, from canonical (unfused) weights ---------


def _rms(x, scale, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _rope(x, theta):
  half = x.shape[-1] // 2
  angle = np.arange(x.shape[1])[None, :, None, None] * theta ** (-np.arange(half) * 2 /
                                                                 x.shape[-1])
  z = (x[..., :half] + 1j * x[..., half:]) * np.exp(1j * angle)
  return np.concatenate([z.real, z.imag], axis=-1)


def numpy_transformer(w, cfg, tokens):
  w = {k: np.asarray(v, np.float64) for k, v in w.items()}
  tokens = np.asarray(tokens)
  x = w["embed/embedding"][tokens]
  length, group = tokens.shape[1], cfg.num_heads // cfg.num_kv_heads
  causal = np.tril(np.ones((length, length), bool))
  for i in range(cfg.num_layers):
    p = {k[len("blocks/"):]: v[i] for k, v in w.items() if k.startswith("blocks/")}
    h = _rms(x, p["attn_norm/scale"], cfg.norm_eps)
    q, k, v = (np.einsum("ble,ehd->blhd", h, p[f"attn/{n}/kernel"]) + p.get(f"attn/{n}/bias", 0.0)
               for n in ("query", "key", "value"))
    q, k = _rope(q, cfg.rope_theta), _rope(k, cfg.rope_theta)
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)   # head h: kv h // group
    s = np.einsum("blhd,bshd->bhls", q, k) / np.sqrt(cfg.head_dim)
    s = np.where(causal, s, -np.inf)
    a = np.exp(s - s.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    x = x + np.einsum("bhls,bshd,hde->ble", a, v, p["attn/out/kernel"])
    h = _rms(x, p["mlp_norm/scale"], cfg.norm_eps)
    gate, up = h @ p["mlp/wi_gate/kernel"], h @ p["mlp/wi_up/kernel"]
    x = x + (gate / (1 + np.exp(-gate)) * up) @ p["mlp/wo/kernel"]
  x = _rms(x, w["final_norm/scale"], cfg.norm_eps)
  return x @ (w["embed/embedding"].T if cfg.tie_embeddings else w["lm_head/kernel"])


def _random_canonical(weights, seed=3):
  """Random values for every canonical weight (biases and norm scales included, so a zero
  init or a ones init cannot hide a mistake), at a scale where activations stay O(1)."""
  rng = np.random.default_rng(seed)
  return {k: (0.3 * rng.standard_normal(np.shape(v)) + (1.0 if k.endswith("scale") else 0.0))
          .astype(np.float32) for k, v in weights.items()}


def _assert_logits_match(logits, ref):
  # float32 model vs float64 reference: a few float32 ulps of the largest logit per op.
  atol = 1e-5 * np.abs(ref).max()
  np.testing.assert_allclose(np.asarray(logits, np.float64), ref, rtol=1e-4, atol=atol)


FIELDS = dict(tie_embeddings=False, rope_theta=500_000.0, norm_eps=1e-5, qkv_bias=True)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("fields", [{}, FIELDS], ids=["defaults", "llama3_qwen2_fields"])
@pytest.mark.slow
def test_model_equals_numpy_reference(framework, fields):
  cfg = config(**fields)
  m = build(framework, cfg)
  weights = _random_canonical(layers.to_canonical(m.params))
  if fields:
    assert weights["lm_head/kernel"].shape == (16, 64)
    assert weights["blocks/attn/query/bias"].shape == (2, 4, 8)
    assert weights["blocks/attn/key/bias"].shape == (2, 2, 8)
  else:
    assert "lm_head/kernel" not in weights and "blocks/attn/query/bias" not in weights
  logits = m.apply(layers.from_canonical(weights, like=m.params), TOKENS)
  _assert_logits_match(logits, numpy_transformer(weights, cfg, TOKENS))


def test_default_fields_are_the_previous_constants():
  cfg = layers.TransformerConfig()
  assert (cfg.tie_embeddings, cfg.rope_theta, cfg.norm_eps, cfg.qkv_bias) == (
      True, 10_000.0, 1e-6, False)


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.slow
def test_fields_give_equal_logits_in_three_frameworks(scan):
  cfg = config(scan_layers=scan, **FIELDS)
  models = {f: build(f, cfg, seed=i) for i, f in enumerate(FRAMEWORKS)}
  weights = _random_canonical(layers.to_canonical(models["linen"].params))
  outs = [np.asarray(m.apply(layers.from_canonical(weights, like=m.params), TOKENS))
          for m in models.values()]
  # One core: the frameworks run the same ops on the same weights.
  np.testing.assert_array_equal(outs[1], outs[0])
  np.testing.assert_array_equal(outs[2], outs[0])


def test_config_rejects_bad_architecture_fields():
  with pytest.raises(layers.ConfigError) as info:
    layers.TransformerConfig(rope_theta=0, norm_eps=-1e-6, qkv_bias="yes", tie_embeddings=1)
  message = str(info.value)
  assert "4 invalid field(s)" in message
  for text in ("rope_theta=0 must be a positive number", "norm_eps=-1e-06 must be a number >= 0",
               "qkv_bias='yes' must be True or False", "tie_embeddings=1 must be True or False"):
    assert text in message


# -- fused framework layout <-> unfused canonical names -------------------------------------


@pytest.mark.parametrize("framework,scan", [("linen", False), ("linen", True), ("nnx", False),
                                            ("nnx", True), ("haiku", False), ("haiku", True)])
@pytest.mark.slow
def test_fused_params_round_trip_through_canonical_bit_exact(framework, scan):
  # Dense MLP unrolled, MoE scanned: every fused kind in every framework.
  cfg = config(scan_layers=scan, qkv_bias=True, num_experts=2 if scan else 0,
               experts_per_token=1)
  m = build(framework, cfg)
  weights = _random_canonical(layers.to_canonical(m.params))
  present = [f for f, (parts, _, _) in FUSED.items() if all(p in weights for p in parts)]
  assert not set(FUSED) & set(weights)
  assert present == ["blocks/attn/qkv/kernel", "blocks/attn/qkv/bias",
                     "blocks/moe/wi" if scan else "blocks/mlp/wi/kernel"]
  back = layers.to_canonical(layers.from_canonical(weights, like=m.params))
  assert sorted(back) == sorted(weights)
  for name, value in weights.items():
    np.testing.assert_array_equal(np.asarray(back[name]), value)


def test_fused_qkv_groups_query_heads_by_kv_head_as_hugging_face_does():
  # Independent spelling of the layout: fused[..., kv, j] is query head kv * group + j,
  # fused[..., kv, group] the key and fused[..., kv, group + 1] the value of kv head kv.
  m = build("haiku", config())
  weights = _random_canonical(layers.to_canonical(m.params))
  fused = np.asarray(layers.from_canonical(weights, like=m.params)
                     ["transformer/blocks_1/attn/qkv"]["kernel"])
  q, k, v = (weights[f"blocks/attn/{n}/kernel"][1] for n in ("query", "key", "value"))
  group = q.shape[1] // k.shape[1]
  for kv in range(k.shape[1]):
    for j in range(group):
      np.testing.assert_array_equal(fused[:, kv, j], q[:, kv * group + j])
    np.testing.assert_array_equal(fused[:, kv, group], k[:, kv])
    np.testing.assert_array_equal(fused[:, kv, group + 1], v[:, kv])


def test_from_canonical_names_the_missing_part_of_a_fused_weight():
  m = build("nnx", config())
  weights = dict(layers.to_canonical(m.params))
  del weights["blocks/attn/key/kernel"], weights["blocks/mlp/wi_up/kernel"]
  with pytest.raises(layers.CanonicalError) as info:
    layers.from_canonical(weights, like=m.params)
  message = str(info.value)
  assert "no weight 'blocks/attn/key/kernel' in the canonical dict" in message
  assert "no weight 'blocks/mlp/wi_up/kernel' in the canonical dict" in message


def test_from_canonical_rejects_query_heads_that_do_not_group_over_kv_heads():
  m = build("haiku", config())
  weights = dict(layers.to_canonical(m.params))
  weights["blocks/attn/key/kernel"] = np.zeros((2, 16, 3, 8), np.float32)
  weights["blocks/attn/value/kernel"] = np.zeros((2, 16, 3, 8), np.float32)
  with pytest.raises(layers.CanonicalError, match=r"do not form grouped-query heads"):
    layers.from_canonical(weights, like=m.params)
