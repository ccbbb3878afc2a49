"""Softmax cross-entropy over the vocabulary in token chunks: the logits never exist whole.

For a large vocabulary the fp32 logits ``(batch, length, vocab)`` are the largest array of a
training step (Qwen2.5-0.5B's vocab of 151936 at batch 8 x 2048 tokens: 10 GB per copy, and
autodiff keeps several). :func:`chunked_cross_entropy` computes the per-token loss from the
final hidden states and the output projection ``chunk`` tokens per row at a time (a
``lax.scan``), and its custom VJP recomputes each chunk's logits from the saved hidden states,
weights and per-token log-sum-exp, so neither pass holds more than one chunk's logits,
``(batch, chunk, vocab)``. :func:`cross_entropy` is the same loss from full logits.

>>> import jax, jax.numpy as jnp
>>> h = jax.random.normal(jax.random.key(0), (2, 10, 8))
>>> table = jax.random.normal(jax.random.key(1), (50, 8))        # tied: (vocab, embed)
>>> targets = jax.random.randint(jax.random.key(2), (2, 10), 0, 50)
>>> ce, correct = chunked_cross_entropy(h, table, targets, chunk=4, tied=True)
>>> full, _ = cross_entropy(jnp.einsum('ble,ve->blv', h, table), targets)
>>> ce.shape, correct.dtype, bool(jnp.allclose(ce, full, rtol=1e-5))
((2, 10), dtype('bool'), True)
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import partition
from layers import _core
from partition.internal import to_spec_entry

Array = jax.Array


def cross_entropy(logits: Array, targets: Array) -> tuple[Array, Array]:
  """Per-token softmax cross-entropy (fp32) and ``argmax(logits) == targets``, from full
  ``logits (..., vocab)``: optax's ``softmax_cross_entropy_with_integer_labels`` formula.

  >>> ce, ok = cross_entropy(jnp.array([[0.0, 0.0]]), jnp.array([1]))
  >>> round(float(ce[0]), 4), ok.tolist()     # log 2; argmax picks the first of a tie
  (0.6931, [False])
  """
  logits = logits.astype(jnp.float32)
  shifted = logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
  target_logit = jnp.take_along_axis(shifted, targets[..., None], axis=-1)[..., 0]
  ce = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1)) - target_logit
  return ce, jnp.argmax(logits, axis=-1) == targets


def chunked_cross_entropy(h: Array, weights: Array, targets: Array, *, chunk: int,
                          tied: bool, dtype: Any = None) -> tuple[Array, Array]:
  """Per-token cross-entropy of the logits ``h @ weights`` without forming them whole.

  Args:
    h: ``(batch, length, embed)`` final hidden states (after the final norm).
    weights: the output projection: with ``tied``, the embedding table ``(vocab, embed)``;
      else ``lm_head/kernel (embed, vocab)``.
    targets: ``(batch, length)`` int token ids.
    chunk: at most this many tokens of each row per scan step. The length splits into
      ``n = ceil(length / chunk)`` steps of ``ceil(length / n)`` tokens (the rows are padded
      by fewer than ``n`` tokens, whose loss is dropped). Step ``i`` takes the tokens ``i,
      i + n, i + 2n, ...`` of every row (strided, not contiguous: a length sharded over
      devices stays sharded, each device's share of every step being its own tokens); the
      batch dim is never split, so its sharding is kept.
    tied: the layout of ``weights`` (see above).
    dtype: the matmul's dtype (the model's ``config.dtype``; default ``h``'s). The logits
      are that matmul's result cast to fp32, as the full-logits path computes them
      (``layers._core.attend`` / ``dense``, then ``.astype(float32)``), so both paths give
      the same numbers; softmax, log-sum-exp and the loss are fp32.

  Returns:
    ``(ce, correct)``: ``(batch, length)`` fp32 losses and bool ``argmax == target``.

  Memory: the forward pass saves ``h``, ``weights`` and an fp32 log-sum-exp per token; each
  step of either pass holds one chunk's fp32 logits, ``batch x chunk x vocab x 4`` bytes.
  The backward pass recomputes every chunk's logits (one more ``h @ weights``: the flops of
  the forward projection again) and accumulates ``dh`` and the weight gradient. Under
  ``partition.axis_rules`` each chunk's logits are constrained to ``('batch', 'length',
  'vocab')`` (vocab-parallel logits over ``tensor`` keep working), and the weight gradient
  is accumulated as per-device partial sums over the batch's mesh axes, reduced once after
  the last chunk (not once per chunk).
  """
  if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
    raise ValueError(f"chunked_cross_entropy: chunk={chunk!r} must be a positive int")
  return _chunked(h, weights, targets, chunk, tied, None if dtype is None else jnp.dtype(dtype))


def _steps(length: int, chunk: int) -> tuple[int, int]:
  """``(n, c)``: ``n`` scan steps of ``c <= chunk`` tokens, ``n * c >= length``."""
  n = -(-length // chunk)
  return n, -(-length // n)


def _split(x: Array, n: int, c: int) -> Array:
  """``(batch, length, ...)`` -> ``(n, batch, c, ...)``, padded with zeros; step ``i`` holds
  the tokens ``i, i + n, ...`` of each row."""
  pad = n * c - x.shape[1]
  if pad:
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
  return jnp.moveaxis(x.reshape(x.shape[0], c, n, *x.shape[2:]), 2, 0)


def _merge(x: Array, length: int) -> Array:
  """The inverse of :func:`_split`: ``(n, batch, c, ...)`` -> ``(batch, length, ...)``."""
  x = jnp.moveaxis(x, 0, 2)
  return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :length]


def _logits(h: Array, w: Array, tied: bool, dtype: Any) -> Array:
  """One chunk's fp32 logits ``(batch, c, vocab)``, constrained like the full logits."""
  dtype = h.dtype if dtype is None else dtype
  spec = "bce,ve->bcv" if tied else "bce,ev->bcv"
  logits = jnp.einsum(spec, h.astype(dtype), w.astype(dtype)).astype(jnp.float32)
  return partition.constrain(logits, _core.LOGITS)


