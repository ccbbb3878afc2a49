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

from partition import PartitionError, did_you_mean

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

  def __repr__(self) -> str:
    return (f"Chip({self.name}: {self.bf16_flops / 1e12:g} TFLOP/s bf16, "
            f"{self.hbm_bytes / 1e9:g} GB HBM at {self.hbm_bandwidth / 1e12:g} TB/s, "
            f"ICI {self.ici_bandwidth / 1e9:g} GB/s x {self.torus_dims} dims, "
            f"DCN {self.dcn_bandwidth / 1e9:g} GB/s)")


_TPU_DCN_PER_HOST = 2.5e10
CHIPS: dict[str, Chip] = {c.name: c for c in (
    # TPUs: the Scaling Book's tables. Hosts hold 4 chips (v4, v5p: 2x2x1) or 8 (v5e, v6e: 4x2).
    Chip("tpu-v4", 2.75e14, 32e9, 1.2e12, 9e10, 3, 4096, _TPU_DCN_PER_HOST / 4,
         SCALING_BOOK_TPUS),
    Chip("tpu-v5e", 1.97e14, 16e9, 8.1e11, 9e10, 2, 256, _TPU_DCN_PER_HOST / 8,
         SCALING_BOOK_TPUS),
    Chip("tpu-v5p", 4.59e14, 96e9, 2.8e12, 1.8e11, 3, 8960, _TPU_DCN_PER_HOST / 4,
         SCALING_BOOK_TPUS),
    Chip("tpu-v6e", 9.2e14, 32e9, 1.6e12, 1.8e11, 2, 256, _TPU_DCN_PER_HOST / 8,
         SCALING_BOOK_TPUS),
    # GPUs: NVIDIA datasheets; 8 GPUs per NVLink node; InfiniBand port per GPU (Gb/s / 8).
    Chip("a100", 3.12e14, 80e9, 2.039e12, 3.0e11, 1, 8, 200e9 / 8, NVIDIA["a100"]),
    Chip("h100", 9.89e14, 80e9, 3.35e12, 4.5e11, 1, 8, 400e9 / 8, NVIDIA["h100"]),
    Chip("h200", 9.89e14, 141e9, 4.8e12, 4.5e11, 1, 8, 400e9 / 8, NVIDIA["h200"]),
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
