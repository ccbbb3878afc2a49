"""The tied embedding's gradient (``layers._model._tied_lm``'s custom VJP).

Reference: plain autodiff of the same function written untied, ``lm_head/kernel`` set to the
table's transpose; the tied table's gradient is then the untied model's lookup gradient plus
its projection gradient transposed. Checked on one device (where the lookup's term is a
scatter-add) and with the tokens sharded over 4 devices (where both terms are one dot, so the
gradient is reduced once: ``test_layers_collectives``). And on one device the step costs the
matmul FLOPs of an independent plain-JAX Llama (``benchmarks.accelerator``'s reference): no
dot with a one-hot ``(batch, length, vocab)`` array, which cost as much as the output
projection's forward pass.
"""

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jaxpr_testlib import matmul_flops
from layers_testlib import FRAMEWORKS, TARGETS, TOKENS, build, config, loss_fn
from marks_testlib import everyday
from mesh_testlib import make_mesh

import layers
import partition
from benchmarks import accelerator

DATA_PARALLEL = partition.AxisRules.from_file(
    pathlib.Path(__file__).resolve().parents[2] / "recipes" / "presets" / "data_parallel.yaml")


def _untied_reference_grads(m, cfg):
  """The tied model's weights in an untied model (``lm_head = table.T``): its gradients by
  plain autodiff, folded back onto the tied model's names."""
  untied_cfg = dataclasses.replace(cfg, tie_embeddings=False)
  weights = layers.to_canonical(m.params)
  untied = build(m.framework, untied_cfg)
  untied_weights = {**weights, "lm_head/kernel": np.asarray(weights["embed/embedding"]).T}
  params = layers.from_canonical(untied_weights, like=untied.params)
  grads = layers.to_canonical(jax.grad(loss_fn(untied))(params, TOKENS, TARGETS))
  table = np.asarray(grads.pop("embed/embedding")) + np.asarray(grads.pop("lm_head/kernel")).T
  return {**grads, "embed/embedding": table}


def _assert_grads_close(got, want):
  assert sorted(got) == sorted(want)
  for name, value in want.items():
    value = np.asarray(value)
    np.testing.assert_allclose(np.asarray(got[name]), value, rtol=1e-5,
                               atol=1e-6 * float(np.abs(value).max()), err_msg=name)


@pytest.mark.parametrize("framework", everyday(FRAMEWORKS, "linen"))
@pytest.mark.parametrize("sharded", [False, True], ids=["one_device", "data_parallel_4"])
def test_tied_table_gradient_equals_untied_autodiff(framework, sharded):
  cfg = config()
  m = build(framework, cfg)
  want = _untied_reference_grads(m, cfg)
  grad = jax.jit(jax.grad(loss_fn(m)))
  if not sharded:
    got = grad(m.params, TOKENS, TARGETS)
  else:
    mesh = make_mesh((4, 2), ("data", "tensor"), AxisType.Auto)   # TOKENS: a batch of 4
    tokens, targets = (jax.device_put(a, NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
                       for a in (TOKENS, TARGETS))
    params = jax.device_put(m.params, NamedSharding(mesh, jax.sharding.PartitionSpec()))
    with partition.axis_rules(DATA_PARALLEL, mesh):
      got = grad(params, tokens, targets)
  _assert_grads_close(layers.to_canonical(got), want)


def test_one_device_step_costs_the_matmul_flops_of_an_independent_llama():
  cfg = layers.TransformerConfig(vocab_size=512, embed_dim=32, mlp_dim=64, num_heads=4,
                                 num_kv_heads=2, head_dim=8, num_layers=2, max_len=64,
                                 scan_layers=True, attention="xla")
  tokens = jnp.zeros((2, 64), jnp.int32)
  ours, ours_grad = accelerator._ours(cfg, *tokens.shape)
  ref, ref_grad = accelerator._reference(cfg, None)
  ours_flops = matmul_flops(jax.make_jaxpr(ours_grad)(ours, tokens).jaxpr)
  ref_flops = matmul_flops(jax.make_jaxpr(ref_grad)(ref, tokens).jaxpr)
  one_hot_dot = 2 * tokens.size * cfg.vocab_size * cfg.embed_dim
  assert ours_flops == ref_flops, (ours_flops, ref_flops, one_hot_dot)
