"""The planner's analytic screen: per-device memory, FLOPs, HBM traffic and collectives of one
candidate plan, from the model's parameter shapes and the preset's rules alone.

It needs no devices (the mesh is a ``jax.sharding.AbstractMesh``), so it can rank plans for
machines far larger than this one, and it decides which plans are worth compiling. What a
compiled plan reports replaces the estimate wherever both exist (:mod:`recipes.plan`).

Accounting, per device and per step (``k`` micro-batches, ``L`` layers, ``T`` tokens per
device per micro-batch, ``a`` bytes per activation element):

* state: parameter shards, Adam's two moments (same dtype and sharding), the gradient, and
  a second gradient copy when ``k > 1`` (the accumulator) or when the gradient is reduced
  over devices (the reduction's output);
* activations saved for the backward, per token and layer, by remat policy
  (:func:`_activations_per_token`): ``full`` / ``nothing_saveable`` keep the block input
  plus one block's working set; ``dots`` every matmul output; ``none`` what each op's
  backward needs (fp32 norm values, matmul inputs, q/k/v, SwiGLU's operands); XLA
  attention's scores by policy (:func:`_score_bytes`; a fused kernel keeps none); the
  logits in the compute dtype and fp32 with their gradient (one chunk's with
  ``model.loss_chunk``); weight copies (:func:`_weight_copies`: compute-dtype casts of the
  weights held whole, one FSDP-gathered layer at a time, every layer's under remat ``none``);
* FLOPs: ``2 P_matmul`` per token forward plus attention ``4 s H d_head`` per token per
  layer; backward twice that; full remat reruns the forward inside the backward, the chunked
  loss its logits matmul;
* collectives: a parameter sharded over a batch axis (FSDP) is all-gathered in the forward
  and again in the backward (in the compute dtype where ``layers`` computes with it:
  ``layers.gathered_in_compute_dtype``) and its gradient reduce-scattered once per
  micro-batch; one
  replicated over a batch axis has its gradient all-reduced once per step; axes that shard
  weights but not the batch (tensor parallelism) all-reduce ``[T, D]`` activations twice
  per layer forward and twice backward per micro-batch (Megatron); a sharded sequence
  all-gathers keys and values per layer (and reduce-scatters their gradients); experts
  split over a mesh axis stay there and four all-to-alls per layer move the dispatched
  tokens (GShard).

A mixture-of-experts block's experts run on their capacity's slots (``E C / l`` per token),
not on every token, and its router, dispatch and combine are matmuls of their own
(:func:`recipes.cost_model._block_matmuls`); the useful FLOPs count the top-k experts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from recipes import cost_model, roofline
from recipes.chips import Chip

BATCH_AXES = ("batch", "length")
ADAM_MOMENTS = 2
REMATS = ("none", "dots", "dots_no_batch", "full", "nothing_saveable")


@dataclasses.dataclass(frozen=True)
class ParamShape:
  """One parameter: path, shape, bytes per element and logical axes (``None``: unnamed)."""

  path: str
  shape: tuple[int, ...]
  itemsize: int
  axes: tuple[str | None, ...] | None


@dataclasses.dataclass(frozen=True)
class Estimate:
  """The analytic figures of one plan, per device.

  Attributes:
    memory: bytes by kind (``params``, ``optimizer``, ``gradients``, ``activations``,
      ``batch``) and ``total``.
    flops: per phase FLOPs; ``model_flops``: useful FLOPs of the step over all devices.
    hbm_bytes: per phase HBM bytes read and written.
    comm_bytes: per mesh-axis group (``'data,fsdp'``), ring bytes sent per device per step.
    comm_phase: per phase, per group, ring bytes (how the group's bytes split over phases).
    comm_s: per phase, per group, seconds on the chip (hierarchical over DCN axes).
    shape: this device's share of the step (:class:`recipes.cost_model.StepShape`).
    terms: per phase, seconds per op class on the chip (:func:`recipes.cost_model.step_terms`;
      a pipeline's bubble already in the block stack's terms).
    bubble: the pipeline's factor ``(r m + p - 1) / (r m)`` on the block stack (1 without
      stages): the terms hold it, the saved activations are multiplied by it.
    attention_temp: bytes of attention scores held for the backward (every block's under
      ``none``) or in one block's backward, included in ``memory['activations']`` (0 for a
      fused kernel, which holds none).
    serial_axes: mesh axes whose collectives sit between two ops that need their result
      (tensor-parallel all-reduces, sequence-parallel key/value gathers, pipeline hand-offs):
      the cost model does not hide them behind compute.
  """

  memory: dict[str, float]
  flops: dict[str, float]
  model_flops: float
  hbm_bytes: dict[str, float]
  comm_bytes: dict[str, float]
  comm_phase: dict[str, dict[str, float]]
  comm_s: dict[str, dict[str, float]]
  shape: cost_model.StepShape | None = None
  terms: dict[str, dict[str, float]] | None = None
  bubble: float = 1.0
  attention_temp: float = 0.0
  serial_axes: tuple[str, ...] = ()


def mesh_axes_of(rules) -> tuple[str, ...]:
  """The mesh axis names a rules table uses, ``data`` first (the axis that spans hosts),
  then in the order the rules first name them.

  >>> import partition
  >>> mesh_axes_of(partition.AxisRules([('mlp', 'tensor'), ('batch', ('data', 'fsdp'))]))
  ('data', 'tensor', 'fsdp')
  """
  return tuple(sorted(rules.mesh_axes, key=lambda name: name != "data"))  # sort is stable


def _spec_axes(spec) -> list[tuple[str, ...]]:
  """Per dimension, the mesh axes of a ``PartitionSpec`` entry."""
  out = []
  for entry in tuple(spec):
    if entry is None:
      out.append(())
    elif isinstance(entry, str):
      out.append((entry,))
    else:
      out.append(tuple(entry))
  return out


def _group(axes, mesh: Mapping[str, int]) -> tuple[str, ...]:
  """``axes`` in mesh order, without the size-1 ones."""
  return tuple(a for a in mesh if a in axes and mesh[a] > 1)


def sharding_signature(params: Sequence[ParamShape], rules, mesh: Mapping[str, int],
                       batch: int, seq_len: int) -> tuple:
  """What distinguishes two plans' shardings: every parameter's and the batch's spec with
  size-1 mesh axes dropped, and the sizes of the others (``fsdp_tp`` on ``tensor=1`` is
  ``fsdp``). Its last entry is the mesh's ``(axis, size)`` pairs."""
  from jax.sharding import AbstractMesh
  amesh = AbstractMesh(tuple(mesh.values()), tuple(mesh))
  sig = []
  for p in params:
    spec = rules.spec(p.axes, p.shape, amesh) if _named(p) else ()
    sig.append(tuple(_group(d, mesh) for d in _spec_axes(spec)))
  bspec = rules.spec(BATCH_AXES, (batch, seq_len), amesh)
  sig.append(tuple(_group(d, mesh) for d in _spec_axes(bspec)))
  sig.append(tuple((a, v) for a, v in mesh.items() if v > 1))
  return tuple(sig)


