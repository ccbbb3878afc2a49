"""What one train step is made of, op class by op class, at the rates a chip really reaches.

:mod:`recipes.roofline` is the bound (every FLOP at the datasheet peak, every byte at the
datasheet bandwidth); this module is the prediction. Per device and per micro-batch it walks
one decoder block and the head, and prices each op class by how it runs:

* **matmuls** (QKV, output, MLP in / out, logits) one by one, each at
  ``max(2MKN / (eta_mm peak), (MK + KN + MN) a / (eta_hbm HBM))``: the chip's calibrated
  matmul efficiency (never the datasheet peak) unless the matmul is too thin to feed it (a
  small micro-batch ``M`` or a tensor-parallel shard ``N``), when its bytes bind. The
  backward runs two matmuls of the same shape per forward one.
* **attention** by the implementation that runs (:func:`resolve_attention`): ``xla``
  materialises the ``[B, H, s, s]`` scores (both triangles computed, softmax, casts and
  their backward cost ``xla_score_bytes`` of HBM traffic per score element); ``cudnn`` /
  ``pallas`` are fused kernels that skip the masked half and never write the scores, at
  ``fused_attention_fraction x s / (s + fused_attention_s0)`` of peak (short sequences
  keep the kernel's tiles idle); ``blockwise`` is an online-softmax ``lax.scan`` (no
  skipping, its forward recomputed in the backward, ``blockwise_score_bytes`` per score).
* **memory-bound work** at ``eta_hbm x HBM``: RMSNorms, residual adds, RoPE, the SwiGLU
  product and the dtype casts (element counts per token in :func:`_elementwise_elems`), the
  fp32 logits, softmax cross-entropy and their gradient over the local vocabulary, the
  weight casts and gradient writes, and the AdamW update (read p, g, m, v; write p, m, v).
* **remat's recompute**: what each policy recomputes in the backward (:data:`RECOMPUTE`).
* on a TPU (``fused_elementwise``) the elementwise ops and weight casts run inside the
  matmuls' fusions, under the MXU's time: only what exceeds a phase's matmul time counts.
* **per-op overhead**: ``op_overhead_s`` per kernel (launch and ramp; :data:`OPS_PER_LAYER`
  kernels per block and micro-batch), which is what small micro-batches and many layers pay.

A pipeline's bubble multiplies the block stack's terms only (:func:`step_terms`); the
collectives are combined with the terms in :func:`recipes.roofline.step_time`.
Every coefficient is a field of :class:`recipes.chips.Calibration` with its source.

>>> import layers
>>> from recipes.chips import get_chip
>>> model = layers.TransformerConfig(dtype='bfloat16', head_dim=128)
>>> resolve_attention('auto', get_chip('h200'), model, batch=4, seq_len=2048)
'cudnn'
>>> resolve_attention('auto', get_chip('v5p'), model, batch=4, seq_len=2048)
'pallas'
"""

from __future__ import annotations

import dataclasses

from recipes.chips import Chip

ATTENTIONS = ("auto", "xla", "cudnn", "pallas", "blockwise")
FUSED = ("cudnn", "pallas")

