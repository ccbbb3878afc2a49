"""``recipes.init_from``: fine-tuning starts from a Hugging Face checkpoint under any preset.

References: the one-device run of the same steps (the ``fsdp_tp`` run on 8 devices must give
the same losses), and ``transformers``' own logits of the checkpoint
(``tests/layers/data/hf/*/golden.npz``) for the first loss.
"""

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import partition
from recipes import init_from, train
from recipes.config import load_config

DATA = pathlib.Path(__file__).parents[1] / "layers" / "data" / "hf"
STEPS = 3


def run_config(name, framework, mesh, preset="fsdp_tp", overrides=()):
  overrides = [f"framework={framework}", f"preset={preset}", f"mesh={mesh}", "seq_len=12",
               "batch_size=4", *overrides]
  config = load_config(train.default_config_path(), overrides)
  model = init_from.resolve_model(DATA / name, config.model,
                                  init_from.explicit_model_fields(overrides))
  return dataclasses.replace(config, model=model)


def batch(name):
  with np.load(DATA / name / "golden.npz") as f:
    tokens, logits = f["tokens"], f["logits"]
  inputs = np.concatenate([tokens, tokens[:, ::-1]])        # batch 4
  targets = np.roll(inputs, -1, axis=1)
  return ({"inputs": inputs, "targets": targets, "mask": np.ones(inputs.shape, np.float32)},
          logits)


def losses(name, config, data):
  """The first ``STEPS`` AdamW losses of a fine-tune started with ``init_from``."""
  mesh, rules = train.make_mesh(config), train.make_rules(config)
  model = init_from.build_model(DATA / name, config, rules=rules, mesh=mesh)
  tx = optax.adamw(1e-2)
  # On the mesh from the start, as the job creates it (Adam's count replicated): the step's
  # outputs have the inputs' shardings, so it compiles once for all STEPS calls.
  params = model.params
  opt_state = partition.optimizer_init(tx, params, param_axes=model.param_axes, rules=rules,
                                       mesh=mesh)

  @jax.jit
  def step(params, opt_state, batch):
    with partition.axis_rules(rules, mesh):
      (loss, _), grads = jax.value_and_grad(
          lambda p: train.masked_loss(model.apply, p, batch), has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  out = []
  for _ in range(STEPS):
    params, opt_state, loss = step(params, opt_state, {k: jnp.asarray(v)
                                                       for k, v in data.items()})
    out.append(float(loss))
  return out, model


@pytest.mark.slow
@pytest.mark.parametrize("framework, name", [("linen", "llama"), ("nnx", "qwen2"),
                                             ("haiku", "mistral")])
def test_fsdp_tp_fine_tune_equals_one_device(framework, name):
  data, golden_logits = batch(name)
  sharded = run_config(name, framework, "{data: 2, fsdp: 2, tensor: 2}")
  single = run_config(name, framework, "{data: 1, fsdp: 1, tensor: 1}")
  ours, model = losses(name, sharded, data)
  reference, _ = losses(name, single, data)
  np.testing.assert_allclose(ours, reference, rtol=1e-5)
  assert ours[-1] < ours[0]                                  # it trains
  # the params really are sharded by the preset (embed over fsdp somewhere)
  specs = [x.sharding.spec for x in jax.tree.leaves(model.params)]
  assert any("fsdp" in jax.tree.leaves(tuple(s)) for s in specs)
  # step 0's loss is the cross-entropy of transformers' own logits of the first two rows
  ce = optax.softmax_cross_entropy_with_integer_labels(jnp.asarray(golden_logits),
                                                       jnp.asarray(data["targets"][:2]))
  first_half = losses_rows(model, data)
  np.testing.assert_allclose(first_half, ce, rtol=1e-4, atol=1e-4)


def losses_rows(model, data):
  """Per-token cross-entropy of rows 0-1 with the loaded (untrained) params."""
  # jitted: one compile instead of one per eager op of the forward pass (same function)
  logits = jax.jit(model.apply)(model.params, jnp.asarray(data["inputs"][:2]))
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), jnp.asarray(data["targets"][:2]))