def _named(p: ParamShape) -> bool:
  return p.axes is not None and any(a is not None for a in p.axes) and len(p.shape) > 0


def batch_groups(rules, mesh: Mapping[str, int], batch: int, seq_len: int
                 ) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """The mesh axes (size > 1) splitting the batch rows and the sequence."""
  from jax.sharding import AbstractMesh
  amesh = AbstractMesh(tuple(mesh.values()), tuple(mesh))
  dims = _spec_axes(rules.spec(BATCH_AXES, (batch, seq_len), amesh))
  dims += [()] * (2 - len(dims))
  return _group(dims[0], mesh), _group(dims[1], mesh)


def estimate(params: Sequence[ParamShape], model: Any, rules, mesh: Mapping[str, int], *,
             batch: int, seq_len: int, microbatches: int, remat: str, chip: Chip,
             hosts: int = 1, attention: str | None = None) -> Estimate:
  """The analytic :class:`Estimate` of one plan (see the module docstring).

  ``attention`` overrides ``model.attention``; what it resolves to on ``chip``
  (``cost_model.resolve_attention``) is what the cost model prices and whose working set the
  memory counts."""
  from jax.sharding import AbstractMesh

  import layers
  amesh = AbstractMesh(tuple(mesh.values()), tuple(mesh))
  size = lambda axes: math.prod(mesh[a] for a in axes)
  rows, seq = batch_groups(rules, mesh, batch, seq_len)
  batch_axes = set(rows) | set(seq)
  k = microbatches
  tokens = batch * seq_len / size(rows) / size(seq) / k  # per device per micro-batch
  a = _itemsize(model.dtype)
  links = roofline.axis_links(mesh, chip, hosts)
  comm_b: dict[str, dict[str, float]] = {p: {} for p in roofline.PHASES}
  comm_t: dict[str, dict[str, float]] = {p: {} for p in roofline.PHASES}

  def add(phase, axes, kind, full_bytes, times=1):
    g = _group(axes, mesh)
    if not g or full_bytes <= 0:
      return
    key = ",".join(g)
    wire = roofline.wire_bytes(kind, full_bytes, size(g)) * times
    comm_b[phase][key] = comm_b[phase].get(key, 0.0) + wire
    t = roofline.collective_seconds(g, kind, full_bytes, mesh, links) * times
    comm_t[phase][key] = comm_t[phase].get(key, 0.0) + t

  stages = _layer_axes(rules, amesh, model.num_layers)
  experts, slots = _expert_widths(model, seq_len)
  local = gathered = gathered_layers = matmul_params = expert_params = 0.0
  local_layers_fsdp = local_stacked = 0.0
  tensor_axes: set[str] = set()
  expert_axes: set[str] = set()
  untied = any(p.path.endswith("lm_head/kernel") for p in params)
  for p in params:
    nbytes = math.prod(p.shape) * p.itemsize
    dims = _spec_axes(rules.spec(p.axes, p.shape, amesh)) if _named(p) else []
    shard = {ax for d in dims for ax in d if mesh[ax] > 1}
    # an expert weight split over its experts stays where it is: the tokens come to it
    expert = _is_expert_weight(p)
    held = _expert_mesh_axes(p, dims, mesh) if expert else set()
    expert_axes |= held
    fsdp = [ax for ax in mesh if ax in shard and ax in batch_axes and ax not in held]
    replicated = [ax for ax in mesh if ax in batch_axes and ax not in shard]
    local += nbytes / size(shard)
    if p.axes and "layers" in p.axes:
      local_stacked += nbytes / size(shard)
    full = nbytes / size(shard - set(fsdp))      # this device's slice once gathered
    gathered += full
    if fsdp and p.axes and "layers" in p.axes:   # gathered one layer at a time in the scan
      gathered_layers += full
      local_layers_fsdp += nbytes / size(shard)
    if _is_matrix(p):   # a stacked norm scale (layers, embed) is no matmul
      if expert:
        expert_params += math.prod(p.shape)
      elif not (untied and p.path.endswith("embed/embedding")):   # a lookup, not a matmul
        matmul_params += math.prod(p.shape)
      tensor_axes |= shard - batch_axes - set(stages)
    # layers gathers the weights it computes with in the compute dtype (cast while sharded)
    cast = a < p.itemsize and layers.gathered_in_compute_dtype(p.path, tied=not untied)
    sent = full * a / p.itemsize if cast else full
    add("forward", fsdp, "all-gather", sent)
    add("backward", fsdp, "all-gather", sent)
    add("backward", fsdp, "reduce-scatter", full, times=k)
    add("backward", replicated, "all-reduce", nbytes / size(shard))

  c = model
  split = lambda name, dim: dim / _split(rules, amesh, name, dim, batch, seq_len)
  heads, kv = split("heads", c.num_heads), split("kv_heads", c.num_kv_heads)
  mlp, vocab = split("mlp", c.mlp_dim), split("vocab", c.vocab_size)
  d, hd, L = c.embed_dim, c.head_dim, c.num_layers
  tensor = tuple(ax for ax in mesh if ax in tensor_axes)
  for phase in roofline.PHASES:     # Megatron: 2 all-reduces of [T, D] per layer and pass
    add(phase, tensor, "all-reduce", tokens * d * a, times=2 * L * k)
  kv_bytes = 2 * tokens * size(seq) * kv * hd * a
  add("forward", seq, "all-gather", kv_bytes, times=L * k)
  add("backward", seq, "reduce-scatter", kv_bytes, times=L * k)
  p_stages = size(stages)
  local_layers = L / p_stages
  pipe = _pipeline_shape(c, p_stages)
  if pipe:
    _add_pipeline_collectives(add, stages, pipe, k, tokens * d * a, local_stacked)

  impl = cost_model.resolve_attention(attention or c.attention, chip, c, batch=batch,
                                     seq_len=seq_len, rules=rules, mesh=amesh)
  rows_mb = batch / size(rows) / k
  moe_axes = tuple(ax for ax in mesh if ax in expert_axes)
  if experts and moe_axes:   # GShard: dispatch and combine, and their transposes backward
    dispatched = rows_mb * slots * seq_len * d * a     # [rows, E, C, D] on this device
    for phase in roofline.PHASES:
      add(phase, moe_axes, "all-to-all", dispatched, times=2 * local_layers * k)
  seq_q = seq_len / size(seq)
  per_token = _activations_per_token(remat, d, heads, kv, hd, mlp, a, slots=slots,
                                     sequence_slots=slots * seq_len,
                                     top_k=c.experts_per_token if experts else 0)
  saved_scores, temp_scores = _score_bytes(remat, impl, a)
  scores_per_token = heads * seq_len          # score elements per query token and block
  # a pipeline saves every iteration's residuals, the bubble's too (:func:`_pipeline_shape`),
  # and runs one block's backward on one pipeline micro-batch of tokens / m at a time
  bubble = pipe.bubble if pipe else 1.0
  live_tokens = tokens / pipe.m if pipe else tokens
  attention_temp = scores_per_token * (live_tokens * temp_scores
                                       + bubble * tokens * local_layers * saved_scores)
  # logits: the compute-dtype matmul output, its fp32 copy, softmax and gradient, for the
  # whole micro-batch or one chunk of the chunked cross-entropy (model.loss_chunk)
  chunk = getattr(c, "loss_chunk", 0) or 0
  logit_tokens = rows_mb * _loss_chunk_tokens(chunk, seq_len) / size(seq) if chunk else tokens
  logits = logit_tokens * vocab * (4 * 3 + a)
  acts = (bubble * tokens * local_layers * per_token[0] + live_tokens * per_token[1]
          + attention_temp + logits)
  if pipe:   # each iteration's chunk of this stage's layers, sliced from the stack by the
    # iteration's repeat, is a residual of the schedule's loop: kept once per iteration
    acts += pipe.iterations * local_stacked / pipe.r
  # the gradient, plus a second copy where it is reduced over devices (the all-reduce or
  # reduce-scatter writes a new buffer: CPU compiles, 8 devices, data_parallel and FSDP, 4 to
  # 16 layers) or accumulated over micro-batches; none for the scanned layers' FSDP-sharded
  # gradients under remat dots / full without micro-batches (CPU compiles, FSDP 2 to 8)
  reduced = local - (local_layers_fsdp if remat != "none" and k == 1 else 0.0)
  grads = local + (reduced if k > 1 or size(rows) * size(seq) > 1 else 0.0)
  weights = _weight_copies(gathered, gathered_layers, local_layers, remat, a,
                           _param_itemsize(params))
  memory = {"params": local, "optimizer": ADAM_MOMENTS * local, "gradients": grads,
            "activations": acts + weights,
            "batch": 3 * 4 * batch * seq_len / size(rows) / size(seq)}
  memory["total"] = sum(memory.values())

  total_tokens = batch * seq_len
  n = size(mesh)
  attn_flops = 4 * seq_len * c.num_heads * hd * L
  # experts: each runs on its slots (capacity x top-k per token), plus the dispatch and
  # combine einsums, 2 T (E C) D each forward, 3 of them backward (the dispatch's 0/1
  # assignment gets no gradient)
  routed = expert_params * slots / experts if experts else 0.0
  routing = 2 * 2 * slots * seq_len * d * L
  forward = (2 * (matmul_params + routed) + attn_flops + routing) * total_tokens
  recompute = forward if remat in ("full", "nothing_saveable") else 0.0
  # the chunked loss reruns each chunk's logits matmul in the backward
  loss_rerun = 2 * d * c.vocab_size * total_tokens if chunk else 0.0
  backward = 2 * forward - routing * total_tokens / 2
  flops = {"forward": forward / n, "backward": (backward + recompute + loss_rerun) / n}
  act_traffic = acts - logits - live_tokens * scores_per_token * temp_scores
  hbm = {"forward": k * gathered + act_traffic * k,
         "backward": k * gathered * (3 if recompute else 2) + act_traffic * k
                     + (3 + ADAM_MOMENTS * 2) * local}
  comm_bytes: dict[str, float] = {}
  for phase in roofline.PHASES:
    for key, v in comm_b[phase].items():
      comm_bytes[key] = comm_bytes.get(key, 0.0) + v
  # useful FLOPs: top-k experts per token, no recompute, the unmasked half of causal attention
  active = expert_params * c.experts_per_token / experts if experts else 0.0
  model_flops = (6 * (matmul_params + active) + 3 * attn_flops / 2) * total_tokens
  gathered_of = lambda ps: sum(math.prod(p.shape) / size(
      {ax for dd in (_spec_axes(rules.spec(p.axes, p.shape, amesh)) if _named(p) else [])
       for ax in dd if mesh[ax] > 1} - batch_axes) for p in ps)
  gathered_elems = gathered_of(params)
  # a pipeline runs the stacked layers in its loop, the rest (embedding, head) once
  stacked_elems = gathered_of([p for p in params if p.axes and "layers" in p.axes])
  shape = cost_model.StepShape(
      rows=rows_mb, seq_q=seq_q, seq_k=seq_len, embed=d, heads=heads, kv_heads=kv,
      head_dim=hd, mlp=mlp, vocab=vocab, layers=local_layers, microbatches=k,
      act_bytes=a, param_bytes=_param_itemsize(params), local_params=_elements(local, params),
      gathered_params=gathered_elems, remat=remat, attention=impl, chunked_loss=bool(chunk),
      experts=experts, expert_slots=slots, pipeline_microbatches=pipe.m if pipe else 1,
      bubble=bubble, pipelined_params=stacked_elems if pipe else None)
  terms = cost_model.step_terms(shape, chip)
  # the experts' all-to-alls sit between the router and the experts' matmuls, as
  # tensor-parallel all-reduces sit between two matmuls
  serial = tuple(ax for ax in mesh if ax in set(tensor) | set(seq) | set(stages)
                 | set(moe_axes))
  return Estimate(memory, flops, model_flops, hbm, comm_bytes, comm_b, comm_t, shape, terms,
                  bubble, attention_temp, serial)


