"""partition.haiku: get_parameter(axes=), path tables, sharded init, apply constraints."""

import re

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from mesh_testlib import make_mesh

import partition
import partition.haiku

RULES = [("batch", "data"), ("embed", "fsdp"), ("mlp", "tensor")]
TABLE = partition.PathRules([(r"linear_0/w$", ("embed", "mlp")), (r"linear_0/b$", ("mlp",)),
                             (r"linear_1/w$", ("mlp", "embed"))])
MESH = make_mesh((4, 2), ("fsdp", "tensor"), AxisType.Explicit)
AUTO_MESH = make_mesh((4, 2), ("fsdp", "tensor"), AxisType.Auto)
MESH_3D = make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), AxisType.Explicit)


def stock(x):
  return hk.nets.MLP([16, 8])(x)


class Mine(hk.Module):
  def __call__(self, x):
    w = partition.haiku.get_parameter("w", (x.shape[-1], 16), init=jnp.ones,
                                      axes=("embed", "mlp"))
    return partition.constrain(x @ w, ("batch", "mlp"))


@pytest.mark.slow
def test_path_table_init_sharded_specs_and_values():
  f = hk.transform(stock)
  x = jnp.ones((4, 8))
  mesh = MESH
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
      hk.transform(stock), jax.random.key(0), jnp.ones((4, 8)), rules=RULES, mesh=MESH,
      param_axes=[(r"/w$", ("embed", "mlp"))])
  assert params["mlp/~/linear_1"]["w"].sharding.spec == P("fsdp", "tensor")


def test_get_parameter_records_axes_and_constrains_at_apply():
  f = hk.transform(lambda x: Mine()(x))
  x = jnp.ones((4, 8))
  assert partition.haiku.eval_axes(f, jax.random.key(0), x) == {"mine": {"w": ("embed",
                                                                              "mlp")}}
  mesh = AUTO_MESH
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
  mesh = AUTO_MESH
  params = partition.haiku.init_sharded(f, jax.random.key(0), x, rules=RULES, mesh=mesh)
  assert params["mlp/~/linear_1"]["w"].sharding.spec == P("tensor", "fsdp")
  with partition.axis_rules(RULES, mesh):
    text = jax.jit(f.apply).lower(params, None, x).as_text()
  assert text.count("sharding_constraint") >= 3  # the getter constrains 3 annotated params