def test_model_comes_from_the_checkpoint():
  config = load_config(train.default_config_path(), ["model.dtype=bfloat16"])
  model = init_from.resolve_model(DATA / "llama", config.model, {"dtype"})
  assert (model.vocab_size, model.embed_dim, model.head_dim, model.rope_theta,
          model.tie_embeddings) == (96, 32, 16, 500_000.0, False)
  assert model.dtype == jnp.bfloat16                        # a run field: the run decides
  assert init_from.resolve_model(DATA / "llama", dataclasses.replace(
      config.model, max_len=8), {"max_len"}).max_len == 8  # shrinking max_len is allowed


def test_how_the_run_computes_is_the_runs_choice():
  overrides = ["model.attention=blockwise", "model.attention_block=16", "model.loss_chunk=8"]
  config = load_config(train.default_config_path(), overrides)
  model = init_from.resolve_model(DATA / "llama", config.model,
                                  init_from.explicit_model_fields(overrides))
  assert (model.attention, model.attention_block, model.loss_chunk) == ("blockwise", 16, 8)
  assert (model.num_layers, model.embed_dim) == (2, 32)     # the rest from the checkpoint


def test_conflicting_overrides_are_errors():
  overrides = ["model.num_layers=4", "model.embed_dim=32", "model.rope_theta=10000.0",
               "model.max_len=128"]
  config = load_config(train.default_config_path(), overrides)
  with pytest.raises(init_from.InitFromError) as e:
    init_from.resolve_model(DATA / "llama", config.model,
                            init_from.explicit_model_fields(overrides))
  message = str(e.value)
  assert "3 model override(s) contradict the checkpoint's config.json" in message
  assert "model.num_layers=4, but the checkpoint has num_layers=2" in message
  assert "model.rope_theta=10000.0, but the checkpoint has rope_theta=500000.0" in message
  assert "model.max_len=128, but the checkpoint has max_len=64" in message
  assert "embed_dim" not in message.split("Drop")[0]        # agreeing with it is fine
  assert "Drop these model.* overrides" in message


def test_build_model_refuses_an_unresolved_config():
  config = load_config(train.default_config_path(), ["mesh={data: 1, fsdp: 1, tensor: 1}"])
  mesh, rules = train.make_mesh(config), train.make_rules(config)
  with pytest.raises(init_from.InitFromError, match="is not the checkpoint's"):
    init_from.build_model(DATA / "llama", config, rules=rules, mesh=mesh)


def test_missing_checkpoint(tmp_path):
  config = load_config(train.default_config_path())
  with pytest.raises(init_from.InitFromError, match="has no config.json"):
    init_from.resolve_model(tmp_path, config.model)


@pytest.mark.slow
def test_train_cli_init_from_then_export_to_hf_keeps_the_weights(tmp_path):
  """``python -m recipes.train init_from=DIR`` with a zero learning rate, then
  ``python -m recipes.export --to hf``: every tensor equals the checkpoint's (bit-exact), so
  the run started from the checkpoint's weights, sharded (fsdp_tp on 8 devices), and the
  export wrote them back in Hugging Face's layout."""
  from safetensors.numpy import load_file

  from recipes import export
  run = tmp_path / "run"
  rc = train.main([f"init_from={DATA / 'llama'}", "steps=2", "optimizer.learning_rate=0",
                   "data.task=copy", "seq_len=12", "batch_size=8", "eval_every=100", "plot=false",
                   f"out_dir={run}"])
  assert rc == 0
  assert export.main(["--checkpoint", str(run), "--to", "hf", "--out", str(tmp_path / "hf")]) == 0
  original = {}
  for f in sorted((DATA / "llama").glob("*.safetensors")):
    original.update(load_file(f))
  written = {}
  for f in sorted((tmp_path / "hf").glob("*.safetensors")):
    written.update(load_file(f))
  assert written.keys() == original.keys()
  for name, value in original.items():
    np.testing.assert_array_equal(written[name], value, err_msg=name)


