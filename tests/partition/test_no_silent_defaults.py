"""No silent defaults (issue 19, item 6): with ``strict=False`` every fallback either raises
(input that cannot be intended) or warns once per cause, naming the name/axis/dim and the
fix; a rules table that replicates on purpose (null rules) warns about nothing."""

import pathlib
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from mesh_testlib import make_mesh

import partition
import partition.flax

PRESETS = pathlib.Path(__file__).resolve().parents[2] / "recipes" / "presets"


@pytest.fixture
def mesh():
  return make_mesh((4, 2), ("data", "model"), AxisType.Auto)


RULES = partition.AxisRules([("batch", "data"), ("embed", "model"), ("mlp", "model"),
                             ("length", None)])


def caught(fn):
  with warnings.catch_warnings(record=True) as out:
    warnings.simplefilter("always")
    result = fn()
  return result, [w for w in out if issubclass(w.category, partition.PartitionWarning)]


def test_typo_logical_name_warns_with_the_fix(mesh):
  with partition.axis_rules(RULES, mesh):
    y, found = caught(lambda: partition.constrain(jnp.ones((8, 4)), ("batch", "mpl")))
  assert y.sharding.spec == P("data", None)
  assert len(found) == 1
  text = str(found[0].message)
  assert text.startswith("partition.constrain: logical axis 'mpl' has no rule (did you mean "
                         "'mlp'?), so x dim 1 is replicated.")
  assert "a null rule, e.g. ['mpl', null], replicates it on purpose" in text
  assert found[0].filename == __file__  # the warning points at the caller


def test_null_rule_replicates_silently(mesh):
  with partition.axis_rules(RULES, mesh):
    y, found = caught(lambda: partition.constrain(jnp.ones((8, 4)), ("batch", "length")))
  assert y.sharding.spec == P("data", None) and found == []


@pytest.mark.parametrize("typo", ["tensr", "dta"])
def test_rule_naming_a_typo_of_a_mesh_axis_is_an_error(typo):
  mesh = make_mesh((4, 2), ("data", "tensor"), AxisType.Auto)
  rules = partition.AxisRules([("batch", typo)])
  want = "data" if typo == "dta" else "tensor"
  with pytest.raises(partition.ResolutionError) as info:
    rules.spec(("batch",), (8,), mesh)
  message = str(info.value)
  assert f"rule #0 names {typo!r}, which is not a mesh axis (did you mean {want!r}?)" in message
  assert "Fix the mesh axis name in the rule table" in message
  assert isinstance(info.value, ValueError)


def test_rule_naming_an_axis_the_mesh_lacks_acts_as_size_one_as_in_flax():
  """'tensor' is no near-miss of 'data': a table shared by bigger meshes (MaxText's)."""
  mesh = make_mesh((8,), ("data",), AxisType.Explicit)
  rules = partition.AxisRules([("mlp", "tensor"), ("batch", "data")])
  assert rules.spec(("batch", "mlp"), (8, 8), mesh) == P("data", None)


def test_indivisible_dim_warns_in_constrain_whatever_the_size(mesh):
  with partition.axis_rules(RULES, mesh):
    y, found = caught(lambda: partition.constrain(jnp.ones((6, 2)), ("batch", "embed")))
  assert y.sharding.spec == P(None, "model")
  assert [str(w.message).splitlines()[0] for w in found] == [
      "partition.constrain: x dim 0 'batch' (size 6) is replicated: no rule for it divides "
      "the dim (rule #0: size 6, needs a multiple of 4)."]


def test_one_warning_per_cause_in_a_tree(mesh):
  x = {"a": jnp.ones((8, 4)), "b": jnp.ones((8, 4))}
  axes = {"a": ("batch", "mpl"), "b": ("batch", "mpl")}
  with partition.axis_rules(RULES, mesh):
    _, found = caught(lambda: partition.constrain(x, axes))
  assert len(found) == 1
  assert "x/a dim 1 is replicated (and 1 more array(s) for the same reason)" in str(
      found[0].message)


def test_rules_without_a_mesh_warn_that_constrain_does_nothing():
  """The legacy `with mesh:` context sets no mesh JAX's public API can read."""
  mesh = make_mesh((8,), ("data",), AxisType.Explicit)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    with mesh, partition.axis_rules([("batch", "data")]):
      y, found = caught(lambda: partition.constrain(jnp.ones(8), ("batch",)))
  np.testing.assert_array_equal(y, np.ones(8))
  assert len(found) == 1
  text = str(found[0].message)
  assert "has axis rules but no mesh, so it does nothing on these 8 devices" in text
  assert "`with jax.set_mesh(mesh):`" in text


