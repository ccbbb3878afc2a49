"""recipes.explain on a pipeline preset: stage assignment, iterations and bubble."""

import io

import partition
from recipes.config import load_config
from recipes.explain import explain_config, render


def _plan(*overrides):
  config = load_config(overrides=["preset=pipeline_parallel", "mesh={data: 2, stage: 4}",
                                   "model.scan_layers=true", *overrides])
  return explain_config(config, compile=False)


def test_pipeline_stage_assignment_and_bubble():
  p = _plan("model.num_layers=8")
  info = p.to_dict()["pipeline"]
  assert info["stages"] == 4 and info["microbatches"] == 4 and info["repeats"] == 1
  assert info["stage_layers"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
  assert info["iterations"] == 4 + 4 - 1
  assert info["bubble"] == partition.pipeline_bubble(4, 4) == 3 / 7
  # each stage holds a quarter of every stacked block parameter
  blocks = [r for r in p.params.rows if r.path.startswith("blocks/")]
  assert blocks and all(r.bytes_per_device * 4 == r.bytes_total for r in blocks)
  out = io.StringIO()
  render(p, out)
  text = out.getvalue()
  assert "pipeline over 'stage'" in text and "bubble (p-1)/(r m+p-1) = 42.9%" in text


def test_pipeline_microbatches_and_repeats_from_the_model_config():
  p = _plan("model.num_layers=8", "model.pipeline_microbatches=8", "model.pipeline_repeats=2")
  info = p.to_dict()["pipeline"]
  assert (info["stages"], info["microbatches"], info["repeats"]) == (4, 8, 2)
  assert info["stage_layers"] == [[0, 4], [1, 5], [2, 6], [3, 7]]  # circular: chunk c on c % p
  assert info["iterations"] == 2 * 8 + 4 - 1
  assert info["bubble"] == partition.pipeline_bubble(4, 8, repeats=2) == 3 / 19


def test_no_pipeline_without_a_stage_axis():
  config = load_config(overrides=["model.num_layers=2"])
  assert explain_config(config, compile=False).pipeline is None
