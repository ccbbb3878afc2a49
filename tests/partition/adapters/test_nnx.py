"""partition.nnx: sharded construction, abstract state, with_axes, path tables."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from mesh_testlib import make_mesh

import partition
import partition.nnx
from partition._base.logical_axes import LogicalAxesTypeError

RULES = [("batch", "data"), ("embed", "fsdp"), ("mlp", "tensor")]
MESH = make_mesh((4, 2), ("fsdp", "tensor"), AxisType.Explicit)
AUTO_MESH = make_mesh((4, 2), ("fsdp", "tensor"), AxisType.Auto)


class MLP(nnx.Module):
  """WithAxes the NNX way: out_sharding metadata on the Variables."""

  def __init__(self, rngs):
    self.up = nnx.Linear(8, 16, rngs=rngs, kernel_metadata={"out_sharding": ("embed", "mlp")},
                         bias_metadata={"out_sharding": ("mlp",)})
    self.down = nnx.Linear(16, 8, rngs=rngs,
                           kernel_metadata={"out_sharding": ("mlp", "embed")})

  def __call__(self, x):
    h = partition.constrain(nnx.relu(self.up(x)), ("batch", "mlp"))
    return self.down(h)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
@pytest.mark.parametrize("shape,names", [((8,), ("fsdp",)), ((4, 2), ("fsdp", "tensor")),
                                         ((2, 2, 2), ("data", "fsdp", "tensor"))])
def test_init_sharded_specs_match_flax_resolver_and_values(shape, names, axis_type):
  mesh = make_mesh(shape, names, axis_type)
  model = partition.nnx.init_sharded(lambda: MLP(nnx.Rngs(0)), rules=RULES, mesh=mesh)
  # Reference: flax's nnx.get_partition_spec under flax's own (dict-based) rules.
  with nnx.use_eager_sharding(False):
    ref_model = MLP(nnx.Rngs(0))
  from flax.core import spmd
  usable = tuple((n, a) for n, a in RULES if a in mesh.axis_names)
  with spmd.logical_axis_rules(usable):
    ref_specs = nnx.get_partition_spec(nnx.state(ref_model))
  got = jax.tree.map(lambda v: v[...].sharding.spec, nnx.state(model),
                     is_leaf=lambda x: isinstance(x, nnx.Variable))
  want = jax.tree.map(lambda v: P(*(e if e in mesh.axis_names or e is None else None
                                    for e in v.get_value())), ref_specs,
                      is_leaf=lambda x: isinstance(x, nnx.Variable))
  assert got == want
  for v in jax.tree.leaves(nnx.state(model)):
    assert isinstance(v.sharding, NamedSharding)
  for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(ref_model))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


def test_abstract_init_and_explain():
  mesh = MESH
  graphdef, state = partition.nnx.abstract_init(lambda: MLP(nnx.Rngs(0)), rules=RULES,
                                                mesh=mesh)
  k = state["up"]["kernel"].get_value()
  assert isinstance(k, jax.ShapeDtypeStruct) and k.sharding.spec == P("fsdp", "tensor")
  assert isinstance(nnx.merge(graphdef, state), MLP)
  report = partition.nnx.explain(lambda: MLP(nnx.Rngs(0)), rules=RULES, mesh=mesh)
  assert report.bytes_per_device == 4 * (8 * 16 // 8 + 16 // 2 + 16 * 8 // 8 + 8)


def test_apply_under_rules_constrains_and_matches_single_device():
  mesh = AUTO_MESH
  model = partition.nnx.init_sharded(lambda: MLP(nnx.Rngs(0)), rules=RULES, mesh=mesh)
  x = jnp.arange(32.0).reshape(4, 8) / 10
  with partition.axis_rules(RULES, mesh):
    text = nnx.jit(lambda m, x: m(x)).lower(model, x).as_text()
    y = nnx.jit(lambda m, x: m(x))(model, x)
  assert text.count("sharding_constraint") >= 1
  with nnx.use_eager_sharding(False):
    ref = MLP(nnx.Rngs(0))(x)  # one device, no rules: constrain is a no-op
  np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-5)


def test_deprecated_sharding_names_model_works_without_warnings_from_us():
  class Old(nnx.Module):
    def __init__(self, rngs):
      init = nnx.initializers.lecun_normal()
      self.w = nnx.Param(init(rngs.params(), (8, 16)), sharding_names=("embed", "mlp"))

  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # flax warns at construction
    model = partition.nnx.init_sharded(lambda: Old(nnx.Rngs(0)), rules=RULES, mesh=MESH)
  assert model.w[...].sharding.spec == P("fsdp", "tensor")


def test_with_axes_on_stock_linear():
  Linear = partition.nnx.with_axes(nnx.Linear, params={"kernel": ("embed", "mlp"),
                                                       "bias": ("mlp",)},
                                   output=("batch", "mlp"))
  assert Linear.__name__ == "Linear" and issubclass(Linear, nnx.Linear)
  mesh = AUTO_MESH
  model = partition.nnx.init_sharded(lambda: Linear(8, 16, rngs=nnx.Rngs(0)), rules=RULES,
                                     mesh=mesh)
  assert model.kernel[...].sharding.spec == P("fsdp", "tensor")
  assert model.bias[...].sharding.spec == P("tensor")
  x = jnp.ones((4, 8))
  with partition.axis_rules(RULES, mesh):
    text = jax.jit(lambda x: model(x)).lower(x).as_text()
  assert "sharding_constraint" in text


def test_with_axes_errors():
  with pytest.raises(ValueError, match=r"'kernal' \(did you mean 'kernel'\?\)"):
    partition.nnx.with_axes(nnx.Linear, params={"kernal": ("a", "b")})(2, 3,
                                                                       rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"Variable 'kernel' has shape \(2, 3\) but was given "
                                       r"logical axes \('a', 'b', 'c'\)"):
    partition.nnx.with_axes(nnx.Linear, params={"kernel": ("a", "b", "c")})(
        2, 3, rngs=nnx.Rngs(0))
  short = partition.nnx.with_axes(nnx.Linear, params={"kernel": ("a",)})(2, 3,
                                                                         rngs=nnx.Rngs(0))
  assert partition.logical_axes(short)["kernel"] == ("a", None)
  with pytest.raises(TypeError, match="Pass a class such as nnx.Linear"):
    partition.nnx.with_axes(dict)
  with pytest.raises(TypeError, match="use partition.flax.with_axes"):
    partition.nnx.with_axes(nn.Dense)
  with pytest.raises(TypeError, match=r"got the str 'em'. Write \('em',\) for one dim"):
    partition.nnx.with_axes(nnx.Linear, params={"kernel": "em"})
  with pytest.raises(TypeError, match=r"keys are Variable names \(str\), got 1"):
    partition.nnx.with_axes(nnx.Linear, params={1: ("a", "b")})


def test_init_sharded_argument_errors():
  model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match=r"got an already built Linear instance. Pass a "
                                      r"function that builds it") as e:
    partition.nnx.init_sharded(model, rules=RULES, mesh=MESH)
  assert isinstance(e.value, partition.PartitionError)
  with pytest.raises(TypeError, match=r"Use partition.flax.init_sharded"):
    partition.nnx.explain(nn.Dense(3), rules=RULES, mesh=MESH)
  with pytest.raises(TypeError, match=r"init_fn must be a function.*got int 3"):
    partition.nnx.init_sharded(3, rules=RULES, mesh=MESH)
  rngs = nnx.Rngs(0)  # made outside the traced init_fn: flax's own error names no fix
  with pytest.raises(TypeError, match=r"uses NNX state created outside it .*create the "
                                      r"nnx.Rngs inside it: lambda: Model\(\.\.\., "
                                      r"rngs=nnx.Rngs\(0\)\)") as e:
    partition.nnx.init_sharded(lambda: nnx.Linear(2, 2, rngs=rngs), rules=RULES, mesh=MESH)
  assert isinstance(e.value, partition.PartitionError)


def test_path_table_for_stock_modules_and_annotate():
  def build():
    return nnx.Sequential(nnx.Linear(8, 16, rngs=nnx.Rngs(0)),
                          nnx.Linear(16, 8, rngs=nnx.Rngs(1)))
  table = partition.PathRules([(r"layers/0/kernel$", ("embed", "mlp")),
                               (r"layers/1/kernel$", ("mlp", "embed"))])
  model = partition.nnx.init_sharded(build, rules=RULES, mesh=MESH, param_axes=table)
  assert model.layers[0].kernel[...].sharding.spec == P("fsdp", "tensor")
  assert model.layers[1].kernel[...].sharding.spec == P("tensor", "fsdp")
  with nnx.use_eager_sharding(False):
    plain = build()
  partition.nnx.declare_axes(plain, table)
  assert plain.layers[1].kernel.get_metadata()["out_sharding"] == ("mlp", "embed")


def test_errors_name_the_fix():
  with pytest.raises(ValueError, match="Pass rules=partition.AxisRules"):
    partition.nnx.init_sharded(lambda: MLP(nnx.Rngs(0)), mesh=MESH)


def test_init_fn_that_returns_no_module_is_an_adapter_type_error():
  """Was a bare IndexError from nnx.split."""
  mesh = make_mesh((8,), ("data",), AxisType.Explicit)
  rules = partition.AxisRules([("batch", "data")])
  with pytest.raises(partition.PartitionError) as info:
    partition.nnx.init_sharded(lambda: 3, rules=rules, mesh=mesh)
  assert isinstance(info.value, TypeError)
  message = str(info.value)
  assert "partition.nnx.init_sharded: init_fn must return an NNX Module" in message
  assert "returned an array (dtype int32, shape ())" in message
  assert "Return the module it builds" in message


def _linear_with(kernel_sharding, rules):
  init = nnx.with_partitioning(nnx.initializers.lecun_normal(), kernel_sharding)
  return partition.nnx.init_sharded(
      lambda: nnx.Linear(8, 16, kernel_init=init, rngs=nnx.Rngs(0)),
      rules=partition.AxisRules(rules), mesh=make_mesh((4, 2), ("data", "model")))


def test_a_str_in_variable_metadata_is_an_error_not_letters():
  """nnx.with_partitioning(init, 'hidden') was read as the axes ('h', 'i', 'd', 'd', 'e',
  'n'): a rank error for a bias, letters without rules (replicated) for a 4-D kernel."""
  with pytest.raises(LogicalAxesTypeError) as e:
    _linear_with("hidden", [("hidden", "model")])
  assert str(e.value) == (
      "kernel: the Variable's 'out_sharding' metadata: logical axes must be a sequence of "
      "names, got the str 'hidden'. Write ('hidden',) for one dim (a str would be split into "
      "the letters ('h', 'i', 'd', 'd', 'e', 'n')).")


def test_several_names_for_one_dim_say_to_name_it_and_the_following_rule_works():
  """It raised 'the logical-axes tree and the shapes tree do not match' (kernel/0, kernel/1):
  the nested tuple was read as a subtree."""
  with pytest.raises(LogicalAxesTypeError) as e:
    _linear_with((("data", "model"), None), [])
  assert str(e.value) == (
      "kernel: the Variable's 'out_sharding' metadata: dim 0 is ('data', 'model'), several "
      "names for one dim. Each dim takes one logical name, and the rules map it to mesh axes: "
      "give it a name, e.g. 'data_model', and the rule ('data_model', ('data', 'model')).")
  model = _linear_with(("data_model", None), [("data_model", ("data", "model"))])
  mesh = make_mesh((4, 2), ("data", "model"))
  with jax.set_mesh(mesh):  # flax's own placement of the nested spec, as the reference
    flax_model = nnx.Linear(8, 16, rngs=nnx.Rngs(0), kernel_init=nnx.with_partitioning(
        nnx.initializers.lecun_normal(), (("data", "model"), None)))
  assert model.kernel[...].sharding.spec == flax_model.kernel[...].sharding.spec
  np.testing.assert_array_equal(model.kernel[...], flax_model.kernel[...])


class _Block(nnx.Module):
  def __init__(self, rngs):
    self.linear = nnx.Linear(8, 16, rngs=rngs, kernel_init=nnx.with_partitioning(
        nnx.initializers.lecun_normal(), ("embed", "hidden")))


def _stack(transform_metadata):
  def make():
    @nnx.split_rngs(splits=4)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata=transform_metadata)
    def create(rngs):
      return _Block(rngs)
    return create(nnx.Rngs(0))
  return make


def test_a_layer_stack_without_transform_metadata_warns_which_dims_the_names_took():
  """flax's scan-over-layers stack without transform_metadata keeps the per-layer names on a
  (4, 8, 16) kernel: read as a prefix, 'embed' sharded the layer dim without a word."""
  mesh = make_mesh((4, 2), ("data", "model"))
  rules = partition.AxisRules([("embed", "data"), ("hidden", "model")])
  with pytest.warns(partition.PartitionWarning) as caught:
    model = partition.nnx.init_sharded(_stack({}), rules=rules, mesh=mesh)
  texts = [str(w.message) for w in caught]
  assert any("  * linear/kernel f32[4,8,16]: ('embed', 'hidden') read as ('embed', "
             "'hidden', None)" in t and "transform_metadata={nnx.PARTITION_NAME: 'layers'}" in t
             for t in texts), texts
  assert model.linear.kernel[...].sharding.spec == P("data", "model", None)
  with warnings.catch_warnings():
    warnings.simplefilter("error", partition.PartitionWarning)
    named = partition.nnx.init_sharded(_stack({nnx.PARTITION_NAME: None}), rules=rules,
                                       mesh=mesh)
  with jax.set_mesh(mesh), nnx.logical_axis_rules(list(rules)):  # flax's own placement
    flax_model = _stack({})()
  assert named.linear.kernel[...].sharding.spec == flax_model.linear.kernel[...].sharding.spec
  np.testing.assert_array_equal(named.linear.kernel[...], flax_model.linear.kernel[...])


def test_a_variable_with_its_own_sharding_rules_is_placed_by_them_as_flax_places_it():
  """flax applies a Variable's sharding_rules metadata; the global table used to win silently
  (dim 0 on 'data' against the Variable's own null rule, dim 1 replicated)."""
  mesh = make_mesh((4, 2), ("data", "model"))
  rules = partition.AxisRules([("embed", "data"), ("hidden", "model")])

  def make():
    return nnx.Linear(8, 16, rngs=nnx.Rngs(0), kernel_init=nnx.with_metadata(
        nnx.initializers.lecun_normal(), sharding=("embed", "embed_model_dim"),
        sharding_rules=[("embed", None), ("embed_model_dim", "model")]))

  with warnings.catch_warnings():
    warnings.simplefilter("error", partition.PartitionWarning)
    model = partition.nnx.init_sharded(make, rules=rules, mesh=mesh)
  with jax.set_mesh(mesh):
    flax_model = make()
  assert model.kernel[...].sharding.spec == flax_model.kernel[...].sharding.spec \
      == P(None, "model")
  np.testing.assert_array_equal(model.kernel[...], flax_model.kernel[...])
  with pytest.raises(partition.LogicalAxesError, match=r"^kernel: the Variable's "
                     r"'sharding_rules' metadata: "):
    partition.nnx.init_sharded(lambda: nnx.Linear(8, 16, rngs=nnx.Rngs(0), kernel_init=(
        nnx.with_metadata(nnx.initializers.lecun_normal(), sharding=("embed", None),
                          sharding_rules=[("embed", 3)]))), rules=rules, mesh=mesh)
