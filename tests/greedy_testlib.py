"""The greedy reference the decode tests compare against: no KV cache, no decode loop.

``conftest.py`` puts ``tests/`` on ``sys.path``: ``from greedy_testlib import greedy_reference``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

import layers


def greedy_reference(params, cfg, prompt, n: int, stop=()) -> list[int]:
  """Greedy continuation of ``prompt`` by re-running the full causal forward pass
  (``layers._model.transformer``) over the sequence so far, ``n`` tokens or up to a ``stop``.

  The sequence sits in a buffer of its final length, zeros after it, so the forward compiles
  once: the logits at position ``i`` see only tokens ``<= i``. A mixture-of-experts model
  is refused, as its routing capacity is shared by every token of a row, padding included.
  """
  if cfg.num_experts:
    raise ValueError("greedy_reference: the zeros after the sequence would take expert "
                     "capacity; use a dense config")
  seq = list(prompt)
  buffer = np.zeros((1, len(seq) + n - 1), np.int32)
  buffer[0, :len(seq)] = seq
  for _ in range(n):
    seq.append(int(_next_token(cfg)(params, buffer, len(seq) - 1)))
    if seq[-1] in stop or len(seq) > buffer.shape[1]:
      break
    buffer[0, len(seq) - 1] = seq[-1]
  return seq[len(prompt):]


@functools.cache
def _next_token(cfg):
  @jax.jit
  def next_token(params, tokens, at):
    logits, _ = layers._model.transformer(params, tokens, cfg)
    return jnp.argmax(logits[0, at])
  return next_token
