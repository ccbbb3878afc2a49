"""The planner's analytic memory per device against the compile of the same plan on this
process's 8 CPU devices (the compiled peak is the reference: arguments + outputs - donated +
temporaries), for what changes it most: FSDP-gathered weights (one layer at a time, every
layer under remat ``none``), the gradient's reduced copy, and the chunked cross-entropy
(``model.loss_chunk``: one chunk's logits, not the whole micro-batch's); and the accounting
by hand.

The activation-heavy configurations (long sequences with XLA attention) are not held to the
same band: XLA:CPU fuses less than a GPU or TPU compiler and keeps more temporaries there
(``docs/planning.md``, Memory). Parameters are fp32 here: XLA:CPU computes a bf16 matmul in
fp32 from converted copies of its operands, so with bf16 parameters its compile holds weight
copies a GPU or TPU does not.
"""

import pytest

from recipes import chips, plan, plan_model, train
from recipes.config import load_config

# weights dominate: 135 M parameters, 64 tokens per device
WEIGHTS = ["seq_len=64", "batch_size=8", "model.vocab_size=1024", "model.embed_dim=1024",
           "model.mlp_dim=4096", "model.num_heads=8", "model.num_kv_heads=8",
           "model.head_dim=128", "model.num_layers=4", "model.max_len=64"]
# the logits dominate: a 65,536-word vocabulary over 1,024 tokens per device
LOGITS = ["seq_len=512", "batch_size=16", "model.vocab_size=65536", "model.embed_dim=128",
          "model.mlp_dim=256", "model.num_heads=2", "model.num_kv_heads=2",
          "model.head_dim=64", "model.num_layers=1", "model.max_len=512"]
COMMON = ["model.dtype=bfloat16", "model.scan_layers=true"]


def _compiled_plans(overrides, preset, remat, top=3):
  cfg = load_config(train.default_config_path(), COMMON + overrides)
  found = plan.search(cfg, devices=8, chip=chips.get_chip("h100"), presets=[preset],
                      remats=[remat], max_microbatches=1, compile_top=top, cache=None,
                      attention="xla")
  compiled = [r for r in found.results if r.compiled]
  assert compiled, "no plan compiled"
  return compiled


@pytest.mark.slow
@pytest.mark.parametrize("preset,remat,overrides", [
    ("fsdp", "none", WEIGHTS),          # every gathered layer kept for the backward
    ("fsdp", "full", WEIGHTS),          # one gathered layer at a time
    ("fsdp", "dots", WEIGHTS),
    ("data_parallel", "none", WEIGHTS),
    ("data_parallel", "none", LOGITS),
    ("data_parallel", "none", LOGITS + ["model.loss_chunk=128"]),
], ids=["fsdp-none", "fsdp-full", "fsdp-dots", "dp-weights", "dp-logits", "dp-chunked-loss"])
def test_analytic_memory_within_10_percent_of_the_compiled_peak(preset, remat, overrides):
  for r in _compiled_plans(overrides, preset, remat):
    analytic, compiled = r.estimate.memory["total"], r.compiled["memory"]["peak"]
    if remat == "none" and dict(r.candidate.mesh).get("fsdp", 1) == 2:
      # FSDP over 2 devices under remat none: the compile keeps about 170 of the 270 MB of
      # gathered layers the estimate holds for the backward (+12 %): an over-estimate
      assert compiled < analytic < 1.15 * compiled
      continue
    assert analytic == pytest.approx(compiled, rel=0.10), (dict(r.candidate.mesh), analytic,
                                                          compiled)


@pytest.mark.slow
def test_chunked_loss_lowers_the_planned_memory_as_the_compile_does():
  full = _compiled_plans(LOGITS, "data_parallel", "none", top=1)[0]
  chunked = _compiled_plans(LOGITS + ["model.loss_chunk=128"], "data_parallel", "none",
                            top=1)[0]
  saved_analytic = full.estimate.memory["total"] - chunked.estimate.memory["total"]
  saved_compiled = full.compiled["memory"]["peak"] - chunked.compiled["memory"]["peak"]
  assert saved_compiled > 0.5 * full.compiled["memory"]["peak"]   # the logits dominate
  assert saved_analytic == pytest.approx(saved_compiled, rel=0.10)
  # the backward reruns every chunk's logits matmul: 2 T D V more FLOPs over the devices
  extra = chunked.estimate.flops["backward"] - full.estimate.flops["backward"]
  assert extra == pytest.approx(2 * 16 * 512 * 128 * 65536 / 8)


def test_loss_chunk_tokens_are_layers_steps():
  # layers._loss: ceil(L / chunk) steps of ceil(L / steps) tokens
  assert plan_model._loss_chunk_tokens(128, 512) == 128
  assert plan_model._loss_chunk_tokens(100, 512) == 86     # 6 steps of 86
  assert plan_model._loss_chunk_tokens(1024, 512) == 512


def test_weight_copies_by_hand():
  gib = 2 ** 30
  # replicated fp32 weights: one bf16 copy of them all
  assert plan_model._weight_copies(8 * gib, 0, 8, "full", 2, 4) == 4 * gib
  # FSDP-gathered stacked layers: a layer's gathered weights and gradient at a time ...
  assert plan_model._weight_copies(8 * gib, 8 * gib, 8, "full", 2, 4) == 2 * gib
  assert plan_model._weight_copies(8 * gib, 8 * gib, 8, "dots", 2, 4) == 2 * gib
  # ... and under remat none every layer's, the backward's saved matmul inputs
  assert plan_model._weight_copies(8 * gib, 8 * gib, 8, "none", 2, 4) == 10 * gib
  # bf16 parameters need no cast
  assert plan_model._weight_copies(8 * gib, 0, 8, "none", 2, 2) == 0
