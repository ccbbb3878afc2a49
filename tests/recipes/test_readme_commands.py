"""The README's ``python -m recipes.*`` commands, as printed: each one parses, trains, and its
losses equal the same run on one device (rtol 1e-5: init is sharding-invariant and the
gradients are those of the full batch, whatever the preset, mesh, micro-batching or framework).

Every preset appears in the README's table, so this is also the every-preset-equals-one-device
test. The runs are made tiny by ``job_testlib.TINY`` (every other key a command names stays as
printed; a printed run length is parsed, then TINY's ``steps`` wins).
"""

import subprocess
import sys

import numpy as np
import pytest
from job_testlib import README, TINY, key, losses, readme_commands

from recipes import config as config_lib
from recipes import train

# The planner's output config (README: recipes.plan --out runs/plan/best.yaml) is trained by
# tests/recipes/test_plan.py::test_written_config_trains_unchanged.
TRAIN_COMMANDS = [c for c in readme_commands("train")
                  if c[:2] != ["--config", "runs/plan/best.yaml"] and c != ["resume=true"]]
# Where the command's strategy lives; the one-device reference replaces them.
STRATEGY_KEYS = {"preset", "mesh", "microbatches", "rules", "out_dir"}
ONE_DEVICE = ["preset=data_parallel", "mesh={data: 1}", "microbatches=1"]


def test_readme_has_the_commands():
  train_commands = readme_commands("train")
  assert [] in train_commands and ["resume=true"] in train_commands
  assert ["preset=microbatch", "mesh={data: 8}", "out_dir=runs/microbatch"] in train_commands
  presets = {a.split("=", 1)[1] for c in train_commands for a in c if key(a) == "preset"}
  assert set(config_lib.PRESET_MESHES) | {"pipeline_parallel", "fsdp_pp"} <= presets


def _train_as_printed(args: list[str], folder, monkeypatch, capsys, extra=()) -> str:
  """``python -m recipes.train *args`` in ``folder``, made tiny; its stderr."""
  monkeypatch.chdir(folder)  # relative out_dirs and files land here
  (folder / "my.yaml").write_text("framework: haiku\nseed: 3\n")
  (folder / "notes.txt").write_text("the quick brown fox jumps over the lazy dog. " * 20)
  if not (folder / "tests").exists():
    (folder / "tests").symlink_to(README.parent / "tests")  # init_from=tests/layers/data/hf/...
  given = {key(a) for a in args} - {"steps"}  # a key the command sets stays as printed
  if "init_from" in given:  # the checkpoint decides the model
    given |= {key(t) for t in TINY if t.startswith("model.")}
  code = train.main(args + [t for t in TINY if key(t) not in given] + list(extra))
  err = capsys.readouterr().err
  assert code == 0, (args, err)
  return err


@pytest.fixture(scope="module")
def one_device_losses(tmp_path_factory):
  """The losses of a command's run on one device, one run per distinct model and data."""
  cache = {}

  def get(args, monkeypatch, capsys):
    what = tuple(a for a in args if key(a) not in STRATEGY_KEYS)
    if what not in cache:
      folder = tmp_path_factory.mktemp("one-device")
      _train_as_printed([*what, *ONE_DEVICE, "out_dir=ref"], folder, monkeypatch, capsys)
      cache[what] = losses(folder / "ref")
    return cache[what]

  return get


@pytest.mark.slow
@pytest.mark.parametrize("args", TRAIN_COMMANDS, ids=lambda args: " ".join(args) or "default")
def test_readme_train_command_equals_one_device(args, tmp_path, monkeypatch, capsys,
                                                one_device_losses):
  _train_as_printed(args, tmp_path, monkeypatch, capsys)
  out_dir = tmp_path / next((a.split("=", 1)[1] for a in args if key(a) == "out_dir"),
                            "runs/default")
  assert (out_dir / "summary.json").exists()
  ran = losses(out_dir)
  assert len(ran) == 3 and all(np.isfinite(ran))
  np.testing.assert_allclose(ran, one_device_losses(args, monkeypatch, capsys), rtol=1e-5)


@pytest.mark.slow
def test_readme_resume_command_continues_the_default_run(tmp_path, monkeypatch, capsys):
  _train_as_printed([], tmp_path, monkeypatch, capsys)
  err = _train_as_printed(["resume=true"], tmp_path, monkeypatch, capsys, extra=["steps=4"])
  assert "resumed from step 3 of " in err  # one more step than the first run


@pytest.mark.slow
def test_readme_explain_command_parses_and_plans():
  [args] = readme_commands("explain")
  proc = subprocess.run([sys.executable, "-m", "recipes.explain", *args, "--no-compile",
                         "--json"], cwd=README.parent, capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert '"num_devices": 64' in proc.stdout
