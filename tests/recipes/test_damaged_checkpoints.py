"""Damaged checkpoint folders: ``recipes.generate``, ``recipes.export`` and ``resume=true``
agree on which steps are complete (``recipes.checkpoint.complete_steps``), skip an
incomplete folder with a warning that names it, and turn a step whose arrays are gone into a
``CheckpointError`` naming the folder and the step to use instead; ``--to hf`` onto a file
is an argument error.

Reference: the run's own checkpoints, as ``train`` wrote them, damaged the two ways a user
trial found (an empty step folder beside good ones; the latest step's array data deleted).
"""

import io
import json
import re
import shutil
import warnings

import numpy as np
import pytest
from job_testlib import TINY

import layers
from recipes import checkpoint, export, generate, train
from recipes.checkpoint import CheckpointError
from recipes.config import load_config

RUN = [*TINY, "checkpoint_every=1", "framework=linen"]

pytestmark = pytest.mark.slow   # every test reads the checkpoints of a trained run


@pytest.fixture(scope="module")
def good_run(tmp_path_factory):
  """A 3-step run with checkpoints at steps 1, 2 and 3 (copy it before damaging it)."""
  out = tmp_path_factory.mktemp("good") / "run"
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")   # the short-warmup warning of a 3-step run
    train.train(load_config(train.default_config_path(), RUN + [f"out_dir={out}"]),
                progress=False, out=io.StringIO(), log=io.StringIO())
  return out


@pytest.fixture
def empty_step(good_run, tmp_path):
  """Case A: an empty folder ``checkpoints/4`` beside the good steps 1-3."""
  out = tmp_path / "run"
  shutil.copytree(good_run, out)
  (out / "checkpoints" / "4").mkdir()
  return out


@pytest.fixture
def arrays_gone(good_run, tmp_path):
  """Case B: the latest step (3) with its array data (``state/d``, ``ocdbt.process_0``)
  deleted; its metadata files are still there."""
  out = tmp_path / "run"
  shutil.copytree(good_run, out)
  state = out / "checkpoints" / "3" / "state"
  shutil.rmtree(state / "d")
  shutil.rmtree(state / "ocdbt.process_0")
  return out


def _warnings_of(call):
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    result = call()
  return result, [str(w.message) for w in caught]


def _resume(out, *overrides):
  config = load_config(train.default_config_path(),
                       RUN + [f"out_dir={out}", "resume=true", *overrides])
  log = io.StringIO()
  (summary, caught) = _warnings_of(lambda: train.train(config, progress=False,
                                                        out=io.StringIO(), log=log))
  return summary, log.getvalue(), caught


# ------------------------------------------------------------- case A: an empty step folder


def test_complete_steps_skip_an_empty_folder_naming_it(empty_step):
  folder = empty_step / "checkpoints" / "4"
  steps, caught = _warnings_of(lambda: checkpoint.complete_steps(empty_step / "checkpoints"))
  assert steps == [1, 2, 3]
  assert caught == [f"skipping checkpoint folder {folder.absolute()}: it is not a complete "
                    "checkpoint (no meta/metadata, no state/_METADATA); using steps "
                    "[1, 2, 3]. Delete it or move it out of "
                    f"{(empty_step / 'checkpoints').absolute()} to silence this."]
  ckpt = checkpoint.Checkpointer(empty_step / "checkpoints")
  (latest, _) = _warnings_of(ckpt.latest_step)
  assert latest == 3
  ckpt.close()


def test_export_and_generate_use_the_latest_complete_step(empty_step, tmp_path, capsys):
  path = tmp_path / "w.npz"
  rc, caught = _warnings_of(lambda: export.main(["--checkpoint", str(empty_step), "--out",
                                                 str(path)]))
  assert rc == 0, capsys.readouterr().err
  assert json.loads(path.with_suffix(".json").read_text())["step"] == 3
  assert any(f"skipping checkpoint folder {empty_step.absolute() / 'checkpoints' / '4'}" in w
             for w in caught)
  source, caught = _warnings_of(lambda: generate.run_source(str(empty_step), None, []))
  assert source.step == 3
  assert any("checkpoints/4: it is not a complete checkpoint" in w for w in caught)


