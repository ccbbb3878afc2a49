"""Calibration rows: measured and published training steps, and the planner's prediction of each.

Every row is a real run (its model, chips, mesh, batch, remat policy and attention kernel,
as its source states them) with its measured step time. :func:`predict` prices it with the
same code the planner ranks plans with (:func:`recipes.plan_model.estimate` on the row's
parameter shapes and preset rules, then :func:`recipes.roofline.step_time`), so the table
in ``docs/planning.md`` and ``tests/recipes/test_calibration.py`` check the planner itself.

``role`` says what a row is for: ``fit`` rows set one coefficient of
:mod:`recipes.chips` each (named in that coefficient's source); ``check`` rows were not
fitted on; ``holdout`` rows are further published runs kept aside while fitting.

Published throughput is converted to a step time with the publisher's own FLOP count:
MaxText's README tables (TFLOP/s per chip) count ``6 x`` the matmul parameters per token
plus non-causal attention ``12 s H d_head L`` (MaxText's formula before its PR #1988);
the tiering table gives tokens per second per chip directly.

>>> row = ROWS['h200-1b-xla']
>>> row.measured_s
0.221
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from recipes import chips as chips_lib
from recipes import cost_model, plan_model, roofline

MAXTEXT = "github.com/AI-Hypercomputer/maxtext at e591f30"
A3_README = f"{MAXTEXT}, src/maxtext/configs/gpu/a3/llama_2_7b/README.md and 1vm.sh..16vm.sh"
V5P_README = f"{MAXTEXT}, src/maxtext/configs/tpu/v5p/README.md and 32b.sh / 64b.sh / 128b.sh"
V5E_README = f"{MAXTEXT}, src/maxtext/configs/tpu/v5e/README.md and 16b.sh .. 128b.sh"
V4_README = f"{MAXTEXT}, src/maxtext/configs/tpu/v4/README.md and 22b.sh / 52b.sh"
TIERING = (f"{MAXTEXT}, docs/reference/models/tiering.md; configs: "
           "benchmarks/maxtext_trillium_model_configs.py, maxtext_v5p_model_configs.py")
H200_ROW = ("measured on one H200, jax 0.11.2 (/work/shared/device/README.md, the "
            "fused-attention issue)")
# Google Cloud A3 (a3-highgpu-8g): 8 H100 and four 200 Gb/s GPUDirect-TCPX NICs per VM,
# 800 Gb/s = 100 GB/s per VM, 12.5 GB/s per GPU (not the 400 Gb/s per GPU of a DGX H100).
A3_DCN = 800e9 / 8 / 8


@dataclasses.dataclass(frozen=True)
class Row:
  """One measured or published run.

  Attributes:
    name: a short key.
    chip: a :mod:`recipes.chips` name; devices, hosts: chips and slices / nodes.
    preset, mesh: the preset and mesh that shard it as the run did.
    model: ``TransformerConfig`` fields (dims, dtypes).
    seq_len, batch_per_device: sequence length and sequences per chip per step.
    remat, attention: the policy (ours or MaxText's, :data:`recipes.cost_model.RECOMPUTE`)
      and kernel.
    measured_s: the measured step time in seconds.
    measured: the published figure as published.
    source: where it is published.
    role: ``fit``, ``check`` or ``holdout``.
    dcn_bandwidth: per-chip bytes/s between nodes when the machine's differ from the chip
      table's.
  """

  name: str
  chip: str
  devices: int
  hosts: int
  preset: str
  mesh: dict[str, int]
  model: dict[str, Any]
  seq_len: int
  batch_per_device: int
  remat: str
  attention: str
  measured_s: float
  measured: str
  source: str
  role: str
  dcn_bandwidth: float | None = None


def maxtext_scaled(scale: int) -> dict[str, Any]:
  """MaxText's ``base.yml`` model at ``global_parameter_scale=scale`` (its
  ``get_individual_scales``: doubling heads and MLP, then embed, then layers, in turn).

  >>> d = maxtext_scaled(32)
  >>> d['embed_dim'], d['num_heads'], d['mlp_dim'], d['num_layers']
  (8192, 64, 28672, 32)
  """
  base, rem = divmod(int(math.log2(scale)), 3)
  heads = base + int(rem > 0)
  emb = base + int(rem > 1)
  return dict(vocab_size=32000, embed_dim=2048 * 2 ** emb, mlp_dim=7168 * 2 ** heads,
              num_heads=16 * 2 ** heads, num_kv_heads=16 * 2 ** heads, head_dim=128,
              num_layers=16 * 2 ** base, dtype="bfloat16", param_dtype="float32",
              tie_embeddings=False)


LLAMA2_7B = dict(vocab_size=32000, embed_dim=4096, mlp_dim=11008, num_heads=32,
                 num_kv_heads=32, head_dim=128, num_layers=32, dtype="bfloat16",
                 param_dtype="float32", tie_embeddings=False)
LLAMA2_70B = dict(LLAMA2_7B, embed_dim=8192, mlp_dim=28672, num_heads=64, num_kv_heads=8,
                  num_layers=80)
LLAMA31_8B = dict(LLAMA2_7B, vocab_size=128256, mlp_dim=14336, num_kv_heads=8)
LLAMA31_70B = dict(LLAMA2_70B, vocab_size=128256)
LLAMA31_405B = dict(LLAMA31_70B, embed_dim=16384, mlp_dim=53248, num_heads=128,
                    num_layers=126)
# MaxText's v4 scripts: base.yml with explicit dims (head_dim 128, so 24 x 128 = 3072 < D);
# num_vocab_tiling=8 tiles the logits along the batch-sequence axis, as layers'
# loss_chunk does: 2048 / 8 = 256 tokens of each row at a time
V4_22B = dict(vocab_size=32000, embed_dim=6144, mlp_dim=24576, num_heads=24, num_kv_heads=24,
              head_dim=128, num_layers=48, dtype="bfloat16", param_dtype="float32",
              tie_embeddings=False, loss_chunk=256)
V4_52B = dict(V4_22B, embed_dim=12288, mlp_dim=49152, num_heads=32, num_kv_heads=32,
              num_layers=32)
OURS_1B = dict(vocab_size=32768, embed_dim=2048, mlp_dim=8192, num_heads=16, num_kv_heads=8,
               head_dim=128, num_layers=16, dtype="bfloat16", param_dtype="float32",
               tie_embeddings=True)


def maxtext_seconds(tflops: float, model: dict[str, Any], seq_len: int, batch: int) -> float:
  """A step's seconds from MaxText's published TFLOP/s per chip (its pre-#1988 count)."""
  per_token = cost_model.model_flops_per_token(
      model["embed_dim"], model["num_heads"], model["num_kv_heads"], model["head_dim"],
      model["mlp_dim"], model["vocab_size"], model["num_layers"], seq_len, causal=False)
  return per_token * seq_len * batch / (tflops * 1e12)


def _a3(nodes: int, tflops: float, role: str) -> Row:
  return Row(f"a3-llama2-7b-{nodes}node", "h100", 8 * nodes, nodes, "fsdp",
             {"data": nodes, "fsdp": 8}, LLAMA2_7B, 4096, 4, "minimal_with_context", "cudnn",
             maxtext_seconds(tflops, LLAMA2_7B, 4096, 4), f"{tflops} TFLOP/s/GPU", A3_README,
             role, dcn_bandwidth=A3_DCN if nodes > 1 else None)


def _v5p(scale: int, slices: int, chips: int, batch: int, tensor: int, tflops: float,
         mfu: str, role: str) -> Row:
  model = maxtext_scaled(scale)
  return Row(f"v5p-{scale}b-{slices}x{2 * chips}", "tpu-v5p", chips * slices, slices,
             "fsdp_tp", {"data": slices, "fsdp": chips // tensor, "tensor": tensor}, model,
             2048, batch, "minimal", "pallas", maxtext_seconds(tflops, model, 2048, batch),
             f"{tflops} TFLOP/s/chip, {mfu} MFU", V5P_README, role)


def _v5e(scale: int, slices: int, batch: int, remat: str, tflops: float, mfu: str,
         role: str, tensor: int = 1) -> Row:
  model = maxtext_scaled(scale)
  mesh = {"data": slices, "fsdp": 256 // tensor, "tensor": tensor}
  return Row(f"v5e-{scale}b-{slices}x256", "tpu-v5e", 256 * slices, slices, "fsdp_tp", mesh,
             model, 2048, batch, remat, "pallas", maxtext_seconds(tflops, model, 2048, batch),
             f"{tflops} TFLOP/s/chip, {mfu} MFU", V5E_README, role)


def _v4(name: str, model: dict[str, Any], slices: int, chips: int, batch: int, tflops: float,
        mfu: str, role: str) -> Row:
  """MaxText's v4 rows: pure FSDP inside a slice (``ici_fsdp_parallelism``), data parallel
  over slices, ``remat_policy=full``, ``attention=flash``, sequences of 2048."""
  return Row(f"v4-{name}-{slices}x{2 * chips}", "tpu-v4", chips * slices, slices, "fsdp",
             {"data": slices, "fsdp": chips}, model, 2048, batch, "full", "pallas",
             maxtext_seconds(tflops, model, 2048, batch), f"{tflops} TFLOP/s/chip, {mfu} MFU",
             V4_README, role)


def _tiering(name: str, chip: str, chips: int, model: dict, seq: int, batch: int, remat: str,
             tokens_per_s: float, mfu: str, role: str) -> Row:
  return Row(name, chip, chips, 1, "fsdp", {"data": 1, "fsdp": chips}, model, seq, batch,
             remat, "pallas", seq * batch / tokens_per_s,
             f"{tokens_per_s:,.0f} tokens/s/chip, {mfu} MFU", TIERING, role)


ROWS: dict[str, Row] = {r.name: r for r in (
    Row("h200-1b-xla", "h200", 1, 1, "data_parallel", {"data": 1}, OURS_1B, 2048, 4, "none",
        "xla", 0.221, "221 ms/step (27 % MFU)", H200_ROW, "check"),
    Row("h200-1b-cudnn-reference", "h200", 1, 1, "data_parallel", {"data": 1}, OURS_1B, 2048,
        4, "none", "cudnn", 0.131, "131 ms/step (46 % MFU), a pure-JAX Llama with "
        "jax.nn.dot_product_attention(implementation='cudnn')", H200_ROW, "fit"),
    _a3(1, 492, "fit"), _a3(2, 422, "holdout"), _a3(4, 407, "holdout"),
    _a3(8, 409, "holdout"), _a3(16, 375, "holdout"),
    _v5p(32, 1, 64, 6, 4, 328, "71.47 %", "fit"),
    _v5p(32, 2, 64, 6, 4, 319, "69.43 %", "holdout"),
    _v5p(64, 1, 64, 3, 4, 323, "70.31 %", "holdout"),
    _v5p(128, 1, 128, 1, 8, 315, "68.68 %", "holdout"),
    _v5e(32, 1, 4, "full", 132, "66.86 %", "fit"),
    _v5e(16, 1, 6, "full", 120, "61.10 %", "holdout"),
    _v5e(64, 1, 2, "full", 118, "59.90 %", "holdout"),
    _v5e(128, 1, 1, "qkv_proj_offloaded", 110, "56.06 %", "holdout", tensor=16),
    _v5e(32, 32, 4, "full", 119, "60.40 %", "holdout"),
    _tiering("v6e-llama3.1-8b", "tpu-v6e", 256, LLAMA31_8B, 8192, 4, "save_qkv_out", 7207,
             "45.46 %", "fit"),
    _tiering("v6e-llama3.1-70b", "tpu-v6e", 256, LLAMA31_70B, 8192, 5, "save_qkv", 960,
             "50.33 %", "holdout"),
    _tiering("v6e-llama2-70b", "tpu-v6e", 256, LLAMA2_70B, 4096, 4, "full", 900, "43.8 %",
             "holdout"),
    _tiering("v5p-llama2-70b", "tpu-v5p", 512, LLAMA2_70B, 4096, 4, "save_dot_except_mlpwi",
             692, "65.4 %", "holdout"),
    # The tiering table's "256 Chips" row links llama3_1_405b_8192_fsdp_dcn, which runs on
    # two v6e-256 slices: ici_fsdp 64 x ici_tensor 4 x dcn_fsdp 2, one fsdp axis of 128
    # across both (hybrid); per-device tokens/s does not depend on the count.
    Row("v6e-llama3.1-405b", "tpu-v6e", 512, 2, "fsdp_tp", {"data": 1, "fsdp": 128,
                                                           "tensor": 4},
        LLAMA31_405B, 8192, 1, "save_qkv_out", "pallas", 8192 / 123,
        "123 tokens/s/chip, 38.55 % MFU", TIERING, "holdout"),
    _v4("22b", V4_22B, 1, 64, 13, 156, "56.7 %", "fit"),
    _v4("22b", V4_22B, 2, 64, 13, 152, "55.2 %", "holdout"),
    _v4("22b", V4_22B, 4, 64, 13, 149, "54.3 %", "holdout"),
    _v4("22b", V4_22B, 8, 64, 13, 146, "53.2 %", "holdout"),
    _v4("52b", V4_52B, 1, 192, 7, 154, "56.0 %", "holdout"),
    _v4("52b", V4_52B, 2, 192, 7, 162, "58.9 %", "holdout"),
)}


def transformer_params(model: dict[str, Any]) -> list[plan_model.ParamShape]:
  """The parameter shapes and logical axes of ``layers``' scanned Transformer for the
  fields ``model`` (what :func:`recipes.plan.model_params` traces, written out so a row
  of 70B parameters costs no tracing; a test checks the two agree on a small model)."""
  import numpy as np
  d, f, h, kv, hd, L = (model[k] for k in ("embed_dim", "mlp_dim", "num_heads",
                                           "num_kv_heads", "head_dim", "num_layers"))
  w = np.dtype(model.get("param_dtype", "float32")).itemsize
  p = plan_model.ParamShape
  out = [p("blocks/attn/out/kernel", (L, h, hd, d), w, ("layers", "heads", "head_dim", "embed")),
         p("blocks/attn/qkv/kernel", (L, d, kv, h // kv + 2, hd), w,
           ("layers", "embed", "kv_heads", None, "head_dim")),
         p("blocks/attn_norm/scale", (L, d), w, ("layers", "embed")),
         p("blocks/mlp/wi/kernel", (L, d, 2, f), w, ("layers", "embed", None, "mlp")),
         p("blocks/mlp/wo/kernel", (L, f, d), w, ("layers", "mlp", "embed")),
         p("blocks/mlp_norm/scale", (L, d), w, ("layers", "embed")),
         p("embed/embedding", (model["vocab_size"], d), w, ("vocab", "embed")),
         p("final_norm/scale", (d,), w, ("embed",))]
  if not model.get("tie_embeddings", True):
    out.append(p("lm_head/kernel", (d, model["vocab_size"]), w, ("embed", "vocab")))
  return out


@dataclasses.dataclass(frozen=True)
class Prediction:
  """A row's prediction: step seconds, MFU, what binds, memory per device, and the error."""

  row: Row
  step_s: float
  mfu: float
  bound: str
  memory: float
  time: roofline.StepTime

  @property
  def error(self) -> float:
    """(predicted - measured) / measured."""
    return self.step_s / self.row.measured_s - 1

  @property
  def measured_mfu(self) -> float:
    return self.mfu * self.step_s / self.row.measured_s


def predict(row: Row, chip: chips_lib.Chip | None = None) -> Prediction:
  """The planner's prediction for ``row`` (optionally on a recalibrated ``chip``)."""
  import layers
  import partition
  from recipes.config import preset_path
  chip = chip or chips_lib.get_chip(row.chip)
  if row.dcn_bandwidth:
    chip = dataclasses.replace(chip, dcn_bandwidth=row.dcn_bandwidth)
  model = layers.TransformerConfig(max_len=row.seq_len, scan_layers=True, **row.model)
  rules = partition.AxisRules.from_file(preset_path(row.preset))
  est = plan_model.estimate(
      transformer_params(row.model), model, rules, row.mesh,
      batch=row.batch_per_device * row.devices, seq_len=row.seq_len, microbatches=1,
      remat=row.remat, chip=chip, hosts=row.hosts, attention=row.attention)
  links = roofline.axis_links(row.mesh, chip, row.hosts)
  t = roofline.step_time(flops=est.flops, hbm_bytes=est.hbm_bytes, comm_s=est.comm_s,
                         chip=chip, model_flops=est.model_flops, devices=row.devices,
                         terms=est.terms, dcn_axes={a for a, v in links.items() if v.dcn},
                         serial_axes=est.serial_axes)
  return Prediction(row, t.step_s, t.mfu, t.bound, est.memory["total"], t)


# What each fit row sets: (chip, Calibration field, rows it is fitted on). A TPU's matmul
# efficiency is solved so its row is predicted exactly; the GPU knee minimises the largest
# error over its two rows (one cannot be matched without missing the other by more).
FITS = (("tpu-v4", "matmul_efficiency", ("v4-22b-1x128",)),
        ("tpu-v5p", "matmul_efficiency", ("v5p-32b-1x128",)),
        ("tpu-v5e", "matmul_efficiency", ("v5e-32b-1x256",)),
        ("tpu-v6e", "matmul_efficiency", ("v6e-llama3.1-8b",)),
        ("h100", "matmul_knee", ("h200-1b-cudnn-reference", "a3-llama2-7b-1node")))


def _with(chip: chips_lib.Chip, field: str, value: float) -> chips_lib.Chip:
  cal = dataclasses.replace(chip.cal, **{field: value})
  if field == "matmul_efficiency" and chip.kind == "tpu":   # the attention rate follows it
    cal = dataclasses.replace(cal, fused_attention_fraction=value * 0.62 / 0.80)
  return dataclasses.replace(chip, cal=cal)


def fit() -> dict[tuple[str, str], float]:
  """Recomputes every fitted coefficient from its rows (:data:`FITS`), independently of the
  values in :mod:`recipes.chips`; a test checks that the table holds these values."""
  out = {}
  for chip_name, field, names in FITS:
    rows = [ROWS[n] for n in names]
    if field == "matmul_efficiency":
      value = 0.8
      for _ in range(8):   # the step is nearly inverse in it: a fixed point in a few steps
        value *= predict(rows[0], _with(chips_lib.get_chip(chip_name), field, value)
                         ).step_s / rows[0].measured_s
      out[(chip_name, field)] = round(value, 2)
    else:
      def worst(knee, field=field, rows=rows):
        return max(abs(predict(r, _with(chips_lib.get_chip(r.chip), field, knee)).error)
                   for r in rows)
      out[(chip_name, field)] = min(range(0, 4001, 100), key=worst)
  return out


def table(rows=None) -> list[Prediction]:
  """Every row's prediction, in :data:`ROWS` order."""
  return [predict(r) for r in (rows or ROWS.values())]


def markdown(preds: list[Prediction]) -> str:
  """The docs table: predicted vs measured per row."""
  lines = ["| row | role | chips | measured | measured step | predicted step | error | "
           "predicted MFU | binds |", "|---|---|---|---|---|---|---|---|---|"]
  for p in preds:
    r = p.row
    axes = f" ({p.time.bound_axes})" if p.time.bound_axes else ""
    lines.append(f"| {r.name} | {r.role} | {r.devices} x {r.chip} | {r.measured} | "
                 f"{_s(r.measured_s)} | {_s(p.step_s)} | {100 * p.error:+.0f} % | "
                 f"{100 * p.mfu:.1f} % | {p.bound}{axes} |")
  return "\n".join(lines)


def _s(x: float) -> str:
  return f"{x * 1e3:.0f} ms" if x < 10 else f"{x:.1f} s"


if __name__ == "__main__":
  import sys
  if "--fit" in sys.argv:
    for key, value in fit().items():
      print(*key, value)
  else:
    print(markdown(table()))
