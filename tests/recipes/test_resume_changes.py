"""What a resumed run may change (how the step is computed, not the weights) and the
learning-rate schedule of a run no longer than its warmup; each against an independent
reference: an uninterrupted run, a numpy schedule."""

import io
import json
import re
import shutil
import warnings

import numpy as np
import pytest
from job_testlib import REPO, TINY, losses

from recipes import init_from, rundir, train
from recipes.config import TrainConfigError, load_config

# A constant learning rate (no warmup, min_lr_ratio 1): a steps=2 run resumed with steps=4
# follows the schedule of an uninterrupted steps=4 run, so their losses can be compared.
CONSTANT_LR = ["optimizer.warmup_steps=0", "optimizer.min_lr_ratio=1"]


def _config(out, *overrides):
  return load_config(train.default_config_path(),
                     TINY + CONSTANT_LR + [f"out_dir={out}", *overrides])


def _train(out, *overrides):
  log = io.StringIO()
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    train.train(_config(out, *overrides), progress=False, out=io.StringIO(), log=log)
  return log.getvalue(), [str(w.message) for w in caught if "warmup_steps" in str(w.message)]


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
  """A run stopped at its step-2 checkpoint (copy it before resuming: tests share it)."""
  out = tmp_path_factory.mktemp("two") / "run"
  _train(out, "steps=2")
  return out


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """The losses of the uninterrupted steps=4 run."""
  out = tmp_path_factory.mktemp("straight") / "run"
  log, schedule_warnings = _train(out, "steps=4")
  assert schedule_warnings == []  # a run longer than its warmup (0) does not warn
  return losses(out)


# ------------------------------------------------------------------ runtime-only changes


@pytest.mark.parametrize("change", [
    "model.remat=dots",
    pytest.param("model.attention=blockwise", marks=pytest.mark.slow),
    pytest.param("model.dtype=bfloat16", marks=pytest.mark.slow),
])
def test_resume_with_a_runtime_change_continues_the_run(change, two_steps, straight, tmp_path):
  out = tmp_path / "run"
  shutil.copytree(two_steps, out)
  log, _ = _train(out, "steps=4", "resume=true", change)
  key, value = change.split("=")
  saved = json.loads(json.dumps(load_config(train.default_config_path(), [])
                                .to_dict()["model"][key.removeprefix("model.")]))
  assert f"resumed from step 2 of {out / 'checkpoints'} (same weights, computed " \
         f"differently: {key} {saved} -> {value})" in log
  ran = losses(out)
  assert len(ran) == 4
  assert ran[:2] == straight[:2]  # the checkpoint's run, kept
  # steps 3 and 4 start from the restored state: the uninterrupted run's losses (float32
  # rounding apart; bfloat16 compute moved them by 1.4e-4 relative when this was written)
  rtol = 2e-3 if "bfloat16" in change else 1e-5
  np.testing.assert_allclose(ran[2:], straight[2:], rtol=rtol)
  # the next checkpoint records the new setting: a second resume with it changes nothing
  log, _ = _train(out, "steps=5", "resume=true", change)
  assert "computed differently" not in log


@pytest.mark.parametrize("change, there, here", [
    ("model.mlp_dim=64", "32", "64"),
    pytest.param("model.param_dtype=bfloat16", "float32", "bfloat16", marks=pytest.mark.slow),
    pytest.param("model.scan_layers=true", "False", "True", marks=pytest.mark.slow),
])
def test_resume_refuses_a_change_of_the_weights(change, there, here, two_steps):
  key = change.split("=")[0]
  free = ", ".join(f"model.{f}" for f in rundir.runtime_fields())
  message = (rf"(?s)resume=true: the checkpoint at step 2 of .* is of another model:\n"
             rf"  \* {re.escape(key)}={there} there, {here} here\n"
             rf"Use that run's framework and model\.\* \(preset, mesh and microbatches may "
             rf"change: the state is resharded; so may {re.escape(free)}: they change how "
             rf"the step is computed, not the weights\), or start a new run with "
             rf"resume=false out_dir=")
  with pytest.raises(TrainConfigError, match=message):
    train.train(_config(two_steps, "steps=4", "resume=true", change), progress=False,
                out=io.StringIO(), log=io.StringIO())
  assert len(losses(two_steps)) == 2  # nothing written


def test_runtime_fields_are_the_ones_generate_accepts_and_the_docs_list():
  fields = rundir.runtime_fields()
  assert fields == init_from.checkpoint_free_fields()  # one list
  assert {"attention", "remat", "dtype"} <= set(fields)
  assert not {"param_dtype", "scan_layers", "embed_dim", "num_layers"} & set(fields)
  resuming = (REPO / "docs" / "training.md").read_text().split("## Resuming")[1]
  listed = resuming.split("--checkpoint` accepts: ")[1].split(")")[0]
  assert re.findall(r"`(\w+)`", listed) == list(fields)