# What each remat policy recomputes in the backward: the block's matmuls (by name), the
# attention core, and the memory-bound ops. Ours (layers.REMAT_POLICIES) and, for the
# calibration rows, MaxText's names (`remat_policy` of MaxText's base.yml).
# A block rerun from its input recomputes QKV, the output projection and the MLP's input
# projection; the MLP's output projection only feeds the residual sum, whose gradient needs
# no values, so XLA drops its recompute as dead code. A mixture-of-experts block reruns its
# router, the dispatch and both expert projections (the combine's gate gradient needs the
# experts' outputs); the combine itself feeds the residual sum.
MATMULS = ("qkv", "out", "mlp_in", "mlp_out")
RERUN = ("qkv", "out", "mlp_in", "router", "dispatch", "expert_in", "expert_out")
# Backward passes per forward matmul: two (the input's and the weight's gradient), but the
# dispatch's 0/1 slot assignment gets no gradient.
BACKWARD_PASSES = {"dispatch": 1}
RECOMPUTE: dict[str, tuple[tuple[str, ...], bool | None, bool]] = {
    "none": ((), False, False),
    # checkpoint_dots saves every dot output; a fused kernel is a custom call, not a dot,
    # so its forward reruns (decided per implementation in _recomputes_attention).
    "dots": ((), None, True),
    "dots_no_batch": ((), True, True),     # the attention einsums have batch dims
    "full": (RERUN, True, True),
    "nothing_saveable": (RERUN, True, True),
    # MaxText's remat_policy names, for the calibration rows (MaxText's layers.py / base.yml)
    "minimal": ((), True, True),                  # every projection saved, attention reruns
    "minimal_with_context": ((), False, True),    # ... and the attention output saved
    "save_dot_except_mlpwi": (("mlp_in",), True, True),
    "save_qkv_out": (("mlp_in",), True, True),    # custom: q, k, v, out saved (offloaded)
    "save_qkv": (("out", "mlp_in"), True, True),  # custom: q, k, v saved
    "qkv_proj_offloaded": (("out", "mlp_in"), True, True),
}
# MaxText's policies that offload what they save to host memory (its ``custom`` policy with
# ``*_proj: offload``; ``qkv_proj_offloaded``), and whether the block input goes too
# (``decoder_layer_input: offload``); what they keep is off the HBM. The transfers run over
# PCIe alongside the compute and are not priced (MaxText schedules them asynchronously).
OFFLOADED = {"save_qkv_out": True, "save_qkv": True, "qkv_proj_offloaded": False}
# kernels per block, per micro-batch: forward (norms, QKV, RoPE, attention, output, adds,
# MLP in, SwiGLU, MLP out) and backward (about twice as many); xla attention adds its
# softmax, mask and cast kernels.
OPS_PER_LAYER = {"forward": 12, "backward": 24}
XLA_ATTENTION_OPS = {"forward": 4, "backward": 8}


def resolve_attention(attention: str, chip: Chip, model, *, batch: int, seq_len: int,
                      rules=None, mesh=None) -> str:
  """The attention implementation ``model`` (a ``layers.TransformerConfig``, with
  ``attention`` in place of its own) runs on ``chip``: ``layers.attention_choice`` decided for
  the chip's backend, the decision the model makes when it is traced there. ``'auto'`` is
  cuDNN on an NVIDIA GPU (bf16/fp16, head_dim a multiple of 8 and <= 256, the sequence not
  sharded), the Pallas kernel on a TPU (head_dim and length multiples of 128), else
  ``'blockwise'`` from 2048 tokens on, else ``'xla'``. ``rules`` and ``mesh`` (an
  ``AbstractMesh``) say whether the sequence is sharded.

  Raises:
    ValueError: an unknown name.
    layers.AttentionError: an explicit kernel whose constraints do not hold on ``chip``.
  """
  import layers
  if attention not in ATTENTIONS:
    raise ValueError(f"attention={attention!r} is not an attention implementation; use one "
                     f"of {', '.join(ATTENTIONS)} (model.attention=... or --attention).")
  config = dataclasses.replace(model, attention=attention)
  return layers.attention_choice(config, batch=batch, length=seq_len, rules=rules, mesh=mesh,
                                 backend=chip.kind).implementation


@dataclasses.dataclass(frozen=True)
class StepShape:
  """One device's share of a step, the shapes the cost model prices.

  Attributes:
    rows, seq_q, seq_k: sequences per micro-batch on this device, query positions per
      sequence on this device, key positions each query sees (the full length).
    embed, heads, kv_heads, head_dim, mlp, vocab: widths on this device (after tensor
      parallelism; ``embed`` is never split by the presets).
    layers: decoder blocks this device runs (``L / stages``).
    microbatches: ``k``.
    act_bytes, param_bytes: bytes per activation / parameter element.
    local_params: parameter elements held by this device (for the optimizer).
    gathered_params: parameter elements this device multiplies per pass (after FSDP gathers).
    remat, attention: the policy and the resolved implementation.
    causal: the mask is causal (fused kernels skip its masked half).
    chunked_loss: the cross-entropy is chunked (``model.loss_chunk``): the backward reruns
      the logits matmul chunk by chunk.
    experts: a mixture-of-experts block's experts ``E`` (0: a dense MLP).
    expert_slots: expert slots per token, ``E C / l`` (``C`` = ``layers.expert_capacity``
      per sequence of ``l`` tokens): the tokens each expert projection runs on per routed
      token, ``capacity_factor x top_k`` up to rounding.
    pipeline_microbatches: ``m``, the pipeline micro-batches a step micro-batch is split
      into when the layers are pipelined over stages (1: no pipeline): each block runs once
      per pipeline micro-batch, on ``tokens / m`` tokens.
    bubble: the pipeline's factor ``(r m + p - 1) / (r m)`` on the block stack (1: no
      pipeline): ``r m + p - 1`` iterations of which ``r m`` do a block's useful work.
    pipelined_params: of ``gathered_params``, the elements of the stacked layers the
      pipeline's loop runs (their casts and gradient writes take the bubble; the embedding
      and the head's do not); ``None``: all of them.
  """

  rows: float
  seq_q: float
  seq_k: float
  embed: float
  heads: float
  kv_heads: float
  head_dim: float
  mlp: float
  vocab: float
  layers: float
  microbatches: int
  act_bytes: int
  param_bytes: int
  local_params: float
  gathered_params: float
  remat: str
  attention: str
  causal: bool = True
  chunked_loss: bool = False
  experts: float = 0.0
  expert_slots: float = 0.0
  pipeline_microbatches: int = 1
  bubble: float = 1.0
  pipelined_params: float | None = None

  @property
  def tokens(self) -> float:
    return self.rows * self.seq_q


