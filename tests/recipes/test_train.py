"""The training recipe: config errors, outputs, kill-and-resume, and checkpoints restored onto
other meshes. Every preset and framework against one device: test_readme_commands.py."""

import io
import json
import pathlib
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest
import yaml
from jax.sharding import AxisType
from job_testlib import TINY, losses
from mesh_testlib import make_mesh

import partition
from recipes import checkpoint, data, rundir, train
from recipes import config as config_lib
from recipes.config import TrainConfigError, load_config

REPO = pathlib.Path(__file__).resolve().parents[2]


def _config(tmp_path, *overrides):
  return load_config(train.default_config_path(),
                     TINY + [f"out_dir={tmp_path}"] + list(overrides))


def _run(tmp_path, name, *overrides, **kwargs):
  out = tmp_path / name
  train.train(_config(out, *overrides), progress=False, out=io.StringIO(), log=io.StringIO(),
              **kwargs)
  return out


# ---------------------------------------------------------------------------- config


def test_config_errors_name_the_key_and_list_the_valid_ones():
  with pytest.raises(TrainConfigError) as e:
    load_config(overrides=["stpes=10", "model.embed_dimm=3", "microbatches=two",
                           "mesh={data: x}"])
  message = str(e.value)
  assert "unknown key 'stpes' (did you mean 'steps'?)." in message
  assert "unknown key 'model.embed_dimm' (did you mean 'model.embed_dim'?)." in message
  assert "microbatches='two': expected an integer" in message
  assert "mesh={'data': 'x'}: expected a mapping {mesh axis: size}" in message
  assert "config: 4 problem(s)." in message  # value checks come after the key checks
  assert "Every key: docs/training.md#config-keys." in message


def test_nested_keys_get_suggestions_and_their_section_keys():
  with pytest.raises(TrainConfigError) as e:
    load_config(overrides=["optimizer.lr=0.1", "data.tsak=copy"])
  message = str(e.value)
  assert "unknown key 'optimizer.lr' (did you mean 'optimizer.learning_rate'?)." in message
  assert "unknown key 'data.tsak' (did you mean 'data.task'?)." in message
  assert "Valid keys" not in message  # a close match needs no list


def test_model_errors_give_command_line_advice():
  with pytest.raises(TrainConfigError) as e:
    load_config(overrides=["model.num_heads=3"])
  message = str(e.value)
  assert "model.num_heads=3 is not a multiple of num_kv_heads=2" in message
  assert "(key=value, e.g. model.num_heads=4)" in message
  assert "dataclasses.replace" not in message


def test_numbers_in_e_notation_and_one_message_per_mistake():
  # YAML 1.1 reads 1e-3 as a string; the README's optimizer.learning_rate=1e-3 must work
  assert load_config(overrides=["optimizer.learning_rate=1e-3"]).optimizer.learning_rate == 1e-3
  with pytest.raises(TrainConfigError) as e:
    load_config(overrides=["optimizer.learning_rate=fast"])
  assert "config: 1 problem(s)." in str(e.value)
  assert "optimizer.learning_rate='fast': expected a number" in str(e.value)


def test_default_yaml_is_the_one_source_of_defaults():
  with pytest.raises(TypeError):  # the dataclasses hold no second set of defaults
    config_lib.TrainConfig()
  raw = yaml.safe_load(train.default_config_path().read_text())
  cfg = load_config()
  assert (cfg.steps, cfg.batch_size, cfg.microbatches) == (raw["steps"], raw["batch_size"],
                                                           raw["microbatches"])
  assert cfg.optimizer.warmup_steps == raw["optimizer"]["warmup_steps"]
  assert load_config(train.default_config_path()) == cfg


