"""Accelerator figures for the planner's roofline, each row with its published source.

A :class:`Chip` holds what a step-time roofline needs: peak dense bf16 FLOP/s, HBM bytes and
bandwidth, the inter-chip bandwidth one chip can push along one mesh axis inside its
high-bandwidth domain (TPU ICI slice, GPU NVLink node), how many torus dimensions that
domain has (a mesh axis that spans k of them gets k times the bandwidth, as in the Scaling
Book's ``n_axes``), and the data-centre network (DCN / InfiniBand) bandwidth per chip for
axes that span domains (``--hosts``).

Conventions (those of the Scaling Book, so its critical batch sizes come out of this table):
``ici_bandwidth`` is the bytes per second one chip *sends* along one axis using both
directions of a ring (the book's "bidi" figure for TPUs; for NVLink the per-direction
figure, half of NVIDIA's bidirectional total, since a ring sends and receives at once).
FLOP/s are dense (no structured sparsity). Bytes are decimal (1 GB = 1e9) as published.

>>> from recipes.chips import get_chip
>>> v5p = get_chip('tpu-v5p')
>>> round(v5p.bf16_flops / v5p.ici_bandwidth)   # the book's "2,550 tokens per chip"
2550
>>> get_chip('h100').hbm_bytes / 1e9
80.0
"""

from __future__ import annotations

import dataclasses

from partition import PartitionError
from partition.internal import did_you_mean

SCALING_BOOK_TPUS = (
    "J. Austin et al., How to Scale Your Model (2025), 'How to Think About TPUs', tables "
    "'specific numbers for our chips' and 'interconnect figures' "
    "(https://jax-ml.github.io/scaling-book/tpus/; github.com/jax-ml/scaling-book tpus.md "
    "at 0819a7d); DCN 2.5e10 B/s per host and host sizes from the same page")
NVIDIA = {
    "a100": "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB: 312 TFLOPS BF16 dense, "
            "2,039 GB/s HBM2e, NVLink 600 GB/s bidirectional), https://www.nvidia.com/"
            "content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-"
            "nvidia-1758950-r4-web.pdf; DGX A100: one 200 Gb/s HDR InfiniBand port per GPU",
    "h100": "NVIDIA H100 Tensor Core GPU datasheet (SXM5: 989 TFLOPS BF16 dense [1,979 with "
            "sparsity], 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s bidirectional), "
            "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet; "
            "DGX H100: one 400 Gb/s ConnectX-7 InfiniBand port per GPU",
    "h200": "NVIDIA H200 product page / datasheet (SXM: 989 TFLOPS BF16 dense, 141 GB HBM3e at "
            "4.8 TB/s, NVLink 900 GB/s bidirectional), https://www.nvidia.com/en-us/"
            "data-center/h200/; HGX H200: one 400 Gb/s InfiniBand port per GPU",
}


H200_MEASURED = (
    "measured on one H200 (jax 0.11.2, /work/shared/device/README.md and the fused-attention "
    "issue): a large bf16 matmul at ~790 of 989 TFLOP/s; causal attention forward+backward "
    "(16/8 heads of 128, bf16): cuDNN 1.14 ms at 4x2048, 2.52 ms at 1x8192, 27.0 ms at "
    "1x32768; XLA einsum+softmax 3.51 ms and 12.8 ms; a naive blockwise scan 8.70, 31.8, "
    "438 ms")


