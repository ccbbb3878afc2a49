"""``layers.from_hf`` / ``layers.to_hf`` against ``transformers``' own logits.

References: ``tests/layers/data/hf/<model>/golden.npz``, the logits and greedy continuations
``transformers`` (fp32, eager attention) computed for tiny random Llama (plain, ``llama3`` and
``linear`` RoPE scaling) / Mistral / Qwen2 / Qwen3 / Mixtral checkpoints saved next to them by
``scripts/make_hf_goldens.py``; the suite itself needs neither torch nor transformers (the
tests that build fresh checkpoints of other shapes with ``transformers`` skip without it).
Mesh loading is checked against the one-device load and by counting the bytes safetensors'
``get_slice`` hands out.
"""

import dataclasses
import importlib.util
import json
import math
import pathlib
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors
import safetensors.numpy
from layers_testlib import FSDP_TP, MESH, build, canonical_axes

import layers
import partition
from layers import hf
from layers._params import LayerArgumentError

DATA = pathlib.Path(__file__).parent / "data" / "hf"
MODELS = ("llama", "mistral", "qwen2", "llama3", "llama_linear", "qwen3", "mixtral")
FAMILY = {"llama3": "llama", "llama_linear": "llama"}   # the architecture of a golden model
FRAMEWORKS = ("linen", "nnx", "haiku")


def golden(name):
  with np.load(DATA / name / "golden.npz") as f:
    return f["tokens"], f["logits"]


def logits_of(framework, weights, cfg, tokens, **kw):
  built = build(framework, cfg, tokens=jnp.asarray(tokens))
  params = layers.from_canonical(weights, like=built.params)
  out = built.apply(params, jnp.asarray(tokens), **kw)
  return jax.tree.map(np.asarray, out)


def goldens_script():
  """``scripts/make_hf_goldens.py`` as a module (for its ``random_model`` and ``greedy``)."""
  path = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "make_hf_goldens.py"
  spec = importlib.util.spec_from_file_location("make_hf_goldens", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def assert_logits_close(ours, theirs):
  # fp32 on both sides; rounding in the 2-layer sums is relative to the logits' scale, not
  # to each (possibly near-zero) logit, so the absolute floor is 1e-5 of their largest
  # magnitude (~4.5e-5; measured differences are <= 3.4e-6).
  np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5 * np.abs(theirs).max())


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.slow
def test_logits_match_transformers(name, framework):
  weights, cfg = layers.from_hf(DATA / name)
  tokens, expected = golden(name)
  assert_logits_close(logits_of(framework, weights, cfg, tokens), expected)


@pytest.mark.slow
def test_scanned_layers_match_too():
  weights, cfg = layers.from_hf(DATA / "qwen2")
  tokens, expected = golden("qwen2")
  scanned = dataclasses.replace(cfg, scan_layers=True)
  assert_logits_close(logits_of("linen", weights, scanned, tokens), expected)


@pytest.mark.slow
def test_every_field_matters():
  """The comparison can fail: a wrong rope_theta or norm epsilon, or a dropped bias or
  untied head, moves the logits far outside the tolerance."""
  tokens, expected = golden("qwen2")
  weights, cfg = layers.from_hf(DATA / "qwen2")
  for change in (dict(rope_theta=10_000.0), dict(norm_eps=1e-2)):
    wrong = logits_of("linen", weights, dataclasses.replace(cfg, **change), tokens)
    assert np.abs(wrong - expected).max() > 1e-2, change
  zero_bias = {k: jnp.zeros_like(v) if k.endswith("/bias") else v for k, v in weights.items()}
  assert np.abs(logits_of("linen", zero_bias, cfg, tokens) - expected).max() > 1e-2
  weights, cfg = layers.from_hf(DATA / "llama")
  tokens, expected = golden("llama")
  tied = {k: v for k, v in weights.items() if k != "lm_head/kernel"}
  wrong = logits_of("linen", tied, dataclasses.replace(cfg, tie_embeddings=True), tokens)
  assert np.abs(wrong - expected).max() > 1e-2