def test_microbatches_rule_with_a_preset_that_loops(tmp_path):
  # default.yaml's microbatches=2 yields to the preset's own serial loop ...
  cfg = load_config(overrides=["preset=microbatch", "mesh={data: 8}"])
  rules = train.make_rules(cfg)
  assert cfg.microbatches is None and config_lib.serial_loops(rules) == (4,)
  assert train.effective_microbatches(cfg, rules) == 4
  # ... but an explicit microbatches (override or --config file) replaces it
  cfg = load_config(overrides=["preset=microbatch", "microbatches=2"])
  rules = train.make_rules(cfg)
  assert config_lib.serial_loops(rules) == () and train.effective_microbatches(cfg, rules) == 2
  mine = tmp_path / "mine.yaml"
  mine.write_text("preset: microbatch\nmicrobatches: 8\n")
  assert load_config(mine).microbatches == 8
  # presets without a loop take default.yaml's count
  assert load_config(overrides=["preset=fsdp"]).microbatches == 2


def test_config_semantic_errors_and_files(tmp_path):
  with pytest.raises(TrainConfigError, match=r"framework='linnen' must be one of \['linen', "
                                             r"'nnx', 'haiku'\] \(did you mean 'linen'\?\)\."):
    load_config(overrides=["framework=linnen"])
  bad = tmp_path / "bad.yaml"
  bad.write_text("steps: 5\noptimiser:\n  learning_rate: 1\n")
  with pytest.raises(TrainConfigError, match=r"unknown key 'optimiser' \(did you mean "
                                             r"'optimizer'\?\)\."):
    load_config(bad)
  good = tmp_path / "good.yaml"
  good.write_text("steps: 5\noptimizer:\n  learning_rate: 0.01\nmodel:\n  num_layers: 3\n")
  cfg = load_config(good, ["model.num_layers=4"])
  assert (cfg.steps, cfg.optimizer.learning_rate, cfg.model.num_layers) == (5, 0.01, 4)
  with pytest.raises(TrainConfigError, match="cannot read"):
    load_config(tmp_path / "missing.yaml")
  with pytest.raises(TrainConfigError, match=r"preset='fdsp' is neither a preset .* \(did you "
                                             r"mean 'fsdp'\?\)\."):
    train.make_rules(load_config(overrides=["preset=fdsp"]))


def test_main_reports_config_errors(capsys):
  assert train.main(["stpes=3"]) == 2
  assert "(did you mean 'steps'?)" in capsys.readouterr().err


def test_main_where_jax_already_runs_keeps_its_devices(tmp_path, capsys):
  """A second run in one process (a notebook): JAX's devices stay, no raw JAX error."""
  assert len(jax.devices()) == 8  # JAX has started
  assert train.main(TINY + ["mesh={data: 16}", "preset=data_parallel", "batch_size=64",
                            f"out_dir={tmp_path}"]) == 2
  err = capsys.readouterr().err
  assert "needs 16 devices, but 8 are available" in err and "Traceback" not in err


