"""``python -m recipes.explain``: the explained per-device bytes against the real shards of a
``build_run`` of the same config, the compiled step's argument bytes against the real state and
batch shards, ``--devices 16`` in a subprocess, the JSON and table outputs, warnings, errors.

(Named ``test_explain_cli.py``: ``tests/partition/test_explain.py`` exists and the test
folders are not packages, so two ``test_explain`` modules would clash.)
"""

import functools
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from recipes import explain, train
from recipes.config import TrainConfigError, load_config

REPO = Path(__file__).resolve().parents[2]
TINY = ["model.embed_dim=16", "model.mlp_dim=32", "model.num_layers=1", "batch_size=16",
        "seq_len=8", "steps=2"]


def _config(*overrides):
  return load_config(train.default_config_path(), TINY + list(overrides))


def _on_first_device(x) -> int:
  first = jax.devices()[0]
  return sum(s.data.nbytes for s in x.addressable_shards if s.device == first)


def _by_path(tree) -> dict:
  return {explain_path(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def explain_path(path) -> str:
  from partition._base.logical_axes import path_str
  return path_str(path)


@pytest.fixture(scope="module")
def explained():
  """The explanation (compiled) and a real run of the same tiny config on 8 devices."""
  config = _config()
  return explain.explain_config(config), train.build_run(config)


@pytest.mark.slow
def test_per_device_bytes_equal_the_real_shards(explained):
  found, run = explained
  real = _by_path(run.state["params"])
  assert sorted(r.path for r in found.params.rows) == sorted(real)
  for row in found.params.rows:
    x = real[row.path]
    assert row.bytes_per_device == _on_first_device(x), row.path
    assert row.bytes_total == x.nbytes, row.path
    assert row.spec == x.sharding.spec, row.path
  assert found.params.bytes_per_device == train.device_bytes(run.state["params"])
  assert found.optimizer.bytes_per_device == train.device_bytes(run.state["opt_state"])
  assert found.optimizer.total_bytes == sum(x.nbytes for x in
                                            jax.tree.leaves(run.state["opt_state"]))
  # the sharded run holds less than a full copy on each device
  assert found.params.bytes_per_device < found.params.total_bytes


@pytest.mark.parametrize("framework", ["haiku", "nnx"])
@pytest.mark.slow
def test_other_frameworks_per_device_bytes(framework):
  config = _config(f"framework={framework}")
  found, run = explain.explain_config(config, compile=False), train.build_run(config)
  real = _by_path(run.state["params"])
  assert sorted(r.path for r in found.params.rows) == sorted(real)
  for row in found.params.rows:
    assert row.bytes_per_device == _on_first_device(real[row.path]), row.path
    assert found.optimizer_by_param[row.path] == 2 * row.bytes_per_device, row.path
  assert found.optimizer.bytes_per_device == train.device_bytes(run.state["opt_state"])


def test_optimizer_bytes_per_parameter_follow_adam_moments(explained):
  found, run = explained
  real = _by_path(run.state["params"])
  for path, opt_bytes in found.optimizer_by_param.items():
    assert opt_bytes == 2 * _on_first_device(real[path]), path  # mu and nu, same sharding
  counts = sum(r.bytes_per_device for r in found.optimizer.rows if r.shape == ())
  assert sum(found.optimizer_by_param.values()) + counts == found.optimizer.bytes_per_device


def test_abstract_state_has_the_real_shardings(explained):
  found, run = explained
  ours = jax.tree_util.tree_flatten_with_path(found.state)[0]
  theirs = jax.tree.leaves(run.state)
  assert len(ours) == len(theirs)
  for (path, a), b in zip(ours, theirs):
    assert (a.shape, a.dtype) == (b.shape, b.dtype), explain_path(path)
    assert a.sharding.is_equivalent_to(b.sharding, len(b.shape)), explain_path(path)


def test_compiled_step_arguments_are_the_real_state_and_batch_shards(explained):
  found, run = explained
  batch = run.data.batch(0)
  state_bytes = train.device_bytes(run.state)
  batch_bytes = train.device_bytes(batch)
  assert found.memory.argument == state_bytes + batch_bytes
  assert found.memory.alias == state_bytes  # the donated state is updated in place
  assert found.memory.temp > 0
  m = found.memory
  assert m.peak == m.argument + m.output - m.alias + m.temp + m.generated_code


def test_json_numbers_and_table(explained):
  found, _ = explained
  d = json.loads(json.dumps(found.to_dict()))
  assert d["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2} and d["num_devices"] == 8
  assert d["totals"]["param_bytes_per_device"] == found.params.bytes_per_device
  assert d["totals"]["num_params"] == sum(int(np.prod(r["shape"])) for r in d["params"])
  qkv = next(r for r in d["params"] if r["path"] == "blocks_0/attn/qkv/kernel")
  assert qkv["logical_axes"] == ["embed", "kv_heads", None, "head_dim"]  # fused, per kv group
  assert qkv["spec"] == ["fsdp", "tensor", None, None]
  assert d["memory"]["argument"] == found.memory.argument
  out = io.StringIO()
  explain.render(found, out)
  text = out.getvalue()
  for needle in ("blocks_0/attn/qkv/kernel", "totals",
                 "compiled train step", "params + optimizer", "temporaries"):
    assert needle in text, needle


def test_the_report_class_is_explanation_and_plan_is_a_deprecated_alias():
  with pytest.warns(DeprecationWarning) as caught:
    old = explain.Plan
  assert old is explain.Explanation
  assert len(caught) == 1
  assert str(caught[0].message) == (
      "recipes.explain.Plan is deprecated and will be removed in the next release: use "
      "recipes.explain.Explanation (the same class, renamed: 'plan' names the planner, "
      "python -m recipes.plan).")
  assert caught[0].filename == __file__   # stacklevel: the warning points at the caller
  with pytest.raises(AttributeError, match="has no attribute 'Plann'"):
    explain.Plann  # noqa: B018
  with pytest.warns(DeprecationWarning, match=r"recipes\.explain\.plan is deprecated .*use "
                    r"recipes\.explain\.explain_config\.$"):
    assert explain.plan is explain.explain_config


def test_large_replicated_params_warn():
  found = explain.explain_config(_config("preset=data_parallel", "mesh={data: 8}"),
                                compile=False, replicated_warn_bytes=1024)
  big = sorted(r.path for r in found.params.rows if r.bytes_total >= 1024)
  assert big and all(r.replicated for r in found.params.rows)
  assert len(found.warnings) == len(big)
  for path, warning in zip(big, found.warnings):
    assert warning.startswith(f"{path} ") and "fully replicated on 8 devices" in warning
    assert "give its logical axes" in warning
  assert explain.explain_config(_config(), compile=False, replicated_warn_bytes=1024).warnings == ()


def test_devices_mesh_must_use_all_devices():
  with pytest.raises(explain.ExplainError, match=r"mesh=\{'data': 2, 'fsdp': 2, 'tensor': 2\} "
                     r"does not use the 16 devices of --devices 16 .*Give one axis -1 to fill "
                     r"them, e.g. mesh='\{data: -1, fsdp: 2, tensor: 2\}'"):
    explain.check_mesh_size(_config(), 16)
  with pytest.raises(explain.ExplainError, match="-1 cannot fill the rest"):
    explain.check_mesh_size(_config("mesh={data: -1, tensor: 3}"), 16)
  explain.check_mesh_size(_config("mesh={data: -1, tensor: 2}"), 16)  # fine


@pytest.mark.parametrize("mesh,devices", [("{data: 3, fsdp: -1}", 64),
                                          ("{data: -1, tensor: 3}", 16),
                                          ("{data: 4, fsdp: 2, tensor: 2}", 64),
                                          ("{data: 5, fsdp: 3}", 12)])
def test_the_suggested_mesh_is_accepted(mesh, devices):
  """The mesh an error suggests passes the same check (it once suggested two -1 axes)."""
  with pytest.raises(explain.ExplainError) as e:
    explain.check_mesh_size(_config(f"mesh={mesh}"), devices)
  suggested = str(e.value).split("e.g. mesh='")[1].split("'")[0]
  explain.check_mesh_size(_config(f"mesh={suggested}"), devices)
  config = _config(f"mesh={suggested}")
  fixed = np.prod([v for v in config.mesh.values() if v > 0])
  sizes = {k: devices // fixed if v == -1 else v for k, v in config.mesh.items()}
  sizes.update({a: 1 for a in ("data", "fsdp", "tensor") if a not in sizes})  # fsdp_tp's
  check = functools.partial(train.check_run, config, train.make_rules(config),
                            jax.sharding.AbstractMesh(tuple(sizes.values()), tuple(sizes)))
  if "(then: " not in str(e.value):
    check()
  else:  # no size fits the batch: what the training job would refuse next is said now
    with pytest.raises(TrainConfigError) as refused:
      check()
    assert f"(then: {str(refused.value).split('  * ')[1]})" in str(e.value)


def test_a_suggested_mesh_the_batch_does_not_fit_says_which_batch_does():
  """--devices 6 suggested a mesh the default batch 64 does not divide into (6 shards x 2
  micro-batches), so following the advice failed next with another error."""
  config = load_config(train.default_config_path(), [])
  with pytest.raises(explain.ExplainError) as e:
    explain.check_mesh_size(config, 6)
  message = str(e.value)
  assert "e.g. mesh='{data: -1, fsdp: 2, tensor: 1}' (then: batch_size=64 does not divide " \
         "into 6 device shard(s)" in message
  fixed = message.split("e.g. batch_size=")[1].split(")")[0]
  config = load_config(train.default_config_path(), [
      "mesh={data: 3, fsdp: 2, tensor: 1}", f"batch_size={fixed}"])
  explain.check_mesh_size(config, 6)
  train.check_run(config, train.make_rules(config),
                  jax.sharding.AbstractMesh((3, 2, 1), ("data", "fsdp", "tensor")))


def test_the_suggested_mesh_shrinks_a_pipeline_to_stages_the_layers_divide():
  config = load_config(train.default_config_path(), [
      "preset=pipeline_parallel", "mesh={data: 2, stage: 4}", "model.num_layers=6",
      "model.scan_layers=true", "batch_size=16"])
  with pytest.raises(explain.ExplainError, match=r"e.g. mesh='\{data: -1, stage: 2\}', or"):
    explain.check_mesh_size(config, 4)


def test_help_is_plain_text(capsys):
  for main in (explain.main, train.main):
    with pytest.raises(SystemExit):
      main(["--help"])
    text = capsys.readouterr().out
    assert "usage: python -m recipes." in text and "``" not in text


# Runs the CLI as __main__ and, on exit, reports that process's own peak RSS on stderr:
# VmHWM of its address space (ru_maxrss would include the forked pytest worker's peak, which
# Linux carries across exec).
_MAIN_WITH_PEAK = """
import re, runpy, sys
sys.argv = ['recipes.explain', *sys.argv[1:]]
try:
  runpy.run_module('recipes.explain', run_name='__main__', alter_sys=True)
finally:
  status = open('/proc/self/status').read()
  print('PEAK_RSS_KIB', re.search(r'VmHWM:\\s+(\\d+) kB', status).group(1), file=sys.stderr)
"""


def _run_cli(*args, timeout=240):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
  return subprocess.run([sys.executable, "-c", _MAIN_WITH_PEAK, *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=timeout)


def _peak_bytes(proc) -> int:
  return int(proc.stderr.rsplit("PEAK_RSS_KIB", 1)[1].split()[0]) * 1024


@pytest.mark.slow
def test_devices_16_in_a_subprocess(explained):
  found8, _ = explained
  proc = _run_cli("--devices", "16", "--json", *TINY, "mesh={data: -1, fsdp: 2, tensor: 2}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  d = json.loads(proc.stdout)
  assert d["num_devices"] == 16 and d["mesh"] == {"data": 4, "fsdp": 2, "tensor": 2}
  assert d["platform"] == "cpu"
  # params are not sharded over 'data': the same bytes per device as on 8 devices
  assert d["totals"] == found8.totals()
  # the step was compiled for 16 devices: each holds 16 / (data 4 x fsdp 2) = 2 batch rows
  batch_bytes = 3 * 2 * 8 * 4  # inputs, targets (int32) and mask (float32)
  step_bytes = 4
  assert d["memory"]["argument"] == (d["totals"]["state_bytes_per_device"] + step_bytes
                                     + batch_bytes)


def test_cli_errors_exit_2_with_the_fix(capsys):
  # both are found before any device is set up, so main() runs in this process
  assert explain.main(["--devices", "16", *TINY]) == 2
  assert "Give one axis -1 to fill them" in capsys.readouterr().err
  assert explain.main(["stpes=3"]) == 2
  assert "(did you mean 'steps'?)" in capsys.readouterr().err
  assert explain.main(["--devices", "-4", *TINY]) == 2
  assert "--devices -4: give a positive number of devices" in capsys.readouterr().err


def test_python_m_recipes_lists_and_dispatches(capsys):
  from recipes.__main__ import main
  assert main([]) == 0
  listing = capsys.readouterr().out
  for command in ("train", "explain", "export"):
    assert f"  {command} " in listing
  assert "The sharding report of a training config, without training." in listing
  assert main(["trian"]) == 2
  assert "unknown command 'trian' (did you mean 'train'?)." in capsys.readouterr().err
  # dispatch: recipes.explain's own argument check answers
  assert main(["explain", "--devices", "16", *TINY]) == 2
  assert "Give one axis -1 to fill them" in capsys.readouterr().err


@pytest.mark.slow
def test_planning_a_big_model_allocates_nothing():
  """A 0.55 B-parameter plan (2.2 GB of params, 6.6 GB with AdamW) compiled for 8 devices in a
  process whose peak memory stays far below the params: nothing was materialised."""
  big = ["model.embed_dim=2048", "model.mlp_dim=8192", "model.num_heads=16",
         "model.num_kv_heads=8", "model.head_dim=128", "model.num_layers=8",
         "model.vocab_size=32000", "model.max_len=128", "model.scan_layers=true",
         "seq_len=128", "batch_size=8", "mesh={data: 1, fsdp: 4, tensor: 2}"]
  proc = _run_cli("--devices", "8", "--json", *big)
  assert proc.returncode == 0, proc.stderr[-3000:]
  d = json.loads(proc.stdout)
  params = d["totals"]["param_bytes_total"]
  assert d["totals"]["num_params"] > 5 * 10**8 and params == 4 * d["totals"]["num_params"]
  assert d["memory"]["argument"] > d["totals"]["state_bytes_per_device"]
  # the CLI process's own peak (RUSAGE_CHILDREN would be the largest of all this worker's
  # children: notebook kernels, multi-process runs)
  peak = _peak_bytes(proc)
  assert peak < params / 2, (peak, params)