@pytest.mark.slow
def test_every_field_of_the_new_families_matters():
  """RoPE scaling (and which one), q/k norm scales, the router's k and a capacity that drops
  tokens all move the logits far outside the tolerance: the goldens test each."""
  def wrong(name, weights=None, **change):
    tokens, expected = golden(name)
    loaded, cfg = layers.from_hf(DATA / name)
    out = logits_of("linen", weights or loaded, dataclasses.replace(cfg, **change), tokens,
                    return_aux=True)
    return np.abs(out[0] - expected).max(), int(out[1]["dropped_tokens"])

  assert wrong("llama3", rope_scaling=None)[0] > 1e-2
  assert wrong("llama3", rope_scaling=layers.RopeScaling("linear", 8.0))[0] > 1e-2
  assert wrong("llama_linear", rope_scaling=None)[0] > 1e-2
  weights, _ = layers.from_hf(DATA / "qwen3")
  ones = {k: jnp.ones_like(v) if k.endswith("_norm/scale") else v for k, v in weights.items()}
  assert wrong("qwen3", ones)[0] > 1e-2
  swapped = {**weights, "blocks/attn/query_norm/scale": weights["blocks/attn/key_norm/scale"],
             "blocks/attn/key_norm/scale": weights["blocks/attn/query_norm/scale"]}
  assert wrong("qwen3", swapped)[0] > 1e-2
  assert wrong("mixtral", experts_per_token=1)[0] > 1e-2
  error, dropped = wrong("mixtral", capacity_factor=1.0)    # 6 slots for 12 tokens
  assert dropped > 0 and error > 1e-2
  assert wrong("mixtral")[1] == 0                           # from_hf's capacity: none dropped


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_greedy_continuation_matches_transformers(name):
  """The golden greedy continuation (transformers' generate, KV cache) equals layers' greedy
  choice from the whole sequence, token for token: what a decode test compares against."""
  with np.load(DATA / name / "golden.npz") as f:
    prompt, generated = f["prompt"], f["generated"]
  weights, cfg = layers.from_hf(DATA / name)
  built = build("linen", cfg, tokens=jnp.asarray(generated))
  params = layers.from_canonical(weights, like=built.params)
  tokens = prompt
  while tokens.shape[1] < generated.shape[1]:
    logits = np.asarray(built.apply(params, jnp.asarray(tokens)))
    tokens = np.concatenate([tokens, logits[:, -1].argmax(-1)[:, None]], axis=1)
  np.testing.assert_array_equal(tokens, generated)
  assert generated.shape == (2, prompt.shape[1] + 8)


def test_configs():
  _, llama = layers.from_hf(DATA / "llama")
  assert (llama.head_dim, llama.num_heads, llama.num_kv_heads, llama.tie_embeddings,
          llama.rope_theta, llama.qkv_bias) == (16, 4, 2, False, 500_000.0, False)
  _, mistral = layers.from_hf(DATA / "mistral")
  # sliding_window 16 < max_position_embeddings 64: longer inputs are refused, not mis-computed
  assert (mistral.max_len, mistral.norm_eps, mistral.num_kv_heads) == (16, 1e-5, 1)
  weights, qwen = layers.from_hf(DATA / "qwen2")
  assert qwen.qkv_bias and qwen.tie_embeddings and "lm_head/kernel" not in weights
  assert weights["blocks/attn/key/bias"].shape == (2, 2, 8)
  assert llama.rope_scaling is None and not (llama.qk_norm or qwen.qk_norm)
  _, llama3 = layers.from_hf(DATA / "llama3")
  assert llama3.rope_scaling == layers.RopeScaling("llama3", 8.0, low_freq_factor=1.0,
                                                   high_freq_factor=4.0, original_max_len=128)
  assert (llama3.max_len, llama3.num_kv_heads, llama3.tie_embeddings) == (1024, 1, True)
  _, linear = layers.from_hf(DATA / "llama_linear")
  assert linear.rope_scaling == layers.RopeScaling("linear", 4.0)
  weights, qwen3 = layers.from_hf(DATA / "qwen3")
  assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.head_dim == 16
  assert weights["blocks/attn/query_norm/scale"].shape == (2, 16)
  weights, mixtral = layers.from_hf(DATA / "mixtral")
  assert (mixtral.num_experts, mixtral.experts_per_token, mixtral.capacity_factor,
          mixtral.mlp_dim) == (4, 2, 2.0, 24)
  assert weights["blocks/moe/router"].shape == (2, 32, 4)
  assert weights["blocks/moe/wi_gate"].shape == (2, 4, 32, 24)
  assert not any(k.startswith("blocks/mlp/") for k in weights)
  # layer 1, expert 3 of each canonical weight is that expert's own tensor, transposed
  with safetensors.safe_open(DATA / "mixtral" / "model.safetensors", "numpy") as f:
    e = "model.layers.1.block_sparse_moe."
    for name, key in (("wi_gate", "experts.3.w1"), ("wi_up", "experts.3.w3"),
                      ("wo", "experts.3.w2")):
      np.testing.assert_array_equal(np.asarray(weights[f"blocks/moe/{name}"][1, 3]),
                                    f.get_tensor(f"{e}{key}.weight").T)
    np.testing.assert_array_equal(np.asarray(weights["blocks/moe/router"][1]),
                                  f.get_tensor(f"{e}gate.weight").T)


