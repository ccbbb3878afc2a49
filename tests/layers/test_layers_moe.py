"""Mixture of experts: capacity, dropped tokens, aux loss and a dense per-token reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from mesh_testlib import make_mesh

from layers import _moe

B, L, D, M, E = 2, 8, 16, 24, 4


def _fused(w):
  """The weights as ``_moe.moe`` takes them: gate and up fused into ``wi (E, D, 2, M)``."""
  return dict(router=w["router"], wi=jnp.stack([w["wi_gate"], w["wi_up"]], axis=2), wo=w["wo"])


def _weights(seed=0):
  k = jax.random.split(jax.random.key(seed), 5)
  n = lambda key, *s: 0.3 * jax.random.normal(key, s)
  return dict(router=n(k[0], D, E), wi_gate=n(k[1], E, D, M), wi_up=n(k[2], E, D, M),
              wo=n(k[3], E, M, D)), n(k[4], B, L, D) / 0.3


def _numpy_routing(logits, k, slots):
  """Reference: fill each expert's slots choice by choice, token by token."""
  logits = np.asarray(logits, np.float64)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  top = np.argsort(-probs, axis=-1, kind="stable")[..., :k]
  kept = np.zeros(top.shape, bool)
  for b in range(top.shape[0]):
    used = np.zeros(logits.shape[-1], int)
    for choice in range(k):
      for t in range(top.shape[1]):
        e = top[b, t, choice]
        kept[b, t, choice] = used[e] < slots
        used[e] += 1
  return probs, top, kept


@pytest.mark.parametrize("k,factor", [(1, 1.0), (2, 0.5), (2, 1.0), (3, 0.75)])
@pytest.mark.slow
def test_routing_respects_capacity_and_counts_drops(k, factor):
  logits = jax.random.normal(jax.random.key(k), (B, L, E)) * 2
  r = _moe.route(logits, k=k, capacity_factor=factor)
  slots = _moe.capacity(L, E, k, factor)
  assert r.dispatch.shape == (B, L, E, slots)
  dispatch = np.asarray(r.dispatch)
  assert dispatch.sum(axis=1).max() <= 1                  # one token per slot
  assert dispatch.sum(axis=(1, 3)).max() <= slots         # capacity per expert
  assert dispatch.sum(axis=(2, 3)).max() <= k             # at most k slots per token
  probs, top, kept = _numpy_routing(logits, k, slots)
  assert int(r.dropped_tokens) == int((~kept).sum())
  assert int(dispatch.sum()) == int(kept.sum())
  gates = np.take_along_axis(probs, top, -1)
  gates /= gates.sum(-1, keepdims=True)
  expected = np.zeros((B, L, E))
  for b, t, c in zip(*np.nonzero(kept)):
    expected[b, t, top[b, t, c]] += gates[b, t, c]
  np.testing.assert_allclose(np.asarray(r.combine).sum(-1), expected, rtol=1e-5, atol=1e-7)


def test_load_balance_loss_matches_switch_formula():
  logits = jax.random.normal(jax.random.key(5), (B, L, E))
  r = _moe.route(logits, k=2, capacity_factor=1.0)
  probs, top, _ = _numpy_routing(logits, 2, 8)
  fraction = np.stack([(top == e).sum() for e in range(E)]) / (B * L * 2)
  expected = E * np.sum(fraction * probs.mean(axis=(0, 1)))
  np.testing.assert_allclose(float(r.load_balance_loss), expected, rtol=1e-5)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.slow