def matmul_efficiency(m: float, k: float, n: float, chip: Chip) -> float:
  """The fraction of peak a ``[m, k] @ [k, n]`` reaches: the chip's large-matmul
  efficiency, lowered for a weight whose smaller dimension ``d = min(k, n)`` (a thin
  shard, a narrow model) is under the reference size the efficiency was measured at
  (``d / (d + knee)`` relative to the reference's: fewer tiles per wave, a larger share of
  prologue and epilogue). A small ``m`` (few tokens per micro-batch) is priced by its
  bytes instead (:func:`matmul_seconds`). ``knee = 0``: no shape effect (the TPU rows,
  whose MXU tiles are 128 or 256 wide, show none).

  >>> from recipes.chips import get_chip
  >>> h200 = get_chip('h200')
  >>> matmul_efficiency(8192, 8192, 8192, h200) == h200.cal.matmul_efficiency
  True
  >>> matmul_efficiency(8192, 2048, 2048, h200) < h200.cal.matmul_efficiency
  True
  """
  c = chip.cal
  if c.matmul_knee <= 0:
    return c.matmul_efficiency
  ref, dmin = c.matmul_reference_dim, min(k, n)
  rel = (dmin / (dmin + c.matmul_knee)) / (ref / (ref + c.matmul_knee))
  return c.matmul_efficiency * min(1.0, rel)


def matmul_seconds(m: float, k: float, n: float, a: int, chip: Chip) -> float:
  """One ``[m, k] @ [k, n]`` at the chip's calibrated rates: its FLOPs at
  :func:`matmul_efficiency` or, for a thin one, its operand and result bytes at
  ``eta_hbm`` (whichever is longer).

  >>> from recipes.chips import get_chip
  >>> h200 = get_chip('h200')
  >>> round(matmul_seconds(8192, 8192, 8192, 2, h200) * 1e3, 3)   # 1.1 TFLOP at 791 TFLOP/s
  1.39
  """
  c = chip.cal
  flops = 2 * m * k * n / (matmul_efficiency(m, k, n, chip) * chip.bf16_flops)
  traffic = (m * k + k * n + m * n) * a / (c.hbm_efficiency * chip.hbm_bandwidth)
  return max(flops, traffic)


def _block_matmuls(s: StepShape) -> dict[str, tuple[float, float]]:
  """The block's matmuls as ``name -> (K, N)`` (``M`` is the tokens). A mixture-of-experts
  block (``layers._moe``) has, instead of the MLP: the fp32 router ``[T, D] @ [D, E]``; the
  dispatch and the combine, each ``2 T (E C) D`` FLOPs (``K = E C``: a sequence's slots); and
  the experts' projections on ``expert_slots`` slots per token (folded into ``N`` / ``K``)."""
  d, hd = s.embed, s.head_dim
  attention = {"qkv": (d, (s.heads + 2 * s.kv_heads) * hd), "out": (s.heads * hd, d)}
  if not s.experts:
    return {**attention, "mlp_in": (d, 2 * s.mlp), "mlp_out": (s.mlp, d)}
  sequence_slots = s.expert_slots * s.seq_k
  return {**attention, "router": (d, s.experts), "dispatch": (sequence_slots, d),
          "expert_in": (d, 2 * s.mlp * s.expert_slots),
          "expert_out": (s.mlp * s.expert_slots, d), "combine": (sequence_slots, d)}


def _backward_matmuls(mm: dict[str, float]) -> float:
  """The backward's matmul cost from the forward's, per matmul (:data:`BACKWARD_PASSES`)."""
  return sum(BACKWARD_PASSES.get(name, 2) * v for name, v in mm.items())