@dataclasses.dataclass(frozen=True)
class Calibration:
  """The rates a chip reaches on the op classes of a train step (:mod:`recipes.cost_model`),
  as fractions of its datasheet figures, each with its source (``sources[field]``).

  Attributes:
    matmul_efficiency: achievable fraction of peak bf16 FLOP/s on a large matmul; no
      prediction is faster than this (a step's MFU is at most this).
    hbm_efficiency: achievable fraction of the HBM bandwidth on streaming (memory-bound) ops.
    fused_attention_fraction, fused_attention_s0: a fused attention kernel runs at
      ``fraction x peak x s / (s + s0)`` for key length ``s`` (FLOPs counted with the causal
      half skipped and FlashAttention-2's backward of 2.5 forwards).
    xla_score_bytes: HBM bytes per attention score element, forward + backward, of XLA's
      materialised softmax attention (scores, mask, fp32 softmax, casts and their gradient).
    blockwise_score_bytes: the same for the pure-JAX blockwise (online softmax) scan.
    op_overhead_s: fixed seconds per kernel (launch, ramp up and tail).
    matmul_knee, matmul_reference_dim: a matmul whose smallest dimension ``d`` is below the
      reference (the size ``matmul_efficiency`` was measured at) runs at
      ``(d / (d + knee)) / (ref / (ref + knee))`` of it (0: no shape effect).
    fused_elementwise: the compiler fuses norms, activations and casts into the matmuls
      (XLA:TPU), so they overlap the matmul time instead of adding to it.
    serial_exposed: the share of the tensor-, sequence- and pipeline-parallel collectives'
      time that is not hidden behind compute (1 on GPUs, which run them between kernels).
    band: the relative band of a prediction on this chip: its calibration rows
      (:mod:`recipes.calibration`) all fall inside it (0.2 where they do; v5e 0.22, for
      its 128B holdout at -21 %; 0.3 for a chip without rows of its own).
    sources: field -> where its value comes from.
  """

  matmul_efficiency: float
  hbm_efficiency: float
  fused_attention_fraction: float
  fused_attention_s0: float
  xla_score_bytes: float
  blockwise_score_bytes: float
  op_overhead_s: float
  matmul_knee: float = 0.0
  matmul_reference_dim: float = 8192.0
  fused_elementwise: bool = False
  serial_exposed: float = 1.0  # share of tensor/sequence/pipeline collectives not hidden
  band: float = 0.2
  sources: tuple[tuple[str, str], ...] = ()

  def source(self, field: str) -> str:
    return dict(self.sources).get(field, "")


class ChipError(PartitionError, KeyError):
  """An unknown chip name."""

  def __str__(self) -> str:  # KeyError would quote the message
    return str(self.args[0])


@dataclasses.dataclass(frozen=True)
class Chip:
  """One accelerator's published figures (see the module docstring for conventions).

  Attributes:
    name: the name ``--chip`` takes.
    bf16_flops: peak dense bf16 FLOP/s per chip.
    hbm_bytes: HBM capacity per chip.
    hbm_bandwidth: HBM bytes/s per chip.
    ici_bandwidth: bytes/s one chip sends along one torus dimension / NVLink.
    torus_dims: dimensions of the high-bandwidth domain's torus (3 for v4/v5p, 2 for
      v5e/v6e, 1 for an NVLink switch, where every GPU reaches every other at full rate).
    domain_chips: the largest high-bandwidth domain (TPU pod, GPU NVLink node).
    dcn_bandwidth: bytes/s per chip between domains (DCN per host / chips per host, or the
      GPU's own InfiniBand port).
    source: where the figures come from.
    kind: ``'tpu'`` or ``'gpu'`` (which attention kernel ``'auto'`` picks, which collectives
      overlap).
    cal: the :class:`Calibration` of the cost model.
  """

  name: str
  bf16_flops: float
  hbm_bytes: float
  hbm_bandwidth: float
  ici_bandwidth: float
  torus_dims: int
  domain_chips: int
  dcn_bandwidth: float
  source: str
  kind: str = "tpu"
  cal: Calibration | None = None

  def __repr__(self) -> str:
    return (f"Chip({self.name}: {self.bf16_flops / 1e12:g} TFLOP/s bf16, "
            f"{self.hbm_bytes / 1e9:g} GB HBM at {self.hbm_bandwidth / 1e12:g} TB/s, "
            f"ICI {self.ici_bandwidth / 1e9:g} GB/s x {self.torus_dims} dims, "
            f"DCN {self.dcn_bandwidth / 1e9:g} GB/s)")