def test_moe_equals_dense_per_token_reference_when_nothing_is_dropped(k):
  w, x = _weights()
  y, aux = _moe.moe(x, **_fused(w), k=k, capacity_factor=E / k)   # capacity == length: no drops
  assert int(aux["dropped_tokens"]) == 0
  xn = np.asarray(x, np.float64)
  wn = {n: np.asarray(v, np.float64) for n, v in w.items()}
  probs, top, _ = _numpy_routing(xn @ wn["router"], k, L)
  silu = lambda v: v / (1 + np.exp(-v))
  ref = np.zeros_like(xn)
  for b in range(B):
    for t in range(L):
      gates = probs[b, t, top[b, t]] / probs[b, t, top[b, t]].sum()
      for g, e in zip(gates, top[b, t]):
        h = silu(xn[b, t] @ wn["wi_gate"][e]) * (xn[b, t] @ wn["wi_up"][e])
        ref[b, t] += g * (h @ wn["wo"][e])
  np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_dropped_tokens_get_no_expert_output():
  w, x = _weights(1)
  y, aux = _moe.moe(x, **_fused(w), k=1, capacity_factor=0.25)    # 1 slot per expert per sequence
  _, top, kept = _numpy_routing(np.asarray(x @ w["router"]), 1, 1)
  distinct = sum(len(set(top[b, :, 0])) for b in range(B))
  assert int(aux["dropped_tokens"]) == B * L - distinct
  routed = np.asarray(jnp.abs(y).sum(-1) > 0)
  np.testing.assert_array_equal(routed, kept[..., 0])     # dropped tokens output zero


@pytest.mark.parametrize("length, experts, k", [(8, 4, 2), (7, 3, 2), (13, 8, 2), (5, 6, 1),
                                                (9, 7, 3)])
def test_capacity_factor_experts_over_k_never_drops(length, experts, k):
  """The rule from_hf uses for Mixtral: capacity_factor = num_experts / k gives each expert a
  slot for every token of the sequence, so even when every token picks the same experts
  (the worst imbalance) nothing is dropped."""
  assert _moe.capacity(length, experts, k, experts / k) >= length
  skewed = jnp.broadcast_to(jnp.arange(experts, 0, -1, dtype=jnp.float32), (2, length, experts))
  r = _moe.route(skewed, k=k, capacity_factor=experts / k)
  assert int(r.dropped_tokens) == 0
  np.testing.assert_allclose(np.asarray(r.combine).sum((-1, -2)), 1.0, rtol=1e-6)
  # one slot fewer per expert and the same routing drops tokens
  factor = (length - 1) * experts / (length * k)
  assert _moe.capacity(length, experts, k, factor) == length - 1
  assert int(_moe.route(skewed, k=k, capacity_factor=factor).dropped_tokens) == 2 * k


@pytest.mark.parametrize("k", [1, 2, 3, 8])
def test_top_k_is_lax_top_k_ties_and_gradients_included(k):
  x = jax.random.normal(jax.random.key(3), (4, 16, 8))
  x = x.at[0, 0, 3].set(x[0, 0, 5]).at[1, 2].set(0.5)   # a tie, and a row of equal values
  want_v, want_i = jax.lax.top_k(x, k)
  got_v, got_i = _moe.top_k(x, k)
  np.testing.assert_array_equal(got_i, want_i)
  np.testing.assert_array_equal(got_v, want_v)
  grad = lambda top: jax.grad(lambda x: (top(x, k)[0] ** 2).sum())(x)
  np.testing.assert_array_equal(grad(_moe.top_k), grad(jax.lax.top_k))


def test_routing_keeps_a_batch_sharded_router_on_its_devices():
  # lax.top_k is not partitioned by XLA: it gathered the router's (batch, length, expert)
  # probabilities from all 8 devices, and every device routed the global batch
  mesh = make_mesh((8,), ("data",), jax.sharding.AxisType.Auto)
  logits = jax.device_put(jax.random.normal(jax.random.key(0), (8, 32, 4)),
                          NamedSharding(mesh, PartitionSpec("data")))
  route = jax.jit(lambda x: _moe.route(x, k=2, capacity_factor=1.25).combine)
  hlo = route.lower(logits).compile().as_text()
  assert "all-gather" not in hlo
  one_device = _moe.route(np.asarray(logits), k=2, capacity_factor=1.25).combine
  np.testing.assert_array_equal(route(logits), one_device)
