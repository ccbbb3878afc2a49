"""The training config's messages say where a mistake was made (the command-line override or
the ``--config`` file), suggest full dotted keys, list valid keys only for typos, and a resumed
run says when it trains nothing or follows another learning-rate schedule."""

import io
import json
import pathlib
import re

import pytest
from job_testlib import TINY

from recipes import config as config_lib
from recipes import report, rundir, train
from recipes.config import TrainConfigError, load_config

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "training.md"


def _error(*overrides, path=None) -> str:
  with pytest.raises(TrainConfigError) as e:
    load_config(path or train.default_config_path(), list(overrides))
  return str(e.value)


# ----------------------------------------------------------------- where it came from


def test_an_override_typo_names_the_override_not_default_yaml():
  message = _error("steps=20", "model.num_layer=2")
  assert message.startswith("config: 1 problem(s).\n")
  assert "default.yaml" not in message
  assert "  * command-line override 'model.num_layer=2': unknown key 'model.num_layer'" \
         in message


def test_a_file_is_named_only_for_its_own_keys(tmp_path):
  mine = tmp_path / "mine.yaml"
  mine.write_text("steps: 5\noptimiser:\n  learning_rate: 1\nbatch_size: many\n")
  message = _error("stepz=3", path=mine)
  assert f"  * {mine}: unknown key 'optimiser' (did you mean 'optimizer'?)." in message
  assert f"batch_size='many': expected an integer (from {mine})" in message
  assert "  * command-line override 'stepz=3': unknown key 'stepz' (did you mean 'steps'?)." \
         in message
  assert f"Fix them on the command line (key=value, e.g. model.num_heads=4) or in {mine}." \
         in message


def test_a_file_may_spell_keys_dotted_as_on_the_command_line(tmp_path):
  mine = tmp_path / "mine.yaml"
  mine.write_text("model.num_layers: 3\nsteps: 5\nmodel:\n  num_heads: 2\n"
                  "optimizer.learning_rate: 0.5\n")
  nested = tmp_path / "nested.yaml"
  nested.write_text("model:\n  num_layers: 3\n  num_heads: 2\nsteps: 5\n"
                    "optimizer:\n  learning_rate: 0.5\n")
  assert load_config(mine) == load_config(nested)
  twice = tmp_path / "twice.yaml"
  twice.write_text("model:\n  num_layers: 2\nmodel.num_layers: 3\n")
  assert _error(path=twice) == (f"config {twice}: model.num_layers is set twice (as "
                                "'model.num_layers' and under 'model:'); keep one of the two.")
  typo = tmp_path / "typo.yaml"
  typo.write_text("model.num_layrs: 3\n")
  assert f"  * {typo}: unknown key 'model.num_layrs' (did you mean 'model.num_layers'?)." \
      in _error(path=typo)


def test_a_mesh_without_spaces_after_the_colons_says_so():
  # YAML reads {data:8} as one key 'data:8' without a value
  message = _error("mesh={data:8, fsdp: 1}")
  assert ("expected a mapping {mesh axis: size}, e.g. {data: 2, fsdp: 2, tensor: 2}, or auto "
          "(YAML reads 'data:8' as one key: put a space after the colon, {data: 8})") in message


def test_ill_typed_overrides_and_sections_name_the_override():
  assert "steps='x': expected an integer (from command-line override 'steps=x')" \
         in _error("steps=x")
  assert "model must be a mapping of TransformerConfig fields, got 3 (from command-line " \
         "override 'model=3')" in _error("model=3")
  # a section given as a mapping: its keys are the override's
  assert "command-line override 'model={num_layer: 2}': unknown key 'model.num_layer'" \
         in _error("model={num_layer: 2}")


# ------------------------------------------------------------------- suggestions


@pytest.mark.parametrize("override, suggestion", [
    ("model.num_layer=2", "model.num_layers"),
    ("optimizer.lr=0.1", "optimizer.learning_rate"),
    ("data.tsak=copy", "data.task"),
    ("stpes=10", "steps"),
    ("num_layers=4", "model.num_layers"),  # a section's key at the top level
])
def test_suggestions_are_full_dotted_keys(override, suggestion):
  key = override.split("=")[0]
  assert f"unknown key {key!r} (did you mean {suggestion!r}?)." in _error(override)


# --------------------------------------------------------- valid keys only for typos


def test_errors_other_than_unknown_keys_list_no_keys(tmp_path):
  for message in (_error("steps=0"), _error(f"init_from={tmp_path / 'none'}"),
                  _error("optimizer.learning_rate=fast")):
    assert "Valid keys" not in message and "docs/training.md" not in message, message
    assert message.rstrip().endswith("(key=value, e.g. model.num_heads=4).")
  assert "has no config.json" in _error(f"init_from={tmp_path / 'none'}")


