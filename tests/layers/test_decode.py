"""Decoding (layers/_decode.py): cached logits equal the full forward pass, per-row positions
make a padded batch equal its rows alone, sharded decoding equals one device, the cache is
placed by the rules, and sampling follows its definitions (numpy references)."""

import math
import pathlib

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from greedy_testlib import greedy_reference
from jax.sharding import AxisType
from marks_testlib import everyday
from mesh_testlib import make_mesh

import layers
import layers.haiku
import layers.linen
import layers.nnx
from layers import _decode
from recipes.config import PRESET_MESHES, preset_rules

RTOL = 1e-5
MESHES = {**PRESET_MESHES, "pipeline_parallel": {"data": 2, "stage": 4},
          "fsdp_pp": {"fsdp": 2, "stage": 4}}


def _config(**kw):
  base = dict(vocab_size=40, embed_dim=16, mlp_dim=32, num_heads=4, num_kv_heads=2,
              head_dim=8, num_layers=2, max_len=32)
  return layers.TransformerConfig(**{**base, **kw})


def _framework(name, cfg, tokens):
  """``(decode params, full forward)`` of a freshly initialised model of ``name``."""
  if name == "linen":
    model = layers.linen.Transformer(cfg)
    variables = model.init(jax.random.key(1), tokens)
    return (layers.linen.decode_params(variables, cfg),
            lambda t: model.apply(variables, t, return_aux=True))
  if name == "nnx":
    model = layers.nnx.Transformer(cfg, rngs=nnx.Rngs(1))
    return layers.nnx.decode_params(model, cfg), lambda t: model(t, return_aux=True)
  f = hk.transform(lambda t: layers.haiku.Transformer(cfg)(t, return_aux=True))
  params = f.init(jax.random.key(1), tokens)
  return layers.haiku.decode_params(params, cfg), lambda t: f.apply(params, None, t)


def _cached_logits(params, cfg, tokens, prompt):
  """Logits at every position: prefill ``tokens[:, :prompt]``, then one decode step per
  remaining token (teacher forcing)."""
  b, n = tokens.shape
  cache = layers.init_cache(cfg, b, n)
  logits, cache = _decode.prefill(params, tokens[:, :prompt], cache, cfg)
  out = [logits]
  step = jax.jit(lambda p, t, pos, c: _decode.decode_step(p, t, pos, c, cfg),
                 donate_argnums=(3,))
  for i in range(prompt, n):
    pos = jnp.full((b, 1), i, jnp.int32)
    logits, cache = step(params, tokens[:, i:i + 1], pos, cache)
    out.append(logits)
  return jnp.concatenate(out, axis=1)


@pytest.mark.parametrize("framework", ["linen", "nnx", "haiku"])
@pytest.mark.parametrize("variant", everyday([
    dict(),
    dict(scan_layers=True, tie_embeddings=False, qkv_bias=True),
    dict(num_kv_heads=1, scan_layers=True),                                  # MQA
    dict(num_experts=2, experts_per_token=2),   # capacity >= length: nothing dropped
], dict(), dict(num_kv_heads=1, scan_layers=True)))
def test_cached_logits_equal_full_forward(framework, variant):
  cfg = _config(**variant)
  tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, cfg.vocab_size)
  params, forward = _framework(framework, cfg, tokens)
  want, aux = forward(tokens)
  assert int(aux["dropped_tokens"]) == 0   # MoE: capacity did not change the reference
  got = _cached_logits(params, cfg, tokens, prompt=4)
  np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL)


def _params(cfg, seed=1):
  tokens = jnp.zeros((1, 4), jnp.int32)
  return _framework("linen", cfg, tokens)[0]


@pytest.mark.slow  # a decode loop / several models: runs in the full suite
@pytest.mark.parametrize("scan", [False, True])
def test_padded_batch_rows_equal_rows_alone_and_greedy_reference(scan):
  cfg = _config(scan_layers=scan)
  params = _params(cfg)
  prompts = [[5, 6, 7, 8, 9], [3], [10, 11, 12]]
  sampling = layers.Sampling(max_new_tokens=5)
  batch = _decode.generate(params, cfg, prompts, sampling).continuations()
  alone = [_decode.generate(params, cfg, [p], sampling).continuations()[0] for p in prompts]
  assert batch == alone
  assert batch == [greedy_reference(params, cfg, p, 5) for p in prompts]


