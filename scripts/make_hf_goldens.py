"""Builds the tiny Hugging Face checkpoints and golden logits of ``tests/layers/test_hf.py``.

Needs the optional ``[hf]`` extra (``transformers`` and ``torch``); the test suite itself
does not. For each of Llama, Mistral and Qwen2 it builds a small random ``*ForCausalLM`` with
``transformers``, saves it with ``save_pretrained`` (safetensors; Mistral sharded into two
files with a ``model.safetensors.index.json``) and records the reference logits of fixed
tokens::

  python scripts/make_hf_goldens.py                 # writes tests/layers/data/hf/
  python scripts/make_hf_goldens.py --out /tmp/hf   # elsewhere

Every parameter is redrawn (norm scales around 1, biases non-zero, weights with std 0.2) so
that a transposed, mis-split or ignored tensor changes the logits by far more than the test's
tolerance; ``transformers``' own init (std 0.02, unit norms, zero biases) would hide some.
Written files: ``<name>/config.json``, ``<name>/*.safetensors`` and ``<name>/golden.npz``
with ``tokens (2, 12)`` int32 and ``logits (2, 12, vocab)`` float32.
"""

from __future__ import annotations

import argparse
import pathlib

import numpy as np

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "layers" / "data" / "hf"
LENGTH = 12

# Sizes differ per model so a swapped field (heads vs kv heads, tied vs untied) shows up.
COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              max_position_embeddings=64, initializer_range=0.2)
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
}
SHARDED = {"mistral": "60KB"}   # save_pretrained's max_shard_size: two files and an index


def build(name: str, seed: int):
  import torch
  import transformers

  config_cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
                "qwen2": transformers.Qwen2Config}[name]
  model_cls = {"llama": transformers.LlamaForCausalLM,
               "mistral": transformers.MistralForCausalLM,
               "qwen2": transformers.Qwen2ForCausalLM}[name]
  config = config_cls(**COMMON, **MODELS[name])
  config._attn_implementation = "eager"   # the plain softmax reference
  torch.manual_seed(seed)
  model = model_cls(config).to(torch.float32).eval()
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for pname, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=generator, dtype=p.dtype)
      p.copy_(1.0 + 0.1 * noise if pname.endswith("norm.weight") else 0.2 * noise)
  return model


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
    directory = args.out / name
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.glob("*.safetensors*"):
      old.unlink()
    model.save_pretrained(directory, max_shard_size=SHARDED.get(name, "10GB"))
    (directory / "generation_config.json").unlink(missing_ok=True)   # not read by from_hf
    np.savez(directory / "golden.npz", tokens=tokens.astype(np.int32),
             logits=logits.astype(np.float32))
    files = sorted(p.name for p in directory.iterdir())
    print(f"{name}: {files}, logits std {logits.std():.3f}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