def test_xmap_rules_on_a_mesh_lacking_the_rules_axis_warn(mesh):
  rules = partition.AxisRules([("batch", ("data", "tensor"))])
  f = partition.xmap(lambda v: v * 2, ["batch", ...], ["batch", ...], axis_resources=rules,
                     mesh=mesh)
  y, found = caught(lambda: f(jnp.ones((8, 2))))
  np.testing.assert_array_equal(y, 2 * np.ones((8, 2)))
  assert len(found) == 1
  text = str(found[0].message)
  assert ("xmap axis 'batch': rule #0 places it on mesh axes ('tensor',) that the mesh "
          "lacks") in text
  assert "Add those axes to the mesh (size 1" in text


@pytest.mark.parametrize("resource", [partition.SerialLoop(4), "data",
                                      ("data", partition.SerialLoop(4))],
                         ids=["loop", "mesh-axis", "mesh-axis-and-loop"])
def test_xmap_rules_no_candidate_of_which_divides_the_axis_warn(mesh, resource):
  # The user asked for a split or a loop; a size nothing divides used to run the axis
  # vectorised on one device with no word (the dict form raises AxisSizeError).
  rules = partition.AxisRules([("batch", resource)])
  f = partition.xmap(lambda v: v * 2, ["batch", ...], ["batch", ...], axis_resources=rules,
                     mesh=mesh)
  y, found = caught(lambda: f(jnp.ones((6, 3))))
  np.testing.assert_array_equal(y, 2 * np.ones((6, 3)))
  assert len(found) == 1 and found[0].filename == __file__
  text = str(found[0].message)
  assert text.startswith("xmap axis 'batch' (size 6) gets no resources: no rule for it "
                         "divides its size (rule #0: size 6, needs a multiple of ")
  assert "neither split nor looped" in text and "add a fallback rule for 'batch'" in text
  # a fallback that divides (4 rows over data, not data x model), or a null rule, is what
  # the rules say: no warning
  for table, rows in (([("batch", ("data", "model")), ("batch", "data")], 4),
                      ([("batch", None)], 6)):
    g = partition.xmap(lambda v: v * 2, ["batch", ...], ["batch", ...],
                       axis_resources=partition.AxisRules(table), mesh=mesh)
    _, found = caught(lambda g=g, rows=rows: g(jnp.ones((rows, 3))))
    assert found == []


class _Mlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    init = nn.with_logical_partitioning(nn.initializers.normal(0.02), ("embed", "mlp"))
    h = nn.Dense(6, kernel_init=init, use_bias=False)(x)
    init = nn.with_logical_partitioning(nn.initializers.normal(0.02), ("mlp", "embed"))
    return nn.Dense(4, kernel_init=init, use_bias=False)(h)


def test_init_sharded_indivisible_dim_warns_whatever_the_size():
  mesh = make_mesh((2, 4), ("data", "model"), AxisType.Explicit)
  rules = partition.AxisRules([("embed", "data"), ("mlp", "model")])
  variables, found = caught(lambda: partition.flax.init_sharded(
      _Mlp(), jax.random.key(0), jnp.ones((2, 4)), rules=rules, mesh=mesh))
  texts = [str(w.message) for w in found]
  assert len(texts) == 1, texts
  assert ("partition.flax.init_sharded: params/Dense_0/kernel dim 1 'mlp' (size 6) is "
          "replicated: no rule for it divides the dim (rule #1: size 6, needs a multiple of "
          "4) (and 1 more array(s) for the same reason).") in texts[0]
  assert variables["params"]["Dense_0"]["kernel"].value.sharding.spec == P("data", None)


def test_init_sharded_unused_path_pattern_is_an_error_without_strict(mesh):
  table = partition.PathRules([(r"kernel$", ("embed", "mlp")), (r"^params/gone$", None)])
  with pytest.raises(partition.PlacementError) as info:
    partition.flax.init_sharded(nn.Dense(8), jax.random.key(0), jnp.ones((2, 4)),
                                rules=RULES, mesh=mesh, param_axes=table)
  assert "path pattern '^params/gone$' matches no parameter" in str(info.value)


def test_data_parallel_preset_warns_about_nothing():
  mesh = make_mesh((8,), ("data",), AxisType.Explicit)
  rules = partition.AxisRules.from_file(PRESETS / "data_parallel.yaml")
  variables, found = caught(lambda: partition.flax.init_sharded(
      _Mlp(), jax.random.key(0), jnp.ones((8, 4)), rules=rules, mesh=mesh))
  assert found == []
  assert variables["params"]["Dense_0"]["kernel"].value.sharding.spec == P(None, None)


def test_errors_md_shows_the_partition_warning_as_emitted():
  text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "errors.md").read_text()
  section = text.split("### Warning: `partition.PartitionWarning`")[1]
  shown = section.split("```text\n")[1].split("```")[0].strip()
  mesh = make_mesh((4, 2), ("data", "model"), AxisType.Explicit)
  rules = partition.AxisRules([("batch", "data"), ("embed", "model"), ("mlp", "model")])
  with partition.axis_rules(rules, mesh):
    _, found = caught(lambda: partition.constrain(jnp.ones((8, 3)), ("batch", "mpl")))
  assert [str(w.message) for w in found] == [shown]