def _is_target(targets: Array, vocab: int) -> Array:
  """``(..., vocab)`` bool one-hot of ``targets``, as a comparison XLA fuses (no array)."""
  return jnp.arange(vocab) == targets[..., None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _chunked(h, w, targets, chunk, tied, dtype):
  return _forward(h, w, targets, chunk, tied, dtype)[0]


def _forward(h, w, targets, chunk, tied, dtype):
  length = h.shape[1]
  n, c = _steps(length, chunk)
  vocab = w.shape[0 if tied else 1]

  def step(_, xs):
    h_c, t_c = xs
    logits = _logits(h_c, w, tied, dtype)
    top = jnp.max(logits, axis=-1, keepdims=True)
    shifted = logits - top
    log_sum = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1))
    # A masked sum, not a gather: exact (one non-zero term) and local to each vocab shard.
    target_logit = jnp.sum(jnp.where(_is_target(t_c, vocab), shifted, 0.0), axis=-1)
    correct = jnp.argmax(logits, axis=-1) == t_c
    return None, (log_sum - target_logit, log_sum + top[..., 0], correct)

  _, (ce, lse, correct) = jax.lax.scan(step, None, (_split(h, n, c), _split(targets, n, c)))
  lse = _merge(lse, length)
  return (_merge(ce, length), _merge(correct, length)), (h, w, targets, lse)


def _backward(chunk, tied, dtype, residuals, cotangents):
  h, w, targets, lse = residuals
  g = cotangents[0].astype(jnp.float32)    # cotangents[1] is `correct`'s (float0)
  length, vocab = h.shape[1], w.shape[0 if tied else 1]
  n, c = _steps(length, chunk)
  dt = h.dtype if dtype is None else dtype
  shards, acc_spec = _partial_sum_layout(h.shape[0], w, tied)

  def step(dw, xs):
    h_c, t_c, lse_c, g_c = xs
    logits = _logits(h_c, w, tied, dtype)
    # d ce / d logits = softmax - onehot(target), scaled by the token's cotangent; cast to the
    # matmul dtype as autodiff of the full path's ``.astype(float32)`` does.
    dlogits = (jnp.exp(logits - lse_c[..., None]) - _is_target(t_c, vocab)) * g_c[..., None]
    dlogits = partition.constrain(dlogits.astype(dt), _core.LOGITS)
    dh_c = jnp.einsum("bcv,ve->bce" if tied else "bcv,ev->bce", dlogits, w.astype(dt))
    dh_c = partition.constrain(dh_c, _core.EMBED)
    # The weight gradient's partial sum of each batch shard stays on its devices: one
    # reduction after the loop instead of one per chunk.
    part = jnp.einsum("sbcv,sbce->sve" if tied else "sbcv,sbce->sev",
                      _by_shard(dlogits, shards), _by_shard(h_c.astype(dt), shards),
                      preferred_element_type=jnp.float32)
    return _constrain(dw + part, acc_spec), dh_c

  dw0 = _constrain(jnp.zeros((shards, *w.shape), jnp.float32), acc_spec)
  xs = (_split(h, n, c), _split(targets, n, c), _split(lse, n, c), _split(g, n, c))
  dw, dh = jax.lax.scan(step, dw0, xs)
  return _merge(dh, length).astype(h.dtype), dw.sum(0).astype(w.dtype), None


_chunked.defvjp(_forward, _backward)


def _partial_sum_layout(batch: int, w: Array, tied: bool) -> tuple[int, Any]:
  """``(s, spec)``: the batch's ``s`` device shards under the current rules and mesh (1
  without them, or when they do not divide ``batch``), and the ``PartitionSpec`` of the
  ``(s, *w.shape)`` accumulator: its leading dim over the batch's mesh axes, the weight's
  dims as the rules place them less those axes (``None`` when ``s == 1``)."""
  axes = _core.batch_mesh_axes(batch)
  if not axes:
    return 1, None
  rules, mesh = partition.current_rules(), partition.current_rules_mesh()
  shards = math.prod(mesh.shape[a] for a in axes)
  if shards == 1 or batch % shards:
    return 1, None
  names = ("vocab", "embed") if tied else ("embed", "vocab")
  kept = [_core.drop_axes(e, set(axes)) for e in rules.spec(names, w.shape, mesh)]
  return shards, P(to_spec_entry(axes), *kept)


def _by_shard(x: Array, shards: int) -> Array:
  """``(batch, ...)`` -> ``(shards, batch / shards, ...)``."""
  return x.reshape(shards, x.shape[0] // shards, *x.shape[1:])


def _constrain(x: Array, spec: Any) -> Array:
  return x if spec is None else partition.constrain(x, spec)
