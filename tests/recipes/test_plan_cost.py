"""The calibrated cost model of ``recipes.plan`` term by term against formulas on paper, the
ranking it gives (micro-batches that only save memory rank below), the overlap rules, the
attention override, and ``--measure`` (slow: it builds and runs plans on 8 CPU devices)."""

import dataclasses
import json

import pytest
from plan_testlib import TINY, run_plan

import layers
import partition
from recipes import chips, cost_model, plan, plan_model, roofline, train
from recipes.config import load_config, preset_path

H200 = chips.get_chip("h200")
ONE_B = ["seq_len=2048", "batch_size=4", "model.vocab_size=32768", "model.embed_dim=2048",
         "model.mlp_dim=8192", "model.num_heads=16", "model.num_kv_heads=8",
         "model.head_dim=128", "model.num_layers=16", "model.max_len=2048",
         "model.dtype=bfloat16", "model.scan_layers=true"]


def _shape(**kw):
  base = dict(rows=4, seq_q=2048, seq_k=2048, embed=2048, heads=16, kv_heads=8, head_dim=128,
              mlp=8192, vocab=32768, layers=16, microbatches=1, act_bytes=2, param_bytes=4,
              local_params=1e9, gathered_params=1e9, remat="none", attention="cudnn")
  return cost_model.StepShape(**{**base, **kw})


def test_big_matmul_at_the_measured_efficiency_thin_one_at_hbm():
  m = k = n = 8192
  assert cost_model.matmul_seconds(m, k, n, 2, H200) == pytest.approx(
      2 * m * k * n / (0.80 * 989e12))
  # one token: the weight read binds (K N a bytes at 90 % of 4.8 TB/s)
  assert cost_model.matmul_seconds(1, k, n, 2, H200) == pytest.approx(
      (k + k * n + n) * 2 / (0.9 * 4.8e12))


def test_thin_shards_lose_efficiency_on_a_gpu_not_on_a_tpu():
  knee = H200.cal.matmul_knee
  rel = (1024 / (1024 + knee)) / (8192 / (8192 + knee))
  assert cost_model.matmul_efficiency(8192, 8192, 1024, H200) == pytest.approx(0.80 * rel)
  v5p = chips.get_chip("v5p")
  assert cost_model.matmul_efficiency(8192, 8192, 1024, v5p) == v5p.cal.matmul_efficiency


def test_fused_attention_skips_the_masked_half_and_xla_pays_for_scores():
  s = _shape()
  fwd = cost_model.attention_seconds(s, H200)["forward"]
  flops = 4 * 4 * 16 * 2048 * 2048 * 128 / 2
  assert fwd == pytest.approx(flops / (0.62 * 989e12 * 2048 / (2048 + 4090)))
  x = cost_model.attention_seconds(dataclasses.replace(s, attention="xla"), H200)
  scores = 4 * 16 * 2048 * 2048
  assert x["forward"] + x["backward"] == pytest.approx(
      3 * 2 * flops / (0.80 * 989e12) + 45 * scores / (0.9 * 4.8e12))


@pytest.mark.parametrize("kind,dtype,head_dim,seq_len,expected", [
    ("h100", "bfloat16", 128, 2048, "cudnn"), ("h100", "float16", 64, 2048, "cudnn"),
    ("h100", "float32", 128, 1024, "xla"), ("h100", "bfloat16", 264, 1024, "xla"),
    ("h100", "bfloat16", 100, 1024, "xla"),   # not a multiple of 8
    ("h100", "float32", 128, 4096, "blockwise"),   # no fused kernel, long: memory-safe path
    ("v5e", "float32", 128, 2048, "pallas"),
    ("v5e", "bfloat16", 64, 1024, "xla"),     # the TPU kernel needs head_dim % 128 == 0
    ("v5e", "bfloat16", 64, 4096, "blockwise")])
def test_auto_attention_by_chip_is_what_the_model_runs_there(kind, dtype, head_dim, seq_len,
                                                            expected):
  model = layers.TransformerConfig(dtype=dtype, head_dim=head_dim, max_len=seq_len)
  assert cost_model.resolve_attention("auto", chips.get_chip(kind), model, batch=4,
                                      seq_len=seq_len) == expected