MISTAKES = {  # overrides -> what the message must say (the key and the fix)
    "indivisible batch": (["batch_size=10"], [
        "batch_size=10 does not divide into 2 device shard(s)", "x 2 micro-batch(es)",
        "use a multiple of 4, e.g. batch_size=8"]),
    "a batch no mesh axis divides (it would train replicated)": (
        ["mesh={data: 8, fsdp: 1, tensor: 1}", "batch_size=4"], [
            "batch_size=4 does not divide into 8 device shard(s) (mesh axes ('data',))",
            "use a multiple of 16, e.g. batch_size=16"]),
    "a rules override for a name the model lacks (it would be ignored)": (
        ["rules=[mpl=tensor]"], [
            "rules override 'mpl=tensor' sets logical axis 'mpl', which the model does not "
            "have (did you mean 'mlp'?)"]),
    "a rules override naming a mesh axis the mesh lacks": (
        ["rules=[mlp=tensr]"], [
            "rules override 'mlp=tensr' names mesh axis 'tensr', which mesh={data: 2, fsdp: 2, "
            "tensor: 2} does not have (did you mean 'tensor'?)"]),
    "both kinds of rules override mistakes at once (they came one run at a time)": (
        ["rules=[mlp=tensr, haeds=null]"], [
            "config: 2 problem(s) with rules=.",
            "rules override 'haeds=null' sets logical axis 'haeds', which the model does not "
            "have (did you mean 'heads'?)",
            "rules override 'mlp=tensr' names mesh axis 'tensr', which mesh={data: 2, fsdp: 2, "
            "tensor: 2} does not have (did you mean 'tensor'?)"]),
    "a rules override with a misspelt null": (
        ["rules=[mlp=nul]"], ["rules override 'mlp=nul' names mesh axis 'nul'",
                              "(did you mean 'null'?)"]),
    "preset without its mesh axes": (["preset=tensor_parallel", "mesh={data: 8}"], [
        "preset=tensor_parallel shards over the mesh axes ['data', 'tensor'], but mesh="
        "{data: 8} has no 'tensor'", "use e.g. mesh='{data: 4, tensor: 2}'", "tensor: 1"]),
    "expert_parallel without experts": (["preset=expert_parallel",
                                         "mesh={data: 2, expert: 4}"], [
        "preset=expert_parallel shards mixture-of-experts layers", "model.num_experts=0",
        "set model.num_experts=4"]),
    "a loop preset with an indivisible batch": (["preset=microbatch", "mesh={data: 8}",
                                                 "batch_size=16"], [
        "batch_size=16 does not divide into 8 device shard(s)", "x 4 micro-batch(es)",
        "e.g. batch_size=32"]),
    "pipeline layers not in stages x repeats": (
        ["preset=pipeline_parallel", "mesh={data: 2, stage: 4}", "model.scan_layers=true",
         "model.num_layers=4", "model.pipeline_repeats=2"], [
            "model.num_layers=4 does not split into 4 pipeline stages x 2 repeats",
            "use a multiple of 8, e.g. model.num_layers=8"]),
    "fewer pipeline micro-batches than stages": (
        ["preset=pipeline_parallel", "mesh={data: 2, stage: 4}", "model.scan_layers=true",
         "model.num_layers=4", "model.pipeline_microbatches=2"], [
            "model.pipeline_microbatches=2 is fewer than the 4 pipeline stages",
            "use model.pipeline_microbatches=4 or more"]),
    "pipeline micro-batches that split a device's rows": (
        ["preset=pipeline_parallel", "mesh={data: 2, stage: 4}", "model.scan_layers=true",
         "model.num_layers=4", "batch_size=16", "microbatches=1",
         "model.pipeline_microbatches=6"], [
            "batch_size=16 over 2 device(s) (mesh axes ('data',)) is 8 row(s) per device",
            "microbatches=1 x model.pipeline_microbatches=6 pipeline micro-batches",
            "a multiple of 12 (e.g. batch_size=12)", "model.pipeline_microbatches in [4, 8]"]),
}


@pytest.mark.parametrize("name", sorted(MISTAKES))
def test_run_mistakes_exit_2_before_compiling(name, tmp_path, monkeypatch, capsys):
  overrides, expected = MISTAKES[name]

  def compiled(*args, **kwargs):
    raise AssertionError("the mistake was found only after building the model")

  monkeypatch.setattr(train, "init_model", compiled)
  assert train.main(overrides + [f"out_dir={tmp_path / 'run'}"]) == 2
  err = capsys.readouterr().err
  headline = next((p for p in expected if p.startswith("config: ")), "config: 1 problem(s)")
  assert err.startswith(f"error: {headline}") and "Traceback" not in err
  for part in expected:
    assert part in err, (part, err)
  assert not (tmp_path / "run").exists()  # nothing written