def _gpu_cal(matmul: float, matmul_source: str, band: float = 0.2) -> Calibration:
  """Hopper-generation coefficients (the attention ones measured on the H200)."""
  return Calibration(
      matmul_efficiency=matmul, hbm_efficiency=HOPPER_HBM, fused_attention_fraction=0.62,
      fused_attention_s0=4090.0, xla_score_bytes=45.0, blockwise_score_bytes=112.0,
      op_overhead_s=GPU_OP_OVERHEAD, matmul_knee=GPU_MATMUL_KNEE, band=band, sources=(
          ("matmul_efficiency", matmul_source),
          ("hbm_efficiency", "assumed: streaming kernels reach ~90 % of HBM bandwidth on "
                             "Hopper (not measured here)"),
          ("fused_attention_fraction", "fitted to the three cuDNN rows of " + H200_MEASURED
                                       + " (614 TFLOP/s, s0 4090: within 7 % of each)"),
          ("fused_attention_s0", "same fit"),
          ("xla_score_bytes", "the XLA rows of the same table: 53 and 48 B per score at "
                              "4.8 TB/s after the matmul time; 50 x 0.9 efficiency. Measured "
                              "when the xla path rounded its logits to bf16; it now keeps "
                              "them in fp32 (about 4 B more per score expected; not yet "
                              "re-measured)"),
          ("blockwise_score_bytes", "the blockwise rows of the same table: 110-143 B per "
                                    "score after 4 passes of matmul time; 125 x 0.9"),
          ("op_overhead_s", "assumed: ~10 us per kernel launch, ramp and tail on a GPU"),
          ("serial_exposed", "assumed: XLA:GPU runs a tensor-parallel all-reduce between the "
                             "matmuls that need it (no GPU row here tests it)"),
          ("matmul_knee", "fitted: the one GPU coefficient fitted to steps, the smallest "
                          "largest error over MaxText's Llama2-7B on one A3 node (8 x H100, "
                          "492 TFLOP/s/GPU) and the H200 cuDNN-attention reference (131 ms)"),
      ))


def _tpu_cal(matmul: float, matmul_source: str, band: float = 0.2) -> Calibration:
  """TPU coefficients: the matmul efficiency from one published MaxText row per generation;
  attention transferred from the H200's cuDNN measurements relative to its matmul rate (no
  TPU kernel timings are available here)."""
  return Calibration(
      matmul_efficiency=matmul, hbm_efficiency=0.9,
      fused_attention_fraction=matmul * 0.62 / 0.80, fused_attention_s0=4090.0,
      xla_score_bytes=45.0, blockwise_score_bytes=112.0, op_overhead_s=TPU_OP_OVERHEAD,
      fused_elementwise=True, serial_exposed=0.0, band=band, sources=(
          ("matmul_efficiency", matmul_source),
          ("hbm_efficiency", "assumed as for GPUs (not measured here)"),
          ("fused_attention_fraction", "transferred: the H200's cuDNN/matmul ratio "
                                       "(614/790) times this chip's matmul efficiency"),
          ("fused_attention_s0", "transferred from the H200's cuDNN fit"),
          ("xla_score_bytes", "transferred from the H200"),
          ("blockwise_score_bytes", "transferred from the H200"),
          ("op_overhead_s", "assumed: XLA:TPU fuses the memory-bound ops around each "
                            "matmul, ~1 us per remaining op"),
          ("serial_exposed", "the Scaling Book's assumption (tensor-parallel collectives "
                             "overlap their matmuls: XLA:TPU's collective matmul and the "
                             "async collective fusion MaxText's LIBTPU_INIT_ARGS enable)"),
      ))


HOPPER_HBM = 0.9
GPU_OP_OVERHEAD = 10e-6
GPU_MATMUL_KNEE = 1700.0
TPU_OP_OVERHEAD = 1e-6
MAXTEXT = ("MaxText (github.com/AI-Hypercomputer/maxtext at e591f30), "
           "src/maxtext/configs/tpu/{v5e,v5p}/README.md and docs/reference/models/tiering.md")
