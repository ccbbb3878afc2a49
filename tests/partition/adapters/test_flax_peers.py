"""Linen models written in the style of the peers, sharded as flax itself would shard them.

* flax's lm1b example: attention kernels are 3-D but boxed with 2 names ('embed', 'kv').
* T5X / flaxformer: ``param_with_axes`` (a ``params_axes`` collection).
* flax's sharding guide: ``nn.with_partitioning`` with mesh-axis names.

The reference is flax's own resolver (``nn.logical_to_mesh_sharding`` over
``nn.get_partition_spec`` / ``get_axis_names``), and outputs are compared with one device.
"""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.linen import partitioning as nn_partitioning
from jax.sharding import AxisType, NamedSharding
from mesh_testlib import make_mesh

import partition
import partition.flax

RULES = [("batch", ("data", "fsdp")), ("embed", "fsdp"), ("mlp", "tensor"),
         ("heads", "tensor"), ("kv", None), ("vocab", "tensor"), ("length", None)]
LOGICAL = nn.with_logical_partitioning
INIT = nn.initializers.normal(0.02)
MESH = make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), AxisType.Auto)


class Lm1bBlock(nn.Module):
  """The shape of flax/examples/lm1b/models.py's EncoderDecoder1DBlock + embedding."""

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(32, 16, embedding_init=LOGICAL(INIT, ("vocab", "embed")))(tokens)
    y = nn.LayerNorm(scale_init=LOGICAL(nn.initializers.ones, ("embed",)),
                     bias_init=LOGICAL(nn.initializers.zeros, ("embed",)))(x)
    y = nn.MultiHeadDotProductAttention(
        num_heads=4, qkv_features=16, kernel_init=LOGICAL(INIT, ("embed", "kv")),
        bias_init=LOGICAL(nn.initializers.zeros, ("embed",)), use_bias=False,
        deterministic=True)(y)
    x = x + y
    h = nn.Dense(32, kernel_init=LOGICAL(INIT, ("embed", "mlp")))(x)
    return x + nn.Dense(16, kernel_init=LOGICAL(INIT, ("mlp", "embed")))(nn.relu(h))


class T5Dense(nn.Module):
  """flaxformer's DenseGeneral style: param_with_axes, no boxes."""

  features: int
  axes: tuple

  @nn.compact
  def __call__(self, x):
    kernel = nn_partitioning.param_with_axes("kernel", INIT, (x.shape[-1], self.features),
                                             axes=self.axes)
    return x @ kernel


class T5Mlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    scale = nn_partitioning.param_with_axes("scale", nn.initializers.ones, (x.shape[-1],),
                                            axes=("embed",))
    h = T5Dense(32, ("embed", "mlp"), name="wi")(x * scale)
    return T5Dense(16, ("mlp", "embed"), name="wo")(nn.relu(h))


class GuideMlp(nn.Module):
  """flax's sharding guide: mesh axes given directly with nn.with_partitioning."""

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(32, kernel_init=nn.with_partitioning(INIT, (None, "tensor")))(x)
    return nn.Dense(16, kernel_init=nn.with_partitioning(INIT, ("tensor", "fsdp")))(h)


def flax_shardings(abstract, mesh):
  """flax's own resolution of every box of ``abstract`` (linen's documented recipe)."""
  with nn.logical_axis_rules(RULES):
    return nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, RULES)


def assert_same_shardings(variables, reference, collection="params"):
  got = jax.tree.leaves(nn.unbox(variables[collection]))
  want = jax.tree.leaves(reference[collection],
                         is_leaf=lambda x: isinstance(x, NamedSharding))
  assert len(got) == len(want) > 0
  for leaf, ref in zip(got, want):
    assert leaf.sharding.is_equivalent_to(ref, leaf.ndim), (leaf.sharding, ref)


def single_device_output(model, variables, x):
  host = jax.tree.map(np.asarray, nn.unbox(variables))
  return model.apply(host, np.asarray(x))


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
@pytest.mark.slow
def test_lm1b_prefix_axes_match_flax_and_outputs_match_one_device(axis_type):
  mesh = make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_type)
  model, tokens = Lm1bBlock(), jnp.arange(16).reshape(4, 4) % 32
  abstract = jax.eval_shape(model.init, jax.random.key(0), tokens)
  variables = partition.flax.init_sharded(model, jax.random.key(0), tokens, rules=RULES,
                                          mesh=mesh)
  assert_same_shardings(variables, flax_shardings(abstract, mesh))
  query = variables["params"]["MultiHeadDotProductAttention_0"]["query"]["kernel"]
  assert query.value.ndim == 3 and query.names == ("embed", "kv")
  if axis_type == AxisType.Auto:  # stock nn.Embed's gather needs out_sharding= on Explicit
    with jax.set_mesh(mesh):
      out = jax.jit(model.apply)(variables, tokens)
    np.testing.assert_allclose(out, single_device_output(model, variables, tokens),
                               rtol=1e-5, atol=1e-6)
  report = partition.flax.explain(model, jax.random.key(0), tokens, rules=RULES, mesh=mesh)
  paths = [r.path for r in report.rows]
  assert "params/MultiHeadDotProductAttention_0/query/kernel" in paths