def test_transformers_4_rope_scaling_spelling(tmp_path):
  """Llama 3.1's config.json on the Hub (transformers 4.x): ``rope_scaling`` with ``type``
  or ``rope_type`` and a top-level ``rope_theta`` read as transformers 5's
  ``rope_parameters``."""
  _, expected = layers.from_hf(DATA / "llama3")
  directory = copy_of("llama3", tmp_path)
  scaling = json.loads((directory / "config.json").read_text())["rope_parameters"]
  theta = scaling.pop("rope_theta")
  for kind in ("rope_type", "type"):
    scaling[kind] = scaling.pop("rope_type", None) or scaling.pop("type")
    edit_config(directory, rope_parameters=None, rope_scaling=scaling, rope_theta=theta)
    assert layers.from_hf(directory)[1] == expected


def meta_llama3_frequencies(head_dim, theta, factor, low, high, old):
  """Meta's reference ``apply_scaling`` (llama-models, Llama 3.1), in float64 loops."""
  out = []
  for i in range(0, head_dim, 2):
    freq = 1.0 / theta ** (i / head_dim)
    wavelen = 2 * math.pi / freq
    if wavelen < old / high:
      out.append(freq)
    elif wavelen > old / low:
      out.append(freq / factor)
    else:
      smooth = (old / wavelen - low) / (high - low)
      out.append((1 - smooth) * freq / factor + smooth * freq)
  return np.array(out)


@pytest.mark.parametrize("head_dim, theta, factor, low, high, old", [
    (128, 500_000.0, 8.0, 1.0, 4.0, 8192),     # Llama 3.1 / 3.3
    (64, 500_000.0, 32.0, 1.0, 4.0, 8192),     # Llama 3.2 1B
    (8, 10_000.0, 8.0, 1.0, 4.0, 128),         # the golden
])
def test_llama3_frequencies_match_metas_reference(head_dim, theta, factor, low, high, old):
  from layers import _core
  scaling = layers.RopeScaling("llama3", factor, low, high, old)
  ours = np.asarray(_core.rope_frequencies(head_dim, theta=theta, scaling=scaling))
  np.testing.assert_allclose(ours, meta_llama3_frequencies(head_dim, theta, factor, low, high,
                                                           old), rtol=2e-6)
  plain = np.asarray(_core.rope_frequencies(head_dim, theta=theta))
  linear = _core.rope_frequencies(head_dim, theta=theta,
                                  scaling=layers.RopeScaling("linear", factor))
  np.testing.assert_allclose(np.asarray(linear), plain / factor, rtol=1e-7)


