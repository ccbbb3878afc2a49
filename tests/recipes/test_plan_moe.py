"""The planner's figures for a mixture-of-experts model (``model.num_experts > 0``) against
the program and the papers: the step's matmul FLOPs counted in its jaxpr (the experts run on
their capacity's slots, plus the dispatch and combine einsums), the useful FLOPs (top-k
experts per token), GShard's four all-to-alls per layer under ``expert_parallel`` (expert
weights stay where they are: no FSDP gather of them), and the compile's collective bytes.

Before: the planner priced every expert for every token (2.6x the step's FLOPs at 8 experts,
top 2), printed MFU above the chip's matmul efficiency, and all-gathered the expert weights
over ``expert`` as if it were FSDP (16x the compiled bytes).
"""

import jax
import pytest
from jaxpr_testlib import matmul_flops

from benchmarks import papers
from recipes import chips, cost_model, plan, plan_model, train
from recipes.config import load_config

MOE = ["seq_len=64", "batch_size=8", "model.max_len=64", "model.embed_dim=64",
       "model.mlp_dim=128", "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=16",
       "model.num_layers=2", "model.vocab_size=256", "model.num_experts=8",
       "model.experts_per_token=2", "model.attention=xla", "model.scan_layers=true"]
H100 = chips.get_chip("h100")


def _config(overrides):
  return load_config(train.default_config_path(), MOE + overrides)


def _estimate(cfg, mesh, remat="none"):
  return plan_model.estimate(plan.model_params(cfg), cfg.model, train.make_rules(cfg), mesh,
                             batch=cfg.batch_size, seq_len=cfg.seq_len, microbatches=1,
                             remat=remat, chip=H100, attention="xla")


@pytest.mark.parametrize("extra", [[], ["model.capacity_factor=4.0"], ["model.num_experts=0"]],
                         ids=["moe", "moe-capacity-4", "dense"])
def test_planned_flops_are_the_steps_matmul_flops(extra):
  cfg = _config(["preset=data_parallel", "mesh={data: 1}", "model.remat=none"] + extra)
  run = train.build_run(cfg)
  jaxpr = jax.make_jaxpr(run.train_step)(run.state, run.data.batch(0, "train")).jaxpr
  est = _estimate(cfg, {"data": 1})
  planned = est.flops["forward"] + est.flops["backward"]
  assert planned == pytest.approx(matmul_flops(jaxpr), rel=0.01)


def test_useful_flops_count_the_top_k_experts_a_token_passes():
  cfg = _config([])
  m = cfg.model
  est = _estimate(cfg, {"data": 1})
  per_token = cost_model.model_flops_per_token(
      m.embed_dim, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim, m.vocab_size,
      m.num_layers, cfg.seq_len, experts_per_token=m.experts_per_token)
  router = 6 * m.embed_dim * m.num_experts * m.num_layers
  assert est.model_flops == pytest.approx((per_token + router) * cfg.batch_size * cfg.seq_len)


def test_expert_parallel_sends_gshards_all_to_alls_not_weight_gathers():
  cfg = _config(["preset=expert_parallel", "mesh={data: 2, expert: 4}"])
  est = _estimate(cfg, {"data": 2, "expert": 4})
  rows = cfg.batch_size // 8                  # the batch over data x expert
  assert cfg.model.dtype == "float32"          # papers.expert_bytes counts fp32 tokens
  gshard = papers.expert_bytes(cfg.model, rows, cfg.seq_len, 4)
  # the router (embed, expert) is split over 'expert' as FSDP splits a weight: gathered
  # forward and backward, its gradient reduce-scattered
  m = cfg.model
  router = m.num_layers * 3 * m.embed_dim * m.num_experts * 4 * 3 / 4
  assert est.comm_bytes["expert"] == pytest.approx(gshard + router)
  assert "expert" in est.serial_axes           # the experts wait for their tokens


def test_moe_plans_never_beat_the_calibrated_matmul_efficiency():
  cfg = load_config(train.default_config_path(), [
      "model.num_experts=8", "model.experts_per_token=2", "model.embed_dim=1024",
      "model.mlp_dim=4096", "model.num_layers=8", "model.num_heads=8", "model.num_kv_heads=8",
      "model.head_dim=128", "seq_len=1024", "model.max_len=1024", "batch_size=64",
      "model.dtype=bfloat16"])
  found = plan.search(cfg, devices=8, chip=H100, max_microbatches=1, compile_top=0,
                      cache=None)
  assert found.results
  for r in found.results:
    assert r.time.mfu <= H100.cal.matmul_efficiency, (r.candidate.preset, r.time.mfu)


@pytest.mark.slow
def test_planned_collective_bytes_match_the_compile_per_axis_group():
  cfg = _config(["model.num_experts=8"])
  found = plan.search(cfg, devices=8, chip=H100, presets=["expert_parallel"], remats=["none"],
                      max_microbatches=1, compile_top=3, cache=None, attention="xla")
  compiled = [r for r in found.results if r.compiled]
  assert len(compiled) == 3
  for r in compiled:
    got = r.compiled["collective_bytes"]
    assert set(got) == set(r.estimate.comm_bytes), dict(r.candidate.mesh)
    for group, wire in got.items():
      assert r.estimate.comm_bytes[group] == pytest.approx(wire, rel=0.05), (
          dict(r.candidate.mesh), group)
