"""partition.logical_axes: linen boxes, NNX metadata (incl. deprecated keys), WithAxes."""

import pathlib
import subprocess
import sys
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import partition


def _linen_variables():
  init = nn.initializers.lecun_normal()

  class M(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.Dense(8, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")))(x)
      p = self.param("scale", nn.with_partitioning(nn.initializers.ones, ("data",)), (8,))
      return nn.Dense(4)(x * p)

  return jax.eval_shape(M().init, jax.random.key(0), jnp.ones((2, 4)))


def test_linen_boxes_match_flax_get_partition_spec():
  variables = _linen_variables()
  axes = partition.logical_axes(variables)
  assert axes == {"params": {
      "Dense_0": {"kernel": ("embed", "mlp"), "bias": None},
      "Dense_1": {"kernel": None, "bias": None},
      "scale": P("data")}}
  # Independent reference: flax's own reader gives the same names as PartitionSpecs.
  flax_specs = nn.get_partition_spec(variables)
  assert tuple(flax_specs["params"]["Dense_0"]["kernel"]) == ("embed", "mlp")
  # nn.with_partitioning names mesh axes: they come back as flax's own PartitionSpec.
  assert axes["params"]["scale"] == flax_specs["params"]["scale"]


def test_nnx_module_state_and_variable():
  class M(nnx.Module):
    def __init__(self, rngs):
      self.a = nnx.Linear(4, 8, rngs=rngs, kernel_metadata={"out_sharding": ("embed", "mlp")})
      self.b = nnx.Linear(8, 4, rngs=rngs)

  with nnx.use_eager_sharding(False):
    model = M(nnx.Rngs(0))
  axes = partition.logical_axes(model)
  assert axes["a"]["kernel"] == ("embed", "mlp")
  assert axes["a"]["bias"] is None and axes["b"]["kernel"] is None
  assert partition.logical_axes(nnx.state(model)) == axes
  assert partition.logical_axes(model.a.kernel) == ("embed", "mlp")
  # Independent reference: flax's nnx.get_partition_spec (no rules: names pass through).
  ref = nnx.get_partition_spec(nnx.state(model))
  assert tuple(ref["a"]["kernel"].get_value()) == ("embed", "mlp")


@pytest.mark.parametrize("key", ["sharding", "sharding_names"])
def test_nnx_deprecated_metadata_read_without_warnings(key):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # constructing with the old key warns (flax's doing)
    v = nnx.Param(jnp.ones((2, 3)), eager_sharding=False, **{key: ("a", "b")})
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # reading must not warn
    assert partition.logical_axes({"v": v}) == {"v": ("a", "b")}


def test_nnx_metadata_dict_with_deprecated_key_only():
  v = nnx.Param(jnp.ones((2, 3)), eager_sharding=False)
  v.get_metadata()  # metadata is a plain dict; simulate an old pickled state
  object.__getattribute__(v, "_var_metadata")["sharding_names"] = ("x", None)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert partition.logical_axes(v) == ("x", None)


def test_annotated_box_and_unbox():
  tree = {"w": partition.WithAxes(jnp.ones((2, 3)), ("embed", "mlp")), "b": jnp.ones(3)}
  assert partition.logical_axes(tree) == {"w": ("embed", "mlp"), "b": None}
  plain = partition.unbox(tree)
  assert plain["w"].shape == (2, 3) and not isinstance(plain["w"], partition.WithAxes)
  assert repr(tree["w"]) == "WithAxes(f32[2,3], names=('embed', 'mlp'))"
  doubled = jax.jit(lambda t: jax.tree.map(lambda x: 2 * x, t))(tree)
  assert doubled["w"].names == ("embed", "mlp")
  assert float(doubled["w"].value[0, 0]) == 2.0


def test_too_many_names_names_every_path():
  tree = {"w": partition.WithAxes(jnp.ones((2, 3)), ("embed", "mlp", "kv")),
          "v": {"k": partition.WithAxes(jnp.ones(3), ("a", "b"))}}
  with pytest.raises(ValueError, match=r"2 parameter\(s\) declare more") as e:
    partition.logical_axes(tree)
  msg = str(e.value)
  assert ("w: logical axes ('embed', 'mlp', 'kv') name 3 dims but the parameter has shape "
          "(2, 3)") in msg
  assert "v/k: logical axes ('a', 'b')" in msg and "at most one logical name" in msg
  assert isinstance(e.value, partition.LogicalAxesError)


def test_short_names_are_a_prefix_like_flax():
  # flax's lm1b example boxes its 3-D attention kernels with 2 names.
  init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "kv"))
  dense = nn.DenseGeneral((2, 4), kernel_init=init)
  variables = jax.eval_shape(dense.init, jax.random.key(0), jnp.ones((1, 8)))
  axes = partition.logical_axes(variables)["params"]["kernel"]
  assert axes == ("embed", "kv", None)
  rules = [("embed", "fsdp"), ("kv", "tensor")]
  # Independent reference: flax's spec for the declared (short) names, padded by JAX.
  ref = nn.logical_to_mesh_axes(("embed", "kv"), rules)
  assert partition.AxisRules(rules).spec(axes) == P(*ref, None)
  tree = {"w": partition.WithAxes(jnp.ones((2, 3)), ("embed",))}
  assert partition.logical_axes(tree) == {"w": ("embed", None)}


def test_t5x_param_with_axes_metadata_is_read():
  from flax.linen import partitioning as nn_partitioning

  class T5Dense(nn.Module):
    @nn.compact
    def __call__(self, x):
      k = nn_partitioning.param_with_axes("kernel", nn.initializers.lecun_normal(),
                                          (x.shape[-1], 8), axes=("embed", "mlp"))
      b = nn_partitioning.param_with_axes("bias", nn.initializers.zeros, (8,),
                                          axes=("mlp",))
      return x @ k + b + self.param("plain", nn.initializers.zeros, (8,))

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      return T5Dense(name="wi")(x)

  variables = jax.eval_shape(Block().init, jax.random.key(0), jnp.ones((2, 4)))
  axes = partition.logical_axes(variables)
  # Independent reference: flax's get_axis_names over the params_axes collection.
  ref = nn_partitioning.get_axis_names(variables["params_axes"])
  assert axes["params"]["wi"]["kernel"] == tuple(ref["wi"]["kernel"]) == ("embed", "mlp")
  assert axes["params"]["wi"]["bias"] == tuple(ref["wi"]["bias"])
  assert axes["params"]["wi"]["plain"] is None


def test_annotated_rejects_a_str_instead_of_names():
  with pytest.raises(TypeError, match=r"Write \('em',\) for one dim") as e:
    partition.WithAxes(jnp.ones(4), "em")
  assert "letters ('e', 'm')" in str(e.value)
  assert isinstance(e.value, partition.PartitionError)
  with pytest.raises(TypeError, match=r"tuple of names \(str or None\), got \('a', 3\)"):
    partition.WithAxes(jnp.ones((4, 4)), ("a", 3))


def test_plain_tree_is_all_none():
  assert partition.logical_axes({"a": jnp.ones(2), "b": [jnp.ones(1)]}) == {
      "a": None, "b": [None]}


@pytest.mark.slow
def test_import_partition_does_not_import_flax_or_haiku():
  code = ("import sys, partition; bad = [m for m in ('flax', 'haiku') if m in sys.modules];"
          " print(bad); assert not bad, bad")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={"JAX_PLATFORMS": "cpu", "PATH": ""},
                       cwd=str(pathlib.Path(__file__).resolve().parents[3]))
  assert out.returncode == 0, out.stdout + out.stderr