def test_three_frameworks_generate_the_same():
  cfg = _config(num_layers=1)
  tokens = jnp.zeros((1, 4), jnp.int32)
  lin = layers.linen.Transformer(cfg)
  variables = lin.init(jax.random.key(1), tokens)
  canonical = layers.to_canonical(variables)
  model = layers.from_canonical(canonical, like=layers.nnx.Transformer(cfg, rngs=nnx.Rngs(5)))
  f = hk.transform(lambda t: layers.haiku.Transformer(cfg)(t))
  hk_params = layers.from_canonical(canonical, like=f.init(jax.random.key(7), tokens))
  prompts, s = [[1, 2, 3], [4]], layers.Sampling(max_new_tokens=6, temperature=0.9, seed=3)
  want = layers.linen.generate(lin, variables, prompts, s).continuations()
  assert layers.nnx.generate(model, prompts, s).continuations() == want
  assert layers.haiku.generate(cfg, hk_params, prompts, s).continuations() == want


@pytest.mark.parametrize("preset", everyday(sorted(MESHES), "data_parallel", "fsdp_tp",
                                             "pipeline_parallel"))
def test_sharded_decode_equals_one_device(preset):
  experts = preset == "expert_parallel"
  cfg = _config(scan_layers="pp" in preset or "pipeline" in preset, num_layers=4,
                num_experts=4 if experts else 0, experts_per_token=4)
  params = _params(cfg)
  prompts = [[5, 6, 7, 8, 9, 10, 11, 12], [3, 4], [13, 14, 15], [16], [1, 2, 3, 4], [7, 7],
             [8], [9, 9, 9]]
  sampling = layers.Sampling(max_new_tokens=4)
  want = _decode.generate(params, cfg, prompts, sampling)
  sizes = MESHES[preset]
  mesh = make_mesh(tuple(sizes.values()), tuple(sizes), AxisType.Auto)
  rules = preset_rules(preset)
  placed = jax.device_put(params, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  got = _decode.generate(placed, cfg, prompts, sampling, rules=rules, mesh=mesh)
  assert got.continuations() == want.continuations()


def test_cache_is_created_in_its_shards_with_the_analytic_bytes():
  cfg = _config(scan_layers=True, num_kv_heads=2)
  mesh = make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), AxisType.Auto)
  rules = preset_rules("fsdp_tp")
  cache = layers.init_cache(cfg, 8, 16, rules=rules, mesh=mesh)
  P = jax.sharding.PartitionSpec
  assert cache.k.sharding.spec == P(None, ("data", "fsdp"), None, "tensor", None)
  # On paper: (layers, batch / (data x fsdp), length, kv_heads / tensor, head_dim) floats.
  per_device = 2 * (2 * (8 // 4) * 16 * (2 // 2) * 8) * 4
  shards = [s for x in (cache.k, cache.v) for s in x.addressable_shards
            if s.device == mesh.devices.flat[0]]
  assert sum(s.data.nbytes for s in shards) == per_device
  assert layers.cache_bytes_per_device(cfg, 8, 16, rules=rules, mesh=mesh) == per_device
  # Never whole on one device: every shard holds a quarter of the rows and half the heads.
  assert all(s.data.shape == (2, 2, 16, 1, 8) for s in cache.k.addressable_shards)


def test_generate_donates_the_cache():
  cfg = _config()
  params = _params(cfg)
  run = _decode.Programs(cfg, layers.Sampling(max_new_tokens=3), batch=1, prompt_length=2,
                         cache_length=5, rules=None, mesh=None)
  cache = run.new_cache()
  logits, cache2 = run.prefill(params, jnp.asarray([[1, 2]]), jnp.asarray([2]), cache)
  assert cache[0].k.is_deleted()
  run.loop(params, cache2, logits, jnp.asarray([2]))
  assert cache2[0].k.is_deleted()


# -- sampling ---------------------------------------------------------------------------------


def _np_softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


LOGITS = np.log(np.array([[0.05, 0.4, 0.1, 0.25, 0.2]], np.float32))


def _draws(sampling, n=4000):
  logits = jnp.broadcast_to(jnp.asarray(LOGITS), (n, LOGITS.shape[1]))
  return np.asarray(_decode.sample(logits, jax.random.key(sampling.seed), sampling))


def test_greedy_and_degenerate_cuts_are_argmax():
  for s in (layers.Sampling(), layers.Sampling(temperature=2.0, top_k=1),
            layers.Sampling(temperature=2.0, top_p=0.01)):
    assert set(_draws(s, 64).tolist()) == {1}


def test_temperature_sampling_follows_the_softmax():
  draws = _draws(layers.Sampling(temperature=0.5, seed=4))
  freq = np.bincount(draws, minlength=5) / draws.size
  want = _np_softmax(LOGITS[0] / 0.5)
  # 4000 draws: a frequency's standard deviation is <= 0.008; allow 4 of them.
  np.testing.assert_allclose(freq, want, atol=0.032)


def test_top_k_and_top_p_keep_numpy_reference_sets():
  top_k = set(_draws(layers.Sampling(temperature=1.0, top_k=3)).tolist())
  assert top_k == set(np.argsort(-LOGITS[0])[:3].tolist())          # {1, 3, 4}
  # Nucleus 0.6: sorted probs 0.4, 0.25 reach 0.65 >= 0.6 -> {1, 3}.
  p = _np_softmax(LOGITS[0])
  order = np.argsort(-p)
  keep = order[:np.searchsorted(np.cumsum(p[order]), 0.6) + 1]
  draws = _draws(layers.Sampling(temperature=1.0, top_p=0.6))
  assert set(draws.tolist()) == set(keep.tolist()) == {1, 3}
  freq = np.bincount(draws, minlength=5)[keep] / draws.size
  np.testing.assert_allclose(freq, p[keep] / p[keep].sum(), atol=0.032)


def test_seed_decides_the_draws():
  a, b = (_draws(layers.Sampling(temperature=1.0, seed=s), 256) for s in (1, 2))
  assert np.array_equal(a, _draws(layers.Sampling(temperature=1.0, seed=1), 256))
  assert not np.array_equal(a, b)


def test_stop_tokens_end_a_row_and_the_others_continue():
  cfg = _config()
  params = _params(cfg)
  prompts = [[5, 6, 7], [20, 21]]
  free = _decode.generate(params, cfg, prompts, layers.Sampling(max_new_tokens=6))
  first = free.continuations()[0]
  stop = first[2]
  assert stop not in free.continuations()[1]   # the test needs a token only row 0 emits
  out = _decode.generate(params, cfg, prompts,
                         layers.Sampling(max_new_tokens=6, stop_tokens=[stop]), pad_id=0)
  assert out.continuations()[0] == first[:first.index(stop) + 1]
  assert out.continuations()[1] == free.continuations()[1]
  assert out.tokens[0, first.index(stop) + 1:].tolist() == [0] * (5 - first.index(stop))


def test_rows_stop_at_max_len():
  cfg = _config(max_len=8)
  out = _decode.generate(_params(cfg), cfg, [[1, 2, 3, 4, 5, 6], [1]],
                         layers.Sampling(max_new_tokens=5))
  assert out.lengths.tolist() == [2, 5]


@pytest.mark.parametrize("kwargs, match", [
    (dict(top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p=1.5 must be in \(0, 1\]"),
    (dict(temperature=-1), "temperature=-1 must be a finite number >= 0"),
    (dict(temperature=float("nan")), "temperature=nan must be a finite number >= 0"),
    (dict(temperature=float("inf")), "temperature=inf must be a finite number >= 0"),
    (dict(top_k=-2), "top_k=-2 must be an int >= 0"),
    (dict(max_new_tokens=0), "max_new_tokens=0 must be an int >= 1"),
])
def test_bad_sampling_settings_are_named(kwargs, match):
  with pytest.raises(layers.GenerateError, match=match):
    layers.Sampling(**kwargs)


def test_bad_prompts_and_stop_tokens_are_named():
  cfg = _config(max_len=8)
  params = _params(cfg)
  with pytest.raises(layers.GenerateError, match=r"prompt\(s\) \[1\] have 9 tokens > the "
                                                 r"model's max_len=8"):
    _decode.generate(params, cfg, [[1], list(range(1, 10))])
  with pytest.raises(layers.GenerateError, match=r"stop token\(s\) \[99\] are not in the "
                                                 r"model's vocabulary \(vocab_size=40"):
    _decode.generate(params, cfg, [[1]], layers.Sampling(stop_tokens=[99]))
  with pytest.raises(layers.GenerateError, match=r"token ids \[45\] are outside") as e:
    _decode.generate(params, cfg, [[45]])
  assert str(e.value).endswith("Pass ids from 0 to 39 (those of the model's tokenizer).")
  assert "horten" not in str(e.value)  # nothing was too long
  with pytest.raises(layers.GenerateError, match=r"prompt\(s\) \[0\] empty"):
    _decode.generate(params, cfg, [[]])


def test_analytic_cache_bytes_formula():
  cfg = _config(num_layers=3)
  mesh = make_mesh((8,), ("data",), AxisType.Auto)
  got = layers.cache_bytes_per_device(cfg, 16, 10, rules=preset_rules("data_parallel"),
                                       mesh=mesh)
  assert got == 3 * 2 * math.prod((16 // 8, 10, 2, 8)) * 4



# -- against transformers' generate (when torch and transformers are installed) ---------------

HF_MODELS = {
    # name: (transformers config class, fields); shapes unlike the goldens' on purpose
    "llama_gqa_untied": ("LlamaConfig", dict(num_attention_heads=6, num_key_value_heads=2,
                                              hidden_size=48, tie_word_embeddings=False)),
    "llama_mqa_tied": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=1,
                                            hidden_size=32, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=2,
                                      hidden_size=32, sliding_window=64, head_dim=8)),
    "qwen2_tied": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2,
                                       hidden_size=32, tie_word_embeddings=True)),
    "qwen3_mqa": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=1,
                                      hidden_size=32, head_dim=16, tie_word_embeddings=False)),
    "mixtral": ("MixtralConfig", dict(num_attention_heads=4, num_key_value_heads=2,
                                      hidden_size=32, num_local_experts=4,
                                      num_experts_per_tok=2)),
    "llama3_scaled": ("LlamaConfig", dict(
        num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16})),
}


