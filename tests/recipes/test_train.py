"""The training recipe: config errors, every preset and framework against one device, outputs,
kill-and-resume, and checkpoints restored onto other meshes.

Reference for the sharded runs: the same config on a one-device mesh with no micro-batching;
the first steps' losses must agree in fp32 (init is sharding-invariant, gradients are those of
the full batch)."""

import json
import pathlib

import jax
import numpy as np
import pytest

import partition
from recipes import checkpoint, train
from recipes.config import TrainConfigError, load_config

TINY = ["model.embed_dim=16", "model.mlp_dim=32", "model.num_heads=2", "model.num_kv_heads=1",
        "model.head_dim=8", "model.num_layers=1", "batch_size=16", "seq_len=8", "steps=3",
        "eval_every=3", "eval_batches=1", "checkpoint_every=0", "plot=false", "log_every=1"]


def _config(tmp_path, *overrides):
  return load_config(train.default_config_path(),
                     TINY + [f"out_dir={tmp_path}"] + list(overrides))


def _losses(out_dir) -> list[float]:
  lines = pathlib.Path(out_dir, "metrics.jsonl").read_text().splitlines()
  return [json.loads(line)["loss"] for line in lines]


def _run(tmp_path, name, *overrides, **kwargs):
  out = tmp_path / name
  train.train(_config(out, *overrides), progress=False, out=open("/dev/null", "w"), **kwargs)
  return out


# ---------------------------------------------------------------------------- config


def test_config_errors_name_the_key_and_list_the_valid_ones():
  with pytest.raises(TrainConfigError) as e:
    load_config(overrides=["stpes=10", "model.embed_dimm=3", "microbatches=two",
                           "mesh={data: x}"])
  message = str(e.value)
  assert "unknown key 'stpes'. Did you mean 'steps'?" in message
  assert "unknown key 'model.embed_dimm'. Did you mean 'embed_dim'?" in message
  assert "microbatches='two': expected an integer" in message
  assert "mesh={'data': 'x'}: expected a mapping {mesh axis: size}" in message
  assert "config: 4 problem(s)." in message  # value checks come after the key checks
  assert "Valid keys: batch_size, checkpoint_every, data.*" in message


def test_config_semantic_errors_and_files(tmp_path):
  with pytest.raises(TrainConfigError, match=r"framework='linnen' must be one of \['linen', "
                                             r"'nnx', 'haiku'\]\. Did you mean 'linen'\?"):
    load_config(overrides=["framework=linnen"])
  bad = tmp_path / "bad.yaml"
  bad.write_text("steps: 5\noptimiser:\n  learning_rate: 1\n")
  with pytest.raises(TrainConfigError, match=r"unknown key 'optimiser'\. Did you mean "
                                             r"'optimizer'\?"):
    load_config(bad)
  good = tmp_path / "good.yaml"
  good.write_text("steps: 5\noptimizer:\n  learning_rate: 0.01\nmodel:\n  num_layers: 3\n")
  cfg = load_config(good, ["model.num_layers=4"])
  assert (cfg.steps, cfg.optimizer.learning_rate, cfg.model.num_layers) == (5, 0.01, 4)
  with pytest.raises(TrainConfigError, match="cannot read"):
    load_config(tmp_path / "missing.yaml")
  with pytest.raises(TrainConfigError, match=r"preset='fdsp' is neither a preset .* Did you "
                                             r"mean 'fsdp'\?"):
    train.make_rules(load_config(overrides=["preset=fdsp"]))


def test_main_reports_config_errors(capsys):
  assert train.main(["stpes=3"]) == 2
  assert "Did you mean 'steps'?" in capsys.readouterr().err


# ---------------------------------------------------------------- strategies = one device

PRESETS = {
    "data_parallel": "{data: 8}",
    "fsdp": "{data: 2, fsdp: 4}",
    "tensor_parallel": "{data: 4, tensor: 2}",
    "fsdp_tp": "{data: 2, fsdp: 2, tensor: 2}",
    "sequence_parallel": "{data: 2, sequence: 4}",
    "microbatch": "{data: 8}",
}


@pytest.fixture(scope="module")
def single_device_losses(tmp_path_factory):
  cache = {}

  def get(framework="linen", *extra):
    key = (framework, extra)
    if key not in cache:
      out = _run(tmp_path_factory.mktemp("ref"), "ref", f"framework={framework}",
                 "preset=data_parallel", "mesh={data: 1}", "microbatches=1", *extra)
      cache[key] = _losses(out)
    return cache[key]

  return get


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_equals_one_device(tmp_path, preset, single_device_losses):
  if preset == "microbatch":  # it brings its own loop (SerialLoop(4) on 'batch'): 32 = 8 x 4
    extra, micro = ("batch_size=32",), "microbatches=null"
  else:
    extra, micro = (), "microbatches=2"
  out = _run(tmp_path, preset, f"preset={preset}", f"mesh={PRESETS[preset]}", micro, *extra)
  np.testing.assert_allclose(_losses(out), single_device_losses("linen", *extra), rtol=1e-5)