def test_auto_attention_under_sequence_parallelism_is_not_cudnn():
  """cuDNN cannot offset its causal mask for a sequence-sharded query block, so the model
  runs 'blockwise' there (layers' dispatch); the planner prices that, not cuDNN."""
  from jax.sharding import AbstractMesh
  rules = partition.AxisRules.from_file(preset_path("sequence_parallel"))
  model = layers.TransformerConfig(dtype="bfloat16", head_dim=128, max_len=4096)
  mesh = AbstractMesh((2, 4), ("data", "sequence"))
  assert cost_model.resolve_attention("auto", H200, model, batch=4, seq_len=4096,
                                      rules=rules, mesh=mesh) == "blockwise"
  assert cost_model.resolve_attention("auto", H200, model, batch=4, seq_len=4096,
                                      rules=rules, mesh=AbstractMesh((8, 1), ("data", "sequence"))
                                      ) == "cudnn"


def test_an_explicit_kernel_the_chip_cannot_run_is_the_models_error():
  model = layers.TransformerConfig(dtype="float32", head_dim=128)
  with pytest.raises(layers.AttentionError, match="cuDNN takes bfloat16/float16 only"):
    cost_model.resolve_attention("cudnn", H200, model, batch=4, seq_len=2048)


def test_remat_recompute_and_optimizer_terms_by_hand():
  none = cost_model.step_terms(_shape(), H200)
  full = cost_model.step_terms(_shape(remat="full"), H200)
  mms = {n: cost_model.matmul_seconds(8192, k, n_, 2, H200)
         for n, (k, n_) in cost_model._block_matmuls(_shape()).items()}
  rerun = sum(mms[n] for n in ("qkv", "out", "mlp_in"))   # the MLP out: dead code
  assert full["backward"]["matmul"] - none["backward"]["matmul"] == pytest.approx(16 * rerun)
  assert full["backward"]["attention"] - none["backward"]["attention"] == pytest.approx(
      16 * cost_model.attention_seconds(_shape(), H200)["forward"])
  # AdamW: read p, g, m, v and write p, m, v, fp32
  assert none["backward"]["optimizer"] == pytest.approx(1e9 * 4 * 7 / (0.9 * 4.8e12))


def test_executed_flops_never_beat_the_calibrated_rate():
  for s in (_shape(), _shape(remat="full", attention="xla"), _shape(rows=1, seq_q=512,
                                                                     seq_k=512)):
    terms = cost_model.step_terms(s, H200)
    compute = terms["forward"]["matmul"] + terms["backward"]["matmul"] + \
        terms["forward"]["attention"] + terms["backward"]["attention"]
    assert cost_model.executed_flops(s) / compute <= 0.80 * 989e12 * (1 + 1e-9)


def _rules(preset):
  from recipes.config import preset_path
  return partition.AxisRules.from_file(preset_path(preset))


def test_dcn_and_tensor_collectives_are_exposed_fsdp_hidden():
  comm = {"forward": {"fsdp": 0.5, "data": 0.2}, "backward": {"fsdp": 1.0, "tensor": 0.3}}
  terms = {"forward": {"matmul": 1.0}, "backward": {"matmul": 2.0}}
  t = roofline.step_time(flops={}, hbm_bytes={}, comm_s=comm, chip=H200, model_flops=0,
                         devices=1, terms=terms, dcn_axes={"data"}, serial_axes=("tensor",))
  assert t.step_s == pytest.approx((1.0 + 0.2) + (2.0 + 0.3))
  v5p = chips.get_chip("v5p")   # TPU: tensor-parallel collectives overlap (collective matmul)
  t = roofline.step_time(flops={}, hbm_bytes={}, comm_s=comm, chip=v5p, model_flops=0,
                         devices=1, terms=terms, dcn_axes={"data"}, serial_axes=("tensor",))
  assert t.step_s == pytest.approx((1.0 + 0.2) + 2.0)


def test_pipeline_bubble():
  cfg = layers.TransformerConfig(vocab_size=64, embed_dim=32, mlp_dim=64, num_heads=4,
                                 num_kv_heads=2, head_dim=8, num_layers=8, max_len=16,
                                 scan_layers=True, pipeline_microbatches=8)
  from recipes import calibration
  params = calibration.transformer_params(dataclasses.asdict(cfg) | {"tie_embeddings": True})
  est = plan_model.estimate(params, cfg, _rules("pipeline_parallel"), {"data": 2, "stage": 4},
                            batch=16, seq_len=16, microbatches=1, remat="none",
                            chip=H200)
  assert est.bubble == pytest.approx((8 + 4 - 1) / 8)
  assert est.shape.layers == 2 and "stage" in est.serial_axes


