"""``python -m recipes.export``: a linen run's checkpoint as canonical weights, loaded into
Haiku and NNX (``layers.from_canonical``) gives the logits of the trained linen model.

Reference: the trained params restored by the training recipe's own resume path
(``Checkpointer.restore_like`` onto the run's 8-device shardings) applied by linen.
"""

import json

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from job_testlib import REPO, TINY

import layers
from layers import haiku as layers_hk
from layers import linen as layers_linen
from layers import nnx as layers_nnx
from recipes import checkpoint, export, train
from recipes.config import load_config

RUN = [*TINY, "checkpoint_every=1", "framework=linen"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A 3-step linen run (checkpoints at steps 1, 2 and 3), its trained params and logits."""
  out = tmp_path_factory.mktemp("run")
  config = load_config(train.default_config_path(), RUN + [f"out_dir={out}"])
  train.train(config, progress=False, out=open("/dev/null", "w"))
  run = train.build_run(config)
  init_params = jax.tree.map(np.asarray, run.state["params"])
  ckpt = checkpoint.Checkpointer(out / "checkpoints")
  params = ckpt.restore_like(3, run.state)["params"]
  ckpt.close()
  tokens = jax.random.randint(jax.random.key(7), (2, 8), 0, config.model.vocab_size)
  logits = np.asarray(run.model.apply(params, tokens))
  return {"out": out, "config": config, "params": params, "init": init_params,
          "tokens": tokens, "logits": logits}


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
  path = tmp_path_factory.mktemp("export") / "weights.npz"
  assert export.main(["--checkpoint", str(trained["out"]), "--out", str(path)]) == 0
  return path


@pytest.mark.slow
def test_training_changed_the_params(trained):
  moved = [not np.array_equal(a, np.asarray(b)) for a, b in
           zip(jax.tree.leaves(trained["init"]), jax.tree.leaves(trained["params"]))]
  assert all(moved)


def test_files_and_config(trained, exported):
  doc = json.loads(exported.with_suffix(".json").read_text())
  assert doc["framework"] == "linen" and doc["step"] == 3
  weights, model_config = export.load(exported)
  assert model_config == trained["config"].model
  assert sorted(doc["weights"]) == sorted(weights)
  # every parameter exactly once, blocks stacked on a leading layers dim
  assert sum(w.size for w in weights.values()) == sum(
      x.size for x in jax.tree.leaves(trained["params"]))
  assert weights["blocks/attn/query/kernel"].shape == (1, 16, 2, 8)
  assert not list(exported.parent.glob("*.tmp*"))  # atomic writes leave nothing behind


@pytest.mark.slow
def test_linen_round_trip_is_exact(trained, exported):
  weights, model_config = export.load(exported)
  tokens = trained["tokens"]
  fresh = layers_linen.Transformer(model_config).init(jax.random.key(1), tokens)
  loaded = layers.from_canonical(weights, like=fresh)
  theirs = jax.tree.leaves(trained["params"])
  ours = jax.tree.leaves(loaded["params"])
  assert len(ours) == len(theirs)
  for a, b in zip(ours, theirs):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_haiku_logits_equal_linen(trained, exported):
  weights, model_config = export.load(exported)
  tokens = trained["tokens"]
  model = hk.transform(lambda t: layers_hk.Transformer(model_config)(t))
  fresh = model.init(jax.random.key(1), tokens)
  loaded = layers.from_canonical(weights, like=fresh)
  logits = model.apply(loaded, None, tokens)
  np.testing.assert_allclose(logits, trained["logits"], rtol=1e-5, atol=1e-6)
  # a model that did not get the weights disagrees (the comparison can fail)
  assert not np.allclose(model.apply(fresh, None, tokens), trained["logits"], rtol=1e-2)


def test_nnx_logits_equal_linen(trained, exported):
  weights, model_config = export.load(exported)
  tokens = trained["tokens"]
  fresh = layers_nnx.Transformer(model_config, rngs=nnx.Rngs(1))
  loaded = layers.from_canonical(weights, like=fresh)
  np.testing.assert_allclose(loaded(jnp.asarray(tokens)), trained["logits"], rtol=1e-5,
                             atol=1e-6)


def test_step_choice_and_errors(trained, tmp_path, capsys):
  first = tmp_path / "step1.npz"
  assert export.main(["--checkpoint", str(trained["out"] / "checkpoints"), "--step", "1",
                      "--out", str(first)]) == 0
  assert json.loads(first.with_suffix(".json").read_text())["step"] == 1
  w1, _ = export.load(first)
  w2 = layers.to_canonical(jax.tree.map(np.asarray, trained["params"]))
  assert not np.array_equal(w1["embed/embedding"], np.asarray(w2["embed/embedding"]))

  assert export.main(["--checkpoint", str(trained["out"]), "--step", "7",
                      "--out", str(tmp_path / "x.npz")]) == 2
  assert "--step 7: no such checkpoint" in (err := capsys.readouterr().err)
  assert "it has steps [1, 2, 3]" in err
  assert export.main(["--checkpoint", str(tmp_path / "nope"), "--out",
                      str(tmp_path / "x.npz")]) == 2
  assert "does not exist. Pass the out_dir" in capsys.readouterr().err
  assert export.main(["--checkpoint", str(trained["out"]), "--out",
                      str(tmp_path / "missing_dir" / "x.npz")]) == 2
  assert "does not exist" in capsys.readouterr().err
  assert not (tmp_path / "x.npz").exists()


@pytest.mark.slow
def test_bfloat16_params_round_trip_exactly(tmp_path):
  """npz has no bfloat16: weights are stored as float32 (exact) and cast back on loading."""
  out = tmp_path / "bf16"
  config = load_config(train.default_config_path(),
                       RUN + [f"out_dir={out}", "model.param_dtype=bfloat16",
                               "model.dtype=bfloat16"])
  run = train.build_run(config)  # a checkpoint as train() writes it (init params suffice)
  trained = run.state["params"]
  ckpt = checkpoint.Checkpointer(out / "checkpoints")
  ckpt.save(1, run.state, run.state_axes, {"config": config.to_dict(),
                                           "rules": run.rules.to_dict()})
  ckpt.close()
  path = tmp_path / "w.npz"
  assert export.main(["--checkpoint", str(out), "--out", str(path)]) == 0
  weights, model_config = export.load(path)
  assert model_config.param_dtype == jnp.bfloat16
  assert {w.dtype for w in weights.values()} == {np.dtype(np.float32)}
  tokens = jnp.zeros((1, 8), jnp.int32)
  fresh = layers_linen.Transformer(model_config).init(jax.random.key(1), tokens)
  loaded = layers.from_canonical(weights, like=fresh)["params"]
  for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(trained)):
    assert a.dtype == b.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.slow
def test_to_hf_round_trips_the_trained_params(trained, tmp_path, capsys):
  """--to hf: a transformers directory from which layers.from_hf gives back the trained
  params bit for bit (the default model ties its output layer: Llama, tied)."""
  out = tmp_path / "hf"
  assert export.main(["--checkpoint", str(trained["out"]), "--to", "hf", "--out",
                      str(out)]) == 0
  assert "model.safetensors, config.json" in capsys.readouterr().out
  doc = json.loads((out / "config.json").read_text())
  assert doc["architectures"] == ["LlamaForCausalLM"] and doc["tie_word_embeddings"]
  weights, model_config = layers.from_hf(out)
  assert model_config == trained["config"].model
  tokens = trained["tokens"]
  fresh = layers_linen.Transformer(model_config).init(jax.random.key(1), tokens)
  loaded = layers.from_canonical(weights, like=fresh)
  for a, b in zip(jax.tree.leaves(loaded["params"]), jax.tree.leaves(trained["params"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # the reference logits come from the 8-device sharded params (another summation order)
  logits = layers_linen.Transformer(model_config).apply(loaded, tokens)
  np.testing.assert_allclose(np.asarray(logits), trained["logits"], rtol=1e-5, atol=1e-6)


def test_to_hf_errors(trained, tmp_path, capsys):
  assert export.main(["--checkpoint", str(trained["out"]), "--to", "hf", "--architecture",
                      "qwen2", "--out", str(tmp_path / "hf")]) == 2
  assert "qkv_bias=False but architecture='qwen2'" in capsys.readouterr().err


@pytest.mark.slow  # a fine-tune, its export and two generations
def test_a_fine_tune_exported_to_hf_keeps_its_base_models_tokens(tmp_path):
  """The export dropped eos_token_id (generation from it never stopped early), the base
  model's tokenizer files and its architecture (a Mistral fine-tune came out as Llama)."""
  import shutil

  from recipes import generate

  base = tmp_path / "base"
  shutil.copytree(REPO / "tests" / "layers" / "data" / "hf" / "mistral", base)
  (base / "tokenizer.json").write_text('{"a stand-in": "copied byte for byte"}\n')
  (base / "generation_config.json").write_text('{"eos_token_id": 2}\n')
  source = json.loads((base / "config.json").read_text())
  run = tmp_path / "run"
  config = load_config(train.default_config_path(), [
      f"init_from={base}", "steps=1", "batch_size=8", "microbatches=1", "seq_len=16",
      "data.task=copy",
      f"out_dir={run}", "plot=false", "mesh={data: 8}", "preset=data_parallel"])
  train.train(config, progress=False, out=open("/dev/null", "w"))
  out = tmp_path / "hf"
  assert export.main(["--checkpoint", str(run), "--to", "hf", "--out", str(out)]) == 0
  written = json.loads((out / "config.json").read_text())
  assert written["model_type"] == source["model_type"] == "mistral"
  for key in ("bos_token_id", "eos_token_id"):
    assert written[key] == source[key], key
  for name in ("tokenizer.json", "generation_config.json"):
    assert (out / name).read_bytes() == (base / name).read_bytes()
  # what python -m recipes.generate stops at, read from each directory
  assert generate._eos_ids(out) == generate._eos_ids(base) == (source["eos_token_id"],)
