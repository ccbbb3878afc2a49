"""The math of every layer, as pure functions on arrays (no framework).

``layers.linen``, ``layers.nnx`` and ``layers.haiku`` only create parameters and call these,
so the three frameworks compute the same thing by construction. Activations are constrained
here, with ``partition.constrain``, at the block boundaries (a no-op without a mesh):

=================  ==========================================
activation         logical axes
=================  ==========================================
embeddings, block  ``('batch', 'length', 'embed')``
queries            ``('batch', 'length', 'heads', 'head_dim')``
keys / values      ``('batch', 'length', 'kv_heads', 'head_dim')``
MLP hidden         ``('batch', 'length', 'mlp')``
expert inputs      ``('batch', 'expert', None, 'embed')`` (None: capacity slots)
dispatched tokens  ``('batch', None, None, 'embed')`` (before / after the all-to-all)
expert hidden      ``('batch', 'expert', None, 'mlp')``
logits             ``('batch', 'length', 'vocab')``
=================  ==========================================

>>> import jax.numpy as jnp
>>> x = jnp.ones((2, 3, 4))
>>> dense(x, jnp.ones((4, 5))).shape
(2, 3, 5)
>>> rms_norm(x, jnp.ones(4)).shape
(2, 3, 4)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import partition
from layers import _attention
from layers._attention import Mask
from partition.internal import entry_mesh_axes, to_spec_entry

Array = jax.Array

ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    "silu": jax.nn.silu, "gelu": jax.nn.gelu, "relu": jax.nn.relu}

EMBED = ("batch", "length", "embed")
MLP_HIDDEN = ("batch", "length", "mlp")
QUERY = ("batch", "length", "heads", "head_dim")
KEY_VALUE = ("batch", "length", "kv_heads", "head_dim")
LOGITS = ("batch", "length", "vocab")


# -- dense, embeddings, norms --------------------------------------------------------------


def dense(x: Array, kernel: Array, bias: Array | None = None, *, contract: int = 1,
          dtype: Any = None) -> Array:
  """``x``'s last ``contract`` dims times ``kernel``'s first ``contract`` dims (+ ``bias``).

  Args:
    x: ``(..., *in_dims)``.
    kernel: ``(*in_dims, *out_dims)``.
    bias: ``out_dims`` or ``None``.
    contract: how many trailing dims of ``x`` are contracted.
    dtype: computation dtype (default: ``x``'s).

  Returns:
    ``(..., *out_dims)``.

  >>> dense(jnp.ones((2, 4)), jnp.ones((4, 3, 5))).shape
  (2, 3, 5)
  """
  dtype = x.dtype if dtype is None else dtype
  x, kernel = x.astype(dtype), kernel.astype(dtype)
  if x.ndim - contract == 2:  # (batch, length, *in): see token_major
    y = token_major(jnp.tensordot(token_major(x), kernel, axes=contract), undo=x.shape[:2])
  else:
    y = jnp.tensordot(x, kernel, axes=contract)
  return y if bias is None else y + bias.astype(dtype)


def token_major(x: Array, *, dim: int = 0, undo: tuple[int, int] | None = None) -> Array:
  """``(..., batch, length, ...)`` -> ``(..., q * batch, length / q, ...)`` when the rules
  shard both ``batch`` (mesh axes ``B``) and ``length`` (mesh axes ``Q``, ``q`` devices):
  sequence parallelism. Else ``x`` itself. ``undo=(batch, length)`` inverts it.

  Each device's tokens stay where they are (local reshapes and a transpose): the merged dim
  is sharded over ``Q + B`` jointly. A dot contracting it reduces over all of ``B x Q`` in
  one all-reduce, where XLA reduces a dot contracting ``batch`` and ``length`` separately
  (one all-reduce over ``Q``, then one over ``B``: ``2 S (q-1)/q + 2 S (b-1)/b`` bytes
  instead of ``2 S (bq-1)/(bq)``). :func:`dense` computes in this layout, so its weight
  gradient is reduced once.
  """
  b, length = undo if undo is not None else x.shape[dim:dim + 2]
  batch, seq = token_mesh_axes(b, length)
  if not batch or not seq:
    return x
  q = math.prod(partition.current_rules_mesh().shape[a] for a in seq)
  if length % q:
    return x
  lead, rest = x.shape[:dim], x.shape[dim + 2:]
  free = (jax.sharding.PartitionSpec.UNCONSTRAINED,) * len(rest)
  P = jax.sharding.PartitionSpec
  split = P(*(P.UNCONSTRAINED,) * dim, to_spec_entry(batch), to_spec_entry(seq),
            None, *free)
  merged = P(*(P.UNCONSTRAINED,) * dim, to_spec_entry(seq + batch), None, *free)
  if undo is None:
    x = partition.constrain(jnp.reshape(x, (*lead, b, q, length // q, *rest)), split)
    x = jnp.swapaxes(x, dim, dim + 1)
    return partition.constrain(jnp.reshape(x, (*lead, q * b, length // q, *rest)), merged)
  x = partition.constrain(x, merged)
  x = jnp.swapaxes(jnp.reshape(x, (*lead, q, b, length // q, *rest)), dim, dim + 1)
  return jnp.reshape(partition.constrain(x, split), (*lead, b, length, *rest))


def _mesh_axes(spec: Any) -> set[str]:
  return {axis for entry in spec for axis in entry_mesh_axes(entry)}


def batch_mesh_axes(batch_size: int) -> tuple[str, ...] | None:
  """The mesh axes the ``batch`` dim is sharded over under the current rules and mesh, in
  the rules' order (``()`` if none); ``None`` without rules or mesh."""
  rules, mesh = partition.current_rules(), partition.current_rules_mesh()
  if rules is None or mesh is None:
    return None
  spec = rules.spec(("batch",), (batch_size,), mesh)
  return tuple(entry_mesh_axes(spec[0])) if len(spec) else ()


def token_mesh_axes(batch_size: int, length: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """``(batch's, length's)`` mesh axes of a ``(batch, length)`` grid of tokens under the
  current rules and mesh: together, the axes a sum over the tokens is reduced over.
  ``((), ())`` without rules or mesh."""
  rules, mesh = partition.current_rules(), partition.current_rules_mesh()
  if rules is None or mesh is None:
    return (), ()
  spec = rules.spec(("batch", "length"), (batch_size, length), mesh)
  batch, seq = (tuple(entry_mesh_axes(e)) for e in (*spec, None, None)[:2])
  return batch, seq


def lookup_table(table: Array, batch_size: int) -> Array:
  """``table (vocab, embed)`` constrained to the sharding an embedding lookup reads it in.

  Under ``partition.axis_rules`` with a mesh: the ``embed`` dim is always gathered, and the
  ``vocab`` dim stays sharded only if its mesh axes are not the batch's. Tensor parallelism
  (``vocab`` over ``tensor``) thus gets Megatron's vocabulary-parallel lookup (each device
  takes its rows, one all-reduce of the embeddings over ``tensor``), while a table sharded
  over a batch axis (FSDP) is all-gathered like any FSDP weight before a local take, never
  gathering the batch's tokens or embeddings. Without rules or mesh: ``table`` itself.
  """
  rules, mesh = partition.current_rules(), partition.current_rules_mesh()
  if rules is None or mesh is None:
    return table
  vocab = _mesh_axes(rules.spec(("vocab",), table.shape[:1], mesh))
  batch = set(batch_mesh_axes(batch_size))
  return partition.constrain(table, (None if vocab & batch else "vocab", None))


def fsdp_gather(weights: Any, axes: Any, batch_size: int, dtypes: Any = None) -> Any:
  """Weights all-gathered over the batch's mesh axes (FSDP / ZeRO-3), once per use site.

  Each weight of the tree ``weights`` (logical ``axes``: a matching tree of tuples) is
  constrained to the sharding its axes resolve to with the batch's mesh axes taken out, so
  the forward pass and the backward pass read the same gathered copy (ZeRO-3 keeps it for the
  backward pass). Left to itself XLA gathered such a weight once per dot that reads it:
  forward and again for the input gradient. The constraint's backward pass is the identity,
  so the gradient goes from the dots' partial sums straight to the parameter's sharding (a
  reduce-scatter over the batch axes), never through a replicated copy. An ``expert`` dim
  keeps its mesh axes even when they are the batch's (expert parallelism moves the tokens to
  the experts, not the experts to the tokens). Weights the batch's
  mesh axes do not shard, and any weight without rules or mesh, are returned as they are.

  ``dtypes`` (a tree matching ``weights``, a dtype or ``None`` per weight; one dtype for
  one weight): the dtype the model computes with that weight. A gathered weight is cast to it
  while still sharded, so the all-gather sends the 16-bit working copy, not the fp32
  master copy (ZeRO's 2 bytes per parameter; XLA's partitioner otherwise gathers the
  parameter and casts the gathered copy). The values are the same: casting commutes with
  gathering.
  """
  rules, mesh = partition.current_rules(), partition.current_rules_mesh()
  if rules is None or mesh is None:
    return weights
  batch = set(batch_mesh_axes(batch_size))

  def one(w, names, dtype=None):
    spec = rules.spec(tuple(names), w.shape, mesh)
    kept = [entry if name == "expert" else drop_axes(entry, batch)  # experts stay put
            for name, entry in zip(names, spec)]
    if kept == list(spec):
      return w
    if dtype is not None and w.dtype != dtype:
      # the cast pinned to the shard's sharding: unpinned, sharding propagation moves the
      # gather before it (onto the fp32 parameter)
      w = partition.constrain(w.astype(dtype), jax.sharding.PartitionSpec(*spec))
    return _gathered(w, jax.sharding.PartitionSpec(*kept))

  trees = (weights, axes) if dtypes is None else (weights, axes, dtypes)
  return jax.tree.map(one, *trees, is_leaf=lambda a: isinstance(a, tuple))


def drop_axes(entry: Any, axes: set[str]) -> Any:
  """A ``PartitionSpec`` entry less the mesh ``axes``."""
  return to_spec_entry(a for a in entry_mesh_axes(entry) if a not in axes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gathered(w: Array, spec: Any) -> Array:
  return partition.constrain(w, spec)


def _gathered_fwd(w, spec):
  return _gathered(w, spec), None


def _gathered_bwd(spec, _, g):
  del spec
  return (g,)


_gathered.defvjp(_gathered_fwd, _gathered_bwd)


def embed(tokens: Array, table: Array, *, dtype: Any = None) -> Array:
  """Embedding lookup: ``tokens (...)`` ints, ``table (vocab, embed)`` -> ``(..., embed)``.

  The table is read as :func:`lookup_table` says when ``tokens`` is ``(batch, length)``.

  >>> embed(jnp.array([[0, 2]]), jnp.eye(3)).tolist()
  [[[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]]
  """
  if tokens.ndim == 2:
    table = lookup_table(table, tokens.shape[0])
  return jnp.take(table, tokens, axis=0).astype(table.dtype if dtype is None else dtype)


def attend(x: Array, table: Array, *, dtype: Any = None) -> Array:
  """Tied output projection: ``x (..., embed)`` against ``table (vocab, embed)``.

  >>> attend(jnp.ones((2, 3)), jnp.ones((5, 3))).shape
  (2, 5)
  """
  dtype = x.dtype if dtype is None else dtype
  return jnp.einsum("...e,ve->...v", x.astype(dtype), table.astype(dtype))


def rms_norm(x: Array, scale: Array, *, eps: float = 1e-6) -> Array:
  """``x / sqrt(mean(x**2) + eps) * scale`` over the last dim (statistics in fp32).

  >>> [round(v, 4) for v in rms_norm(jnp.array([3.0, 4.0]), jnp.ones(2), eps=0.0).tolist()]
  [0.8485, 1.1314]
  """
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (y * scale.astype(jnp.float32)).astype(x.dtype)


def layer_norm(x: Array, scale: Array, bias: Array, *, eps: float = 1e-6) -> Array:
  """``(x - mean) / sqrt(var + eps) * scale + bias`` over the last dim (fp32 statistics).

  >>> layer_norm(jnp.array([1.0, 3.0]), jnp.ones(2), jnp.zeros(2), eps=0.0).tolist()
  [-1.0, 1.0]
  """
  x32 = x.astype(jnp.float32)
  mean = jnp.mean(x32, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
  y = (x32 - mean) * jax.lax.rsqrt(var + eps)
  return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


# -- MLP -------------------------------------------------------------------------------------


def glu(gate: Array, up: Array, *, activation: str = "silu") -> Array:
  """Gated hidden ``act(gate) * up`` (``(batch, length, mlp)``), constrained.

  >>> glu(jnp.zeros((1, 1, 2)), jnp.ones((1, 1, 2))).tolist()
  [[[0.0, 0.0]]]
  """
  return partition.constrain(ACTIVATIONS[activation](gate) * up, MLP_HIDDEN)


def gated_mlp(x: Array, wi: Array, wo: Array, *, activation: str = "silu",
              dtype: Any = None) -> Array:
  """Gated MLP ``(act(x @ wi[:, 0]) * (x @ wi[:, 1])) @ wo`` (SwiGLU for silu).

  The gate and up projections are one fused kernel, so the backward pass returns the input
  gradient of both as one dot (one all-reduce under tensor parallelism, not two).

  Args:
    x: ``(batch, length, embed)``.
    wi: ``(embed, 2, mlp)``: ``wi[:, 0]`` the gate, ``wi[:, 1]`` the up projection.
    wo: ``(mlp, embed)``.
    activation: a key of ``ACTIVATIONS``.

  Returns:
    ``(batch, length, embed)``; the hidden ``(batch, length, mlp)`` is constrained.

  >>> gated_mlp(jnp.ones((1, 2, 4)), jnp.ones((4, 2, 8)), jnp.ones((8, 4))).shape
  (1, 2, 4)
  """
  gate_up = dense(x, wi, dtype=dtype)                                   # (b, l, 2, mlp)
  h = glu(gate_up[..., 0, :], gate_up[..., 1, :], activation=activation)
  return partition.constrain(dense(h, wo, dtype=dtype), EMBED)


def mlp(p: dict, x: Array, *, activation: str = "silu", dtype: Any = None) -> Array:
  """:func:`gated_mlp` on a parameter tree ``{'wi': {'kernel'}, 'wo': {'kernel'}}``."""
  return gated_mlp(x, p["wi"]["kernel"], p["wo"]["kernel"], activation=activation,
                   dtype=dtype)


# -- attention -------------------------------------------------------------------------------


def causal_mask(length: int) -> Array:
  """``(1, 1, length, length)`` bool: query ``i`` sees keys ``j <= i``.

  >>> causal_mask(2)[0, 0].tolist()
  [[True, False], [True, True]]
  """
  return jnp.tril(jnp.ones((length, length), bool))[None, None]


def padding_mask(valid: Array) -> Array:
  """``valid (batch, length)`` bool -> ``(batch, 1, length, length)``: both ends valid."""
  return (valid[:, None, :, None] & valid[:, None, None, :]).astype(bool)


def rope_frequencies(head_dim: int, *, theta: float = 10_000.0, scaling: Any = None) -> Array:
  """The ``head_dim / 2`` inverse frequencies ``theta ** (-2i / head_dim)`` of RoPE, scaled.

  ``scaling`` (a ``layers.RopeScaling`` or None) as ``transformers``' ``rope_type`` of the
  same name: ``'linear'`` divides every frequency by ``factor``; ``'llama3'``
  (``_compute_llama3_parameters``) divides those whose wavelength ``2 pi / f`` exceeds
  ``original_max_len / low_freq_factor`` by ``factor``, keeps those below
  ``original_max_len / high_freq_factor`` and, between, mixes ``f / factor`` and ``f`` with
  weight ``s = (original_max_len / wavelength - low) / (high - low)`` on ``f``.

  >>> from layers import RopeScaling
  >>> f = rope_frequencies(8, theta=10_000.0)
  >>> bool(jnp.allclose(rope_frequencies(8, scaling=RopeScaling('linear', 4.0)), f / 4))
  True
  >>> s = RopeScaling('llama3', 8.0, original_max_len=64)   # wavelengths 6.3, 63, 628, 6283
  >>> [round(float(r), 3) for r in rope_frequencies(8, scaling=s) / f]
  [1.0, 0.13, 0.125, 0.125]
  """
  freq = theta ** (-jnp.arange(head_dim // 2, dtype=jnp.float32) * 2 / head_dim)
  if scaling is None:
    return freq
  if scaling.kind == "linear":
    return freq / scaling.factor
  wavelength = 2 * math.pi / freq
  low, high, old = scaling.low_freq_factor, scaling.high_freq_factor, scaling.original_max_len
  smooth = (old / wavelength - low) / (high - low)
  mixed = (1 - smooth) * freq / scaling.factor + smooth * freq
  out = jnp.where(wavelength > old / low, freq / scaling.factor, freq)
  return jnp.where((wavelength >= old / high) & (wavelength <= old / low), mixed, out)


def rope(x: Array, positions: Array, *, theta: float = 10_000.0, scaling: Any = None) -> Array:
  """Rotary position embedding of ``x (batch, length, heads, head_dim)``.

  Dim ``i`` of the first half and dim ``i`` of the second half form a pair rotated by angle
  ``position * theta ** (-2i / head_dim)`` (with ``scaling``: ``position *``
  :func:`rope_frequencies` ``[i]``); ``positions`` is ``(batch, length)``.

  >>> q = jnp.ones((1, 3, 2, 4))
  >>> bool(jnp.allclose(rope(q, jnp.zeros((1, 3), int)), q))   # position 0: identity
  True
  """
  freq = rope_frequencies(x.shape[-1], theta=theta, scaling=scaling)
  angle = positions.astype(jnp.float32)[..., None, None] * freq       # (b, l, 1, half)
  sin, cos = jnp.sin(angle), jnp.cos(angle)
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def dot_product_attention(q: Array, k: Array, v: Array, mask: Mask | Array | None = None, *,
                          implementation: str = "auto", block: int = 512) -> Array:
  """Softmax attention with grouped-query heads, by the implementation ``implementation``
  (``layers._attention``: ``'auto'``, ``'xla'``, ``'cudnn'``, ``'pallas'``, ``'blockwise'``).

  Args:
    q: ``(batch, q_length, heads, head_dim)``.
    k, v: ``(batch, kv_length, kv_heads, head_dim)``; ``heads`` a multiple of ``kv_heads``
      (query head ``h`` uses kv head ``h // (heads // kv_heads)``).
    mask: a :class:`layers._attention.Mask` (causal flag, padding, segment ids); or a bool
      array broadcastable to ``(batch, heads, q_length, kv_length)``, True = attend
      (``'xla'`` only); or None.
    implementation, block: see ``layers._attention.dot_product_attention``.

  Returns:
    ``(batch, q_length, heads, head_dim)``.

  >>> q = jnp.ones((1, 3, 4, 8)); k = v = jnp.ones((1, 3, 2, 8))
  >>> dot_product_attention(q, k, v, causal_mask(3)).shape
  (1, 3, 4, 8)
  """
  return _attention.dot_product_attention(q, k, v, mask, implementation=implementation,
                                          block=block)


def attention_core(q: Array, k: Array, v: Array, *, mask: Mask | Array | None = None,
                   positions: Array | None = None, use_rope: bool = True,
                   rope_theta: float = 10_000.0, rope_scaling: Any = None,
                   implementation: str = "auto", block: int = 512, cache: Any = None) -> Any:
  """Attention on projected heads: constrain, optional RoPE, softmax attention.

  Args:
    q: ``(batch, length, heads, head_dim)``; k, v: ``(batch, length, kv_heads, head_dim)``.
    mask: a ``Mask`` or a bool array broadcastable to ``(batch, heads, length, length)``.
    positions: ``(batch, length)`` ints for RoPE (default ``0..length-1``).
    use_rope: rotate queries and keys; rope_theta: the rotary base; rope_scaling: a
      ``layers.RopeScaling`` of its frequencies or None (:func:`rope_frequencies`).
    implementation, block: as for :func:`dot_product_attention`.
    cache: decoding only (``layers._decode.KVCache`` of this layer): the rotated keys and
      values join it and the queries attend what it then holds.

  Returns:
    ``(batch, length, heads, head_dim)``; with ``cache``, ``(that, updated cache)``.
  """
  q = partition.constrain(q, QUERY)
  k, v = partition.constrain(k, KEY_VALUE), partition.constrain(v, KEY_VALUE)
  if use_rope:
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(q.shape[1]), q.shape[:2])
    q = rope(q, positions, theta=rope_theta, scaling=rope_scaling)
    k = rope(k, positions, theta=rope_theta, scaling=rope_scaling)
  if cache is not None:
    k, v, mask, cache, implementation = cache.update(k, v, positions, mask, implementation)
    return dot_product_attention(q, k, v, mask, implementation=implementation,
                                 block=block), cache
  return dot_product_attention(q, k, v, mask, implementation=implementation, block=block)


def split_qkv(fused: Array) -> tuple[Array, Array, Array]:
  """``(..., kv_heads, q_per_kv + 2, head_dim)`` -> queries ``(..., heads, head_dim)``, keys
  and values ``(..., kv_heads, head_dim)``; query head ``h`` is in kv group ``h // q_per_kv``.

  >>> q, k, v = split_qkv(jnp.zeros((5, 2, 3 + 2, 4)))
  >>> q.shape, k.shape, v.shape
  ((5, 6, 4), (5, 2, 4), (5, 2, 4))
  """
  per_kv = fused.shape[-2] - 2
  q = fused[..., :per_kv, :]
  q = q.reshape(*q.shape[:-3], q.shape[-3] * per_kv, q.shape[-1])
  return q, fused[..., per_kv, :], fused[..., per_kv + 1, :]


def attention(p: dict, x: Array, *, mask: Mask | Array | None = None,
              positions: Array | None = None, use_rope: bool = True,
              rope_theta: float = 10_000.0, rope_scaling: Any = None, norm_eps: float = 1e-6,
              dtype: Any = None, implementation: str = "auto", block: int = 512,
              cache: Any = None) -> Any:
  """Self-attention on a parameter tree: one fused QKV projection, attention, output.

  Args:
    p: ``{'qkv': {'kernel': (embed, kv_heads, q_per_kv + 2, head_dim)[, 'bias': (kv_heads,
      q_per_kv + 2, head_dim)]}, 'out': {'kernel': (heads, head_dim, embed)}}``. The QKV
      kernel is grouped by kv head (each group: its ``q_per_kv`` query heads, its key, its
      value), so sharding ``kv_heads`` splits queries, keys and values alike and the input
      gradient of all three is one dot (one all-reduce under tensor parallelism). With
      ``query_norm``/``key_norm`` (``{'scale': (head_dim,)}``, Qwen3's q/k norm) each query
      and key head is RMS-normed (``norm_eps``) before RoPE.
    x: ``(batch, length, embed)``.
    mask, positions, use_rope, rope_theta, rope_scaling, implementation, block, cache: as
      for :func:`attention_core`.

  Returns:
    ``(batch, length, embed)``, constrained to ``('batch', 'length', 'embed')``; with
    ``cache``, ``(that, updated cache)``.

  >>> p = {'qkv': {'kernel': jnp.ones((4, 1, 2 + 2, 2))}, 'out': {'kernel': jnp.ones((2, 2, 4))}}
  >>> attention(p, jnp.ones((1, 3, 4)), mask=causal_mask(3)).shape
  (1, 3, 4)
  """
  qkv = dense(x, p["qkv"]["kernel"], p["qkv"].get("bias"), dtype=dtype)
  q, k, v = split_qkv(qkv)
  if "query_norm" in p:   # Qwen3: per-head RMSNorm between the projection and RoPE
    q = rms_norm(q, p["query_norm"]["scale"], eps=norm_eps)
    k = rms_norm(k, p["key_norm"]["scale"], eps=norm_eps)
  out = attention_core(q, k, v, mask=mask, positions=positions, use_rope=use_rope,
                       rope_theta=rope_theta, rope_scaling=rope_scaling,
                       implementation=implementation, block=block, cache=cache)
  out, cache = out if cache is not None else (out, None)
  out = partition.constrain(dense(out, p["out"]["kernel"], contract=2, dtype=dtype), EMBED)
  return out if cache is None else (out, cache)


# -- model-level helpers ---------------------------------------------------------------------


def decoder_mask(tokens: Array, valid: Array | None = None,
                 segment_ids: Array | None = None) -> Mask:
  """The decoder's mask as structure: causal, with padding and packing when given.

  Args:
    tokens: ``(batch, length)`` (only its shape is read).
    valid: ``(batch, length)`` bool, True for real tokens (padding anywhere); or ``(batch,)``
      ints, the number of real tokens of each row (right padding, which cuDNN takes); or None.
    segment_ids: ``(batch, length)`` ints, one id per packed sequence, or None.

  >>> m = decoder_mask(jnp.zeros((1, 3), int), valid=jnp.array([2]))
  >>> m.kind, m.dense(3)[0, 0].astype(int).tolist()
  ('causal+lengths', [[1, 0, 0], [1, 1, 0], [0, 0, 0]])
  """
  del tokens
  if valid is not None and jnp.ndim(valid) == 1:
    return Mask(causal=True, lengths=valid, segment_ids=segment_ids)
  return Mask(causal=True, valid=valid, segment_ids=segment_ids)


def merge_aux(aux: dict[str, Array]) -> dict[str, Array]:
  """Per-layer aux outputs stacked on a leading dim -> model totals (mean loss, sum drops)."""
  return {"load_balance_loss": jnp.mean(aux["load_balance_loss"]),
          "dropped_tokens": jnp.sum(aux["dropped_tokens"])}


def no_aux() -> dict[str, Array]:
  """The auxiliary outputs of a dense block (zeros), same structure as an MoE block's."""
  return {"load_balance_loss": jnp.zeros((), jnp.float32),
          "dropped_tokens": jnp.zeros((), jnp.int32)}