def test_partition_errors_exit_2(tmp_path, capsys):
  # a rules override the partition library rejects: its own message, rc 2, no traceback
  assert train.main(["rules=[nonsense]", f"out_dir={tmp_path}"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: ") and "Traceback" not in err and "nonsense" in err


# Every preset, framework and micro-batching against one device: the README's commands, in
# tests/recipes/test_readme_commands.py.


# ------------------------------------------------------------------------- devices


def test_mesh_auto_is_the_presets_axes_with_every_device_on_the_batch_axis():
  for preset, fill in [("fsdp_tp", "data"), ("fsdp_pp", "fsdp"), ("pipeline_parallel", "data")]:
    mesh = load_config(overrides=[f"preset={preset}", "mesh=auto"]).mesh
    axes = list(config_lib.preset_rules(preset).mesh_axes)
    assert set(mesh) == set(axes) and mesh[fill] == -1  # first entry of 'batch' fills
    assert all(v == 1 for k, v in mesh.items() if k != fill)
  with pytest.raises(TrainConfigError, match=r"mesh='autp': expected a mapping .* or auto"):
    load_config(overrides=["mesh=autp"])


def test_per_device_bytes_are_counted_on_the_meshs_devices():
  # A mesh that leaves out jax.local_devices()[0] (as the CPU mesh of a run on a GPU machine
  # leaves out the GPU): the count is one of its devices' shards, not that device's zero.
  mesh = make_mesh((2, 2), ("data", "fsdp"), AxisType.Explicit, devices=jax.devices()[4:])
  x = jax.device_put(np.zeros((8, 6), np.float32),
                     jax.sharding.NamedSharding(mesh, jax.P("fsdp")))
  assert train.device_bytes({"x": x}, mesh) == 8 * 6 * 4 // 2
  assert train.device_bytes({"x": x}) == 8 * 6 * 4 // 2  # the tree's own mesh by default


class _FakeGPU:
  platform, device_kind, id, process_index = "gpu", "NVIDIA H200", 0, 0


def test_a_mesh_larger_than_the_accelerators_says_it_runs_on_cpu_and_how_to_use_them(
    monkeypatch):
  real = jax.devices
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(jax, "devices", lambda backend=None: [_FakeGPU()] if backend is None
                      else real(backend))
  devices, why = train.mesh_devices(load_config(overrides=[]))
  assert devices == real("cpu")
  assert why == ("mesh={data: 2, fsdp: 2, tensor: 2} needs 8, this machine has 1 gpu device "
                 "(NVIDIA H200); mesh=auto trains on it")
  devices, why = train.mesh_devices(load_config(overrides=["mesh=auto"]))
  assert devices == [devices[0]] and isinstance(devices[0], _FakeGPU)
  assert why == "the gpu devices present"


def test_the_run_says_which_devices_and_why(tmp_path):
  config = _config(tmp_path / "run", "mesh=auto")
  _, note = train._mesh_and_note(config)
  assert note == ("devices: 8 virtual CPU devices: JAX_PLATFORMS=cpu; data=-1 fills them: "
                  "data=8")


# ------------------------------------------------------------------------- outputs


@pytest.mark.slow
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
  assert summary["devices"] == "8 virtual CPU devices"
  assert 0 < summary["param_bytes_per_device"] < summary["param_bytes_total"]


@pytest.mark.slow
def test_byte_level_lm_on_a_text_file(tmp_path):
  text = tmp_path / "corpus.txt"
  text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
  out = _run(tmp_path, "lm", f"data.path={text}", "model.vocab_size=256", "steps=2")
  assert all(np.isfinite(losses(out)))
  # At init the tied logits h . e_v have unit variance (h RMS-normed, embeddings of std
  # 1/sqrt(embed)), and the mean cross-entropy of N(0, 1) logits over V classes is about
  # log V + 1/2; the draw of one small batch moves it by a few percent.
  assert losses(out)[0] == pytest.approx(np.log(256) + 0.5, rel=0.05)


# ------------------------------------------------------------------- checkpoints


def _cli(env: dict[str, str], *args: str) -> subprocess.Popen:
  return subprocess.Popen([sys.executable, "-m", "recipes.train", *args], cwd=REPO, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_sigterm_midway_then_resume_gives_the_uninterrupted_run(tmp_path, child_env):
  """A real process gets SIGTERM mid-run: it finishes the step, checkpoints, exits 0; the
  resumed run's losses and data equal an uninterrupted run's, step by step."""
  flags = TINY + ["steps=40", "checkpoint_every=0", "eval_every=40"]
  straight = _run(tmp_path, "straight", *flags[len(TINY):])
  killed = tmp_path / "killed"
  proc = _cli(child_env, *flags, f"out_dir={killed}")
  seen = []
  for line in proc.stderr:  # stderr is a pipe: a progress line per step (log_every=1)
    seen.append(line)
    if line.startswith("step 3/"):
      proc.send_signal(signal.SIGTERM)
      break
  stdout, rest = proc.communicate(timeout=240)
  err = "".join(seen) + rest
  assert proc.returncode == 0, err
  stopped = checkpoint.Checkpointer(killed / "checkpoints")
  step = stopped.latest_step()
  stopped.close()
  assert 3 <= step < 40, err  # the step it was in when the signal came, then it stopped
  assert f"stopped by SIGTERM after step {step}: checkpoint written" in err
  assert "resume=true" in err and "training summary" not in stdout
  log = io.StringIO()
  train.train(_config(killed, *flags[len(TINY):], "resume=true"), progress=False,
              out=io.StringIO(), log=log)
  assert f"resumed from step {step} of {killed / 'checkpoints'}" in log.getvalue()
  assert losses(killed) == losses(straight)  # bit-identical, steps 1..40


def test_resumed_data_is_the_uninterrupted_data():
  """The batches of steps 5.. are the same whether the pipeline starts at 0 or at 5, and
  the same as the source's global batches (row r of step s = example s * batch + r)."""
  cfg = load_config(overrides=["batch_size=16", "seq_len=8"])
  run_a = data.Pipeline(data.make_source(cfg), 0, 16, _shardings())
  straight = [run_a.batch(s) for s in range(8)]
  run_b = data.Pipeline(data.make_source(cfg), 0, 16, _shardings())
  for s in range(5, 8):
    for k, v in run_b.batch(s).items():
      np.testing.assert_array_equal(np.asarray(v), np.asarray(straight[s][k]))
      np.testing.assert_array_equal(np.asarray(v), run_b.source.batch(0, s, 16)[k])
  assert not np.array_equal(np.asarray(straight[5]["inputs"]), np.asarray(straight[6]["inputs"]))
  other_seed = data.Pipeline(data.make_source(cfg), 1, 16, _shardings()).batch(5)
  assert not np.array_equal(np.asarray(other_seed["inputs"]), np.asarray(straight[5]["inputs"]))


def _shardings():
  from jax.sharding import NamedSharding, PartitionSpec
  mesh = make_mesh((2, 4), ("data", "sequence"), AxisType.Explicit)
  return {k: NamedSharding(mesh, PartitionSpec("data", "sequence"))
          for k in ("inputs", "targets", "mask")}


def test_token_ids_from_a_npy_file(tmp_path):
  ids = (np.arange(600) * 7 % 50).astype(np.int32)
  np.save(tmp_path / "ids.npy", ids)
  source = data.TokenFile(str(tmp_path / "ids.npy"), seq_len=8, vocab_size=64)
  example = source.dataset(seed=0)[0]
  start = int(np.flatnonzero(ids == example["inputs"][0])[0])  # ids repeat every 50
  np.testing.assert_array_equal(example["inputs"], np.roll(ids, -start)[:8])
  np.testing.assert_array_equal(example["targets"], np.roll(ids, -start)[1:9])
  with pytest.raises(TrainConfigError, match=r"holds token id 49, but model.vocab_size=32: "
                                             r"set model.vocab_size=50"):
    data.TokenFile(str(tmp_path / "ids.npy"), seq_len=8, vocab_size=32)


def test_a_small_vocabulary_trains_on_token_ids_but_not_on_bytes(tmp_path):
  """A tokenizer's .npy ids need model.vocab_size above the largest id only (the >= 256 rule
  of byte-level files refused every small-vocabulary fine-tune on its own tokens)."""
  np.save(tmp_path / "ids.npy", (np.arange(4000) * 7 % 90).astype(np.int32))
  (tmp_path / "notes.txt").write_text("some text " * 400)
  summary = train.train(_config(tmp_path / "run", f"data.path={tmp_path / 'ids.npy'}",
                                "model.vocab_size=96"),
                        progress=False, out=io.StringIO(), log=io.StringIO())
  assert np.isfinite(summary["final_loss"])
  with pytest.raises(TrainConfigError) as e:
    _config(tmp_path / "bytes", f"data.path={tmp_path / 'notes.txt'}", "model.vocab_size=96")
  assert ("model.vocab_size=96 must be >= 256 for byte-level language modelling of "
          f"data.path='{tmp_path / 'notes.txt'}' (each byte is a token); or give a .npy of "
          "token ids") in str(e.value)


@pytest.mark.slow
def test_rerun_into_the_same_out_dir_keeps_the_first_run(tmp_path, capsys):
  first = _run(tmp_path, "run", "checkpoint_every=1")
  before = {p: p.read_bytes() for p in first.rglob("*") if p.is_file()}
  assert train.main(TINY + [f"out_dir={first}"]) == 2
  err = capsys.readouterr().err
  assert f"error: out_dir={first} already holds a run" in err
  assert "checkpoints at steps 1, 2, 3" in err
  assert "resume=true" in err and f"out_dir={first}-2" in err
  assert {p: p.read_bytes() for p in first.rglob("*") if p.is_file()} == before


def test_the_default_out_dir_numbers_itself_and_one_you_set_does_not(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert load_config(overrides=TINY).out_dir == "runs/default"
  (tmp_path / "runs/default").mkdir(parents=True)
  assert load_config(overrides=TINY).out_dir == "runs/default"  # an empty folder holds no run
  (tmp_path / "runs/default/metrics.jsonl").write_text("")
  (tmp_path / "runs/default-2/checkpoints/7").mkdir(parents=True)
  fresh = load_config(overrides=TINY)
  assert fresh.out_dir == "runs/default-3"
  assert rundir.numbered_note(fresh) == (
      "runs/default holds an earlier run, so this one writes to runs/default-3 (continue it "
      "later with resume=true out_dir=runs/default-3)")
  assert load_config(overrides=TINY + ["resume=true"]).out_dir == "runs/default"
  chosen = load_config(overrides=TINY + ["out_dir=runs/default"])
  assert chosen.out_dir == "runs/default"
  with pytest.raises(TrainConfigError, match=r"out_dir=runs/default already holds a run"):
    rundir.check_fresh(chosen)


@pytest.mark.slow
def test_rerunning_the_default_job_writes_beside_the_first_run(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  assert train.main(TINY) == 0
  assert train.main(TINY) == 0
  err = capsys.readouterr().err
  assert "runs/default holds an earlier run, so this one writes to runs/default-2" in err
  assert (tmp_path / "runs/default/summary.json").exists()
  assert (tmp_path / "runs/default-2/summary.json").exists()


@pytest.mark.slow
def test_resume_checks_the_model_and_reshards(tmp_path):
  first = _run(tmp_path, "run", "steps=2")
  with pytest.raises(TrainConfigError, match=r"(?s)is of another model:.*model.embed_dim=16 "
                                             r"there, 32 here.*resume=false out_dir="):
    train.train(_config(first, "steps=4", "model.embed_dim=32", "resume=true"),
                progress=False, out=io.StringIO(), log=io.StringIO())
  # another preset and mesh: the same state, resharded
  log = io.StringIO()
  summary = train.train(_config(first, "steps=3", "resume=true", "preset=fsdp",
                                "mesh={data: 2, fsdp: 4}"), progress=False, out=io.StringIO(),
                        log=log)
  assert "resumed from step 2" in log.getvalue() and "resharded: preset fsdp_tp -> fsdp" \
      in log.getvalue()
  assert [r["step"] for r in map(json.loads, (first / "metrics.jsonl").read_text().splitlines())] \
      == [1, 2, 3]
  assert summary["resumed_from"] == 2 and summary["eval_loss"] is not None
  # a step that already has a checkpoint is written again, not an orbax error
  ckpt = checkpoint.Checkpointer(first / "checkpoints")
  state = ckpt.restore_on(3, make_mesh((8,), ("data",), AxisType.Explicit))[0]
  ckpt.save(3, state, None, {"note": "again"})
  ckpt.wait()
  assert ckpt.all_steps() == [2, 3] and ckpt.meta(3)["note"] == "again"
  ckpt.close()


@pytest.mark.slow
def test_a_diverging_loss_stops_keeping_the_last_good_checkpoint(tmp_path):
  out = tmp_path / "nan"
  with pytest.raises(train.Stopped) as e:
    train.train(_config(out, "steps=20", "checkpoint_every=1", "optimizer.learning_rate=1e30",
                        "optimizer.warmup_steps=0", "optimizer.clip_norm=0"),
                progress=False, out=io.StringIO(), log=io.StringIO())
  step = e.value.step
  assert e.value.exit_code == 1
  assert f"at step {step}: training diverged" in str(e.value)
  assert f"the last good checkpoint is step {step - 1}" in str(e.value)
  ckpt = checkpoint.Checkpointer(out / "checkpoints")
  assert ckpt.latest_step() == step - 1
  ckpt.close()
  assert all(np.isfinite(losses(out)[:step - 1]))


@pytest.mark.slow
def test_progress_lines_without_a_terminal(tmp_path):
  log = io.StringIO()
  train.train(_config(tmp_path / "run", "steps=4", "log_every=2"), progress="log",
              out=io.StringIO(), log=log)
  first, *lines = log.getvalue().splitlines()
  assert first == "devices: 8 virtual CPU devices: JAX_PLATFORMS=cpu"  # which, and why
  assert [line.split()[1] for line in lines] == ["2/4", "4/4"]
  assert all("loss " in line and " tok/s" in line and "ETA " in line for line in lines)


def test_the_progress_bar_is_drawn_on_the_log_stream_not_on_stdout(capsys):
  """main() picks the bar when stderr is a terminal: drawn on rich's default stdout, a
  `| tee` or `> log.txt` hid it from the terminal for the whole run (and put one final bar
  line in the file)."""
  from recipes import report
  log = io.StringIO()
  with report.progress(3, mode="bar", stream=log) as bar:
    for step in (1, 2, 3):
      bar.update(step, {"loss": 1.0, "tokens_per_s": 10.0})
  with report.progress(2, mode="bar") as bar:   # the default stream is stderr
    bar.update(2, {"loss": 1.0, "tokens_per_s": 10.0})
  printed = capsys.readouterr()
  assert "train" in log.getvalue() and "3/3" in log.getvalue()
  assert printed.out == "" and "2/2" in printed.err


def test_sigint_while_building_the_model_is_a_message_and_exit_130(tmp_path, monkeypatch,
                                                                      capsys):
  """Ctrl-C before the first step (XLA compiling the init) was a 60-line traceback."""
  def interrupted(config):
    raise KeyboardInterrupt
  monkeypatch.setattr(train, "build_run", interrupted)
  assert train.main(TINY + [f"out_dir={tmp_path / 'run'}"]) == 130
  err = capsys.readouterr().err
  assert err.startswith("error: stopped by SIGINT outside the training steps (while building")
  assert "resume=true continues from the last one" in err and "Traceback" not in err


@pytest.mark.slow
def test_the_command_line_shows_a_warning_without_this_module_s_source_line(tmp_path,
                                                                            child_env):
  """The short-warmup warning named recipes/train.py's line and printed that line of code
  (a real process: pytest records warnings instead of printing them)."""
  proc = _cli(child_env, *TINY, f"out_dir={tmp_path / 'run'}", "optimizer.warmup_steps=30")
  _, err = proc.communicate(timeout=300)
  assert proc.returncode == 0, err
  assert "UserWarning: optimizer.warmup_steps=30 is not shorter than steps=3" in err
  assert "train.py:" not in err and "train(config" not in err


@pytest.mark.slow
def test_restore_on_other_meshes_is_bit_identical(tmp_path):
  out = _run(tmp_path, "src", "steps=2", "microbatches=1")
  ckpt = checkpoint.Checkpointer(out / "checkpoints")
  devices = jax.devices()
  names = ("data", "fsdp", "tensor")
  meshes = [make_mesh((2, 2, 2), names, AxisType.Explicit, devices=devices),
            make_mesh((1, 2, 2), names, AxisType.Explicit, devices=devices[:4]),
            make_mesh((1, 1, 1), names, AxisType.Explicit, devices=devices[:1])]
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
