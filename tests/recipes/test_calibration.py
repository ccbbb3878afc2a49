"""The calibration table: every measured or published run against the planner's prediction,
the fitted coefficients against an independent refit, and the docs table against a fresh
recomputation (a prediction that leaves its band fails here).

References: the rows' figures are the published ones (MaxText READMEs and tiering table,
the H200 measurements), converted to seconds with the publisher's FLOP count, which
``maxtext_seconds`` is checked against by hand below.
"""

import re
from pathlib import Path

import pytest

import layers
from recipes import calibration, chips, cost_model, plan, train
from recipes.config import load_config

REPO = Path(__file__).resolve().parents[2]
# the rows the issue lists (its targets): every one within +-20 %
LISTED = ("h200-1b-xla", "h200-1b-cudnn-reference", "a3-llama2-7b-1node",
          "a3-llama2-7b-2node", "a3-llama2-7b-4node", "a3-llama2-7b-16node",
          "v5p-32b-1x128", "v5e-32b-1x256", "v6e-llama3.1-8b", "v6e-llama3.1-70b")


@pytest.fixture(scope="module")
def table():
  return calibration.table()


def test_every_row_within_its_chip_band(table):
  for p in table:
    band = chips.get_chip(p.row.chip).cal.band
    assert abs(p.error) <= band, (p.row.name, p.error, band)
    assert p.time.band == band


def test_listed_rows_within_20_percent(table):
  by_name = {p.row.name: p for p in table}
  for name in LISTED:
    assert abs(by_name[name].error) <= 0.20, (name, by_name[name].error)


def test_holdouts_exist_on_every_calibrated_chip(table):
  """The model is checked on rows it was not fitted on, on each chip that has a fit row."""
  fitted = {p.row.chip for p in table if p.row.role == "fit"}
  held = {p.row.chip for p in table if p.row.role == "holdout"}
  assert {"h100", "tpu-v4", "tpu-v5p", "tpu-v5e", "tpu-v6e"} <= fitted
  assert fitted - {"h200"} <= held


def test_no_prediction_above_the_calibrated_matmul_efficiency(table):
  for p in table:
    assert p.mfu <= chips.get_chip(p.row.chip).cal.matmul_efficiency + 1e-9, p.row.name


def test_refit_gives_the_chip_table(table):
  """Each fitted coefficient of recipes/chips.py is what refitting its rows gives."""
  for (chip, field), value in calibration.fit().items():
    assert getattr(chips.get_chip(chip).cal, field) == pytest.approx(value, abs=0.005), (
        chip, field)
  # the GPU knee is one coefficient shared by the H100 and H200
  assert chips.get_chip("h100").cal.matmul_knee == chips.get_chip("h200").cal.matmul_knee


def test_docs_table_is_the_recomputed_table(table):
  text = (REPO / "docs" / "planning.md").read_text()
  block = re.search(r"<!-- calibration-table -->\n(.*?)\n<!-- /calibration-table -->", text,
                    re.S)
  assert block, "docs/planning.md lacks the calibration table markers"
  assert block.group(1).strip() == calibration.markdown(table).strip()


def test_maxtext_seconds_by_hand():
  """Llama2-7B at seq 4096, 4 sequences, 492 TFLOP/s: MaxText's count per token is
  6 (32 (4 D^2 + 3 D F) + D V) + 12 s H d_head L (non-causal)."""
  d, f, v, L, s = 4096, 11008, 32000, 32, 4096
  per_token = 6 * (L * (4 * d * d + 3 * d * f) + d * v) + 12 * s * 32 * 128 * L
  assert calibration.maxtext_seconds(492, calibration.LLAMA2_7B, s, 4) == pytest.approx(
      per_token * s * 4 / 492e12)


def test_maxtext_scaled_models():
  """MaxText's get_individual_scales: 16B doubles heads and MLP twice, embed and layers once;
  128B heads and MLP three times, embed and layers twice."""
  m16, m128 = calibration.maxtext_scaled(16), calibration.maxtext_scaled(128)
  assert (m16["embed_dim"], m16["num_heads"], m16["mlp_dim"], m16["num_layers"]) == (
      4096, 64, 28672, 32)
  assert (m128["embed_dim"], m128["num_heads"], m128["mlp_dim"], m128["num_layers"]) == (
      8192, 128, 57344, 64)


@pytest.mark.parametrize("tie", [True, False])
def test_written_out_params_match_the_traced_model(tie):
  """calibration.transformer_params (shapes written out) equals what the planner traces."""
  fields = dict(vocab_size=64, embed_dim=32, mlp_dim=48, num_heads=4, num_kv_heads=2,
                head_dim=8, num_layers=3, dtype="float32", param_dtype="float32",
                tie_embeddings=tie)
  cfg = load_config(train.default_config_path(),
                    [f"model.{k}={v}" for k, v in fields.items()]
                    + ["model.scan_layers=true", "model.max_len=16", "seq_len=16"])
  traced = sorted(plan.model_params(cfg), key=lambda p: p.path)
  written = sorted(calibration.transformer_params(fields), key=lambda p: p.path)
  assert written == traced


def test_prediction_names_the_binding_term_and_kernel(table):
  by_name = {p.row.name: p for p in table}
  assert by_name["h200-1b-xla"].time.terms["backward"]["attention"] > \
      2 * by_name["h200-1b-cudnn-reference"].time.terms["backward"]["attention"]
  for p in table:
    assert p.bound in ("compute", "HBM", "overhead", "communication")


def test_unknown_attention_is_rejected():
  with pytest.raises(ValueError, match=r"attention='flash' is not an attention implementation"
                                       r"; use one of auto, xla, cudnn, pallas, blockwise"):
    cost_model.resolve_attention("flash", chips.get_chip("h100"), layers.TransformerConfig(),
                                 batch=4, seq_len=2048)
