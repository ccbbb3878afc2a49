"""partition.haiku: get_parameter(axes=), path tables, sharded init, apply constraints."""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import partition
import partition.haiku

RULES = [("batch", "data"), ("embed", "fsdp"), ("mlp", "tensor")]
TABLE = partition.PathRules([(r"linear_0/w$", ("embed", "mlp")), (r"linear_0/b$", ("mlp",)),
                             (r"linear_1/w$", ("mlp", "embed"))])


def _mesh(axis_type=AxisType.Explicit):
  return jax.make_mesh((4, 2), ("fsdp", "tensor"), axis_types=(axis_type,) * 2)


def stock(x):
  return hk.nets.MLP([16, 8])(x)


class Mine(hk.Module):
  def __call__(self, x):
    w = partition.haiku.get_parameter("w", (x.shape[-1], 16), init=jnp.ones,
                                      axes=("embed", "mlp"))
    return partition.constrain(x @ w, ("batch", "mlp"))


def test_path_table_init_sharded_specs_and_values():
  f = hk.transform(stock)
  x = jnp.ones((4, 8))
  mesh = _mesh()
  params = partition.haiku.init_sharded(f, jax.random.key(0), x, rules=RULES, mesh=mesh,
                                        param_axes=TABLE)
  specs = jax.tree.map(lambda a: a.sharding.spec, params)
  assert specs == {"mlp/~/linear_0": {"w": P("fsdp", "tensor"), "b": P("tensor")},
                   "mlp/~/linear_1": {"w": P("tensor", "fsdp"), "b": P()}}
  for leaf in jax.tree.leaves(params):
    assert isinstance(leaf, jax.Array) and isinstance(leaf.sharding, NamedSharding)
  ref = f.init(jax.random.key(0), x)  # independent reference: unsharded init
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


def test_path_table_as_pairs():
  params = partition.haiku.init_sharded(
      hk.transform(stock), jax.random.key(0), jnp.ones((4, 8)), rules=RULES, mesh=_mesh(),
      param_axes=[(r"/w$", ("embed", "mlp"))])
  assert params["mlp/~/linear_1"]["w"].sharding.spec == P("fsdp", "tensor")


def test_get_parameter_records_axes_and_constrains_at_apply():
  f = hk.transform(lambda x: Mine()(x))
  x = jnp.ones((4, 8))
  assert partition.haiku.eval_axes(f, jax.random.key(0), x) == {"mine": {"w": ("embed",
                                                                              "mlp")}}
  mesh = _mesh(AxisType.Auto)
  params = partition.haiku.init_sharded(f, jax.random.key(0), x, rules=RULES, mesh=mesh)
  assert params["mine"]["w"].sharding.spec == P("fsdp", "tensor")
  with partition.axis_rules(RULES, mesh):
    text = jax.jit(f.apply).lower(params, None, x).as_text()
    y = jax.jit(f.apply)(params, None, x)
  assert text.count("sharding_constraint") >= 2  # the param and the activation
  np.testing.assert_allclose(np.asarray(y), np.asarray(x) @ np.ones((8, 16)))


def test_get_parameter_rank_error():
  f = hk.transform(lambda x: partition.haiku.get_parameter("w", (2, 3), init=jnp.ones,
                                                           axes=("embed",)))
  with pytest.raises(ValueError, match=r"shape \(2, 3\) has 2 dims but axes=\('embed',\) "
                                       r"names 1\. Give one logical"):
    f.init(jax.random.key(0), None)


def test_param_axes_from_inside_transform_creator_and_getter():
  def fn(x):
    with partition.haiku.param_axes_from(TABLE):
      return stock(x)

  f = hk.transform(fn)
  x = jnp.ones((4, 8))
  axes = partition.haiku.eval_axes(f, jax.random.key(0), x)
  assert axes["mlp/~/linear_0"] == {"w": ("embed", "mlp"), "b": ("mlp",)}
  assert axes["mlp/~/linear_1"] == {"w": ("mlp", "embed"), "b": None}
  mesh = _mesh(AxisType.Auto)
  params = partition.haiku.init_sharded(f, jax.random.key(0), x, rules=RULES, mesh=mesh)
  assert params["mlp/~/linear_1"]["w"].sharding.spec == P("tensor", "fsdp")
  with partition.axis_rules(RULES, mesh):
    text = jax.jit(f.apply).lower(params, None, x).as_text()
  assert text.count("sharding_constraint") >= 3  # the getter constrains 3 annotated params


def test_annotate_gives_boxes_logical_axes_reads():
  boxed = partition.haiku.annotate(hk.transform(stock), jax.random.key(0), jnp.ones((4, 8)),
                                   param_axes=TABLE)
  assert isinstance(boxed["mlp/~/linear_0"]["w"], partition.Annotated)
  assert partition.logical_axes(boxed)["mlp/~/linear_0"] == {"w": ("embed", "mlp"),
                                                              "b": ("mlp",)}
  assert partition.unbox(boxed)["mlp/~/linear_1"]["b"].shape == (8,)


def test_transform_with_state_and_abstract_and_explain():
  def fn(x):
    counter = hk.get_state("count", (), jnp.int32, init=jnp.zeros)
    hk.set_state("count", counter + 1)
    return stock(x)

  f = hk.transform_with_state(fn)
  x = jnp.ones((4, 8))
  params, state = partition.haiku.init_sharded(f, jax.random.key(0), x, rules=RULES,
                                               mesh=_mesh(), param_axes=TABLE)
  assert params["mlp/~/linear_0"]["w"].sharding.spec == P("fsdp", "tensor")
  assert state["~"]["count"].sharding.spec == P()
  abstract = partition.haiku.abstract_init(hk.transform(stock), jax.random.key(0), x,
                                           rules=RULES, mesh=_mesh(), param_axes=TABLE)
  assert abstract["mlp/~/linear_0"]["w"].sharding.spec == P("fsdp", "tensor")
  report = partition.haiku.explain(hk.transform(stock), jax.random.key(0), x, rules=RULES,
                                   mesh=_mesh(), param_axes=TABLE)
  assert report.bytes_per_device == 4 * (8 * 16 // 8 + 16 // 2 + 16 * 8 // 8 + 8)


def test_rank_mismatch_in_table_names_path():
  bad = partition.PathRules([(r"linear_0/b$", ("embed", "mlp"))])
  with pytest.raises(ValueError, match=r"mlp/~/linear_0/b: pattern #0"):
    partition.haiku.init_sharded(hk.transform(stock), jax.random.key(0), jnp.ones((4, 8)),
                                 rules=RULES, mesh=_mesh(), param_axes=bad)