def test_expert_parallel_preset_equals_one_device(tmp_path, single_device_losses):
  moe = ("model.num_experts=4", "model.experts_per_token=2")
  out = _run(tmp_path, "ep", "preset=expert_parallel", "mesh={data: 2, expert: 4}", *moe)
  np.testing.assert_allclose(_losses(out), single_device_losses("linen", *moe), rtol=1e-5)


@pytest.mark.parametrize("framework", ["nnx", "haiku"])
def test_frameworks_with_microbatches_equal_one_device(tmp_path, framework,
                                                       single_device_losses):
  out = _run(tmp_path, framework, f"framework={framework}", "microbatches=4")
  np.testing.assert_allclose(_losses(out), single_device_losses(framework), rtol=1e-5)


# ------------------------------------------------------------------------- outputs


def test_outputs(tmp_path):
  out = _run(tmp_path, "run", "steps=4", "eval_every=2", "plot=true")
  records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == [1, 2, 3, 4]
  assert all(np.isfinite(r["loss"]) for r in records)
  evals = [r for r in records if "eval_loss" in r]
  assert [r["step"] for r in evals] == [2, 4]
  assert all(0.0 <= r["accuracy"] <= 1.0 for r in evals)
  assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  summary = json.loads((out / "summary.json").read_text())
  assert summary["final_loss"] == records[-1]["loss"]
  assert summary["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2}
  assert 0 < summary["param_bytes_per_device"] < summary["param_bytes_total"]


def test_byte_level_lm_on_a_text_file(tmp_path):
  text = tmp_path / "corpus.txt"
  text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
  out = _run(tmp_path, "lm", f"data.path={text}", "model.vocab_size=256", "steps=2")
  assert all(np.isfinite(_losses(out)))
  assert _losses(out)[0] == pytest.approx(np.log(256), rel=0.1)  # uniform at start


# ------------------------------------------------------------------- checkpoints


def test_kill_and_resume_gives_the_identical_loss_sequence(tmp_path):
  straight = _run(tmp_path, "straight", "steps=6", "checkpoint_every=2")
  killed = tmp_path / "killed"
  cfg = _config(killed, "steps=6", "checkpoint_every=2")
  train.train(cfg, progress=False, out=open("/dev/null", "w"), stop_after=3)  # dies at 3
  assert checkpoint.Checkpointer(killed / "checkpoints").latest_step() == 2
  train.train(_config(killed, "steps=6", "checkpoint_every=2", "resume=true"),
              progress=False, out=open("/dev/null", "w"))
  assert _losses(killed) == _losses(straight)  # bit-identical, steps 1..6


def test_restore_on_other_meshes_is_bit_identical(tmp_path):
  out = _run(tmp_path, "src", "steps=2", "microbatches=1")
  ckpt = checkpoint.Checkpointer(out / "checkpoints")
  devices = jax.devices()
  meshes = [jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), devices=devices),
            jax.make_mesh((1, 2, 2), ("data", "fsdp", "tensor"), devices=devices[:4]),
            jax.make_mesh((1, 1, 1), ("data", "fsdp", "tensor"), devices=devices[:1])]
  restored = [ckpt.restore_on(None, mesh)[0] for mesh in meshes]
  ckpt.close()
  reference = jax.tree.map(np.asarray, restored[0])
  for state, mesh in zip(restored[1:], meshes[1:]):
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), state, reference)
    leaves = jax.tree.leaves(state["params"])
    assert all(x.sharding.mesh.size == mesh.size for x in leaves)
  # the 4-device copy shards each kernel by its recorded logical axes, not replicated
  meta = checkpoint.Checkpointer(out / "checkpoints").meta(2)
  rules = partition.AxisRules.from_dict(meta["rules"])
  flat = {checkpoint.path_of(p): x
          for p, x in jax.tree_util.tree_flatten_with_path(restored[1])[0]}
  kernels = [p for p in flat if p.startswith("params/") and p.endswith("kernel")]
  assert kernels
  for path in kernels:
    want = rules.spec(tuple(meta["logical_axes"][path]), flat[path].shape, meshes[1])
    assert flat[path].sharding.spec == want and any(want), (path, flat[path].sharding.spec)
  # and 8 -> 4 -> 1 through a save on 4 devices
  relay = checkpoint.Checkpointer(tmp_path / "relay")
  relay.save(2, restored[1], None, {"rules": partition.AxisRules.from_dict(
      meta["rules"]).to_dict()})
  relay.wait()
  again, _ = relay.restore_on(2, meshes[2])
  relay.close()
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), again, reference)