def test_a_close_match_gets_the_suggestion_not_the_key_list():
  message = _error("model.num_layer=2", "stpes=3")
  assert "Valid keys" not in message
  assert message.endswith("Every key: docs/training.md#config-keys.")


def test_a_key_without_a_close_match_lists_its_level():
  nested = _error("optimizer.zzz=1")
  assert "unknown key 'optimizer.zzz'. Valid keys of optimizer: learning_rate, warmup_steps, " \
         "min_lr_ratio, weight_decay, b1, b2, clip_norm." in nested
  assert "Valid keys:" not in nested  # not the top level's too
  top = _error("qqq=1")
  assert "Valid keys: batch_size, checkpoint_every, data.*, distributed.*, eval_batches" in top
  assert "model.*, optimizer.*" in top and "num_kv_heads" not in top  # sections collapsed
  assert len(top) < 600, top


def test_docs_list_every_key_under_the_anchor_messages_name():
  text = DOCS.read_text()
  assert re.search(r"^## Config keys$", text, re.M) and re.search(r"^## Resuming$", text, re.M)
  section = text[text.index("## Config keys"):text.index("## Presets and micro-batches")]
  documented = set(re.findall(r"`(\w+)`", section))
  for entry in config_lib._valid_keys():
    names = re.findall(r"\w+", entry.split(".", 1)[1]) if "." in entry else [entry]
    assert set(names) <= documented, (entry, set(names) - documented)


# -------------------------------------------------------------------------- resume


def test_summary_of_a_run_resumed_past_its_steps():
  assert report.step_fields(30, 40) == {"steps": 40, "steps_requested": 30,
                                        "steps_trained": 0, "resumed_from": 40}
  assert report.step_fields(40, 20)["steps_trained"] == 20
  assert report.steps_text(report.step_fields(30, 40)) == \
      "40 (already past steps=30: nothing trained)"
  # the summary train.py writes today ("steps" the config's) reads the same
  assert report.steps_text({"steps": 30, "resumed_from": 40}) == \
      "40 (already past steps=30: nothing trained)"
  assert report.steps_text({"steps": 40, "resumed_from": 40}) == \
      "40 (already at steps=40: nothing trained)"
  assert report.steps_text({"steps": 300, "resumed_from": None}) == "300"


class _Log:
  def __init__(self, rate):
    self.rate = rate

  def last(self, key):
    return self.rate if key == "learning_rate" else None


def test_schedule_note_only_when_steps_change_and_training_goes_on():
  run = type("Run", (), {"schedule": staticmethod(lambda step: 0.002)})()
  note = rundir.schedule_note(20, 40, 20, run, _Log(0.00285))
  assert note.startswith("warning: resume=true with steps=40, but the checkpoint's run had "
                         "steps=20.")
  assert "the learning rate goes from 0.00285 at step 20 to 0.002 at step 21" in note
  assert "docs/training.md#resuming" in note
  assert "resume with steps=40 to keep it" in rundir.schedule_note(40, 60, 10, run, _Log(0.1))
  assert rundir.schedule_note(20, 20, 10, run, _Log(0.1)) is None  # same steps
  assert rundir.schedule_note(40, 30, 40, run, _Log(0.1)) is None  # nothing trained
  assert rundir.schedule_note(None, 30, 10, run, _Log(0.1)) is None  # an older checkpoint


def _train(out, *overrides):
  log, table = io.StringIO(), io.StringIO()
  config = load_config(train.default_config_path(),
                       TINY + ["checkpoint_every=2", f"out_dir={out}", *overrides])
  summary = train.train(config, progress=False, out=table, log=log)
  return summary, log.getvalue(), table.getvalue()


@pytest.mark.slow  # trains two runs
def test_resume_past_steps_then_with_more_steps(tmp_path):
  out = tmp_path / "run"
  _train(out, "steps=2")
  # fewer steps than the run has: nothing trained, said in the log and the summary table
  summary, log, table = _train(out, "steps=1", "resume=true")
  assert "resumed from step 2 of" in log
  assert "it is already past steps=1, so nothing is trained (steps=3 or more trains on)" in log
  assert "warning" not in log
  assert "2 (already past steps=1: nothing trained)" in table
  assert summary["resumed_from"] == 2
  # more steps: trains on, warning that the schedule is another one from step 3
  summary, log, table = _train(out, "steps=4", "resume=true")
  assert "warning: resume=true with steps=4, but the checkpoint's run had steps=2." in log
  rates = {r["step"]: r["learning_rate"] for r in map(
      json.loads, (out / "metrics.jsonl").read_text().splitlines())}
  assert f"goes from {rates[2]:.3g} at step 2 to {rates[3]:.3g} at step 3" in log
  assert "4 (resumed from 2)" in table