@pytest.mark.parametrize("kind, fields", [
    ("llama3", dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)),
    ("llama3", dict(factor=32.0, low_freq_factor=2.0, high_freq_factor=8.0,
                    original_max_position_embeddings=512)),
    ("linear", dict(factor=3.0)),
])
def test_rope_frequencies_match_transformers(kind, fields):
  pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

  from layers import _core
  hf_config = transformers.LlamaConfig(
      hidden_size=256, num_attention_heads=2, head_dim=128, max_position_embeddings=100_000,
      rope_parameters={"rope_type": kind, "rope_theta": 500_000.0, **fields})
  theirs = ROPE_INIT_FUNCTIONS[kind](hf_config, "cpu")[0].numpy()
  cfg, _ = hf.config_from_hf(hf_config.to_dict())
  ours = _core.rope_frequencies(128, theta=cfg.rope_theta, scaling=cfg.rope_scaling)
  np.testing.assert_allclose(np.asarray(ours), theirs, rtol=1e-6)


# Checkpoints of other shapes than the goldens, built by transformers in the test:
# (family, config fields) with and without tied embeddings, GQA / MQA / MHA.
FRESH = [
    ("llama", dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=3, head_dim=8,
                   num_hidden_layers=3, vocab_size=130, tie_word_embeddings=True,
                   rope_parameters={"rope_type": "llama3", "rope_theta": 500_000.0,
                                    "factor": 4.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 2.0,
                                    "original_max_position_embeddings": 32})),
    ("llama", dict(hidden_size=24, num_attention_heads=2, num_key_value_heads=1, head_dim=12,
                   vocab_size=70, tie_word_embeddings=False,
                   rope_parameters={"rope_type": "linear", "rope_theta": 10_000.0,
                                    "factor": 2.5})),
    ("qwen3", dict(hidden_size=40, num_attention_heads=2, num_key_value_heads=1, head_dim=24,
                   vocab_size=200, tie_word_embeddings=False)),
    ("qwen3", dict(hidden_size=32, num_attention_heads=6, num_key_value_heads=3, head_dim=4,
                   num_hidden_layers=3, vocab_size=64, tie_word_embeddings=True)),
    ("mixtral", dict(hidden_size=24, num_attention_heads=3, num_key_value_heads=3, head_dim=8,
                     num_local_experts=5, num_experts_per_tok=3, intermediate_size=20,
                     vocab_size=90, tie_word_embeddings=True)),
    ("mixtral", dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=1, head_dim=6,
                     num_local_experts=3, num_experts_per_tok=1, intermediate_size=16,
                     num_hidden_layers=3, vocab_size=50, tie_word_embeddings=False)),
]


@pytest.mark.slow
@pytest.mark.parametrize("family, fields", FRESH)
def test_fresh_checkpoints_of_other_shapes_match_transformers(family, fields, tmp_path):
  """Only with the optional [hf] extra: a random checkpoint of another shape, saved by
  transformers; from_hf + a layers model give its logits and its greedy continuation."""
  torch = pytest.importorskip("torch")
  pytest.importorskip("transformers")
  script = goldens_script()
  fields = {"num_hidden_layers": 2, "intermediate_size": 40, "max_position_embeddings": 256,
            "rms_norm_eps": 1e-6, **fields}
  model = script.random_model(family, fields, seed=len(tmp_path.name))
  model.save_pretrained(tmp_path)
  tokens = np.random.default_rng(1).integers(0, fields["vocab_size"], (3, 10))
  with torch.no_grad():
    expected = model(torch.from_numpy(tokens)).logits.numpy()
  generated, _ = script.greedy(model, tokens[:, :4], new_tokens=5)
  weights, cfg = layers.from_hf(tmp_path)
  assert cfg.tie_embeddings == fields["tie_word_embeddings"]
  assert_logits_close(logits_of("linen", weights, cfg, tokens), expected)
  ours = tokens[:, :4]
  while ours.shape[1] < generated.shape[1]:
    logits = logits_of("linen", weights, cfg, ours)
    ours = np.concatenate([ours, logits[:, -1].argmax(-1)[:, None]], axis=1)
  np.testing.assert_array_equal(ours, generated)


@pytest.mark.slow
def test_sliding_window_limits_the_length():
  weights, cfg = layers.from_hf(DATA / "mistral")
  built = build("linen", cfg, tokens=jnp.zeros((1, 16), jnp.int32))
  with pytest.raises(LayerArgumentError, match="length 17 > config.max_len=16"):
    built.apply(built.params, jnp.zeros((1, 17), jnp.int32))


