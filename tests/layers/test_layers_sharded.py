"""Sharded Transformers on a (2, 2, 2) mesh equal the single-device ones, in all frameworks.

Parameters are created by each adapter's ``init_sharded`` from the layers' logical axes, the
single-device weights are loaded into them with ``layers.from_canonical`` (keeping the
shardings), and the forward pass and gradient run under ``jax.jit`` and
``partition.axis_rules``. The compiled program must hold the collectives the strategy
implies: all-gathers of FSDP-sharded weights and all-reduce / reduce-scatter of partial
sums (tensor parallelism, gradient reduction).
"""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from layers_testlib import FSDP_TP, MESH, TARGETS, TOKENS, build, config, init_sharded, loss_fn

import layers
import partition

# Expert parallelism: experts over 'tensor', the rest FSDP.
EXPERT = FSDP_TP.override("expert=tensor", "mlp=null", "heads=null", "kv_heads=null",
                          "vocab=null")


def _spec(params, name):
  """The sharding spec of the parameter with canonical ``name`` (first layer if unrolled)."""
  flat = jax.tree_util.tree_flatten_with_path(partition.unbox(params))[0]
  for path, leaf in flat:
    parts = [q for k in path
             for q in str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
             .split("/")]
    if layers._canonical.canonical_name(parts) in ((name, None), (name, 0)):
      return leaf.sharding.spec
  raise KeyError(name)


def _assert_close(got, want, name=""):
  """rtol 1e-5 per element; atol 1e-5 of the tensor's largest entry, because a sharded
  program sums in another order, and an entry near zero in a tensor of O(1) entries carries
  an absolute rounding error of ~eps * (the sizes summed), not ~eps * itself."""
  want = np.asarray(want)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5,
                             atol=1e-5 * float(np.abs(want).max()), err_msg=name)


def _step(m):
  """One jitted program: loss, logits (the forward) and the gradient."""
  loss = loss_fn(m)
  with_logits = lambda p, t, y: (loss(p, t, y), m.apply(p, t))
  return jax.jit(jax.value_and_grad(with_logits, has_aux=True))


def _single_device(m):
  (loss, logits), grads = _step(m)(m.params, TOKENS, TARGETS)
  return layers.to_canonical(m.params), logits, loss, grads


def _run_sharded(m, params):
  tokens = jax.device_put(TOKENS, NamedSharding(MESH, P(("data", "fsdp"))))
  targets = jax.device_put(TARGETS, NamedSharding(MESH, P(("data", "fsdp"))))
  compiled = _step(m).lower(params, tokens, targets).compile()
  (loss, logits), grads = compiled(params, tokens, targets)
  return logits, loss, grads, compiled.as_text()


# Each framework's unrolled and stacked parameter declarations under FSDP+TP, and an MoE model
# under expert parallelism; scanned == unrolled is
# checked on one device in test_layers_models.py.
CASES = [("linen", False, "fsdp_tp", 0), ("nnx", True, "fsdp_tp", 0),
         ("haiku", True, "fsdp_tp", 0), ("linen", True, "expert", 4),
         ("haiku", False, "expert", 4)]


@pytest.mark.parametrize("framework,scan,table,experts", CASES)
@pytest.mark.slow
def test_sharded_forward_and_grad_equal_single_device(framework, scan, table, experts):
  rules = {"fsdp_tp": FSDP_TP, "expert": EXPERT}[table]
  cfg = config(scan_layers=scan, num_experts=experts, experts_per_token=2)
  # One model: its seed-3 weights on one device are the reference, and are loaded into the
  # params its init_sharded creates (those are seeded 0: every value is overwritten).
  m = build(framework, cfg, seed=3)
  weights, ref_logits, ref_loss, ref_grads = _single_device(m)
  params = layers.from_canonical(weights, like=init_sharded(m, rules))
  lead = (None,) if scan else ()
  if table == "fsdp_tp":
    # The fused QKV kernel (embed, kv_heads, q_per_kv + 2, head_dim): kv groups over tensor.
    assert _spec(params, "blocks/attn/qkv/kernel") == P(*lead, "fsdp", "tensor", None, None)
    assert _spec(params, "blocks/mlp/wo/kernel") == P(*lead, "tensor", "fsdp")
    assert _spec(params, "embed/embedding") == P("tensor", "fsdp")
  else:
    assert _spec(params, "blocks/moe/wi") == P(*lead, "tensor", "fsdp", None, None)
  with partition.axis_rules(rules, MESH):
    logits, loss, grads, hlo = _run_sharded(m, params)
  _assert_close(logits, ref_logits, "logits")
  np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
  got, want = layers.to_canonical(grads), layers.to_canonical(ref_grads)
  for name in want:
    _assert_close(got[name], want[name], name)
  assert "all-gather" in hlo                             # FSDP weights gathered
  assert "all-reduce" in hlo or "reduce-scatter" in hlo  # partial sums / grads reduced
