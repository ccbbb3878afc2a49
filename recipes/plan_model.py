"""The planner's analytic screen: per-device memory, FLOPs, HBM traffic and collectives of one
candidate plan, from the model's parameter shapes and the preset's rules alone.

It needs no devices (the mesh is a ``jax.sharding.AbstractMesh``), so it can rank plans for
machines far larger than this one, and it decides which plans are worth compiling. What a
compiled plan reports replaces the estimate wherever both exist (:mod:`recipes.plan`).

Accounting, per device and per step (``k`` micro-batches, ``L`` layers, ``T`` tokens per
device per micro-batch, ``a`` bytes per activation element):

* state: parameter shards, Adam's two moments (same dtype and sharding), the gradient, and
  a gradient accumulator when ``k > 1``;
* activations saved for the backward, per token and layer, by remat policy: ``full`` /
  ``nothing_saveable`` keep the block input (``D``) plus one block's working set; ``dots``
  keeps every matmul output (q, k, v, attention scores and output, the MLP's two
  up-projections, both output projections); ``dots_no_batch`` the same without the
  attention scores; ``none`` the ``dots`` set plus the norms, residuals and softmax
  probabilities; plus the fp32 logits and their gradient;
* FLOPs: ``2 P_matmul`` per token forward plus attention ``4 s H d_head`` per token per
  layer; backward twice that; full remat reruns the forward inside the backward;
* collectives: a parameter sharded over a batch axis (FSDP) is all-gathered in the forward
  and again in the backward and its gradient reduce-scattered once per micro-batch; one
  replicated over a batch axis has its gradient all-reduced once per step; axes that shard
  weights but not the batch (tensor parallelism) all-reduce ``[T, D]`` activations twice
  per layer forward and twice backward per micro-batch (Megatron); a sharded sequence
  all-gathers keys and values per layer (and reduce-scatters their gradients).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from recipes import roofline
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
  """

  memory: dict[str, float]
  flops: dict[str, float]
  model_flops: float
  hbm_bytes: dict[str, float]
  comm_bytes: dict[str, float]
  comm_phase: dict[str, dict[str, float]]
  comm_s: dict[str, dict[str, float]]


def mesh_axes_of(rules) -> tuple[str, ...]:
  """The mesh axis names a rules table uses, ``data`` first (the axis that spans hosts),
  then in the order the rules first name them.

  >>> import partition
  >>> mesh_axes_of(partition.AxisRules([('mlp', 'tensor'), ('batch', ('data', 'fsdp'))]))
  ('data', 'tensor', 'fsdp')
  """
  names: list[str] = []

  def visit(value):
    if isinstance(value, str):
      if value not in names:
        names.append(value)
    elif isinstance(value, (list, tuple)):
      for v in value:
        visit(v)

  for _, value in rules.to_dict()["rules"]:
    visit(value)
  return tuple(sorted(names, key=lambda n: (n != "data", names.index(n))))


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
             hosts: int = 1) -> Estimate:
  """The analytic :class:`Estimate` of one plan (see the module docstring)."""
  from jax.sharding import AbstractMesh
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

  local = gathered = matmul_params = 0.0
  tensor_axes: set[str] = set()
  for p in params:
    nbytes = math.prod(p.shape) * p.itemsize
    dims = _spec_axes(rules.spec(p.axes, p.shape, amesh)) if _named(p) else []
    shard = {ax for d in dims for ax in d if mesh[ax] > 1}
    fsdp = [ax for ax in mesh if ax in shard and ax in batch_axes]
    replicated = [ax for ax in mesh if ax in batch_axes and ax not in shard]
    local += nbytes / size(shard)
    full = nbytes / size(shard - set(fsdp))      # this device's slice once gathered
    gathered += full
    if len(p.shape) >= 2:
      matmul_params += math.prod(p.shape)
      tensor_axes |= shard - batch_axes
    add("forward", fsdp, "all-gather", full)
    add("backward", fsdp, "all-gather", full)
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

  per_token = _activations_per_token(remat, d, heads, kv, hd, mlp, seq_len)
  acts = tokens * (L * per_token[0] + per_token[1]) * a + tokens * vocab * 4 * 3
  grads = local * (2 if k > 1 else 1)
  memory = {"params": local, "optimizer": ADAM_MOMENTS * local, "gradients": grads,
            "activations": acts, "batch": 3 * 4 * batch * seq_len / size(rows) / size(seq)}
  memory["total"] = sum(memory.values())

  total_tokens = batch * seq_len
  n = size(mesh)
  attention = 4 * seq_len * c.num_heads * hd * L
  forward = (2 * matmul_params + attention) * total_tokens
  recompute = forward if remat in ("full", "nothing_saveable") else 0.0
  flops = {"forward": forward / n, "backward": (2 * forward + recompute) / n}
  act_traffic = acts - tokens * vocab * 4 * 3
  hbm = {"forward": k * gathered + act_traffic * k,
         "backward": k * gathered * (3 if recompute else 2) + act_traffic * k
                     + (3 + ADAM_MOMENTS * 2) * local}
  comm_bytes: dict[str, float] = {}
  for phase in roofline.PHASES:
    for key, v in comm_b[phase].items():
      comm_bytes[key] = comm_bytes.get(key, 0.0) + v
  return Estimate(memory, flops, 3 * forward, hbm, comm_bytes, comm_b, comm_t)


def _split(rules, amesh, name: str, dim: int, batch: int, seq_len: int) -> int:
  """How many shards the rules give the logical axis ``name`` of an activation
  ``[batch, length, name]`` (mesh axes the batch already takes are not available to it)."""
  spec = _spec_axes(rules.spec(BATCH_AXES + (name,), (batch, seq_len, dim), amesh))
  spec += [()] * (3 - len(spec))
  return math.prod(amesh.shape[ax] for ax in spec[2])


def _activations_per_token(remat: str, d: float, heads: float, kv: float, hd: float,
                           mlp: float, seq_len: int) -> tuple[float, float]:
  """(elements saved per token per layer, elements live once for the recomputed block)."""
  scores = heads * seq_len
  no_batch = heads * hd + 2 * kv * hd + heads * hd + d + 2 * mlp + d
  dots = no_batch + scores
  none = dots + 4 * d + mlp + scores
  if remat in ("full", "nothing_saveable"):
    return d, none
  return {"dots": (dots, 0.0), "dots_no_batch": (no_batch, scores)}.get(remat, (none, 0.0))


def _itemsize(dtype) -> int:
  import jax.numpy as jnp
  import numpy as np
  return int(np.dtype(jnp.dtype(dtype)).itemsize)