def test_annotate_gives_boxes_logical_axes_reads():
  boxed = partition.haiku.annotate(hk.transform(stock), jax.random.key(0), jnp.ones((4, 8)),
                                   param_axes=TABLE)
  assert isinstance(boxed["mlp/~/linear_0"]["w"], partition.WithAxes)
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
                                               mesh=MESH, param_axes=TABLE)
  assert params["mlp/~/linear_0"]["w"].sharding.spec == P("fsdp", "tensor")
  assert state["~"]["count"].sharding.spec == P()
  abstract = partition.haiku.abstract_init(hk.transform(stock), jax.random.key(0), x,
                                           rules=RULES, mesh=MESH, param_axes=TABLE)
  assert abstract["mlp/~/linear_0"]["w"].sharding.spec == P("fsdp", "tensor")
  report = partition.haiku.explain(hk.transform(stock), jax.random.key(0), x, rules=RULES,
                                   mesh=MESH, param_axes=TABLE)
  assert report.bytes_per_device == 4 * (8 * 16 // 8 + 16 // 2 + 16 * 8 // 8 + 8)


def test_rank_mismatch_in_table_names_path():
  bad = partition.PathRules([(r"linear_0/b$", ("embed", "mlp"))])
  with pytest.raises(partition.PathRulesError, match=r"mlp/~/linear_0/b: pattern #0") as info:
    partition.haiku.init_sharded(hk.transform(stock), jax.random.key(0), jnp.ones((4, 8)),
                                 rules=RULES, mesh=MESH, param_axes=bad)
  # the same class as partition.flax raises for the same mistake (one class per mistake)
  assert "got logical axes of the wrong rank from param_axes" in str(info.value)
  assert "at most one name (or None) per dim" in str(info.value)


# -- hk.layer_stack: a leading stacked axis ----------------------------------------------------

STACK_RULES = [("layers", "data"), ("embed", "fsdp"), ("mlp", "tensor")]


class Dense(hk.Module):
  def __call__(self, x):
    w = partition.haiku.get_parameter("w", (x.shape[-1], 8), init=jnp.ones,
                                      axes=("embed", "mlp"))
    return x @ w / 8


def test_layer_stack_get_parameter_gets_leading_stack_axis():
  f = hk.transform(lambda x: hk.layer_stack(4)(lambda h: Dense()(h))(x))
  x = jnp.ones((2, 8))
  axes = partition.haiku.eval_axes(f, jax.random.key(0), x)
  assert axes == {"__layer_stack_no_per_layer/dense": {"w": ("layers", "embed", "mlp")}}
  renamed = partition.haiku.eval_axes(f, jax.random.key(0), x, stack_axis="stage")
  assert renamed["__layer_stack_no_per_layer/dense"]["w"] == ("stage", "embed", "mlp")
  unnamed = partition.haiku.eval_axes(f, jax.random.key(0), x, stack_axis=None)
  assert unnamed["__layer_stack_no_per_layer/dense"]["w"] == (None, "embed", "mlp")
  params = partition.haiku.init_sharded(f, jax.random.key(0), x, rules=STACK_RULES,
                                        mesh=MESH_3D)
  w = params["__layer_stack_no_per_layer/dense"]["w"]
  assert w.shape == (4, 8, 8) and w.sharding.spec == P("data", "fsdp", "tensor")
  np.testing.assert_array_equal(np.asarray(w), np.ones((4, 8, 8)))


@pytest.mark.slow
@pytest.mark.bitwise  # Haiku's eager init against a jitted, sharded one
def test_layer_stack_param_axes_from_and_table_nested_and_per_layer_inputs():
  table = [(r"/w$", ("embed", "mlp")), (r"/b$", ("mlp",))]

  def inner(h):
    return hk.Linear(8)(h)

  def nested(x):
    with partition.haiku.param_axes_from(table):
      return hk.layer_stack(2)(lambda h: hk.layer_stack(3)(inner)(h))(x)

  x = jnp.ones((2, 8))
  axes = partition.haiku.eval_axes(hk.transform(nested), jax.random.key(0), x)
  (leaf,) = axes.values()
  assert leaf == {"w": ("layers", "layers", "embed", "mlp"), "b": ("layers", "layers", "mlp")}

  def per_layer(x, ys):
    return hk.experimental.layer_stack(4, with_per_layer_inputs=True)(
        lambda h, y: (hk.Linear(8)(h) + y, None))(x, ys)

  f = hk.transform(per_layer)
  ys = jnp.ones((4, 2, 8))
  # The table given outside the transform works the same way; full-rank axes are kept.
  axes = partition.haiku.eval_axes(f, jax.random.key(0), x, ys,
                                   param_axes=[(r"/w$", ("layers", None, "mlp"))] + table)
  (leaf,) = axes.values()
  assert leaf == {"w": ("layers", None, "mlp"), "b": ("layers", "mlp")}
  params = partition.haiku.init_sharded(f, jax.random.key(1), x, ys, rules=STACK_RULES,
                                        mesh=MESH_3D, param_axes=table)
  (p,) = params.values()
  assert p["w"].sharding.spec == P("data", "fsdp", "tensor")
  assert p["b"].sharding.spec == P("data", "tensor")
  ref = f.init(jax.random.key(1), x, ys)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_layer_stack_rank_error_mentions_layer_stack():
  f = hk.transform(lambda x: hk.layer_stack(3)(lambda h: hk.Linear(8)(h))(x))
  x = jnp.ones((2, 8))
  # A short tuple is a per-layer prefix (as in flax), the stacked dim goes in front.
  axes = partition.haiku.eval_axes(f, jax.random.key(0), x, param_axes=[(r"/w$", ("mlp",))])
  assert axes["__layer_stack_no_per_layer/linear"]["w"] == ("layers", "mlp", None)
  with pytest.raises(ValueError, match=r"(?s)linear/w: pattern #0 '/w\$' gives \('a', 'b', "
                                       r"'c', 'd'\) \(4 names\) but it has shape \(3, 8, 8\); "
                                       r"it is stacked by hk.layer_stack.*give at most 2 "
                                       r"per-layer names"):
    partition.haiku.eval_axes(f, jax.random.key(0), x,
                              param_axes=[(r"/w$", ("a", "b", "c", "d"))])


# -- Python flags stay static; strict belongs to the adapter -----------------------------------


def flagged(x, is_training):
  h = hk.nets.MLP([8, 8])(x)
  return hk.dropout(hk.next_rng_key(), 0.5, h) if is_training else h


@pytest.mark.slow
@pytest.mark.bitwise  # Haiku's eager init against a jitted one
def test_python_flags_are_static_and_values_match_init():
  f = hk.transform(flagged)
  x = jnp.ones((4, 8))
  params = partition.haiku.init_sharded(f, jax.random.key(0), x, True, rules=RULES,
                                        mesh=MESH, param_axes=TABLE)
  ref = f.init(jax.random.key(0), x, True)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # An array flag is traced: a clear error, and static_argnums fixes it.
  with pytest.raises(TypeError, match=r"(?s)needs a concrete Python value.*args\[1\] "
                                      r"\(bool\[\]\).*static_argnums=") as info:
    partition.haiku.init_sharded(f, jax.random.key(0), x, jnp.array(True), rules=RULES,
                                 mesh=MESH, param_axes=TABLE)
  assert isinstance(info.value, partition.PartitionError)
  assert isinstance(info.value.__cause__, jax.errors.TracerBoolConversionError)
  again = partition.haiku.init_sharded(f, jax.random.key(0), x, jnp.array(True), rules=RULES,
                                       mesh=MESH, param_axes=TABLE, static_argnums=1)
  assert again["mlp/~/linear_0"]["w"].sharding.spec == P("fsdp", "tensor")


@pytest.mark.bitwise  # Haiku's eager init against a jitted one
def test_int_seed_like_haiku_init():
  f = hk.transform(stock)
  x = jnp.ones((4, 8))
  params = partition.haiku.init_sharded(f, 3, x, rules=RULES, mesh=MESH, param_axes=TABLE)
  ref = f.init(3, x)  # Haiku's own int-seed handling
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_strict_is_the_adapters_not_the_models():
  def fn(x, **kwargs):  # would swallow a forwarded strict= silently
    assert not kwargs, kwargs
    return stock(x)

  f = hk.transform(fn)
  x = jnp.ones((4, 8))
  partition.haiku.init_sharded(f, jax.random.key(0), x, rules=RULES, mesh=MESH,
                               param_axes=TABLE, strict=False)
  with pytest.raises(partition.PartitionError, match=r"(?s)init_sharded\(strict=True\).*"
                                                     r"mlp/~/linear_1/b: no declared axes "
                                                     r"and no path pattern matches it"):
    partition.haiku.init_sharded(f, jax.random.key(0), x, rules=RULES, mesh=MESH,
                                 param_axes=TABLE, strict=True)


def test_replicated_warning_names_the_big_parameter():
  f = hk.transform(lambda x: hk.Linear(128)(x))
  x = jnp.ones((2, 128))
  with pytest.warns(UserWarning, match=r"(?s)init_sharded: 2 parameter\(s\) are fully "
                                       r"replicated.*linear/w f32\[128,128\]"):
    params = partition.haiku.init_sharded(f, jax.random.key(0), x, rules=RULES, mesh=MESH)
  assert params["linear"]["w"].sharding.spec == P()


# -- state -------------------------------------------------------------------------------------


def test_get_state_axes_and_table_shard_state():
  def fn(x):
    total = partition.haiku.get_state("total", (8, 16), init=jnp.zeros, axes=("embed", "mlp"))
    hk.set_state("total", total + 1)
    return hk.BatchNorm(True, True, 0.9)(x, is_training=True)

  f = hk.transform_with_state(fn)
  x = jnp.ones((4, 8))
  table = [(r"batch_norm/~/(mean|var)_ema/(average|hidden)$", (None, "embed")),
           (r"counter$", None), (r"(scale|offset)$", (None, "embed"))]
  params, state = partition.haiku.init_sharded(f, jax.random.key(0), x, rules=RULES,
                                               mesh=MESH, param_axes=table)
  assert state["~"]["total"].sharding.spec == P("fsdp", "tensor")
  assert state["batch_norm/~/mean_ema"]["average"].sharding.spec == P(None, "fsdp")
  assert state["batch_norm/~/mean_ema"]["counter"].sharding.spec == P()
  assert params["batch_norm"]["scale"].sharding.spec == P(None, "fsdp")
  ref_params, ref_state = f.init(jax.random.key(0), x)
  for a, b in zip(jax.tree.leaves((params, state)), jax.tree.leaves((ref_params, ref_state))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
  axes = partition.haiku.eval_axes(f, jax.random.key(0), x, param_axes=table)
  assert axes[1]["~"] == {"total": ("embed", "mlp")}
  report = partition.haiku.explain(f, jax.random.key(0), x, rules=RULES, mesh=MESH,
                                   param_axes=table)
  assert "state/~/total" in str(report)


# -- constrain_outputs -------------------------------------------------------------------------


def test_constrain_outputs_in_jaxpr_and_values_unchanged():
  table = {r"mlp/~/linear_0$": ("batch", "mlp")}

  @hk.transform
  @partition.haiku.constrain_outputs(table)
  def f(x):
    return stock(x)

  plain = hk.transform(stock)
  x = jnp.arange(32.0).reshape(4, 8) / 32
  params = plain.init(jax.random.key(0), x)
  mesh = AUTO_MESH
  with partition.axis_rules(RULES, mesh):
    jaxpr = jax.make_jaxpr(f.apply)(params, None, x)
    y = jax.jit(f.apply)(params, None, x)
  constraints = [e for e in jaxpr.eqns if e.primitive.name == "sharding_constraint"]
  assert len(constraints) == 1
  assert constraints[0].params["sharding"].spec == P(None, "tensor")  # batch: no rule here
  assert jax.make_jaxpr(plain.apply)(params, None, x).eqns and not any(
      e.primitive.name == "sharding_constraint"
      for e in jax.make_jaxpr(plain.apply)(params, None, x).eqns)
  # Same values as the unconstrained program on one device (the sharded dot may sum in
  # another order: float32 rounding only).
  np.testing.assert_allclose(np.asarray(y), np.asarray(plain.apply(params, None, x)),
                             rtol=1e-6, atol=1e-7)


def test_constrain_outputs_unused_rank_and_type_errors():
  def run(table, strict=False, fn=stock):
    def g(x):
      with partition.haiku.constrain_outputs(table, strict=strict):
        return fn(x)
    with partition.axis_rules(RULES, AUTO_MESH):
      return hk.transform(g).init(jax.random.key(0), jnp.ones((4, 8)))

  with pytest.warns(UserWarning, match=r"pattern 'mlp/~/lnear_0\$' matched no module call"):
    run({r"mlp/~/lnear_0$": ("batch", "mlp")})
  with pytest.raises(ValueError, match=r"pattern 'lnear\$' matched no module call"):
    run({r"lnear$": ("batch", "mlp")}, strict=True)
  with pytest.raises(ValueError, match=r"module mlp/~/linear_0 \(pattern #0 'linear_0\$'\) "
                                       r"returned shape \(4, 16\) \(2 dims\) but the pattern "
                                       r"gives \('mlp',\)"):
    run({r"linear_0$": ("mlp",)})
  with pytest.raises(TypeError, match=r"the axes is the string 'mlp'.*write \('mlp',\)"):
    run({r"linear_0$": "mlp"})


# -- argument errors (issue 9) -----------------------------------------------------------------


def test_axes_string_is_an_error_not_letters():
  f = hk.transform(lambda x: partition.haiku.get_parameter("s", (8,), init=jnp.ones, axes="e"))
  with pytest.raises(TypeError, match=r"axes is the string 'e', which would be read as the "
                                      r"one-letter axes \('e',\): write \('e',\)"):
    f.init(jax.random.key(0), None)
  with pytest.raises(ValueError, match=r"entry #0 '/w\$': the axes is the string 'em'.*"
                                       r"write \('em',\)"):
    partition.haiku.eval_axes(hk.transform(stock), jax.random.key(0), jnp.ones((4, 8)),
                              param_axes=[(r"/w$", "em")])


def test_entry_points_name_bad_arguments():
  x = jnp.ones((4, 8))
  cases = [
      ((stock, jax.random.key(0)), r"transformed is a plain callable \(stock\), not a Haiku "
                                   r"transform: pass hk.transform\(stock\)"),
      ((hk.Linear, jax.random.key(0)), r"Haiku module class Linear; modules are created "
                                       r"inside a function"),
      ((hk.transform(stock), "seed"), r"rng must be a PRNG key, got str 'seed'"),
      ((hk.transform(stock), True), r"rng is the bool True"),
      ((hk.transform(stock), jnp.ones(3)), r"rng is an array of shape \(3,\) and dtype "
                                          r"float32, not a PRNG key"),
  ]
  for (transformed, rng), message in cases:
    with pytest.raises(TypeError, match=message) as info:
      partition.haiku.init_sharded(transformed, rng, x, rules=RULES, mesh=MESH)
    assert isinstance(info.value, partition.PartitionError)
  # Several problems of one call: one message.
  with pytest.raises(ValueError, match=r"(?s)plain callable.*rng must be a PRNG key.*"
                                       r"static_argnums=\(3,\) has \[3\], out of range.*"
                                       r"stack_axis must be a logical name"):
    partition.haiku.init_sharded(stock, "k", x, rules=RULES, mesh=MESH, static_argnums=3,
                                 stack_axis=7)
  with pytest.raises(TypeError, match=r"param_axes must be a partition.PathRules, a list"):
    partition.haiku.eval_axes(hk.transform(stock), jax.random.key(0), x, param_axes=3)


@pytest.mark.slow
def test_layer_stack_state_made_by_set_state_gets_the_stack_axis():
  # BatchNorm's EMA 'average' is created by hk.set_state (no creator runs for it).
  f = hk.transform_with_state(lambda x: hk.layer_stack(2)(
      lambda h: hk.BatchNorm(True, True, 0.9)(h, is_training=True))(x))
  table = [(r"_ema/(average|hidden)$", (None, "mlp")), (r"counter$", None),
           (r"(scale|offset)$", (None, "mlp"))]
  x = jnp.ones((4, 8))
  _, state = partition.haiku.init_sharded(f, jax.random.key(0), x, rules=STACK_RULES,
                                          mesh=MESH_3D, param_axes=table)
  (ema,) = [v for k, v in state.items() if k.endswith("mean_ema")]
  assert ema["average"].shape == (2, 1, 8)
  assert ema["average"].sharding.spec == P("data", None, "tensor")
  assert ema["hidden"].sharding.spec == P("data", None, "tensor")
  ref = f.init(jax.random.key(0), x)[1]
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


def test_table_pattern_matching_a_declared_parameter_is_used_under_strict():
  """As in partition.flax: a pattern that matches a parameter has matched it, even when the
  model's declared axes win."""
  def declared(x):
    w = partition.haiku.get_parameter("w", (8, 16), init=hk.initializers.Constant(1.0),
                                      axes=("embed", "mlp"))
    return x @ w

  table = partition.PathRules([(r"/w$", ("embed", "mlp"))])
  params = partition.haiku.init_sharded(hk.transform(declared), jax.random.key(0),
                                        jnp.ones((4, 8)), rules=RULES, mesh=MESH,
                                        param_axes=table, strict=True)
  assert params["~"]["w"].sharding.spec == P("fsdp", "tensor")
  stale = table + [(r"never$", None)]
  with pytest.raises(partition.PlacementError, match=r"'never\$'"):
    partition.haiku.init_sharded(hk.transform(declared), jax.random.key(0), jnp.ones((4, 8)),
                                 rules=RULES, mesh=MESH, param_axes=stale, strict=True)


def _accumulate(axes):
  def f(x):
    hk.set_state("acc", jnp.arange(4.0))
    return x + partition.haiku.get_state("acc", axes=axes)  # no shape, as hk.get_state allows
  return hk.transform_with_state(f)


def test_get_state_without_a_shape_reads_the_state_set_before_and_declares_its_axes():
  """It raised TypeError: 'NoneType' object is not iterable (len(tuple(shape)))."""
  f, x = _accumulate(("embed",)), jnp.ones((2, 4))
  assert partition.haiku.eval_axes(f, jax.random.key(0), x) == ({}, {"~": {"acc": ("embed",)}})
  params, state = partition.haiku.init_sharded(f, jax.random.key(0), x, rules=RULES,
                                               mesh=AUTO_MESH)
  assert state["~"]["acc"].sharding.spec == P("fsdp")
  _, want = f.init(jax.random.key(0), x)
  np.testing.assert_array_equal(state["~"]["acc"], want["~"]["acc"])
  with pytest.raises(partition.LogicalAxesError, match=re.escape(
      "partition.haiku.get_state('acc'): shape (4,) has 1 dims but axes=('embed', 'mlp') "
      "names 2.")):
    _accumulate(("embed", "mlp")).init(jax.random.key(0), x)


@pytest.mark.parametrize("method", ["init", "apply"])
def test_passing_the_init_or_apply_function_says_to_pass_the_transform(method):
  """It said "transformed is a plain callable (init_fn) ...: pass hk.transform(init_fn)"."""
  f = hk.transform(lambda x: hk.Linear(8)(x))
  with pytest.raises(partition.AdapterInputError) as e:
    partition.haiku.init_sharded(getattr(f, method), jax.random.key(0), jnp.ones((2, 4)),
                                 rules=RULES, mesh=AUTO_MESH)
  assert (f"transformed is the {method} function of a Haiku transform (f.{method}), not the "
          f"transform: pass f itself (f = hk.transform(...)), not f.{method}") in str(e.value)


def _typo_dense(x):
  w = partition.haiku.get_parameter("w", (x.shape[-1], 16), init=jnp.ones,
                                    axes=("embed", "mpl"))
  return x @ w


def test_a_typo_in_get_parameter_warns_once_per_use_naming_the_parameter(recwarn):
  """init_sharded also warned from inside the library about an unnamed "x dim 1"; at apply
  time that was the only warning."""
  import warnings
  f = hk.transform(lambda x: hk.to_module(_typo_dense)(name="dense")(x))
  x = jnp.ones((4, 8))
  warnings.simplefilter("always")
  params = partition.haiku.init_sharded(f, jax.random.key(0), x, rules=RULES, mesh=AUTO_MESH)
  texts = [str(w.message) for w in recwarn.list if issubclass(w.category,
                                                              partition.PartitionWarning)]
  assert len(texts) == 1, texts
  assert texts[0].startswith("partition.haiku.init_sharded: logical axis 'mpl' has no rule "
                             "(did you mean 'mlp'?), so dense/w dim 1 is replicated.")
  recwarn.clear()
  with partition.axis_rules(RULES, AUTO_MESH):
    jax.jit(f.apply)(params, None, x)
  caught = [w for w in recwarn.list if issubclass(w.category, partition.PartitionWarning)]
  assert [str(w.message).splitlines()[0] for w in caught] == [
      "partition.haiku.get_parameter: logical axis 'mpl' has no rule (did you mean 'mlp'?), "
      "so dense/w dim 1 is replicated."]
  assert caught[0].filename == __file__  # the get_parameter call above, not the library