@pytest.mark.slow  # a decode loop / several models: runs in the full suite
@pytest.mark.parametrize("name", sorted(HF_MODELS))
def test_greedy_equals_transformers_generate(name, tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  cls, fields = HF_MODELS[name]
  torch.manual_seed(0)
  hf_config = getattr(transformers, cls)(
      vocab_size=80, intermediate_size=64, num_hidden_layers=2, max_position_embeddings=64,
      initializer_range=0.3, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
      pad_token_id=0, **fields)
  model = getattr(transformers, cls.replace("Config", "ForCausalLM"))(hf_config).eval()
  model.save_pretrained(tmp_path, safe_serialization=True)
  weights, cfg = layers.from_hf(tmp_path)
  linen_model = layers.linen.Transformer(cfg)
  like = linen_model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
  params = layers.linen.decode_params(layers.from_canonical(weights, like=like), cfg)
  prompts = [[1, 17, 33, 9, 60, 4, 41], [1, 5], [1, 70, 70, 12]]
  ours = _decode.generate(params, cfg, prompts,
                          layers.Sampling(max_new_tokens=10, stop_tokens=[2])).continuations()
  for prompt, got in zip(prompts, ours):
    with torch.no_grad():
      out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=10,
                           eos_token_id=2, pad_token_id=0)
    assert got == out[0, len(prompt):].tolist(), prompt
  assert sum(map(len, ours)) > 15, ours   # not a trivial early stop everywhere