MAXTEXT_V4 = ("MaxText (github.com/AI-Hypercomputer/maxtext at e591f30), "
              "src/maxtext/configs/tpu/v4/README.md")
_TPU_DCN_PER_HOST = 2.5e10
CHIPS: dict[str, Chip] = {c.name: c for c in (
    # TPUs: the Scaling Book's tables. Hosts hold 4 chips (v4, v5p: 2x2x1) or 8 (v5e, v6e: 4x2).
    Chip("tpu-v4", 2.75e14, 32e9, 1.2e12, 9e10, 3, 4096, _TPU_DCN_PER_HOST / 4,
         SCALING_BOOK_TPUS, "tpu", _tpu_cal(0.73, "fitted to " + MAXTEXT_V4 + ": v4-128, "
                                                  "22B, 56.7 % MFU")),
    Chip("tpu-v5e", 1.97e14, 16e9, 8.1e11, 9e10, 2, 256, _TPU_DCN_PER_HOST / 8,
         SCALING_BOOK_TPUS, "tpu", _tpu_cal(0.88, "fitted to " + MAXTEXT + ": v5e-256, "
                                                  "32B, 66.86 % MFU", band=0.22)),
    Chip("tpu-v5p", 4.59e14, 96e9, 2.8e12, 1.8e11, 3, 8960, _TPU_DCN_PER_HOST / 4,
         SCALING_BOOK_TPUS, "tpu", _tpu_cal(0.76, "fitted to " + MAXTEXT + ": v5p-128, "
                                                  "32B, 71.47 % MFU")),
    Chip("tpu-v6e", 9.2e14, 32e9, 1.6e12, 1.8e11, 2, 256, _TPU_DCN_PER_HOST / 8,
         SCALING_BOOK_TPUS, "tpu", _tpu_cal(0.57, "fitted to " + MAXTEXT + ": v6e-256, "
                                                  "Llama 3.1 8B, 7,207 tokens/s/chip")),
    # GPUs: NVIDIA datasheets; 8 GPUs per NVLink node; InfiniBand port per GPU (Gb/s / 8).
    Chip("a100", 3.12e14, 80e9, 2.039e12, 3.0e11, 1, 8, 200e9 / 8, NVIDIA["a100"], "gpu",
         _gpu_cal(0.80, "assumed: the H200's measured fraction (no A100 row used here)",
                  band=0.3)),
    Chip("h100", 9.89e14, 80e9, 3.35e12, 4.5e11, 1, 8, 400e9 / 8, NVIDIA["h100"], "gpu",
         _gpu_cal(0.80, "the H200's measured 790/989 (the same GH100 die)")),
    Chip("h200", 9.89e14, 141e9, 4.8e12, 4.5e11, 1, 8, 400e9 / 8, NVIDIA["h200"], "gpu",
         _gpu_cal(0.80, "measured: " + H200_MEASURED)),
)}
ALIASES = {"v4": "tpu-v4", "v4p": "tpu-v4", "tpu-v4p": "tpu-v4", "v5e": "tpu-v5e",
           "v5p": "tpu-v5p", "v6e": "tpu-v6e", "trillium": "tpu-v6e"}


def get_chip(name: str) -> Chip:
  """The :class:`Chip` called ``name`` (case-insensitive; ``v5p`` is ``tpu-v5p``).

  Raises:
    ChipError: for an unknown name, with the closest known names.
  """
  key = name.strip().lower()
  key = ALIASES.get(key, key)
  if key in CHIPS:
    return CHIPS[key]
  known = sorted(CHIPS) + sorted(ALIASES)
  hint = did_you_mean(key, known, cutoff=0.5, n=2)
  raise ChipError(f"--chip {name!r} is not in the chip table{hint}. Known chips: "
                  f"{', '.join(sorted(CHIPS))} (recipes/chips.py; add a row with its source "
                  "to plan for another).")