@dataclasses.dataclass(frozen=True)
class _Pipeline:
  """A pipelined plan's schedule (``partition.pipeline``): ``p`` stages, ``m`` pipeline
  micro-batches per step micro-batch, ``r`` repeats (chunks per stage)."""

  p: int
  m: int
  r: int

  @property
  def iterations(self) -> int:
    """The schedule's loop trip count, ``r m + p - 1`` (``partition.pipeline_iterations``)."""
    return self.r * self.m + self.p - 1

  @property
  def bubble(self) -> float:
    """The step-time factor ``(r m + p - 1) / (r m)``: every iteration runs a chunk of
    ``L / (p r)`` layers on ``T / m`` tokens, ``r m`` of them useful."""
    return self.iterations / (self.r * self.m)

  def relayout_rounds(self) -> int:
    """``ppermute`` rounds of the circular schedule's chunk relayout (chunk ``c`` moves
    from stage ``c // r`` to stage ``c mod p``): as many as the busiest stage sends or
    receives (König's edge colouring, ``partition.pipeline``); 0 for GPipe (``r = 1``)."""
    if self.r == 1:
      return 0
    moves = [(c // self.r, c % self.p) for c in range(self.p * self.r)
             if c // self.r != c % self.p]
    ends = [("from", a) for a, _ in moves] + [("to", b) for _, b in moves]
    return max((ends.count(e) for e in set(ends)), default=0)


def _pipeline_shape(model: Any, stages: int) -> _Pipeline | None:
  """The schedule of a plan with ``stages`` pipeline stages (``None``: not pipelined):
  ``model.pipeline_microbatches`` (0: one per stage) and ``model.pipeline_repeats``."""
  if stages <= 1:
    return None
  return _Pipeline(stages, getattr(model, "pipeline_microbatches", 0) or stages,
                   getattr(model, "pipeline_repeats", 1) or 1)


def _add_pipeline_collectives(add, stages: tuple[str, ...], pipe: _Pipeline, k: int,
                              activations: float, local_stacked: float) -> None:
  """The stage axis's collectives, per step micro-batch (``k`` of them) and per phase (the
  backward runs each one's transpose): every iteration hands one pipeline micro-batch's
  activations (``activations / m``, all of it sent: a ``ppermute``) to the next stage; the
  outputs, left on stage 0, are summed over the stages once (an all-reduce of
  ``activations``); the circular schedule first moves its chunks to their stages (one
  chunk of ``local_stacked / r`` bytes per relayout round). (CPU compiles, 8 devices:
  within 1 % of the compiled stage bytes for GPipe, ``m`` 4 to 16, and ``r = 2``.)"""
  for phase in roofline.PHASES:
    add(phase, stages, "permute", activations / pipe.m, times=k * pipe.iterations)
    add(phase, stages, "all-reduce", activations, times=k)
    add(phase, stages, "permute", local_stacked / pipe.r, times=k * pipe.relayout_rounds())


def _expert_widths(model: Any, seq_len: int) -> tuple[int, float]:
  """``(E, E C / l)``: a mixture-of-experts model's experts and expert slots per token
  (``C`` slots per expert and sequence of ``l`` tokens, ``layers.expert_capacity``);
  ``(0, 0.0)`` for a dense model."""
  experts = getattr(model, "num_experts", 0) or 0
  if not experts:
    return 0, 0.0
  import layers
  per_sequence = layers.expert_capacity(seq_len, experts, model.experts_per_token,
                                        model.capacity_factor)
  return experts, experts * per_sequence / seq_len


def _is_matrix(p: ParamShape) -> bool:
  """Two or more dims besides a stacked ``layers`` dim: a weight some matmul multiplies."""
  stacked = 1 if p.axes and "layers" in p.axes else 0
  return len(p.shape) - stacked >= 2


def _is_expert_weight(p: ParamShape) -> bool:
  """An expert's MLP weight (``('expert', 'embed', None, 'mlp')``): it multiplies only the
  tokens routed to its expert (the router, ``('embed', 'expert')``, multiplies all)."""
  return bool(p.axes) and "expert" in p.axes and "mlp" in p.axes


def _expert_mesh_axes(p: ParamShape, dims: list[tuple[str, ...]],
                      mesh: Mapping[str, int]) -> set[str]:
  """The mesh axes (size > 1) that split an expert weight over its experts."""
  return {ax for name, d in zip(p.axes, dims) if name == "expert" for ax in d if mesh[ax] > 1}


def _layer_axes(rules, amesh, num_layers: int) -> tuple[str, ...]:
  """The mesh axes (size > 1) a stacked ``layers`` dimension is split over (pipeline
  stages), ``()`` when the rules keep the layers whole."""
  dims = _spec_axes(rules.spec(("layers",), (num_layers,), amesh))
  return tuple(ax for d in dims for ax in d if amesh.shape[ax] > 1)


def _loss_chunk_tokens(chunk: int, seq_len: int) -> int:
  """Tokens of each row one step of the chunked cross-entropy holds (``layers``'
  ``chunked_cross_entropy``: ``ceil(L / chunk)`` steps of ``ceil(L / steps)`` tokens)."""
  steps = -(-seq_len // chunk)
  return -(-seq_len // steps)


def _weight_copies(gathered: float, gathered_layers: float, layers: float, remat: str, a: int,
                   itemsize: int) -> float:
  """Bytes of weight copies beyond the parameter shards: the compute-dtype casts of the
  weights a device holds whole (replicated or tensor-sharded: one copy the backward
  reuses), and for FSDP-sharded stacked layers (``gathered_layers``: their gathered bytes,
  all layers) one layer's gathered weights and its unreduced gradient at a time, the scan
  gathering each layer when it runs; under remat ``none`` the backward keeps every layer's
  gathered weights (the matmuls' saved inputs), where other policies gather them again.
  (Compiled on CPU, 8 devices, FSDP=8, 4 to 16 layers: ``2 x`` a gathered layer fixed, and
  under ``none`` one gathered layer more per layer.)"""
  whole = gathered - gathered_layers
  casts = whole / itemsize * a if itemsize > a else 0.0
  per_layer = gathered_layers / max(layers, 1.0)
  return casts + 2 * per_layer + (gathered_layers if remat == "none" else 0.0)


def _param_itemsize(params: Sequence[ParamShape]) -> int:
  """The parameters' bytes per element (the largest matrix's)."""
  big = max(params, key=lambda p: math.prod(p.shape), default=None)
  return big.itemsize if big else 4


def _elements(local_bytes: float, params: Sequence[ParamShape]) -> float:
  return local_bytes / _param_itemsize(params)


def _score_bytes(remat: str, impl: str, a: int) -> tuple[float, float]:
  """(bytes per attention score element saved for the backward per block, bytes per score
  of one block's backward working set). XLA's materialised softmax (``layers``' attention)
  saves the broadcast mask (1 B), the fp32 probabilities (4 B) and the compute-dtype
  weights (``a``) under ``none``, the fp32 logits (4 B, a dot's output) under ``dots``; a
  block's backward holds fp32 probability and logit gradients and the weights' gradient
  (``8 + a``), plus the recomputed forward's ``5 + a`` when the policy reruns it. Fused and
  blockwise kernels keep no scores (a log-sum-exp per row, negligible)."""
  if impl != "xla":
    return 0.0, 0.0
  backward = 8.0 + a
  if remat == "none":
    return 1.0 + 4.0 + a, backward
  saved = 4.0 if remat == "dots" else 0.0
  return saved, backward + (0.0 if remat == "dots" else 5.0 + a)


def _split(rules, amesh, name: str, dim: int, batch: int, seq_len: int) -> int:
  """How many shards the rules give the logical axis ``name`` of an activation
  ``[batch, length, name]`` (mesh axes the batch already takes are not available to it)."""
  spec = _spec_axes(rules.spec(BATCH_AXES + (name,), (batch, seq_len, dim), amesh))
  spec += [()] * (3 - len(spec))
  return math.prod(amesh.shape[ax] for ax in spec[2])


def _activations_per_token(remat: str, d: float, heads: float, kv: float, hd: float,
                           mlp: float, a: int, *, slots: float = 0.0,
                           sequence_slots: float = 0.0, top_k: int = 0
                           ) -> tuple[float, float]:
  """(bytes saved per token per block for the backward, bytes live once for the block the
  backward recomputes), from what ``layers``' block keeps (scores apart, :func:`_score_bytes`):

  * ``none``: both RMSNorms' fp32 input and normalised output (``16 D``), every matmul's
    input (``D`` for QKV, ``H d_head`` for the output projection, ``D`` for the MLP in,
    ``F`` for the MLP out), queries, keys and values, and SwiGLU's gate, up and
    ``silu(gate)`` (``3 F``);
  * ``dots`` / ``dots_no_batch`` and MaxText's projection-saving policies: the dot outputs
    (QKV, the attention output, both output projections, the MLP's two up-projections)
    and the block input;
  * ``full`` / ``nothing_saveable``: the block input, and one block's ``none`` set while its
    backward runs;
  * MaxText's host-offloading policies (:data:`recipes.cost_model.OFFLOADED`): the block
    input unless it is offloaded too, and one block's ``none`` set.

  A mixture-of-experts block (``slots`` expert slots per token, ``sequence_slots`` = ``E C``
  per sequence, ``top_k`` choices) replaces the MLP's terms, as JAX saves them
  (``jax.ad_checkpoint.print_saved_residuals`` of ``layers._moe.moe``): under ``none`` the
  experts' ``4 F`` and their dispatched input and output (``2 D``) per slot, the dispatch
  and combine tensors (``E C`` each, compute dtype) and the fp32 slot assignment
  (``k E C``) per token; under ``dots`` the dot outputs: the dispatched input, both expert
  projections and the fp32 combine weights, the slot assignment and dispatch being
  recomputed for one block at a time in the backward.
  """
  attention_none = 16 * d + a * (2 * d + 2 * heads * hd + 2 * kv * hd)
  attention_dots = a * (heads * hd + 2 * kv * hd + heads * hd + d)
  if slots:
    none = attention_none + a * (slots * (4 * mlp + 2 * d) + 2 * sequence_slots) + \
        4 * top_k * sequence_slots
    dots = attention_dots + a * slots * (2 * d + 2 * mlp) + 4 * sequence_slots
    routing = 4 * (top_k + 1) * sequence_slots   # what dots recomputes, one block at a time
  else:
    none = attention_none + a * 4 * mlp
    dots = attention_dots + a * (2 * mlp + d)
    routing = 0.0
  if remat in cost_model.OFFLOADED:
    return (0.0 if cost_model.OFFLOADED[remat] else a * d), none
  redo = cost_model.RECOMPUTE.get(remat, ((), False, False))[0]
  if remat in ("full", "nothing_saveable") or redo == cost_model.RERUN:
    return a * d, none
  return (none, 0.0) if remat == "none" else (dots, routing)


def _itemsize(dtype) -> int:
  import jax.numpy as jnp
  import numpy as np
  return int(np.dtype(jnp.dtype(dtype)).itemsize)