def test_step_naming_the_empty_folder_says_it_is_incomplete(empty_step, tmp_path, capsys):
  folder = (empty_step / "checkpoints" / "4").absolute()
  assert export.main(["--checkpoint", str(empty_step), "--step", "4", "--out",
                      str(tmp_path / "w.npz")]) == 2
  err = capsys.readouterr().err
  assert (f"--step 4: the folder {folder} is not a complete checkpoint (no meta/metadata, "
          "no state/_METADATA); the complete steps are [1, 2, 3]. Pass one of them, or "
          "leave --step out for the latest.") in err
  assert not (tmp_path / "w.npz").exists()
  assert generate.main(["--checkpoint", str(empty_step), "--step", "4",
                        "--tokens", "1 2"]) == 2
  assert f"--step 4: the folder {folder} is not a complete checkpoint" in \
      capsys.readouterr().err


def test_resume_continues_from_the_latest_complete_step(empty_step):
  summary, log, caught = _resume(empty_step, "steps=4")
  assert "resumed from step 3 of" in log
  assert summary["resumed_from"] == 3
  assert any("skipping checkpoint folder" in w and "checkpoints/4" in w for w in caught)
  # the empty folder was replaced by the resumed run's step 4, complete this time
  assert checkpoint.complete_steps(empty_step / "checkpoints") == [2, 3, 4]


# --------------------------------------------------- case B: the latest step's arrays gone


def _damaged(out, step: int) -> str:
  return (f"checkpoint step {step} in {(out / 'checkpoints' / str(step)).absolute()} is "
          "incomplete or damaged: reading its arrays failed:")


def test_export_of_a_damaged_step_names_it_and_the_earlier_step(arrays_gone, tmp_path,
                                                                 capsys):
  for step in ([], ["--step", "3"]):   # the latest, or named: never silently step 2
    assert export.main(["--checkpoint", str(arrays_gone), *step, "--out",
                        str(tmp_path / "w.npz")]) == 2
    err = capsys.readouterr().err
    assert _damaged(arrays_gone, 3) in err
    assert "NOT_FOUND" in err   # what the reader said, as context
    assert ("Pass --step 2 to use the latest step before it (the complete steps before it: "
            "[1, 2]), or copy that folder again if it came from elsewhere.") in err
    assert not (tmp_path / "w.npz").exists()


def test_generate_from_a_damaged_step_exits_2_naming_it(arrays_gone, capsys):
  assert generate.main(["--checkpoint", str(arrays_gone), "--tokens", "1 2"]) == 2
  err = capsys.readouterr().err
  assert _damaged(arrays_gone, 3) in err and "Pass --step 2 to use" in err
  assert "Traceback" not in err


def test_resume_from_a_damaged_step_says_which_folder_to_move(arrays_gone, capsys):
  folder = (arrays_gone / "checkpoints" / "3").absolute()
  with pytest.raises(CheckpointError) as e:
    _resume(arrays_gone, "steps=4")
  assert _damaged(arrays_gone, 3) in str(e.value)
  assert (f"resume=true continues from the latest step: delete {folder} or move it out of "
          f"{folder.parent} to resume from step 2, the latest step before it.") in str(e.value)
  # the command line: exit 2 with the message, nothing trained
  assert train.main([*RUN, f"out_dir={arrays_gone}", "resume=true", "steps=4"]) == 2
  assert _damaged(arrays_gone, 3) in capsys.readouterr().err
  assert checkpoint.complete_steps(arrays_gone / "checkpoints") == [1, 2, 3]


# ------------------------------------------------------------------ --to hf onto a file


def test_to_hf_onto_an_existing_file_is_an_argument_error(good_run, tmp_path, capsys):
  target = tmp_path / "weights.npz"
  target.write_bytes(b"not a directory")
  assert export.main(["--checkpoint", str(good_run), "--to", "hf", "--out",
                      str(target)]) == 2
  err = capsys.readouterr().err
  assert (f"--out {str(target)!r} is a file, but with --to hf --out is the directory to "
          "write (config.json, model.safetensors). Pass a new or existing directory (e.g. "
          f"--out {target.with_suffix('')}), or leave --to hf out to write an .npz.") in err
  assert target.read_bytes() == b"not a directory"
  # layers.to_hf itself: an HFError naming the path, not FileExistsError from mkdir
  params, meta, _ = export.restore_params(good_run)
  weights = {k: np.asarray(v) for k, v in layers.to_canonical(params).items()}
  with pytest.raises(layers.hf.HFError, match=re.escape(
      f"to_hf: path {str(target)!r} is a file; it must be a directory (created if missing)")):
    layers.to_hf(weights, export.model_config(meta), target)
  assert target.read_bytes() == b"not a directory"
