"""Attention implementations and the one place that picks between them.

Every implementation computes the same function, grouped-query softmax attention::

  out[b, i, h] = sum_j softmax_j(q[b, i, h] . k[b, j, h // g] / sqrt(d) | visible(b, i, j))
                 * v[b, j, h // g]

with ``g = heads // kv_heads``, and they differ only in how they get there:

=============  ==============================================================================
``xla``        einsum + softmax, the numerical reference; builds the ``(L, S)`` logits and a
               dense mask (memory ``O(L S)`` per head).
``blockwise``  pure JAX, every backend: an online softmax over ``block``-wide K/V chunks
               (``lax.scan``) with a flash-style custom VJP that saves only the output and
               the log-sum-exp and recomputes each block in the backward pass (memory
               ``O(L x block)`` per head). GQA without repeating K/V. Under a causal mask
               the queries are blocked too and the fully masked (query block, key block)
               pairs are never computed (about half the FLOPs).
``cudnn``      ``jax.nn.dot_product_attention(implementation='cudnn')`` (NVIDIA GPUs):
               ``is_causal`` and padding as sequence lengths; no segment ids.
``pallas``     the Pallas TPU splash-attention kernel (causal mask as a block-sparse
               structure, padding and packing as segment ids).
=============  ==============================================================================

Masks are a structure, :class:`Mask` (causal flag, padding as a ``valid`` array or as
``lengths``, packing as ``segment_ids``), never a ``(batch, heads, L, L)`` array: each
implementation turns it into what it takes. A query with no visible key (a padded query)
outputs zeros in every implementation.

:func:`choose` decides from static facts (backend, dtype, head_dim, mask kind, length,
whether the sequence is sharded) and says why; an explicit choice whose constraints do not
hold raises :class:`AttentionError` naming the constraint (never a silent fallback).

>>> import jax, jax.numpy as jnp
>>> q = jax.random.normal(jax.random.key(0), (1, 6, 4, 8))
>>> k = v = jax.random.normal(jax.random.key(1), (1, 6, 2, 8))
>>> ref = dot_product_attention(q, k, v, Mask(), implementation='xla')
>>> out = dot_product_attention(q, k, v, Mask(), implementation='blockwise', block=4)
>>> bool(jnp.allclose(out, ref, atol=1e-6))
True
>>> choose('auto', backend='cpu', dtype=jnp.float32, head_dim=8, q_length=6,
...        mask=Mask()).implementation
'xla'
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import partition
from partition.internal import did_you_mean, entry_mesh_axes, format_message, to_spec_entry

Array = jax.Array

IMPLEMENTATIONS = ("auto", "xla", "cudnn", "pallas", "blockwise")
# 'auto' runs the blockwise path (no fused kernel available) from this query length on: below
# it the (L, L) logits are small and XLA's einsum path is faster.
BLOCKWISE_MIN_LENGTH = 2048
# Matches the Pallas TPU kernels' mask value: finite, so a row whose every key is masked in one
# block never produces inf - inf.
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
_QUERY = ("batch", "length", "heads", "head_dim")
_KEY_VALUE = ("batch", "length", "kv_heads", "head_dim")


class AttentionError(partition.PartitionError, ValueError):
  """An attention implementation was asked for where its constraints do not hold."""


# -- the mask description --------------------------------------------------------------------


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["valid", "lengths", "segment_ids"], meta_fields=["causal"])
@dataclasses.dataclass(frozen=True)
class Mask:
  """Which keys each query sees, as structure (no ``(L, L)`` array).

  Query ``i`` of example ``b`` sees key ``j`` iff all of: ``j <= i`` (when ``causal``);
  both are real tokens (``valid[b, i] and valid[b, j]``, or ``i, j < lengths[b]``); and both
  are in the same packed sequence (``segment_ids[b, i] == segment_ids[b, j]``).

  Attributes:
    causal: decoder (causal) masking.
    valid: ``(batch, length)`` bool, True for real tokens (padding anywhere), or None.
    lengths: ``(batch,)`` ints: the first ``lengths[b]`` tokens are real (right padding,
      what cuDNN takes), or None. At most one of ``valid`` / ``lengths``.
    segment_ids: ``(batch, length)`` ints, equal for tokens of one packed sequence, or None.

  A ``Mask`` is a pytree (its arrays are leaves, ``causal`` is static), so it passes through
  ``jax.jit``, ``lax.scan`` and pipeline stages like any argument.

  >>> m = Mask(lengths=jnp.array([2]))
  >>> m.kind
  'causal+lengths'
  >>> m.dense(3)[0, 0].astype(int).tolist()
  [[1, 0, 0], [1, 1, 0], [0, 0, 0]]
  """

  causal: bool = True
  valid: Array | None = None
  lengths: Array | None = None
  segment_ids: Array | None = None

  def __post_init__(self):
    if self.valid is not None and self.lengths is not None:
      raise AttentionError("layers.Mask: give padding as valid (batch, length) bool or as "
                           "lengths (batch,) ints, not both.")

  @property
  def kind(self) -> str:
    """``'causal'``, ``'causal+valid'``, ``'full+segments'``, ...: what the mask holds."""
    parts = ["causal" if self.causal else "full"]
    parts += [name for name, a in (("valid", self.valid), ("lengths", self.lengths),
                                   ("segments", self.segment_ids)) if a is not None]
    return "+".join(parts)

  def dense(self, q_length: int, kv_length: int | None = None, q_offset: int = 0) -> Array:
    """The ``(batch or 1, 1, q_length, kv_length)`` bool mask (the ``xla`` path's input)."""
    kv_length = q_length if kv_length is None else kv_length
    return _block_visible(_parts(self), self.causal, q_offset, q_length, 0, kv_length,
                          kv_length)[:, 0]


def array_problems(name: str, a: Any, shape: tuple[int, ...], integer_only: bool = False
                   ) -> list[str]:
  """What is wrong with the mask array ``a`` called ``name``: not ``shape``, or not of an
  integer (or, unless ``integer_only``, bool) dtype. Empty when it fits."""
  problems = []
  if tuple(np.shape(a)) != tuple(shape):
    problems.append(f"{name} has shape {tuple(np.shape(a))}; expected {tuple(shape)}")
  dtype = jnp.asarray(a).dtype
  if not (jnp.issubdtype(dtype, jnp.integer) or (dtype == jnp.dtype(bool) and not integer_only)):
    problems.append(f"{name} has dtype {dtype.name}; expected "
                    f"{'integer' if integer_only else 'bool or integer'}")
  return problems


def _input_problems(q: Any, k: Any, v: Any, mask: Mask | Array | None) -> list[str]:
  """What keeps ``q, k, v`` and ``mask`` from being one attention problem."""
  shapes = [tuple(np.shape(a)) for a in (q, k, v)]
  bad = [f"{n} has shape {s}; expected (batch, {'q' if n == 'q' else 'kv'}_length, "
         f"{'heads' if n == 'q' else 'kv_heads'}, head_dim)"
         for n, s in zip("qkv", shapes) if len(s) != 4]
  if bad:
    return bad
  (b, length, heads, d), kshape, vshape = shapes
  problems = []
  if kshape != vshape:
    problems.append(f"k has shape {kshape} and v {vshape}; they must be equal")
  if kshape[0] != b:
    problems.append(f"batch {b} of q and {kshape[0]} of k differ")
  if kshape[3] != d:
    problems.append(f"head_dim {d} of q and {kshape[3]} of k differ")
  if heads % kshape[2]:
    problems.append(f"heads={heads} is not a multiple of kv_heads={kshape[2]} (grouped-query "
                    "attention shares each kv head among heads // kv_heads query heads)")
  kv_length = kshape[1]
  if isinstance(mask, Mask):
    for name in ("valid", "segment_ids"):
      a = getattr(mask, name)
      if a is not None and length != kv_length:
        problems.append(f"mask.{name} is one {name} array for queries and keys, but they have "
                        f"lengths {length} and {kv_length}")
      elif a is not None:
        problems += array_problems(f"mask.{name}", a, (b, length),
                                   integer_only=name == "segment_ids")
    if mask.lengths is not None:
      problems += array_problems("mask.lengths", mask.lengths, (b,), integer_only=True)
  elif mask is not None:
    try:
      np.broadcast_shapes(np.shape(mask), (b, heads, length, kv_length))
    except ValueError:
      problems.append(f"the dense mask has shape {tuple(np.shape(mask))}; it must broadcast to "
                      f"(batch, heads, q_length, kv_length) = {(b, heads, length, kv_length)}")
  return problems


def _check_inputs(q: Any, k: Any, v: Any, mask: Mask | Array | None, block: Any,
                  where: str) -> None:
  problems = _input_problems(q, k, v, mask)
  if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block < 1:
    problems.append(f"block={block!r} must be a positive int (the K/V block width, e.g. 512)")
  if problems:
    raise AttentionError(format_message(
        f"{where}: the inputs do not fit together.", bullets=problems,
        fix="Pass q (batch, q_length, heads, head_dim), k and v (batch, kv_length, kv_heads, "
            "head_dim) with heads a multiple of kv_heads, and a Mask whose arrays are "
            "(batch, length) (valid, segment_ids) or (batch,) (lengths)."))


def _parts(mask: Mask) -> dict[str, Array]:
  """The mask's arrays split into their query side and key side (``q_valid``/``kv_valid``,
  ``q_seg``/``kv_seg``, ``lengths``): under sequence parallelism the two sides are sharded
  differently (the queries' with the queries, the keys' gathered)."""
  out = {}
  if mask.valid is not None:
    out["q_valid"] = out["kv_valid"] = jnp.asarray(mask.valid, bool)
  if mask.lengths is not None:
    out["lengths"] = jnp.asarray(mask.lengths, jnp.int32)
  if mask.segment_ids is not None:
    out["q_seg"] = out["kv_seg"] = jnp.asarray(mask.segment_ids, jnp.int32)
  return out


def _block_visible(parts: dict[str, Array], causal: bool, q_offset: Any, q_length: int,
                   k_start: Any, k_size: int, kv_length: int) -> Array:
  """``(batch or 1, 1, 1, q_length, k_size)`` bool: which keys ``k_start .. k_start +
  k_size`` each query sees (query ``i`` is position ``q_offset + i``). Keys at or beyond
  ``kv_length`` (block padding) are never visible. ``parts['kv_*']`` hold this block's keys."""
  qi = q_offset + jnp.arange(q_length)[:, None]
  kj = k_start + jnp.arange(k_size)[None, :]
  vis = jnp.ones((1, q_length, k_size), bool)
  if causal:
    vis = vis & (qi >= kj)[None]
  if kv_length % k_size:  # the last block is padded with keys that do not exist
    vis = vis & (kj < kv_length)[None]
  if "lengths" in parts:
    n = parts["lengths"][:, None, None]
    vis = vis & (qi[None] < n) & (kj[None] < n)
  if "q_valid" in parts:
    vis = vis & parts["q_valid"][:, :, None] & parts["kv_valid"][:, None, :]
  if "q_seg" in parts:
    vis = vis & (parts["q_seg"][:, :, None] == parts["kv_seg"][:, None, :])
  return vis[:, None, None]


# -- choosing an implementation --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Choice:
  """The implementation that runs and why (what ``recipes.explain`` prints)."""

  implementation: str
  reason: str

  def __str__(self) -> str:
    return f"{self.implementation} ({self.reason})"


def _cudnn_problems(backend: str, dtype: Any, head_dim: int, mask: Mask,
                    sequence_sharded: bool) -> list[str]:
  problems = []
  if backend != "gpu":
    problems.append(f"cuDNN needs an NVIDIA GPU; the backend is {backend!r}")
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    problems.append(f"cuDNN takes bfloat16/float16 only; the dtype is {jnp.dtype(dtype).name} "
                    "(set model.dtype=bfloat16)")
  if head_dim % 8 or head_dim > 256:
    problems.append(f"cuDNN needs head_dim a multiple of 8 and <= 256; head_dim={head_dim}")
  if mask.segment_ids is not None:
    problems.append("cuDNN's public API has no segment ids (packed sequences)")
  if mask.valid is not None:
    problems.append("cuDNN takes padding only as sequence lengths (right padding); the mask "
                    "has a valid array (pass lengths instead)")
  if sequence_sharded:
    problems.append("cuDNN cannot offset its causal mask for a sequence-sharded query block "
                    "(sequence parallelism)")
  return problems


def _pallas_problems(backend: str, head_dim: int, q_length: int, kv_length: int,
                     block: int, sequence_sharded: bool) -> list[str]:
  problems = []
  if backend != "tpu":
    problems.append(f"the Pallas splash-attention kernel needs a TPU; the backend is "
                    f"{backend!r}")
  if head_dim % 128:
    problems.append(f"the Pallas TPU kernel needs head_dim a multiple of 128 (the TPU lane "
                    f"width); head_dim={head_dim}")
  b = _pallas_block(q_length, block)
  if q_length % 128 or kv_length % 128 or q_length % b or kv_length % _pallas_block(
      kv_length, block):
    problems.append(f"the Pallas TPU kernel needs the sequence length a multiple of 128 and "
                    f"of its block size ({b}); length={q_length}")
  if sequence_sharded:
    problems.append("the Pallas kernel is not wired for a sequence-sharded query block "
                    "(sequence parallelism)")
  return problems


def _pallas_block(length: int, block: int) -> int:
  return max(128, min(block, length) // 128 * 128)


def choose(requested: str, *, backend: str, dtype: Any, head_dim: int, q_length: int,
           mask: Mask | None, kv_length: int | None = None, block: int = 512,
           sequence_sharded: bool = False, dense_mask: bool = False) -> Choice:
  """The implementation that runs for ``requested``, from static facts only.

  ``'auto'``: the fused kernel of the backend when its constraints hold (cuDNN on GPUs,
  Pallas splash attention on TPUs), else ``'blockwise'`` from ``BLOCKWISE_MIN_LENGTH``
  tokens on, else ``'xla'``. An explicit request is honoured or refused.

  Args:
    requested: one of ``IMPLEMENTATIONS``.
    backend: ``'cpu'``, ``'gpu'``, ``'tpu'`` (``jax.default_backend()`` or the mesh's).
    dtype, head_dim, q_length, kv_length: of the queries and keys.
    mask: the :class:`Mask` (None: no masking at all).
    block: the K/V block of the blockwise path and the Pallas kernel.
    sequence_sharded: the rules shard the query length over a mesh axis.
    dense_mask: the caller passed a dense mask array (only ``'xla'`` takes one).

  Raises:
    AttentionError: ``requested`` is unknown, or its constraints do not hold (each one
      listed).

  >>> print(choose('auto', backend='gpu', dtype='bfloat16', head_dim=128, q_length=2048,
  ...              mask=Mask()))
  cudnn (auto: the fused cuDNN kernel (gpu, bfloat16, head_dim 128, causal))
  >>> choose('auto', backend='cpu', dtype='float32', head_dim=64, q_length=8192,
  ...        mask=Mask()).implementation
  'blockwise'
  """
  kv_length = q_length if kv_length is None else kv_length
  mask = Mask(causal=False) if mask is None else mask
  if requested not in IMPLEMENTATIONS:
    hint = did_you_mean(str(requested), IMPLEMENTATIONS)
    raise AttentionError(f"attention={requested!r} is not an implementation; use one of "
                         f"{list(IMPLEMENTATIONS)}{hint}.")
  if dense_mask:
    if requested not in ("auto", "xla"):
      raise AttentionError(f"attention={requested!r} cannot take a dense mask array (only "
                           "'xla' does): pass the mask as a layers Mask (causal, valid / "
                           "lengths, segment_ids), or use attention='xla'.")
    return Choice("xla", "a dense mask array was given (only 'xla' takes one)")
  cudnn = _cudnn_problems(backend, dtype, head_dim, mask, sequence_sharded)
  pallas = _pallas_problems(backend, head_dim, q_length, kv_length, block, sequence_sharded)
  facts = f"{backend}, {jnp.dtype(dtype).name}, head_dim {head_dim}, {mask.kind}"
  if requested in ("cudnn", "pallas"):
    problems = cudnn if requested == "cudnn" else pallas
    if problems:
      raise AttentionError(format_message(
          f"attention={requested!r} cannot run here: {len(problems)} constraint(s) do not hold.",
          bullets=problems,
          fix="Use attention='auto' (picks what the backend and mask allow), 'blockwise' "
              "(every backend, any mask) or 'xla'."))
    return Choice(requested, f"requested; constraints hold ({facts})")
  if requested in ("xla", "blockwise"):
    return Choice(requested, "requested")
  if backend == "gpu" and not cudnn:
    return Choice("cudnn", f"auto: the fused cuDNN kernel ({facts})")
  if backend == "tpu" and not pallas:
    return Choice("pallas", f"auto: the Pallas splash-attention kernel ({facts})")
  fused = cudnn if backend == "gpu" else pallas if backend == "tpu" else []
  why = f"; no fused kernel: {fused[0]}" if fused else f"; no fused kernel on {backend}"
  if q_length >= BLOCKWISE_MIN_LENGTH:
    return Choice("blockwise", f"auto: length {q_length} >= {BLOCKWISE_MIN_LENGTH}{why}")
  return Choice("xla", f"auto: length {q_length} < {BLOCKWISE_MIN_LENGTH}{why}")


def choice_for(config: Any, *, batch: int, length: int, rules: Any = None, mesh: Any = None,
               mask: Mask | None = None, backend: str | None = None) -> Choice:
  """What a ``TransformerConfig``'s attention runs for ``(batch, length)`` tokens under
  ``rules`` and ``mesh`` (default: a causal mask), as the model will decide it when traced.

  ``backend`` (``'cpu'``, ``'gpu'``, ``'tpu'``): the platform to decide for, e.g. the chip
  a plan is for (default: the mesh's devices', else this process's).

  >>> import layers
  >>> print(choice_for(layers.TransformerConfig(), batch=2, length=16))
  xla (auto: length 16 < 2048; no fused kernel on cpu)
  >>> cfg = layers.TransformerConfig(dtype='bfloat16', head_dim=128)
  >>> choice_for(cfg, batch=2, length=16, backend='gpu').implementation
  'cudnn'

  Raises:
    AttentionError: an explicit ``config.attention`` that cannot run there.
  """
  shape = (batch, length, config.num_heads, config.head_dim)
  seq = _query_axes(shape, rules, mesh)[1]
  return choose(config.attention, backend=backend or backend_of(mesh), dtype=config.dtype,
                head_dim=config.head_dim, q_length=length,
                mask=Mask() if mask is None else mask, block=config.attention_block,
                sequence_sharded=bool(seq))


def backend_of(mesh: Any = None) -> str:
  """The platform attention runs on: the mesh's devices', else ``jax.default_backend()``."""
  if isinstance(mesh, jax.sharding.Mesh) and mesh.devices.size:  # an AbstractMesh has none
    return mesh.devices.flat[0].platform
  return jax.default_backend()


# -- the dispatch ----------------------------------------------------------------------------


def dot_product_attention(q: Array, k: Array, v: Array, mask: Mask | Array | None = None, *,
                          implementation: str = "auto", block: int = 512) -> Array:
  """Grouped-query softmax attention by the implementation :func:`choose` picks.

  Args:
    q: ``(batch, q_length, heads, head_dim)``.
    k, v: ``(batch, kv_length, kv_heads, head_dim)``; ``heads`` a multiple of ``kv_heads``
      (query head ``h`` uses kv head ``h // (heads // kv_heads)``).
    mask: a :class:`Mask`; or a bool array broadcastable to ``(batch, heads, q_length,
      kv_length)`` (True = attend; ``'xla'`` only); or None (every key visible).
    implementation: one of ``IMPLEMENTATIONS``.
    block: the K/V block width of ``'blockwise'`` (and the Pallas kernel's block).

  Returns:
    ``(batch, q_length, heads, head_dim)`` in ``q``'s dtype.

  Raises:
    AttentionError: an explicit ``implementation`` whose constraints do not hold here, or
      inputs that do not fit together (each problem named).
  """
  _check_inputs(q, k, v, mask, block, "dot_product_attention")
  dense_mask = mask is not None and not isinstance(mask, Mask)
  rules, mesh = partition.current_rules(), partition.current_rules_mesh()
  seq_axes = _query_axes(q.shape, rules, mesh)[1]
  choice = choose(implementation, backend=backend_of(mesh), dtype=q.dtype, head_dim=q.shape[-1],
                  q_length=q.shape[1], kv_length=k.shape[1],
                  mask=None if dense_mask else mask, block=block,
                  sequence_sharded=bool(seq_axes), dense_mask=dense_mask)
  if dense_mask:
    return xla_attention(q, k, v, mask)
  mask = Mask(causal=False) if mask is None else mask
  kernel = {"xla": _xla_kernel, "blockwise": functools.partial(_blockwise_kernel, block=block),
            "cudnn": _cudnn_kernel,
            "pallas": functools.partial(_pallas_kernel, block=block)}[choice.implementation]
  if choice.implementation in ("cudnn", "pallas"):  # custom calls: XLA cannot partition them
    return shard_mapped(kernel, q, k, v, mask)
  if choice.implementation == "blockwise" and seq_axes:
    # Sequence parallelism: each device runs its own query block against all keys and values
    # at its offset. Left to XLA, the causal schedule's slices of the sharded query dim
    # inside the scan run replicated (every device computes every query).
    return shard_mapped(kernel, q, k, v, mask)
  return kernel(q, k, v, _parts(mask), causal=mask.causal, q_offset=0)


def _query_axes(shape: tuple[int, ...], rules: Any, mesh: Any) -> tuple[tuple[str, ...], ...]:
  """The mesh axes of the queries' ``(batch, length, heads)`` dims (empty without rules)."""
  if rules is None or mesh is None:
    return (), (), ()
  spec = rules.spec(_QUERY, shape, mesh)
  entries = (*spec, None, None, None)[:3]
  return tuple(entry_mesh_axes(e) for e in entries)


# -- xla: the reference ----------------------------------------------------------------------


def xla_attention(q: Array, k: Array, v: Array, mask: Array | None = None) -> Array:
  """Einsum + fp32 softmax attention with a dense bool ``mask`` (the numerical reference).

  The logits are accumulated and kept in fp32 (as the blockwise path and cuDNN keep them):
  bf16 logits lost the softmax's precision once they grow (relative error 0.13 at logit
  std 100, 0.30 under a constant shift of 1e4 that the softmax should not see). Queries with
  no visible key output zeros (not a uniform average of the values).
  """
  groups = q.shape[2] // k.shape[2]
  b, length, heads, d = q.shape
  qg = _grouped_q(q, k.shape[2])
  logits = jnp.einsum("blkgd,bskd->bkgls", qg, k, preferred_element_type=jnp.float32)
  if mask is not None:
    mask = jnp.broadcast_to(mask, (b, heads, *logits.shape[-2:]))
    mask = mask.reshape(b, heads // groups, groups, *logits.shape[-2:])
    logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
  weights = jax.nn.softmax(logits, axis=-1)
  if mask is not None:
    weights = jnp.where(mask, weights, 0.0)  # fully masked rows: zeros, as every kernel
  out = jnp.einsum("bkgls,bskd->blkgd", weights.astype(v.dtype), v)
  return out.reshape(b, length, heads, d)


def _xla_kernel(q, k, v, parts, *, causal, q_offset):
  mask = _block_visible(parts, causal, q_offset, q.shape[1], 0, k.shape[1], k.shape[1])
  return xla_attention(q, k, v, mask[:, 0])


# -- blockwise: online softmax over K/V blocks, flash-style VJP ------------------------------


def blockwise_attention(q: Array, k: Array, v: Array, mask: Mask | None = None, *,
                        block: int = 512, q_offset: Any = 0, unroll: int | bool = 1) -> Array:
  """Memory-efficient attention in pure JAX (no sharding logic; see the module docstring).

  ``q_offset`` is the position of query 0 among the keys (a sequence-sharded query block).
  Under a causal mask with a static (Python int) ``q_offset``, the queries are cut into
  ``block``-long blocks too and only the (query block, key block) pairs at or below the
  diagonal run: with ``n`` blocks, ``n (n + 1) / 2`` of the ``n^2`` pairs, about half the
  FLOPs. ``unroll`` is ``lax.scan``'s (True: no loop, how the tests read XLA's FLOP count).
  """
  _check_inputs(q, k, v, mask, block, "blockwise_attention")
  mask = Mask(causal=False) if mask is None else mask
  return _blockwise_kernel(q, k, v, _parts(mask), causal=mask.causal, q_offset=q_offset,
                           block=block, unroll=unroll)


def _blockwise_kernel(q, k, v, parts, *, causal, q_offset, block, unroll=1):
  schedule = _Schedule.of(q.shape[1], k.shape[1], block, causal, q_offset)
  return _blockwise(q, k, v, parts, jnp.asarray(q_offset, jnp.int32), causal, schedule,
                    unroll)


@dataclasses.dataclass(frozen=True)
class _Schedule:
  """Which (query block, key block) pairs the blockwise loops visit, in order (static).

  Without a causal mask, or where the query offset is traced (a sequence-sharded device's),
  the queries are one block and every key block is visited: ``n`` steps. Under a causal mask
  with a static offset, query block ``i`` visits only the key blocks whose first key some of
  its queries can see (``j * kv_block <= q_offset + last query of block i``): the pairs above
  the diagonal are fully masked and never computed.
  """

  q_block: int
  kv_block: int
  q_blocks: int
  kv_blocks: int
  pairs: tuple[tuple[int, int], ...]

  @staticmethod
  def of(q_length: int, kv_length: int, block: int, causal: bool, q_offset: Any) -> _Schedule:
    kv_block = min(block, kv_length)
    kv_blocks = -(-kv_length // kv_block)
    if not causal or not isinstance(q_offset, (int, np.integer)):
      return _Schedule(q_length, kv_block, 1, kv_blocks,
                       tuple((0, j) for j in range(kv_blocks)))
    q_block = min(block, q_length)
    q_blocks = -(-q_length // q_block)
    last = lambda i: int(q_offset) + min((i + 1) * q_block, q_length) - 1
    pairs = tuple((i, j) for i in range(q_blocks) for j in range(kv_blocks)
                  if j * kv_block <= last(i))
    return _Schedule(q_block, kv_block, q_blocks, kv_blocks, pairs)

  def q_blocked(self, a: Array, fill: Any = 0) -> Array:
    """``a`` (query length on dim 1) padded to whole query blocks."""
    pad = self.q_blocks * self.q_block - a.shape[1]
    return jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2), constant_values=fill)

  def q_slice(self, a: Array, i: Array, axis: int) -> Array:
    return jax.lax.dynamic_slice_in_dim(a, i * self.q_block, self.q_block, axis)

  def q_update(self, a: Array, update: Array, i: Array, axis: int) -> Array:
    return jax.lax.dynamic_update_slice_in_dim(a, update, i * self.q_block, axis)


def _kv_blocks(k, v, parts, size):
  """K, V and the key-side mask arrays as ``n`` blocks on a leading dim (keys padded up)."""
  length = k.shape[1]
  n = -(-length // size)
  pad = n * size - length

  def blocks(a, fill=0):
    a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2), constant_values=fill)
    return jnp.moveaxis(a.reshape(a.shape[0], n, size, *a.shape[2:]), 1, 0)

  kv_parts = {name: blocks(a) for name, a in parts.items() if name.startswith("kv_")}
  return n, blocks(k), blocks(v), kv_parts


def _q_parts(parts, schedule):
  """The query-side mask arrays padded to whole query blocks (padded queries see nothing)."""
  return {name: schedule.q_blocked(a, fill=False if a.dtype == bool else 0)
          for name, a in parts.items() if name.startswith("q_")}


def _pair_inputs(schedule, kb, vb, kv_parts, qparts, pair):
  """Key block ``j``'s K, V and mask arrays, and query block ``i``'s mask arrays."""
  i, j = pair[0], pair[1]
  take = lambda a: jax.lax.dynamic_index_in_dim(a, j, keepdims=False)
  block_parts = {name: schedule.q_slice(a, i, 1) for name, a in qparts.items()}
  block_parts.update({name: take(a) for name, a in kv_parts.items()})
  return i, j, take(kb), take(vb), block_parts


def _grouped_q(q, kv_heads):
  b, length, heads, d = q.shape
  return (q / jnp.sqrt(d).astype(q.dtype)).reshape(b, length, kv_heads, heads // kv_heads, d)


def _scores(qg, kj, block_parts, causal, q_start, k_start, size, length):
  """``(b, kv_heads, groups, q_block, size)`` fp32 logits of one (query block, K/V block)
  pair and its visibility (``block_parts``: this pair's mask arrays, ``lengths`` whole)."""
  s = jnp.einsum("blkgd,bskd->bkgls", qg, kj, preferred_element_type=jnp.float32)
  visible = _block_visible(block_parts, causal, q_start, qg.shape[1], k_start, size, length)
  return s, visible


def _blockwise_fwd_impl(q, k, v, parts, q_offset, causal, schedule, unroll):
  b, length, heads, d = q.shape
  kv_heads, size = k.shape[2], schedule.kv_block
  qg = schedule.q_blocked(_grouped_q(q, kv_heads))
  qparts = _q_parts(parts, schedule)
  lengths = {"lengths": parts["lengths"]} if "lengths" in parts else {}
  _, kb, vb, kv_parts = _kv_blocks(k, v, parts, size)
  stats = (b, kv_heads, heads // kv_heads, qg.shape[1])

  def step(carry, pair):
    i, j, kj, vj, block_parts = _pair_inputs(schedule, kb, vb, kv_parts, qparts, pair)
    m, total, acc = (schedule.q_slice(c, i, 3) for c in carry)
    s, visible = _scores(schedule.q_slice(qg, i, 1), kj, {**block_parts, **lengths}, causal,
                         q_offset + i * schedule.q_block, j * size, size, k.shape[1])
    m_new = jnp.maximum(m, jnp.max(jnp.where(visible, s, _MASK_VALUE), axis=-1))
    # The mask inside the exponent: exp of a masked score is exp(-inf) = 0 with a zero
    # derivative, where where(visible, exp(s - m), 0) would take exp(inf) in the dropped
    # branch while a row has seen no key (m still _MASK_VALUE) and differentiating it
    # again gives 0 * inf = NaN.
    p = jnp.exp(jnp.where(visible, s - m_new[..., None], -jnp.inf))
    alpha = jnp.exp(m - m_new)
    total = alpha * total + jnp.sum(p, axis=-1)
    pv = jnp.einsum("bkgls,bskd->bkgld", p.astype(v.dtype), vj,
                    preferred_element_type=jnp.float32)
    new = (m_new, total, alpha[..., None] * acc + pv)
    return tuple(schedule.q_update(c, u, i, 3) for c, u in zip(carry, new)), None

  init = _varying_like((jnp.full(stats, _MASK_VALUE, jnp.float32),
                        jnp.zeros(stats, jnp.float32), jnp.zeros((*stats, d), jnp.float32)),
                       q, k, v, parts, q_offset)
  pairs = jnp.asarray(schedule.pairs, jnp.int32)
  (m, total, acc), _ = jax.lax.scan(step, init, pairs, unroll=unroll)
  seen = total > 0  # a query with no visible key (padding) outputs zeros
  total = jnp.where(seen, total, 1.0)
  out = jnp.where(seen[..., None], acc / total[..., None], 0.0)
  lse = jnp.where(seen, m + jnp.log(total), 0.0)  # per padded query block (a residual)
  out = jnp.moveaxis(out[..., :length, :], 3, 1).reshape(b, length, heads, d)
  return out, lse   # out in fp32: the caller casts it


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _blockwise(q, k, v, parts, q_offset, causal, schedule, unroll):
  out, _ = _blockwise_fwd_impl(q, k, v, parts, q_offset, causal, schedule, unroll)
  return out.astype(q.dtype)


def _blockwise_fwd(q, k, v, parts, q_offset, causal, schedule, unroll):
  out, lse = _blockwise_fwd_impl(q, k, v, parts, q_offset, causal, schedule, unroll)
  # The residual is the fp32 output: the backward's D = dout . out from a bf16-rounded out
  # biased every ds = p (dp - D), and dq, dk came out 10-20 % further from the truth than
  # XLA's autodiff of the fp32 softmax (2 more bytes per output element kept).
  return out.astype(q.dtype), (q, k, v, parts, q_offset, out, lse)


def _blockwise_bwd(causal, schedule, unroll, residuals, dout):
  q, k, v, parts, q_offset, out, lse = residuals
  b, length, heads, d = q.shape
  kv_heads, groups, size = k.shape[2], heads // k.shape[2], schedule.kv_block
  qg = schedule.q_blocked(_grouped_q(q, kv_heads))
  qparts = _q_parts(parts, schedule)
  lengths = {"lengths": parts["lengths"]} if "lengths" in parts else {}
  n, kb, vb, kv_parts = _kv_blocks(k, v, parts, size)
  # padded queries get a zero cotangent, so they add nothing to dk, dv (ds = p (dp - D) = 0)
  do = schedule.q_blocked(dout.reshape(b, length, kv_heads, groups, d))
  # D_i = sum_j p_ij dp_ij = do_i . out_i (the softmax Jacobian's diagonal term).
  delta = jnp.einsum("blkgd,blkgd->bkgl", do.astype(jnp.float32),
                     schedule.q_blocked(out.reshape(b, length, kv_heads, groups, d))
                     .astype(jnp.float32))

  def step(carry, pair):
    dq, dk, dv = carry
    i, j, kj, vj, block_parts = _pair_inputs(schedule, kb, vb, kv_parts, qparts, pair)
    qi, do_i = schedule.q_slice(qg, i, 1), schedule.q_slice(do, i, 1)
    s, visible = _scores(qi, kj, {**block_parts, **lengths}, causal,
                         q_offset + i * schedule.q_block, j * size, size, k.shape[1])
    p = jnp.exp(jnp.where(visible, s - schedule.q_slice(lse, i, 3)[..., None], -jnp.inf))
    dv_j = jnp.einsum("bkgls,blkgd->bskd", p.astype(do.dtype), do_i,
                      preferred_element_type=jnp.float32)
    dp = jnp.einsum("blkgd,bskd->bkgls", do_i, vj, preferred_element_type=jnp.float32)
    ds = p * (dp - schedule.q_slice(delta, i, 3)[..., None])
    dq_i = jnp.einsum("bkgls,bskd->blkgd", ds.astype(kj.dtype), kj,
                      preferred_element_type=jnp.float32)
    dk_j = jnp.einsum("bkgls,blkgd->bskd", ds.astype(qi.dtype), qi,
                      preferred_element_type=jnp.float32)
    add_at = lambda a, u: jax.lax.dynamic_update_index_in_dim(
        a, jax.lax.dynamic_index_in_dim(a, j, keepdims=False) + u, j, 0)
    dq = schedule.q_update(dq, schedule.q_slice(dq, i, 1) + dq_i, i, 1)
    return (dq, add_at(dk, dk_j), add_at(dv, dv_j)), None

  kv_zeros = jnp.zeros((n, b, size, kv_heads, d), jnp.float32)
  init = _varying_like((jnp.zeros(qg.shape, jnp.float32), kv_zeros, kv_zeros),
                       q, k, v, parts, q_offset, dout)
  pairs = jnp.asarray(schedule.pairs, jnp.int32)
  (dq, dk, dv), _ = jax.lax.scan(step, init, pairs, unroll=unroll)
  unblock = lambda a: jnp.moveaxis(a, 0, 1).reshape(b, n * size, kv_heads, d)[:, :k.shape[1]]
  # the forward's scale exactly (sqrt(d) rounded to q's dtype, as _grouped_q divides), so
  # this is the gradient of the function the forward computed, in bf16 too
  dq = dq[:, :length] / jnp.sqrt(d).astype(q.dtype).astype(jnp.float32)
  zeros = jax.tree.map(_zero_cotangent, (parts, q_offset))
  return (dq.reshape(q.shape).astype(q.dtype), unblock(dk).astype(k.dtype),
          unblock(dv).astype(v.dtype), *zeros)


def _varying_like(init, *refs):
  """``init`` made to depend on ``refs``, so that inside ``shard_map`` (a pipeline stage) it
  varies over the manual mesh axes they vary over, as a scan's initial carry must and as a
  nested ``check_vma=False`` shard_map's outputs do not (``where(False, ...)``: no arithmetic
  touches the values)."""
  anchor = sum(jnp.where(False, jnp.ravel(r)[0], 0).astype(jnp.float32)
               for r in jax.tree.leaves(refs) if jnp.size(r))
  return jax.tree.map(lambda x: x + anchor.astype(x.dtype), init)


def _zero_cotangent(a):
  return np.zeros(a.shape, jax.dtypes.float0)


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


# -- cuDNN -----------------------------------------------------------------------------------


def _cudnn_kernel(q, k, v, parts, *, causal, q_offset, implementation="cudnn"):
  """``jax.nn.dot_product_attention`` with the mask as ``is_causal`` + sequence lengths.

  ``implementation='xla'`` runs JAX's own XLA version of the same call: how the wrapper is
  tested where no GPU is (the same arguments, the same layout, another backend).
  """
  del q_offset  # 0: choose() refuses a sequence-sharded query block for cuDNN
  lengths = parts.get("lengths")
  out = jax.nn.dot_product_attention(q, k, v, is_causal=causal, query_seq_lengths=lengths,
                                     key_value_seq_lengths=lengths,
                                     implementation=implementation)
  if lengths is not None:  # padded queries: zeros, as every implementation
    out = jnp.where((jnp.arange(q.shape[1]) < lengths[:, None])[..., None, None], out, 0)
  return out.astype(q.dtype)


# -- Pallas TPU splash attention -------------------------------------------------------------


def _pallas_kernel(q, k, v, parts, *, causal, q_offset, block, interpret=False):
  """Splash attention (``jax.experimental.pallas.ops.tpu``), one MQA kernel per kv head.

  GQA: the ``g`` query heads of a kv head form one multi-query call (K/V never repeated),
  vmapped over kv heads and batch. Padding and packing become segment ids (a padded token
  gets its own id -1, so real tokens never see it; padded queries are zeroed afterwards).
  ``interpret=True`` runs the kernel in Pallas' interpreter (how it is tested off TPU).
  """
  del q_offset  # 0: choose() refuses a sequence-sharded query block for Pallas
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
  b, length, heads, d = q.shape
  kv_length, kv_heads = k.shape[1], k.shape[2]
  kernel = _splash(length, kv_length, heads // kv_heads, causal, _pallas_block(length, block),
                   _pallas_block(kv_length, block), interpret)
  qg = _grouped_q(q, kv_heads)                                    # (b, L, kvh, g, d)
  qg = jnp.transpose(qg, (0, 2, 3, 1, 4))                         # (b, kvh, g, L, d)
  kh, vh = (jnp.transpose(a, (0, 2, 1, 3)) for a in (k, v))       # (b, kvh, S, d)
  q_ids, kv_ids, q_real = _segment_ids(parts, b, length, kv_length)
  per_head = jax.vmap(lambda qh, kk, vv, qi, ki: kernel(qh, kk, vv,
                                                        segment_ids=sk.SegmentIds(qi, ki)),
                      in_axes=(0, 0, 0, None, None))
  out = jax.vmap(per_head)(qg, kh, vh, q_ids, kv_ids)             # (b, kvh, g, L, d)
  out = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, length, heads, d)
  if q_real is not None:
    out = jnp.where(q_real[..., None, None], out, 0)
  return out.astype(q.dtype)


def _segment_ids(parts, b, length, kv_length):
  """``(q_ids, kv_ids, q_real)``: segment ids with padding folded in (-1), per example."""
  q_ids = parts.get("q_seg", jnp.zeros((b, length), jnp.int32))
  kv_ids = parts.get("kv_seg", jnp.zeros((b, kv_length), jnp.int32))
  q_real = kv_real = None
  if "lengths" in parts:
    q_real = jnp.arange(length)[None] < parts["lengths"][:, None]
    kv_real = jnp.arange(kv_length)[None] < parts["lengths"][:, None]
  if "q_valid" in parts:
    q_real, kv_real = parts["q_valid"], parts["kv_valid"]
  if q_real is not None:
    q_ids, kv_ids = jnp.where(q_real, q_ids, -1), jnp.where(kv_real, kv_ids, -1)
  return q_ids, kv_ids, q_real


@functools.cache
def _splash(length, kv_length, groups, causal, block_q, block_kv, interpret):
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
  shape = (length, kv_length)
  one = sm.CausalMask(shape) if causal else sm.FullMask(shape)
  sizes = sk.BlockSizes(block_q=block_q, block_kv=block_kv, block_kv_compute=block_kv,
                        block_q_dkv=block_q, block_kv_dkv=block_kv,
                        block_kv_dkv_compute=block_kv, block_q_dq=block_q, block_kv_dq=block_kv)
  # Cached across traces, so its mask tables must be concrete arrays: built inside a jit they
  # would be that trace's tracers, leaked into the next jit with the same shapes.
  with jax.ensure_compile_time_eval():
    return sk.make_splash_mqa(sm.MultiHeadMask([one] * groups), block_sizes=sizes,
                              head_shards=1, q_seq_shards=1, interpret=interpret)


# -- sharding: kernels XLA cannot partition run inside shard_map -----------------------------


def shard_mapped(kernel, q: Array, k: Array, v: Array, mask: Mask) -> Array:
  """``kernel(q, k, v, parts, causal=, q_offset=)`` run per device inside ``jax.shard_map``.

  The mesh axes come from the ``partition.axis_rules`` context: the queries' ``batch`` and
  ``heads`` dims stay sharded as the rules say (each device runs the kernel on its examples
  and heads); a sharded query ``length`` (sequence parallelism) stays sharded while keys and
  values are gathered over it, each device passing its queries' offset to the kernel. Keys
  and values follow the queries' heads: sharded alike when the rules shard ``kv_heads`` as
  ``heads``, else gathered and each device slices its query heads' kv heads. Without rules
  and mesh: ``kernel`` on the whole arrays.
  """
  P = jax.sharding.PartitionSpec
  rules, mesh = partition.current_rules(), partition.current_rules_mesh()
  parts = _parts(mask)
  batch, seq, heads = _query_axes(q.shape, rules, mesh)
  if not (batch or seq or heads):
    return kernel(q, k, v, parts, causal=mask.causal, q_offset=0)
  kv_heads = entry_mesh_axes((*rules.spec(_KEY_VALUE, k.shape, mesh), None, None, None)[2])
  size = lambda axes: math.prod(dict(mesh.shape)[a] for a in axes)
  groups = q.shape[2] // k.shape[2]
  local_heads = q.shape[2] // size(heads)
  slice_kv = bool(heads) and kv_heads != heads
  if slice_kv and local_heads % groups and groups % local_heads:
    heads, slice_kv = (), False  # the local query heads would straddle kv groups: replicate
  kv_entry = None if slice_kv or not heads else to_spec_entry(heads)
  e = to_spec_entry
  q_spec = P(e(batch), e(seq), e(heads), None)
  kv_spec = P(e(batch), None, kv_entry, None)
  side = {"q_valid": P(e(batch), e(seq)), "q_seg": P(e(batch), e(seq)),
          "kv_valid": P(e(batch), None), "kv_seg": P(e(batch), None), "lengths": P(e(batch))}
  local_q = q.shape[1] // size(seq)
  kv_per_shard = max(local_heads // groups, 1)

  def local(q, k, v, parts):
    offset = _linear_index(seq, mesh) * local_q if seq else 0
    if slice_kv:
      start = _linear_index(heads, mesh) * local_heads // groups
      k, v = (jax.lax.dynamic_slice_in_dim(a, start, kv_per_shard, axis=2) for a in (k, v))
    return kernel(q, k, v, parts, causal=mask.causal, q_offset=offset)

  used = tuple(a for a in mesh.axis_names if a in {*batch, *seq, *heads})
  in_specs = (q_spec, kv_spec, kv_spec, {n: side[n] for n in parts})
  if jax.sharding.get_abstract_mesh().manual_axes:  # inside a pipeline stage
    replicated_kv = tuple(a for a in used if a not in entry_mesh_axes(kv_entry)
                          and a not in batch)
    return _with_own_vjp(local, mesh, used, in_specs, q_spec, replicated_kv)(q, k, v, parts)
  run = jax.shard_map(local, mesh=mesh, axis_names=set(used), check_vma=False,
                      in_specs=in_specs, out_specs=q_spec)
  return run(q, k, v, parts)


def _with_own_vjp(local, mesh, axes, in_specs, out_spec, replicated_kv):
  """``jax.shard_map(local)`` over ``axes`` with its gradient taken per device.

  Nested in another shard_map's manual axes (a pipeline stage), JAX's transpose of this
  ``check_vma=False`` shard_map drops the outer axes from its cotangents ('Expected cotangent
  type ...{V:stage}'), and with ``check_vma=True`` its residuals are given specs over the
  outer, already manual, axes. So the VJP is ``local``'s own, run inside a forward shard_map,
  its residuals leaving each device as one leading per-device dim (no layout to spec), and
  the keys' and values' cotangents summed over the axes they were gathered across.
  """
  shard_map = functools.partial(jax.shard_map, mesh=mesh, axis_names=set(axes),
                                check_vma=False)
  per_device = jax.sharding.PartitionSpec(axes)

  def forward(q, k, v, parts):
    # The VJP is taken with respect to a per-device copy: the inputs themselves carry the outer
    # axes' variance, which nothing computed in a check_vma=False body does, so cotangents of
    # them would never type-check.
    inputs = jax.tree.map(lambda a: a[None], (q, k, v, parts))
    out, vjp = jax.vjp(lambda xs: local(*jax.tree.map(lambda a: a[0], xs))[None], inputs)
    return out[0], jax.tree.map(lambda r: r[None], vjp)

  def backward(vjp, dout):
    (dq, dk, dv, _), = jax.tree.map(lambda r: r[0], vjp)(dout[None])
    dq, dk, dv = dq[0], dk[0], dv[0]
    if replicated_kv:
      dk, dv = jax.lax.psum((dk, dv), replicated_kv)
    return dq, dk, dv

  # Outside, a check_vma=False shard_map's outputs vary over none of the outer manual axes:
  # each must be made to vary as its inputs do, or the outer shard_map takes a per-stage
  # value (a residual, say) for one replicated over stages.
  @jax.custom_vjp
  def run(q, k, v, parts):
    out = shard_map(local, in_specs=in_specs, out_specs=out_spec)(q, k, v, parts)
    return _varying_like(out, q, k, v)

  def run_fwd(q, k, v, parts):
    out, vjp = shard_map(forward, in_specs=in_specs,
                         out_specs=(out_spec, per_device))(q, k, v, parts)
    out, vjp = _varying_like((out, vjp), q, k, v)
    return out, ((q, k, v), parts, vjp)

  def run_bwd(residuals, dout):
    primals, parts, vjp = residuals
    grads = shard_map(backward, in_specs=(per_device, out_spec),
                      out_specs=in_specs[:3])(vjp, dout)
    grads = [_varying_like(g, p) for g, p in zip(grads, primals)]
    return (*grads, jax.tree.map(_zero_cotangent, parts))

  run.defvjp(run_fwd, run_bwd)
  return run


def _linear_index(axes: tuple[str, ...], mesh: Any) -> Array:
  """The device's index along several mesh axes taken together (major to minor)."""
  index = 0
  for a in axes:
    index = index * dict(mesh.shape)[a] + jax.lax.axis_index(a)
  return index