@pytest.mark.parametrize("name", MODELS)
def test_round_trip_is_bit_exact(name, tmp_path):
  weights, cfg = layers.from_hf(DATA / name)
  files = layers.to_hf(weights, cfg, tmp_path / "out", architecture=FAMILY.get(name, name),
                       max_shard_bytes=40_000)
  assert "model.safetensors.index.json" in files   # sharded on the way back too
  again, cfg2 = layers.from_hf(tmp_path / "out")
  assert cfg2 == cfg and sorted(again) == sorted(weights)
  for k in weights:
    np.testing.assert_array_equal(np.asarray(again[k]), np.asarray(weights[k]), err_msg=k)
  # the tensors themselves equal the original checkpoint's, name for name
  original = hf._Files(DATA / name)
  written = hf._Files(tmp_path / "out")
  assert sorted(original.where) == sorted(written.where)
  for key in original.where:
    np.testing.assert_array_equal(original.slice(key)[:], written.slice(key)[:], err_msg=key)


@pytest.mark.slow
def test_round_trip_through_a_framework(tmp_path):
  """linen params -> to_canonical -> to_hf -> from_hf -> from_canonical: the same params."""
  weights, cfg = layers.from_hf(DATA / "llama")
  built = build("nnx", cfg, tokens=jnp.zeros((1, 4), jnp.int32))
  params = layers.from_canonical(weights, like=built.params)
  layers.to_hf(layers.to_canonical(params), cfg, tmp_path)
  back = layers.from_canonical(layers.from_hf(tmp_path)[0], like=built.params)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [
      "LlamaForCausalLM"]


def test_layout_axes_are_the_models_axes():
  """from_hf shards each weight by the logical axes the frameworks declare for it (the
  unfused ones: q/k/v and gate/up are fused in the frameworks' own layout)."""
  _, cfg = layers.from_hf(DATA / "llama")
  variables = jax.eval_shape(layers.linen.Transformer(cfg).init, jax.random.key(0),
                             jnp.zeros((1, 4), jnp.int32))
  declared = canonical_axes(partition.logical_axes(variables)["params"])
  ours = {k: lay.axes for k, lay in hf.layouts(cfg).items()}
  shared = sorted(set(ours) & set(declared))
  assert {"embed/embedding", "lm_head/kernel", "blocks/attn/out/kernel",
          "blocks/mlp/wo/kernel", "final_norm/scale"} <= set(shared), shared
  assert {k: ours[k] for k in shared} == {k: declared[k] for k in shared}


class CountingOpen:
  """``safetensors.safe_open`` that records every block read through ``get_slice``."""

  def __init__(self, real):
    self.real, self.reads = real, []

  def __call__(self, file, framework):
    handle, reads = self.real(file, framework=framework), self.reads

    class Handle:
      def keys(self):
        return handle.keys()

      def get_slice(self, name):
        lazy = handle.get_slice(name)

        class Slice:
          def get_shape(self):
            return lazy.get_shape()

          def get_dtype(self):
            return lazy.get_dtype()

          def __getitem__(self, index):
            block = lazy[index]
            reads.append((name, tuple(lazy.get_shape()), np.asarray(block).nbytes))
            return block
        return Slice()
    return Handle()