def _recomputes_attention(s: StepShape) -> bool:
  _, attn, _ = RECOMPUTE[s.remat]
  if attn is None:   # "dots": the xla einsums are dots and saved, a fused kernel reruns
    return s.attention != "xla"
  return attn


def attention_seconds(s: StepShape, chip: Chip) -> dict[str, float]:
  """Per phase, one block's attention core for one micro-batch (no recompute)."""
  c = chip.cal
  scores = s.rows * s.heads * s.seq_q * s.seq_k
  full = 4 * scores * s.head_dim                      # QK^T and PV, both triangles
  hbm = c.hbm_efficiency * chip.hbm_bandwidth
  if s.attention in FUSED:
    frac = 0.5 if s.causal else 1.0
    rate = c.fused_attention_fraction * chip.bf16_flops * s.seq_k / (
        s.seq_k + c.fused_attention_s0)
    fwd = full * frac / rate
    return {"forward": fwd, "backward": 2.5 * fwd}     # FlashAttention-2's backward
  mm = full / (c.matmul_efficiency * chip.bf16_flops)   # one pass of QK^T and PV
  if s.attention == "blockwise":   # checkpointed scan: the backward reruns the forward
    mem = c.blockwise_score_bytes * scores / hbm
    return {"forward": mm + mem / 4, "backward": 3 * mm + 3 * mem / 4}
  mem = c.xla_score_bytes * scores / hbm
  return {"forward": mm + mem / 3, "backward": 2 * mm + 2 * mem / 3}


def _elementwise_elems(s: StepShape) -> float:
  """Elements one block's forward reads and writes per token outside matmuls and attention:
  two RMSNorms (read, write D each, in and out of fp32), two residual adds (read 2D, write D),
  RoPE on queries and keys (read, write), SwiGLU (read 2F, write F)."""
  d = s.embed
  return 4 * d + 6 * d + 2 * (s.heads + s.kv_heads) * s.head_dim + 3 * s.mlp


def step_terms(s: StepShape, chip: Chip) -> dict[str, dict[str, float]]:
  """Per phase (``forward``, ``backward``; the optimizer update is in the backward), seconds
  per op class for the whole step on one device (``k`` micro-batches, a pipeline's bubble
  included).

  A pipelined step (``m = pipeline_microbatches > 1``) runs its blocks on one pipeline
  micro-batch (``T / m`` tokens) at a time: the block matmuls are ``m`` matmuls of ``T / m``
  rows, and the per-op overhead is paid ``m`` times per step micro-batch; the ``bubble``
  ``(r m + p - 1) / (r m)`` makes that once per pipeline iteration (``r m + p - 1`` of them,
  each a chunk of ``L / (p r)`` layers). The bubble multiplies only what runs in the loop:
  the block stack's matmuls, attention, elementwise ops, per-op overhead and its weights'
  casts and gradient writes (``pipelined_params``). The head's matmul, the logits and the
  cross-entropy, the embedding's weights and the optimizer update run once per step
  micro-batch (the update once per step), outside the loop.

  >>> from recipes.chips import get_chip
  >>> s = StepShape(rows=4, seq_q=2048, seq_k=2048, embed=2048, heads=16, kv_heads=8,
  ...               head_dim=128, mlp=8192, vocab=32768, layers=16, microbatches=1,
  ...               act_bytes=2, param_bytes=4, local_params=1.07e9, gathered_params=1.07e9,
  ...               remat='none', attention='cudnn')
  >>> t = step_terms(s, get_chip('h200'))
  >>> sorted(t['backward'])
  ['attention', 'elementwise', 'logits', 'matmul', 'optimizer', 'overhead', 'weights']
  """
  c, k, L, a, T = chip.cal, s.microbatches, s.layers, s.act_bytes, s.tokens
  hbm = c.hbm_efficiency * chip.hbm_bandwidth
  redo, _, redo_elementwise = RECOMPUTE[s.remat]
  pm = max(1, s.pipeline_microbatches)
  mm = {name: pm * matmul_seconds(T / pm, kk, n, a, chip)
        for name, (kk, n) in _block_matmuls(s).items()}
  head = matmul_seconds(T, s.embed, s.vocab, a, chip)
  attn = attention_seconds(s, chip)
  elem = _elementwise_elems(s) * T * a / hbm
  ops = {p: OPS_PER_LAYER[p] + (XLA_ATTENTION_OPS[p] if s.attention == "xla" else 0)
         for p in OPS_PER_LAYER}
  recompute_mm = sum(mm[n] for n in redo if n in mm)
  recompute_attn = attn["forward"] if _recomputes_attention(s) else 0.0
  stack = s.bubble * L   # the block stack: its layers, each run r m + p - 1 times over r m
  stacked = s.gathered_params if s.pipelined_params is None else s.pipelined_params
  weights = s.bubble * stacked + (s.gathered_params - stacked)   # elements, bubble priced
  terms = {
      "forward": {
          "matmul": k * (stack * sum(mm.values()) + head),
          "attention": k * stack * attn["forward"],
          "elementwise": k * stack * elem,
          # fp32 logits written, read twice (max/logsumexp, the target's logit)
          "logits": k * T * s.vocab * 4 * 3 / hbm,
          "weights": k * weights * (s.param_bytes + a) / hbm,   # the casts
          "overhead": k * pm * stack * ops["forward"] * c.op_overhead_s,
      },
      "backward": {
          "matmul": k * (stack * (_backward_matmuls(mm) + recompute_mm)
                         + (3 if s.chunked_loss else 2) * head),
          "attention": k * stack * (attn["backward"] + recompute_attn),
          "elementwise": k * stack * elem * (2 + (1 if redo_elementwise else 0)),
          "logits": k * T * s.vocab * (4 * 2 + a) / hbm,   # softmax - onehot, cast
          "weights": k * weights * 2 * s.param_bytes / hbm,   # gradient writes
          "optimizer": s.local_params * s.param_bytes * (7 + (2 * k if k > 1 else 0)) / hbm,
          "overhead": (k * pm * stack * c.op_overhead_s
                       * (ops["backward"] + (ops["forward"] if redo_elementwise else 0))),
      },
  }
  if c.fused_elementwise:   # XLA:TPU fuses them into the matmuls' operand and output reads
    for t in terms.values():
      hidden = min(t["elementwise"] + t["weights"], t["matmul"])
      share = hidden / max(t["elementwise"] + t["weights"], 1e-30)
      t["elementwise"] *= 1 - share
      t["weights"] *= 1 - share
  return terms


