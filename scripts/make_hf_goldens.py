"""Builds the tiny Hugging Face checkpoints and golden logits of ``tests/layers/test_hf.py``.

Needs the optional ``[hf]`` extra (``transformers`` and ``torch``); the test suite itself
does not. For each model of ``MODELS`` (Llama, Llama with ``llama3`` and with ``linear`` RoPE
scaling, Mistral, Qwen2, Qwen3, Mixtral) it builds a small random ``*ForCausalLM`` with
``transformers``, saves it with ``save_pretrained`` (safetensors; Mistral sharded into two
files with a ``model.safetensors.index.json``) and records the reference logits of fixed
tokens and the greedy continuation ``generate`` makes of a prompt::

  python scripts/make_hf_goldens.py                 # writes tests/layers/data/hf/
  python scripts/make_hf_goldens.py --out /tmp/hf   # elsewhere

Every parameter is redrawn (norm scales around 1, biases non-zero, weights with std 0.2) so
that a transposed, mis-split or ignored tensor changes the logits by far more than the test's
tolerance; ``transformers``' own init (std 0.02, unit norms, zero biases) would hide some.
Written files: ``<name>/config.json``, ``<name>/*.safetensors`` and ``<name>/golden.npz``
with ``tokens (2, 12)`` int32 and ``logits (2, 12, vocab)`` float32 (one forward pass), and
the greedy decode: ``prompt (2, 5)`` int32 (the first 5 tokens), ``generated (2, 5 + 8)``
int32 (``generate(prompt, max_new_tokens=8, do_sample=False)`` with the KV cache, no
end-of-sequence stop) and ``generated_scores (2, 8, vocab)`` float32, the logits each new
token was the argmax of (so a decode test can see how clear each choice was).
"""

from __future__ import annotations

import argparse
import pathlib

import numpy as np

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "layers" / "data" / "hf"
LENGTH = 12
PROMPT, NEW_TOKENS = 5, 8

# Sizes differ per model so a swapped field (heads vs kv heads, tied vs untied) shows up.
COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              max_position_embeddings=64, initializer_range=0.2)
# llama3 RoPE with head_dim 8, theta 1e4: wavelengths 6.3, 63, 628, 6283 against the
# thresholds 128 / 4 = 32 and 128 / 1 = 128: one pair kept, one interpolated, two divided.
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10_000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 128}
MODELS = {
    # head_dim 16 != hidden_size / heads = 8: HF's explicit head_dim; untied output layer.
    "llama": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  rms_norm_eps=1e-6, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 500_000.0}),
    # sliding_window 16 >= the 12 tokens: full causal attention on them; eps 1e-5; MQA.
    "mistral": dict(num_attention_heads=4, num_key_value_heads=1, head_dim=8,
                    rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=16,
                    rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}),
    # q/k/v biases, tied embeddings, no head_dim field (hidden_size / heads = 8).
    "qwen2": dict(num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                  tie_word_embeddings=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}),
    # Llama 3.1-style scaled RoPE (see LLAMA3; 1024 = 8 x the original 128 positions); MQA,
    # tied embeddings.
    "llama3": dict(num_attention_heads=4, num_key_value_heads=1, head_dim=8,
                   max_position_embeddings=1024,
                   rms_norm_eps=1e-5, tie_word_embeddings=True, rope_parameters=LLAMA3),
    # linear RoPE scaling (every frequency / 4); GQA, untied.
    "llama_linear": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         rms_norm_eps=1e-6, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "linear", "rope_theta": 10_000.0,
                                          "factor": 4.0}),
    # per-head q/k RMSNorm, no biases; head_dim 16 != 32 / 4; tied.
    "qwen3": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  rms_norm_eps=1e-6, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}),
    # sparse MoE: 4 experts of width 24, top-2; GQA, untied.
    "mixtral": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                    rms_norm_eps=1e-5, tie_word_embeddings=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}),
}
FAMILY = {"llama3": "llama", "llama_linear": "llama"}   # transformers' class of a model
SHARDED = {"mistral": "60KB"}   # save_pretrained's max_shard_size: two files and an index


def build(name: str, seed: int):
  """The golden model ``name`` (``MODELS``), drawn from ``seed``."""
  return random_model(FAMILY.get(name, name), {**COMMON, **MODELS[name]}, seed)


def random_model(family: str, fields: dict, seed: int):
  """A ``transformers`` ``family`` model of config ``fields``, every parameter redrawn."""
  import torch
  import transformers

  prefix = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3",
            "mixtral": "Mixtral"}[family]
  config = getattr(transformers, prefix + "Config")(**fields)
  model_cls = getattr(transformers, prefix + "ForCausalLM")
  config._attn_implementation = "eager"   # the plain softmax reference
  torch.manual_seed(seed)
  model = model_cls(config).to(torch.float32).eval()
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for pname, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=generator, dtype=p.dtype)
      p.copy_(1.0 + 0.1 * noise if pname.endswith("norm.weight") else 0.2 * noise)
  return model


def greedy(model, prompt: np.ndarray, new_tokens: int = NEW_TOKENS):
  """``(tokens (batch, prompt + new), scores (batch, new, vocab))`` of ``transformers``'
  greedy ``generate`` (KV cache, no end-of-sequence stop: every row gets ``new`` tokens)."""
  import torch

  model.generation_config.eos_token_id = None   # a random model may emit "eos" anywhere
  model.generation_config.pad_token_id = 0
  with torch.no_grad():
    out = model.generate(torch.from_numpy(prompt), max_new_tokens=new_tokens, do_sample=False,
                         attention_mask=torch.ones(prompt.shape, dtype=torch.long),
                         output_scores=True, return_dict_in_generate=True)
  tokens = out.sequences.numpy()
  scores = torch.stack(out.scores, dim=1).numpy()
  assert tokens.shape == (prompt.shape[0], prompt.shape[1] + new_tokens), tokens.shape
  assert (tokens[:, prompt.shape[1]:] == scores.argmax(-1)).all()
  return tokens, scores


def main(argv=None) -> int:
  import torch

  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", type=pathlib.Path, default=OUT)
  args = parser.parse_args(argv)
  tokens = np.random.default_rng(0).integers(0, COMMON["vocab_size"], (2, LENGTH),
                                             dtype=np.int64)
  for seed, name in enumerate(MODELS):
    model = build(name, seed)
    with torch.no_grad():
      logits = model(torch.from_numpy(tokens)).logits.numpy()
    generated, scores = greedy(model, tokens[:, :PROMPT])
    directory = args.out / name
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.glob("*.safetensors*"):
      old.unlink()
    model.save_pretrained(directory, max_shard_size=SHARDED.get(name, "10GB"))
    (directory / "generation_config.json").unlink(missing_ok=True)   # not read by from_hf
    np.savez(directory / "golden.npz", tokens=tokens.astype(np.int32),
             logits=logits.astype(np.float32), prompt=tokens[:, :PROMPT].astype(np.int32),
             generated=generated.astype(np.int32),
             generated_scores=scores.astype(np.float32))
    files = sorted(p.name for p in directory.iterdir())
    top2 = np.sort(scores, axis=-1)[..., -2:]
    print(f"{name}: {files}, logits std {logits.std():.3f}, greedy margin "
          f"{(top2[..., 1] - top2[..., 0]).min():.3f}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