def test_microbatches_that_only_save_memory_rank_below():
  """The issue's 1.07B model on one H200: k = 4 costs time (smaller matmuls, more weight
  casts and kernels) and the memory it saves is not needed, so k = 1 ranks first."""
  cfg = load_config(train.default_config_path(), ONE_B)
  found = plan.search(cfg, devices=1, chip=H200, presets=["data_parallel"], remats=["none"],
                      max_microbatches=4, compile_top=0, attention="xla")
  ks = [r.candidate.microbatches for r in found.results]
  assert ks == [1, 2, 4]
  steps = [r.time.step_s for r in found.results]
  assert steps[2] > steps[0] * 1.1
  assert all(r.fits for r in found.results)
  top = found.results[0]
  assert top.time.mfu <= H200.cal.matmul_efficiency
  assert top.memory_source.startswith("analytic")


def test_attention_flag_and_override(tmp_path):
  common = ["--devices", "8", "--chip", "h100", "--compile", "0", "--json", "--no-plot",
            "--out", str(tmp_path / "b.yaml"), "--cache", "", *TINY, "model.dtype=bfloat16",
            "model.head_dim=8"]
  code, text, err = run_plan(*common)
  assert code == 0, err
  assert {p["attention"] for p in json.loads(text)["plans"]} == {"cudnn"}
  code, text, _ = run_plan(*common, "model.attention=xla")
  assert {p["attention"] for p in json.loads(text)["plans"]} == {"xla"}
  code, text, _ = run_plan(*common, "--attention", "blockwise")
  assert {p["attention"] for p in json.loads(text)["plans"]} == {"blockwise"}
  code, _, err = run_plan(*common, "--attention", "cudn")
  assert code == 2 and "--attention 'cudn' is not an attention implementation " \
                       "(did you mean 'cudnn'" in err


def test_a_fused_kernel_the_planning_host_lacks_is_planned_for_the_chip(tmp_path):
  """model.attention=cudnn planned for an H100 from this CPU host: priced as cuDNN, traced
  and compiled here with a kernel the host runs, and the plan written keeps cuDNN."""
  out = tmp_path / "b.yaml"
  common = ["--devices", "8", "--chip", "h100", "--json", "--no-plot", "--out", str(out),
            "--cache", "", "--preset", "fsdp", "--remat", "none", *TINY,
            "model.dtype=bfloat16", "model.head_dim=8", "model.attention=cudnn"]
  code, text, err = run_plan("--compile", "1", *common)
  assert code == 0, err
  report = json.loads(text)
  assert report["compile_failures"] == {}
  assert {p["attention"] for p in report["plans"]} == {"cudnn"}
  # compiled here: the plan the analytic ranking put first (the compile's memory may then
  # move it among plans tied on time)
  assert sum(p["compiled"] is not None for p in report["plans"]) == 1
  assert load_config(out).model.attention == "cudnn"
  # A kernel the chip itself cannot run is the model's error, as training there would be.
  code, _, err = run_plan("--compile", "0", *common[:-1], "model.attention=cudnn",
                      "model.dtype=float32")
  assert code == 2 and "cuDNN takes bfloat16/float16 only" in err


def test_measure_needs_the_devices_it_plans_for(tmp_path):
  code, _, err = run_plan("--devices", "4", "--chip", "h100", "--compile", "0", "--no-plot",
                      "--measure", "1", "--out", str(tmp_path / "b.yaml"), "--cache", "",
                      *TINY)
  assert code == 2
  assert "--measure times the plans on the devices this process sees: 8 cpu device(s), " \
         "but --devices is 4" in err


@pytest.mark.slow
def test_measure_prints_predicted_and_measured(tmp_path):
  code, text, err = run_plan("--devices", "8", "--chip", "h100", "--compile", "0", "--no-plot",
                         "--measure", "2", "--measure-steps", "2", "--preset", "fsdp",
                         "--remat", "none", "--out", str(tmp_path / "b.yaml"), "--cache", "",
                         *TINY)
  assert code == 0, err
  assert "predicted (for h100) vs measured (on this machine)" in text
  assert "measured on cpu, predicted for h100" in text
  # two measured plans, each with a measured step time in ms or µs
  table = text.split("predicted (for h100) vs measured")[1]
  assert table.count("fsdp [") == 2
  assert sum(unit in line for line in table.splitlines() for unit in (" ms ", " µs ")) >= 2