def test_mesh_load_reads_each_device_block_once(monkeypatch):
  counter = CountingOpen(safetensors.safe_open)
  monkeypatch.setattr(safetensors, "safe_open", counter)
  sharded, cfg = layers.from_hf(DATA / "llama", mesh=MESH, rules=FSDP_TP)
  monkeypatch.undo()
  plain, _ = layers.from_hf(DATA / "llama")
  total = 0   # fp32: 4 bytes an element
  for name, array in sharded.items():
    np.testing.assert_array_equal(np.asarray(array), np.asarray(plain[name]), err_msg=name)
    lay = hf.layouts(cfg)[name]
    assert array.sharding.spec == FSDP_TP.spec(lay.axes, array.shape, MESH), name
    # the distinct device blocks: each is read once, replicas share the read
    blocks = {tuple((s.start, s.stop) for s in idx)
              for idx in array.sharding.devices_indices_map(array.shape).values()}
    total += len(blocks) * int(np.prod(array.sharding.shard_shape(array.shape))) * 4
  # every byte of the checkpoint is read exactly once...
  assert sum(n for _, _, n in counter.reads) == total == sum(v.nbytes for v in plain.values())
  # ...and a tensor sharded over k devices is read in blocks of 1/k of it, never whole
  embed = [n for key, _, n in counter.reads if key == "model.embed_tokens.weight"]
  full = plain["embed/embedding"].nbytes
  assert sharded["embed/embedding"].sharding.spec == jax.sharding.PartitionSpec("tensor",
                                                                                "fsdp")
  assert embed == [full // 4] * 4
  query = [n for key, _, n in counter.reads if key == "model.layers.0.self_attn.q_proj.weight"]
  assert query == [plain["blocks/attn/query/kernel"][0].nbytes // 4] * 4


def test_mesh_load_needs_rules():
  with pytest.raises(hf.HFError, match="mesh= needs rules="):
    layers.from_hf(DATA / "llama", mesh=MESH)


# -- bad input -------------------------------------------------------------------------------


def copy_of(name, tmp_path):
  return pathlib.Path(shutil.copytree(DATA / name, tmp_path / name))


def edit_config(directory, **changes):
  path = directory / "config.json"
  config = json.loads(path.read_text())
  config.update(changes)
  path.write_text(json.dumps(config))


def test_missing_directory_or_config(tmp_path):
  with pytest.raises(hf.HFError, match=r"has no config.json. Pass a local directory"):
    layers.from_hf(tmp_path)
  (tmp_path / "config.json").write_text((DATA / "llama" / "config.json").read_text())
  with pytest.raises(hf.HFError, match=r"no \*.safetensors files"):
    layers.from_hf(tmp_path)


def test_missing_tensor(tmp_path):
  directory = copy_of("llama", tmp_path)
  tensors = safetensors.numpy.load_file(directory / "model.safetensors")
  del tensors["model.layers.1.mlp.up_proj.weight"]
  safetensors.numpy.save_file(tensors, directory / "model.safetensors")
  with pytest.raises(hf.HFError, match=r"1 tensor\(s\) do not match config.json"
                                       r"[\s\S]*model.layers.1.mlp.up_proj.weight: missing "
                                       r"\(needed for blocks/mlp/wi_up/kernel\)"):
    layers.from_hf(directory)


def test_missing_shard_file(tmp_path):
  directory = copy_of("mistral", tmp_path)
  next(directory.glob("model-00002-*.safetensors")).unlink()
  with pytest.raises(hf.HFError, match=r"names 'model-00002-of-00002.safetensors', which "
                                       "does not exist"):
    layers.from_hf(directory)


@pytest.mark.parametrize("keep", [3, 200, -40])
def test_truncated_or_foreign_safetensors_file(tmp_path, keep):
  """A download cut short (its header or its data) is an HFError naming the file (it was
  safetensors' own 'incomplete metadata' error from deep inside)."""
  directory = copy_of("llama", tmp_path)
  path = directory / "model.safetensors"
  data = path.read_bytes()
  path.write_bytes(data[:keep] if keep > 0 else data[:keep])
  with pytest.raises(hf.HFError, match=r"model.safetensors' cannot be read as safetensors "
                                       r"\(.*\)\. The file is truncated or is not a "
                                       "safetensors file"):
    layers.from_hf(directory)


def test_wrong_shape(tmp_path):
  directory = copy_of("qwen2", tmp_path)
  edit_config(directory, intermediate_size=64)
  with pytest.raises(hf.HFError, match=r"model.layers.0.mlp.gate_proj.weight: shape "
                                       r"\(48, 32\), config.json implies \(64, 32\)"):
    layers.from_hf(directory)


@pytest.mark.parametrize("model_type", ["gpt2", "qwen2"])
def test_unsupported_architecture(tmp_path, model_type):
  """A named architecture layers does not know is refused even where model_type is one it
  knows (it was read as that model_type)."""
  directory = copy_of("llama", tmp_path)
  edit_config(directory, architectures=["GPT2LMHeadModel"], model_type=model_type)
  with pytest.raises(hf.HFError, match=r"architectures=\['GPT2LMHeadModel'\], "
                                       rf"model_type='{model_type}'; layers supports"):
    layers.from_hf(directory)


@pytest.mark.parametrize("name, changes, message", [
    ("llama", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 5e5, "factor": 8.0}),
     r"rope_parameters.rope_type='yarn': layers computes rope_type 'default', 'linear' and "
     r"'llama3' only"),
    ("llama", dict(rope_parameters=None, rope_scaling={"type": "dynamic", "factor": 2.0}),
     "rope_scaling.rope_type='dynamic'"),
    ("llama", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}),
     r"rope_parameters.rope_type='llama3' lacks \['low_freq_factor', 'high_freq_factor', "
     r"'original_max_position_embeddings'\]"),
    ("llama3", dict(rope_parameters={**json.loads((DATA / "llama3" / "config.json").read_text())
                                     ["rope_parameters"], "low_freq_factor": 4.0}),
     r"rope_parameters: rope_scaling: low_freq_factor=4.0 must be below high_freq_factor=4.0"),
    ("llama", dict(rope_parameters={"full_attention": {"rope_type": "default"},
                                    "sliding_attention": {"rope_type": "default"}}),
     r"rope_parameters is nested per layer type"),
    ("llama", dict(partial_rotary_factor=0.5), r"partial_rotary_factor=0.5: layers rotates "
                                               "the whole head_dim"),
    ("qwen3", dict(attention_bias=True), "attention_bias=True: Qwen3ForCausalLM's flag also "
                                         "adds a bias to o_proj"),
    ("qwen3", dict(use_sliding_window=True, sliding_window=8),
     "use_sliding_window=True: sliding-window attention is not supported"),
    ("mixtral", dict(router_jitter_noise=0.1), r"router_jitter_noise=0.1: layers' router has "
                                               "no jitter"),
    ("llama", dict(attention_bias=True), "attention_bias=True: LlamaForCausalLM's flag also "
                                         "adds a bias to o_proj"),
    ("llama", dict(mlp_bias=True), "mlp_bias=True: layers' MLP has no biases"),
    ("llama", dict(hidden_act="gelu"), "hidden_act='gelu'"),
    ("qwen2", dict(use_sliding_window=True, sliding_window=8),
     "use_sliding_window=True: sliding-window attention is not supported"),
    ("qwen2", dict(layer_types=["full_attention", "sliding_attention"]),
     r"layer_types contains \['sliding_attention'\]"),
])
def test_unsupported_settings(name, changes, message, tmp_path):
  directory = copy_of(name, tmp_path)
  edit_config(directory, **changes)
  with pytest.raises(hf.HFError, match=message):
    layers.from_hf(directory)