def executed_flops(s: StepShape) -> float:
  """FLOPs one device executes in a step (matmuls, attention as implemented, recompute)."""
  k, L, T = s.microbatches, s.layers, s.tokens
  mms = {n: 2 * T * kk * nn for n, (kk, nn) in _block_matmuls(s).items()}
  head = 2 * T * s.embed * s.vocab
  scores = s.rows * s.heads * s.seq_q * s.seq_k
  attn = 4 * scores * s.head_dim * (0.5 if s.attention in FUSED and s.causal else 1.0)
  redo, _, _ = RECOMPUTE[s.remat]
  layer = sum(mms.values()) + _backward_matmuls(mms) + sum(
      mms[n] for n in redo if n in mms) + 3 * attn + (
      attn if _recomputes_attention(s) else 0.0)
  return k * (L * layer + (4 if s.chunked_loss else 3) * head)


def model_flops_per_token(embed: int, heads: int, kv_heads: int, head_dim: int, mlp: int,
                          vocab: int, layers: int, seq_len: int, causal: bool = True,
                          experts_per_token: int = 1) -> float:
  """Useful training FLOPs per token (forward + backward, no recompute): ``6 x`` the matmul
  parameters a token passes (the blocks and the logits, not the embedding lookup) plus
  attention's ``12 s H d_head`` per block, halved for a causal mask (only the unmasked
  half is useful; MaxText's convention since its PR #1988).

  >>> round(model_flops_per_token(4096, 32, 32, 128, 11008, 32000, 32, 4096) / 1e9, 2)
  42.86
  """
  per_layer = embed * (heads + 2 * kv_heads) * head_dim + heads * head_dim * embed + \
      3 * embed * mlp * experts_per_token
  attn = 12 * seq_len * heads * head_dim * (0.5 if causal else 1.0)
  return 6 * (layers * per_layer + embed * vocab) + layers * attn


def bound_of(terms: dict[str, float]) -> str:
  """Which op class takes longest in one phase's compute: ``compute`` (matmuls, attention),
  ``HBM`` (memory-bound ops) or ``overhead`` (per-op latency)."""
  groups = {"compute": terms.get("matmul", 0.0) + terms.get("attention", 0.0),
            "HBM": sum(v for n, v in terms.items()
                       if n in ("elementwise", "logits", "weights", "optimizer")),
            "overhead": terms.get("overhead", 0.0)}
  return max(groups, key=groups.get)

