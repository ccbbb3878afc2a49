"""Mixture of experts: a top-k router with a capacity per expert, as pure functions.

Tokens are routed within their own sequence (one routing group per batch row, as in
GShard), so the batch axis stays sharded and each expert takes at most

    capacity = ceil(capacity_factor * length * k / num_experts)

tokens of a sequence. Slots are filled choice-major (every token's first choice before any
second choice) and in token order within a choice; assignments past the capacity are
dropped and counted. The load-balancing loss is Switch Transformer's, generalised to top-k:
``num_experts * sum_e fraction_routed_e * mean_probability_e`` (1.0 when balanced).

>>> import jax, jax.numpy as jnp
>>> x = jnp.ones((1, 4, 8))
>>> w = lambda *s: jnp.full(s, 0.1)
>>> y, aux = moe(x, w(8, 4), w(4, 8, 2, 16), w(4, 16, 8), k=2, capacity_factor=2.0)
>>> y.shape, int(aux['dropped_tokens'])
((1, 4, 8), 0)
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import einops
import jax
import jax.numpy as jnp

import partition
from layers._core import ACTIVATIONS, EMBED, dense

Array = jax.Array

EXPERT_IN = ("batch", "expert", None, "embed")
EXPERT_HIDDEN = ("batch", "expert", None, "mlp")
#: Dispatched tokens where they were routed (the batch's own devices, every expert's slots):
#: the layout between the local dispatch/combine einsum and the all-to-all.
TOKEN_SLOTS = ("batch", None, None, "embed")


class Routing(NamedTuple):
  """Routing of ``(batch, length)`` tokens to ``(expert, capacity)`` slots.

  Attributes:
    dispatch: ``(batch, length, expert, capacity)`` 0/1: token goes to this slot.
    combine: same shape: the token's gate weight for that slot (0 where dropped).
    load_balance_loss: scalar, Switch-style auxiliary loss.
    dropped_tokens: scalar int, token-expert assignments past capacity.
  """

  dispatch: Array
  combine: Array
  load_balance_loss: Array
  dropped_tokens: Array


def capacity(length: int, num_experts: int, k: int, capacity_factor: float) -> int:
  """Slots per expert and sequence: ``ceil(capacity_factor * length * k / num_experts)``.

  >>> capacity(8, 4, 2, 1.0)
  4
  """
  return max(1, math.ceil(capacity_factor * length * k / num_experts))


def top_k(x: Array, k: int) -> tuple[Array, Array]:
  """``jax.lax.top_k(x, k)`` over the last axis (the same values, indices and ties: the
  lower index first), as ``k`` rounds of ``argmax``. XLA's SPMD partitioner runs
  ``lax.top_k`` on the whole array, gathering a batch-sharded router's logits from every
  device (the routing then ran on the global batch everywhere); ``argmax`` is a reduction
  over the experts and keeps the batch sharded. ``k`` is a handful (the router's top-k).

  >>> top_k(jnp.array([[1.0, 3.0, 3.0, 2.0]]), 2)[1].tolist()
  [[1, 2]]
  """
  values, indices = [], []
  for _ in range(k):
    i = jnp.argmax(x, axis=-1, keepdims=True)
    values.append(jnp.take_along_axis(x, i, axis=-1))
    indices.append(i)
    x = jnp.where(jnp.arange(x.shape[-1]) == i, -jnp.inf, x)
  return jnp.concatenate(values, axis=-1), jnp.concatenate(indices, axis=-1)


def route(logits: Array, *, k: int, capacity_factor: float) -> Routing:
  """Top-``k`` routing of router ``logits (batch, length, expert)`` with a capacity.

  Gates are the top-``k`` softmax probabilities renormalised to sum to one per token.
  """
  _, length, num_experts = logits.shape
  slots = capacity(length, num_experts, k, capacity_factor)
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  top_p, top_i = top_k(probs, k)                                        # (b, l, k)
  gates = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
  chosen = jax.nn.one_hot(top_i, num_experts, dtype=jnp.int32)         # (b, l, k, e)
  # Queue position of each assignment at its expert: choice-major, then token order.
  order = einops.rearrange(chosen, "b l k e -> b (k l) e")
  position = einops.rearrange(jnp.cumsum(order, axis=1) - 1, "b (k l) e -> b l k e", k=k)
  kept = chosen * (position < slots)
  slot = jax.nn.one_hot(position, slots, dtype=jnp.float32) * kept[..., None]
  dispatch = jnp.sum(slot, axis=2)                                      # (b, l, e, c)
  combine = jnp.einsum("blkec,blk->blec", slot, gates)
  fraction = jnp.mean(jnp.sum(chosen, axis=2), axis=(0, 1)) / k         # (e,)
  balance = num_experts * jnp.sum(fraction * jnp.mean(probs, axis=(0, 1)))
  dropped = jnp.sum(chosen) - jnp.sum(kept)
  return Routing(dispatch, combine, balance, dropped.astype(jnp.int32))


def experts(xe: Array, wi: Array, wo: Array, *, activation: str = "silu",
            dtype: Any = None) -> Array:
  """Each expert's gated MLP on its slots: ``xe (batch, expert, capacity, embed)``.

  ``wi``: ``(expert, embed, 2, mlp)``, gate (``[:, :, 0]``) and up (``[:, :, 1]``) fused into
  one kernel (one input-gradient dot); ``wo``: ``(expert, mlp, embed)``.
  """
  dtype = xe.dtype if dtype is None else dtype
  act = ACTIVATIONS[activation]
  gate_up = jnp.einsum("becd,edgm->becgm", xe.astype(dtype), wi.astype(dtype))
  h = partition.constrain(act(gate_up[..., 0, :]) * gate_up[..., 1, :], EXPERT_HIDDEN)
  return jnp.einsum("becm,emd->becd", h, wo.astype(dtype))


def moe(x: Array, router: Array, wi: Array, wo: Array, *, k: int,
        capacity_factor: float = 1.25, activation: str = "silu",
        dtype: Any = None) -> tuple[Array, dict[str, Array]]:
  """Mixture-of-experts MLP.

  Args:
    x: ``(batch, length, embed)``.
    router: ``(embed, expert)`` router kernel.
    wi: ``(expert, embed, 2, mlp)`` (gate and up); wo: ``(expert, mlp, embed)``.
    k: experts per token.
    capacity_factor: slots per expert relative to a perfectly balanced load.
    activation: gate activation (``'silu'`` = SwiGLU experts).

  Returns:
    ``(y, aux)``: ``y (batch, length, embed)`` constrained to ``('batch', 'length',
    'embed')``; ``aux`` has ``load_balance_loss`` and ``dropped_tokens`` scalars.
  """
  dtype = x.dtype if dtype is None else dtype
  routing = route(dense(x, router, dtype=jnp.float32), k=k,
                  capacity_factor=capacity_factor)
  xe = jnp.einsum("blec,bld->becd", routing.dispatch.astype(dtype), x.astype(dtype))
  # Each reshard is pinned on both sides (TOKEN_SLOTS <-> EXPERT_IN), so the dispatch and the
  # combine are each one all-to-all, forward and (as the constraints transpose) backward:
  # GShard's four. Unpinned, XLA gathered the combine's cotangent over the batch axes and
  # re-gathered activations for the experts' weight gradients (twice GShard's bytes).
  xe = partition.constrain(partition.constrain(xe, TOKEN_SLOTS), EXPERT_IN)
  ye = partition.constrain(experts(xe, wi, wo, activation=activation, dtype=dtype), EXPERT_IN)
  ye = partition.constrain(ye, TOKEN_SLOTS)
  y = jnp.einsum("blec,becd->bld", routing.combine.astype(dtype), ye)
  aux = {"load_balance_loss": routing.load_balance_loss,
         "dropped_tokens": routing.dropped_tokens}
  return partition.constrain(y, EMBED), aux