def test_to_hf_errors(tmp_path):
  weights, cfg = layers.from_hf(DATA / "qwen2")
  with pytest.raises(hf.HFError, match=r"qkv_bias=True but architecture='llama'"):
    layers.to_hf(weights, cfg, tmp_path, architecture="llama")
  partial = {k: v for k, v in weights.items() if k != "final_norm/scale"}
  with pytest.raises(hf.HFError, match=r"final_norm/scale: missing from the weights"):
    layers.to_hf(partial, cfg, tmp_path)
  with pytest.raises(hf.HFError, match=r"num_experts=2 but architecture='qwen2': only "
                                       r"mixtral has experts[\s\S]*blocks/moe/router: missing"):
    layers.to_hf(weights, dataclasses.replace(cfg, num_experts=2), tmp_path,
                 architecture="qwen2")
  weights, cfg = layers.from_hf(DATA / "qwen3")
  with pytest.raises(hf.HFError, match=r"qk_norm=True but architecture='llama': only qwen3 "
                                       r"has qk_norm"):
    layers.to_hf(weights, cfg, tmp_path, architecture="llama")
  weights, cfg = layers.from_hf(DATA / "mixtral")
  with pytest.raises(hf.HFError, match=r"num_experts=0 but architecture='mixtral'[\s\S]*"
                                       r"blocks/moe/wo: not a weight of this config"):
    layers.to_hf(weights, dataclasses.replace(cfg, num_experts=0), tmp_path,
                 architecture="mixtral")
  assert not list(tmp_path.iterdir())   # nothing written on error


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_transformers_loads_to_hf_output(name, tmp_path):
  """Only with the optional [hf] extra: transformers reads what to_hf wrote."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  weights, cfg = layers.from_hf(DATA / name)
  layers.to_hf(weights, cfg, tmp_path, architecture=FAMILY.get(name, name))
  tokens, golden_logits = golden(name)

  def logits_of(directory):
    model = transformers.AutoModelForCausalLM.from_pretrained(directory,
                                                              attn_implementation="eager")
    with torch.no_grad():
      return model(torch.from_numpy(tokens).long()).logits.numpy()

  # Against the original checkpoint run by the same transformers: same weights, same program,
  # same bits. (The stored golden logits come from the transformers/torch that wrote them;
  # other versions differ from them by float rounding, ~2e-6 here.)
  np.testing.assert_array_equal(logits_of(tmp_path), logits_of(DATA / name))
  np.testing.assert_allclose(logits_of(tmp_path), golden_logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dropped", ["rope_parameters", "rms_norm_eps"])
def test_a_key_config_json_leaves_out_takes_the_familys_transformers_default(dropped,
                                                                             tmp_path):
  """Every family got Llama's defaults: a Mixtral config.json without its RoPE theta loaded
  with 1e4 (MixtralConfig's default is 1e6), 0.785 off the golden logits, silently."""
  directory = copy_of("mixtral", tmp_path)
  config = json.loads((directory / "config.json").read_text())
  assert config[dropped] and config.get("rms_norm_eps") == 1e-5
  assert config.get("rope_theta", config.get("rope_parameters", {}).get("rope_theta")) == 1e6
  del config[dropped]
  config.pop("rope_theta", None)
  (directory / "config.json").write_text(json.dumps(config))
  weights, cfg = layers.from_hf(directory)
  assert (cfg.rope_theta, cfg.norm_eps) == (1e6, 1e-5)
  tokens, expected = golden("mixtral")
  assert_logits_close(logits_of("linen", weights, cfg, tokens), expected)


def test_mistral_without_a_sliding_window_key_gets_mistrals_window():
  base = dict(model_type="mistral", vocab_size=8, hidden_size=8, intermediate_size=16,
              num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=32768)
  assert hf.config_from_hf(base)[0].max_len == 4096            # MistralConfig's default
  assert hf.config_from_hf({**base, "sliding_window": None})[0].max_len == 32768
  assert hf.config_from_hf({**base, "model_type": "llama"})[0].max_len == 32768


def test_llama3_rope_without_its_original_length_is_an_error_not_max_len():
  """It used max_position_embeddings (131072 for Llama 3.1, not 8192): other frequencies."""
  config = json.loads((DATA / "llama3" / "config.json").read_text())
  config["rope_parameters"].pop("original_max_position_embeddings")
  config.pop("original_max_position_embeddings", None)
  with pytest.raises(hf.HFError, match=re.escape(
      "rope_parameters.rope_type='llama3' lacks ['original_max_position_embeddings']")):
    hf.config_from_hf(config)


def test_a_truncated_config_json_is_an_hf_error_naming_the_file(tmp_path):
  directory = copy_of("llama", tmp_path)
  text = (directory / "config.json").read_text()
  (directory / "config.json").write_text(text[:len(text) // 2])
  with pytest.raises(hf.HFError, match=r"config.json' is not valid JSON \(line \d+, column "
                     r"\d+: .*\)\. A download or save_pretrained cut short leaves it "
                     r"truncated: fetch or save the checkpoint again\."):
    layers.from_hf(directory)


def test_a_config_with_dropout_loads_with_a_warning_that_says_what_it_means():
  config = json.loads((DATA / "llama" / "config.json").read_text())
  with pytest.warns(UserWarning, match=re.escape(
      "sets {'attention_dropout': 0.1}; layers has no dropout: the logits equal transformers' "
      "eval mode (inference is exact), and a fine-tune from it trains without dropout.")):
    cfg, _ = hf.config_from_hf({**config, "attention_dropout": 0.1})
  assert cfg == hf.config_from_hf(config)[0]