def test_runtime_changes_are_told_apart_from_model_changes():
  config = load_config(train.default_config_path(), ["model.remat=dots", "model.num_heads=8"])
  saved = load_config(train.default_config_path(), []).to_dict()
  assert rundir.runtime_changes(config, saved) == [("model.remat", "none", "dots")]
  assert rundir.mismatches(config, saved, {}, {}) == ["model.num_heads=4 there, 8 here"]


# ------------------------------------------------------------- the learning-rate schedule


def _reference_rates(steps, warmup_steps, peak, min_lr_ratio):
  """The documented schedule at steps 0..steps-1, warmup shortened to ``steps``."""
  i = np.arange(steps, dtype=np.float64)
  w = min(warmup_steps, steps)
  end = peak * min_lr_ratio
  t = np.clip((i - w) / max(steps - w, 1), 0.0, 1.0)
  cosine = end + (peak - end) * 0.5 * (1 + np.cos(np.pi * t))
  return np.where(i < w, peak * i / max(w, 1), cosine)


@pytest.mark.parametrize("steps, warmup", [(4, 30), (30, 30), (1, 30), (31, 30), (50, 5),
                                           (10, 0)])
def test_schedule_is_the_documented_one(steps, warmup):
  config = load_config(train.default_config_path(), [f"steps={steps}",
                                                     f"optimizer.warmup_steps={warmup}"])
  o = config.optimizer
  rates = np.array([float(train.make_optimizer(config)[1](i)) for i in range(steps)])
  expected = _reference_rates(steps, warmup, o.learning_rate, o.min_lr_ratio)
  np.testing.assert_allclose(rates, expected, rtol=1e-6, atol=1e-12)
  if steps <= warmup:  # warmed up over the whole run: i / steps of the peak, no decay
    np.testing.assert_allclose(rates, o.learning_rate * np.arange(steps) / steps, rtol=1e-6)


def test_short_warmup_warning_names_both_keys_and_the_fix():
  config = load_config(train.default_config_path(), ["steps=4"])  # warmup_steps: 30
  assert train.short_warmup_warning(config) == (
      "optimizer.warmup_steps=30 is not shorter than steps=4, so the warmup is shortened to "
      "the run's 4 step(s): the learning rate rises linearly from 0 to 0.00225 (3/4 of "
      "optimizer.learning_rate=0.003) at the last step and never decays. For a warmup and "
      "then the cosine decay, set optimizer.warmup_steps below 4 (e.g. "
      "optimizer.warmup_steps=0) or steps above 30 "
      "(docs/training.md#the-learning-rate-schedule).")
  equal = train.short_warmup_warning(load_config(train.default_config_path(), ["steps=30"]))
  assert "so the warmup takes the run's 30 step(s)" in equal
  one = train.short_warmup_warning(load_config(train.default_config_path(), ["steps=1"]))
  assert "its one step has learning rate 0 (where the warmup starts), so no weight " \
         "changes" in one
  assert train.short_warmup_warning(load_config(train.default_config_path(),
                                                ["steps=31"])) is None
  with pytest.raises(TrainConfigError, match=r"optimizer.warmup_steps=-1 must be >= 0 "
                                             r"\(0: no warmup\)"):
    load_config(train.default_config_path(), ["optimizer.warmup_steps=-1"])
  assert "\n## The learning-rate schedule\n" in (REPO / "docs" / "training.md").read_text()


def test_a_run_shorter_than_its_warmup_warns_and_logs_that_schedule(tmp_path):
  out = tmp_path / "run"
  config = load_config(train.default_config_path(), TINY + [f"out_dir={out}"])  # steps=3
  o = config.optimizer
  with pytest.warns(UserWarning, match=r"optimizer.warmup_steps=30 is not shorter than "
                                       r"steps=3, so the warmup is shortened to the run's 3 "
                                       r"step\(s\).*set optimizer.warmup_steps below 3"):
    train.train(config, progress=False, out=io.StringIO(), log=io.StringIO())
  logged = [json.loads(line)["learning_rate"]
            for line in (out / "metrics.jsonl").read_text().splitlines()]
  np.testing.assert_allclose(logged, _reference_rates(3, 30, o.learning_rate, o.min_lr_ratio),
                             rtol=1e-6)
  np.testing.assert_allclose(logged, [0.0, 0.001, 0.002], rtol=1e-6)
