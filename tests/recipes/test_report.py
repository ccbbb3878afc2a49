"""The run's summary (``recipes.report``): it names exactly the files the run left in its
``out_dir``, and a pipelined run's stages, micro-batches, repeats and bubble."""

import io
import json
import re

import pytest
from job_testlib import TINY

from recipes import report, train
from recipes.config import load_config

PIPELINE = ["preset=pipeline_parallel", "mesh={data: 2, stage: 4}", "model.scan_layers=true",
            "model.num_layers=4"]


def _train(out_dir, *overrides):
  config = load_config(train.default_config_path(), TINY + [f"out_dir={out_dir}", *overrides])
  printed = io.StringIO()
  summary = train.train(config, progress=False, out=printed, log=io.StringIO())
  return summary, _text(printed)


def _text(printed: io.StringIO) -> str:
  """The printed table as one line of words: a cell that wraps reads as one."""
  return " ".join(re.sub("[│┃]", " ", printed.getvalue()).split())


def _listed(printed: str) -> set[str]:
  """The run files the printed summary names (its ``outputs`` row)."""
  row = printed[printed.index("outputs"):]
  return {name for name in report.OUTPUTS if re.search(rf"[(, ]{re.escape(name)}[,)]", row)}


def _left(out_dir) -> set[str]:
  return {p.name + ("/" if p.is_dir() else "") for p in out_dir.iterdir()}


@pytest.mark.parametrize("plot", [False, True])
def test_the_summary_names_exactly_the_files_the_run_wrote(tmp_path, plot):
  out = tmp_path / "run"
  summary, printed = _train(out, f"plot={str(plot).lower()}")
  left = _left(out)
  assert left == {"metrics.jsonl", "summary.json", "checkpoints/"} | ({"loss.png"} if plot else
                                                                     set())
  assert _listed(printed) == left


def test_a_pipelined_run_states_its_schedule_and_bubble_and_records_its_files(tmp_path):
  out = tmp_path / "run"
  summary, printed = _train(out, *PIPELINE)
  assert set(summary["outputs"]) == _left(out) == _listed(printed)
  assert json.loads((out / "summary.json").read_text())["outputs"] == summary["outputs"]
  p, m, r = 4, 4, 1     # mesh stage=4; pipeline_microbatches=0 is one per stage; GPipe
  assert summary["pipeline"] == {"stages": p, "microbatches": m, "repeats": r,
                                 "iterations": r * m + p - 1,
                                 "bubble": pytest.approx((p - 1) / (r * m + p - 1))}
  assert "pipeline 4 stages x 4 micro-batches x 1 repeat: 7 iterations, bubble 42.9%" in printed


def test_an_unpipelined_run_has_no_pipeline_row(tmp_path):
  summary, printed = _train(tmp_path / "run")
  assert "pipeline" not in summary and "bubble" not in printed


@pytest.mark.parametrize("p, m, r, shown", [
    (4, 8, 1, "27.3%"), (4, 8, 2, "15.8%"), (4, 4, 1, "42.9%"), (2, 16, 3, "2.0%")])
def test_pipeline_fields_are_docs_pipeline_mds_bubble(p, m, r, shown):
  fields = report.pipeline_fields(p, m, r)
  assert fields["bubble"] == pytest.approx((p - 1) / (r * m + p - 1))
  assert fields["iterations"] == r * m + p - 1
  assert report.pipeline_text(fields).endswith(f"bubble {shown}")


@pytest.mark.parametrize("plot", [False, True])
def test_finish_writes_and_lists_the_same_files(tmp_path, plot):
  (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
  base = {"framework": "linen", "preset": "fsdp", "mesh": {"data": 8}, "microbatches": 1,
          **report.step_fields(1, 0), "final_loss": 1.0, "eval_loss": None, "accuracy": None,
          "exact_match": None, "tokens_per_s": 1.0, "param_bytes_per_device": 4,
          "optimizer_bytes_per_device": 8, "param_bytes_total": 32, "out_dir": str(tmp_path),
          "pipeline": report.pipeline_fields(4, 8, 2)}
  printed = io.StringIO()
  summary = report.finish(base, [{"step": 1, "loss": 1.0}], tmp_path, plot=plot, out=printed)
  text = _text(printed)
  assert _left(tmp_path) == set(summary["outputs"]) == _listed(text)
  assert ("loss.png" in summary["outputs"]) is plot
  assert "pipeline 4 stages x 8 micro-batches x 2 repeats: 19 iterations, bubble 15.8%" in text