def test_train_cli_rejects_a_conflicting_model_override(tmp_path, capsys):
  rc = train.main([f"init_from={DATA / 'llama'}", "model.num_layers=7", "steps=1",
                   f"out_dir={tmp_path / 'run'}"])
  assert rc == 2
  err = capsys.readouterr().err
  assert "model.num_layers=7, but the checkpoint has num_layers=2" in err
  assert "Drop these model.* overrides" in err


def test_train_cli_rejects_a_checkpoint_it_cannot_express(tmp_path, capsys):
  """A config.json layers cannot compute (yarn RoPE): rc 2 and a message naming it."""
  import json
  import shutil
  directory = pathlib.Path(shutil.copytree(DATA / "llama3", tmp_path / "ckpt"))
  hf = json.loads((directory / "config.json").read_text())
  hf["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
  (directory / "config.json").write_text(json.dumps(hf))
  rc = train.main([f"init_from={directory}", "steps=1", f"out_dir={tmp_path / 'run'}"])
  assert rc == 2
  assert "rope_parameters.rope_type='yarn': layers computes rope_type 'default', 'linear' " \
         "and 'llama3' only" in capsys.readouterr().err


def test_new_families_resolve_from_their_checkpoints():
  config = load_config(train.default_config_path(), ["steps=1"])
  for name, field, value in (("llama3", "rope_scaling", layers_scaling()),
                             ("qwen3", "qk_norm", True), ("mixtral", "num_experts", 4)):
    model = init_from.resolve_model(DATA / name, config.model)
    assert getattr(model, field) == value, name


def layers_scaling():
  import layers
  return layers.RopeScaling("llama3", 8.0, 1.0, 4.0, 128)


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["linen", "nnx", "haiku"])
def test_the_params_to_fill_are_abstract_with_the_real_shardings(framework):
  """build_model fills an abstract build (no random init beside the loaded weights): its
  shapes, dtypes, shardings and logical axes are those of the real sharded init."""
  from recipes import model as model_lib
  config = run_config("llama", framework, "{data: 2, fsdp: 2, tensor: 2}")
  mesh, rules = train.make_mesh(config), train.make_rules(config)
  kwargs = dict(seed=0, example=model_lib.example_tokens(4, 12), rules=rules, mesh=mesh)
  real = model_lib.build(framework, config.model, **kwargs)
  abstract = model_lib.build(framework, config.model, abstract=True, **kwargs)
  assert abstract.param_axes == real.param_axes
  real_leaves, treedef = jax.tree.flatten(real.params)
  abstract_leaves, abstract_treedef = jax.tree.flatten(abstract.params)
  assert abstract_treedef == treedef
  for want, got in zip(real_leaves, abstract_leaves, strict=True):
    assert isinstance(got, jax.ShapeDtypeStruct)
    assert (got.shape, got.dtype, got.sharding) == (want.shape, want.dtype, want.sharding)


def test_build_model_runs_no_random_init(monkeypatch):
  """The loaded weights are the only params ever created: a random sharded init would fail
  here; the params hold the checkpoint's tensors (read back with safetensors' own reader)."""
  from safetensors.numpy import load_file

  import layers
  import partition.flax

  def no_init(*args, **kwargs):
    raise AssertionError("build_model ran a random init beside the loaded weights")

  monkeypatch.setattr(partition.flax, "init_sharded", no_init)
  config = run_config("llama", "linen", "{data: 2, fsdp: 2, tensor: 2}")
  model = init_from.build_model(DATA / "llama", config, rules=train.make_rules(config),
                                mesh=train.make_mesh(config))
  canonical = layers.to_canonical(model.params)
  tensors = {}
  for f in sorted((DATA / "llama").glob("*.safetensors")):
    tensors.update(load_file(f))
  np.testing.assert_array_equal(np.asarray(canonical["embed/embedding"]),
                                tensors["model.embed_tokens.weight"])
