"""Constraints inside an xmap body that maps mesh axes (issue 19, item 2).

Per-example gradients through a raw xmap (``Mean('batch')`` over a batch on ``data`` and a
serial loop) of a model that constrains its own activations: logical constraints drop the
mesh axes the xmap maps (the xmap places that dim), a hard-coded ``PartitionSpec`` naming
them is a ``ResourceError``. Reference: the mean gradient of the same model on one device.
"""

import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec
from mesh_testlib import make_mesh

import partition

PAIRS = [("batch", "data"), ("embed", "model"), ("mlp", "model")]
X = (np.arange(32.0, dtype=np.float32).reshape(8, 4) - 16) / 10


class _Constrained(nn.Module):
  """Constrains its activations by logical name, as the T5X decoder does."""

  @nn.compact
  def __call__(self, x):
    x = nn.with_logical_constraint(x, ("batch", "embed"))
    h = nn.Dense(8, use_bias=False, name="dense")(x)
    h = nn.with_logical_constraint(h, ("batch", "mlp"))
    h = partition.constrain(jnp.tanh(h), ("batch", "mlp"))
    return jnp.sum(h ** 2)


@pytest.fixture
def mesh():
  return make_mesh((4, 2), ("data", "model"), AxisType.Auto)


@pytest.mark.parametrize("rules_from", ["partition.axis_rules", "nn.logical_axis_rules"])
@pytest.mark.slow
def test_per_example_grads_of_a_model_that_constrains_activations(mesh, rules_from):
  model = _Constrained()
  params = model.init(jax.random.key(0), X[:1])
  want = jax.grad(lambda p: model.apply(p, X) / len(X))(params)

  def per_example(p, example):
    return model.apply(p, example[None])

  grads = partition.xmap(jax.grad(per_example), in_axes=({}, ["batch", ...]),
                         out_axes=partition.Mean("batch"),
                         axis_resources={"batch": ("data", partition.SerialLoop(2))})
  # partition.axis_rules also sets flax's rules; a user may set flax's own on top (T5X).
  context = (partition.axis_rules(PAIRS, mesh) if rules_from == "partition.axis_rules"
             else nn.logical_axis_rules(PAIRS))
  with jax.set_mesh(mesh), partition.axis_rules(PAIRS, mesh), context:
    got = jax.jit(grads)(params, X)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)


def test_flax_rules_outside_the_body_keep_the_mapped_axes(mesh):
  """The dropped axes are dropped only while the body is traced."""
  from flax.core import spmd
  seen = []

  def body(v):
    seen.append(dict(spmd.get_logical_axis_rules()))
    return v * 2

  with jax.set_mesh(mesh), partition.axis_rules(PAIRS, mesh):
    partition.xmap(body, ["batch", ...], ["batch", ...],
                   axis_resources={"batch": "data"})(X)
    after = dict(spmd.get_logical_axis_rules())
  assert seen == [{"batch": None, "embed": "model", "mlp": "model"}]
  assert after == {"batch": "data", "embed": "model", "mlp": "model"}


def test_hard_coded_partition_spec_on_a_mapped_axis_is_a_resource_error(mesh):
  def loss(w, example):
    return jnp.sum(jax.lax.with_sharding_constraint(example * w, PartitionSpec("data")))

  f = partition.xmap(loss, in_axes=({}, ["batch", ...]), out_axes=partition.Sum("batch"),
                     axis_resources={"batch": "data"})
  with jax.set_mesh(mesh), pytest.raises(partition.ResourceError) as info:
    f(jnp.float32(2.0), X)
  message = str(info.value)
  assert "loss): a sharding constraint in the function names mesh axes ('data',)" in message
  assert "with_sharding_constraint(x, P('data',))" in message
  assert "'data' (axis 'batch')" in message
  assert "partition.value_and_grad" in message


def test_constraints_in_the_body_see_xmaps_mesh_and_rules_without_a_context(mesh):
  """mesh= and a rules table given to xmap are what the body's constraints use, as a
  jax.set_mesh mesh and a partition.axis_rules table would be (no JAX RuntimeError asking
  for a context mesh, no silently dropped logical constraint)."""
  model = _Constrained()
  params = model.init(jax.random.key(0), X[:1])
  want = jax.grad(lambda p: model.apply(p, X) / len(X))(params)
  grads = partition.xmap(jax.grad(lambda p, example: model.apply(p, example[None])),
                         in_axes=({}, ["batch", ...]), out_axes=partition.Mean("batch"),
                         axis_resources=partition.AxisRules(PAIRS), mesh=mesh)
  with warnings.catch_warnings():
    # the example's 'batch' dim of size 1 lives on no mesh axis: 'data' is the xmap's
    warnings.simplefilter("error", partition.PartitionWarning)
    text = grads.lower(params, X).as_text()
  # the body's ('batch', 'mlp') constraints place mlp on 'model' (batch is the xmap's, on data)
  assert re.search(r'sharding_constraint %\d+ <@mesh, \[\{"data"\}, \{\}, \{"model"\}\]>', text)
  got = grads(params, X)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)

  def bare(example):  # a hard-coded spec on an axis the xmap does not map
    return jax.lax.with_sharding_constraint(example * 2, PartitionSpec("model"))

  out = partition.xmap(bare, ["batch", ...], ["batch", ...], axis_resources={"batch": "data"},
                       mesh=mesh)(X)
  assert out.sharding.spec == PartitionSpec("data", "model")
  np.testing.assert_array_equal(np.asarray(out), X * 2)
  mapped = partition.xmap(lambda e: jax.lax.with_sharding_constraint(e, PartitionSpec("data")),
                          ["batch", ...], ["batch", ...], axis_resources={"batch": "data"},
                          mesh=mesh)
  with pytest.raises(partition.ResourceError, match=r"names mesh axes \('data',\)"):
    mapped(X)
