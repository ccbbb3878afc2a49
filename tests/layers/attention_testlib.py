"""The attention tests' independent reference: grouped-query softmax attention in float64
numpy, straight from the ``layers.Mask`` docstring's definition of which keys a query sees."""

import numpy as np


def visible(mask, b, length, kv_length=None):
  """``(b, length, kv_length)`` bool, from the Mask docstring's definition."""
  kv_length = length if kv_length is None else kv_length
  i, j = np.arange(length)[:, None], np.arange(kv_length)[None, :]
  vis = np.ones((b, length, kv_length), bool)
  if mask.causal:
    vis &= i >= j
  if mask.valid is not None:
    va = np.asarray(mask.valid, bool)
    vis &= va[:, :, None] & va[:, None, :]
  if mask.lengths is not None:
    n = np.asarray(mask.lengths)[:, None, None]
    vis &= (i < n) & (j < n)
  if mask.segment_ids is not None:
    s = np.asarray(mask.segment_ids)
    vis &= s[:, :, None] == s[:, None, :]
  return vis


def numpy_attention(q, k, v, mask):
  """float64 attention (query head ``h`` uses kv head ``h // g``); a query with no visible
  key outputs zeros."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  b, length, heads, d = q.shape
  g = heads // k.shape[2]
  vis = visible(mask, b, length, k.shape[1])
  out = np.zeros_like(q)
  for h in range(heads):
    s = np.einsum("bld,bsd->bls", q[:, :, h], k[:, :, h // g]) / np.sqrt(d)
    s = np.where(vis, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
    e = np.where(vis, np.exp(s - np.where(np.isfinite(m), m, 0)), 0)
    z = e.sum(-1, keepdims=True)
    out[:, :, h] = np.einsum("bls,bsd->bld", e / np.where(z > 0, z, 1), v[:, :, h // g])
  return out
