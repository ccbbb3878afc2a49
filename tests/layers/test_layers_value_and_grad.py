"""``partition.value_and_grad`` with micro-batches on each framework's Transformer.

Sharded (FSDP+TP on a (2, 2, 2) mesh) and in 2 sequential micro-batches, the loss and the
gradient equal plain ``jax.value_and_grad`` of the full batch on one device.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from layers_testlib import FRAMEWORKS, FSDP_TP, MESH, build, config, init_sharded

import layers
import partition
import partition.haiku

if not hasattr(partition, "value_and_grad"):
  pytest.skip("partition.value_and_grad has not landed yet", allow_module_level=True)

TOKENS = jax.random.randint(jax.random.key(4), (8, 8), 0, 64)
BATCH = {"tokens": TOKENS, "targets": jax.random.randint(jax.random.key(5), (8, 8), 0, 64)}
BATCH_AXES = {"tokens": ("batch", "length"), "targets": ("batch", "length")}


def _loss(m):
  def loss(params, batch):
    logp = jax.nn.log_softmax(m.apply(params, batch["tokens"]).astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1))
  return loss


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.slow
def test_value_and_grad_with_microbatches_equals_full_batch(framework):
  cfg = config(scan_layers=framework != "linen")
  m = build(framework, cfg, tokens=TOKENS)
  ref_loss, ref_grads = jax.jit(jax.value_and_grad(_loss(m)))(m.params, BATCH)
  params = layers.from_canonical(layers.to_canonical(m.params),
                                 like=init_sharded(m, FSDP_TP, tokens=TOKENS))
  # Haiku params are plain dicts: their axes come from the model's declarations.
  param_axes = (partition.haiku.eval_axes(m.init, jax.random.key(0), TOKENS)
                if framework == "haiku" else None)
  step = partition.value_and_grad(_loss(m), batch_axes=BATCH_AXES, param_axes=param_axes,
                                  rules=FSDP_TP, mesh=MESH, microbatches=2)
  loss, grads = step(params, BATCH)
  np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
  got, want = layers.to_canonical(grads), layers.to_canonical(ref_grads)
  assert sorted(got) == sorted(want)
  for name in want:
    w = np.asarray(want[name])
    # atol relative to the tensor's scale: micro-batching and sharding reorder the sums.
    np.testing.assert_allclose(np.asarray(got[name]), w, rtol=1e-5,
                               atol=1e-5 * float(np.abs(w).max()), err_msg=name)