GOLDENS = pathlib.Path(__file__).parent / "data" / "hf"


@pytest.mark.parametrize("name", [  # llama in the everyday loop, the other families in full
    name if name == "llama" else pytest.param(name, marks=pytest.mark.slow)
    for name in sorted(p.name for p in GOLDENS.iterdir() if (p / "golden.npz").is_file())])
def test_greedy_and_scores_equal_transformers_goldens(name):
  """``transformers``' greedy ``generate`` (KV cache, no stop) of each golden checkpoint
  (Llama 3.1-style and linear RoPE scaling, Qwen3's q/k norm and Mixtral included):
  the same tokens, and the same logits at every new position."""
  with np.load(GOLDENS / name / "golden.npz") as f:
    prompt, generated, scores = f["prompt"], f["generated"], f["generated_scores"]
  weights, cfg = layers.from_hf(GOLDENS / name)
  like = layers.linen.Transformer(cfg).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
  params = layers.linen.decode_params(layers.from_canonical(weights, like=like), cfg)
  new = generated.shape[1] - prompt.shape[1]
  out = _decode.generate(params, cfg, prompt.tolist(), layers.Sampling(max_new_tokens=new))
  np.testing.assert_array_equal(out.tokens, generated[:, prompt.shape[1]:])
  logits = _cached_logits(params, cfg, jnp.asarray(generated), prompt.shape[1])
  ours = np.asarray(logits[:, prompt.shape[1] - 1:-1])
  # As tests/layers/test_hf.py: fp32 both sides, an absolute floor of 1e-5 of the largest.
  np.testing.assert_allclose(ours, scores, rtol=1e-4, atol=1e-5 * np.abs(scores).max())