def test_t5x_param_with_axes_are_read_and_match_flax():
  mesh = MESH
  model, x = T5Mlp(), jnp.ones((4, 16))
  abstract = jax.eval_shape(model.init, jax.random.key(0), x)
  variables = partition.flax.init_sharded(model, jax.random.key(0), x, rules=RULES, mesh=mesh)
  # Independent reference: flax's get_axis_names over T5X's params_axes collection.
  names = nn_partitioning.get_axis_names(abstract["params_axes"])
  reference = nn.logical_to_mesh_sharding(names, mesh, RULES)
  for path in (("wi", "kernel"), ("wo", "kernel"), ("scale",)):
    leaf, ref = variables["params"], reference
    for k in path:
      leaf, ref = leaf[k], ref[k]
    assert leaf.sharding.is_equivalent_to(ref, leaf.ndim), path
  assert variables["params"]["wi"]["kernel"].sharding.spec == jax.P("fsdp", "tensor")
  np.testing.assert_allclose(model.apply(variables, x), single_device_output(model, variables, x),
                             rtol=1e-5)


def test_with_partitioning_mesh_axes_pass_through_as_in_flax():
  mesh = MESH
  model, x = GuideMlp(), jnp.ones((4, 16))
  abstract = jax.eval_shape(model.init, jax.random.key(0), x)
  with warnings.catch_warnings():
    warnings.simplefilter("error", partition.ReplicatedWarning)
    variables = partition.flax.init_sharded(model, jax.random.key(0), x, rules=RULES,
                                            mesh=mesh)
  # Independent reference: flax's get_sharding reads nn.Partitioned's mesh axes as they are.
  assert_same_shardings(variables, nn.get_sharding(abstract, mesh))
  assert variables["params"]["Dense_1"]["kernel"].value.sharding.spec == jax.P("tensor", "fsdp")


def test_unannotated_model_warns_once_with_bytes_and_strict_raises():
  class Plain(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(256)(nn.Dense(128)(x))

  mesh, x = MESH, jnp.ones((4, 128))
  with pytest.warns(partition.ReplicatedWarning) as caught:
    partition.flax.init_sharded(Plain(), jax.random.key(0), x, rules=RULES, mesh=mesh)
  assert len(caught) == 1
  text = str(caught[0].message)
  # 128*256*4 + 128*128*4 bytes of kernels + 384*4 of biases, replicated on each device
  assert text.startswith("partition.flax.init_sharded: 4 parameter(s) are fully replicated "
                         "on 8 devices, 193.50 KiB per device:")
  assert "params/Dense_0/kernel f32[128,256]: no logical axes" in text
  with pytest.raises(partition.PlacementError, match="params/Dense_0/kernel: no declared axes "
                                                     "and no path pattern matches it"):
    partition.flax.init_sharded(Plain(), jax.random.key(0), x, rules=RULES, mesh=mesh,
                                param_axes=[(r"Dense_1/kernel$", ("embed", "mlp")),
                                            (r"bias$", None)], strict=True)


def test_strict_lists_typos_and_indivisible_dims_in_one_error():
  class Typo(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.Dense(32, kernel_init=LOGICAL(INIT, ("embd", "mlp")))(x)
      return nn.Dense(5, kernel_init=LOGICAL(INIT, ("embed", "vocab")))(h)

  with pytest.raises(partition.PlacementError) as e:
    partition.flax.init_sharded(Typo(), jax.random.key(0), jnp.ones((4, 16)), rules=RULES,
                                mesh=MESH, strict=True)
  text = str(e.value)
  assert "params/Dense_0/kernel dim 0: logical axis 'embd' has no rule (did you mean " \
         "'embed'?)" in text
  assert "params/Dense_1/kernel dim 1 'vocab': no rule divides it (size 5, needs a multiple " \
         "of 2)" in text


@pytest.mark.slow
def test_path_table_override_replaces_declared_axes():
  mesh, model = MESH, Lm1bBlock()
  tokens = jnp.arange(16).reshape(4, 4) % 32
  table = partition.PathRules([(r"Dense_0/kernel$", ("mlp", "embed"))], override=True)
  variables = partition.flax.init_sharded(model, jax.random.key(0), tokens, rules=RULES,
                                          mesh=mesh, param_axes=table)
  assert variables["params"]["Dense_0"]["kernel"].value.sharding.spec == jax.P("tensor", "fsdp")
  plain = partition.flax.init_sharded(model, jax.random.key(0), tokens, rules=RULES,
                                      mesh=mesh, param_axes=table.pairs)
  assert plain["params"]["Dense_0"]["kernel"].value.sharding.spec == jax.P("fsdp", "tensor")


def test_t5x_full_path_table_under_strict_counts_declared_parameters_as_matched():
  """A pattern that matches a parameter has matched it, even when the parameter's own
  params_axes win (issue 19: strict=True listed every such pattern as unused)."""
  mesh, model, x = MESH, T5Mlp(), jnp.ones((4, 16))
  table = partition.PathRules([(r"^params/scale$", ("embed",)),
                               (r"^params/wi/kernel$", ("embed", "mlp")),
                               (r"^params/wo/kernel$", ("mlp", "embed"))])
  variables = partition.flax.init_sharded(model, jax.random.key(0), x, rules=RULES, mesh=mesh,
                                          param_axes=table, strict=True)
  assert variables["params"]["wi"]["kernel"].sharding.spec == jax.P("fsdp", "tensor")
  report = table.match(jax.eval_shape(model.init, jax.random.key(0), x))
  assert report.unused == ()
  assert set(report.declared) == {"params/scale", "params/wi/kernel", "params/wo/kernel"}
  stale = table + [(r"^params/gone$", None)]
  with pytest.raises(partition.PlacementError, match=r"'\^params/gone\$'"):
    partition.flax.init_sharded(model, jax.random.key(0), x, rules=RULES, mesh=mesh,
                                param_axes=stale, strict=True)
