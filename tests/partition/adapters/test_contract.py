"""The contract: one 2-layer MLP in linen, NNX and Haiku, annotated the idiomatic way in each,
gives the same PartitionSpec tree, the same outputs sharded as on one device, and an init
that never materialises a sharded weight in full on one device."""

import functools

import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from mesh_testlib import make_mesh

import partition
import partition.flax
import partition.haiku
import partition.nnx

RULES = partition.AxisRules([("batch", "data"), ("embed", "fsdp"), ("mlp", "tensor")])
EMBED, MLP_DIM = 8, 16
MESHES = {(4, 2): ("fsdp", "tensor"), (2, 2, 2): ("data", "fsdp", "tensor")}
AXES = {"layer1": {"kernel": ("embed", "mlp"), "bias": ("mlp",)},
        "layer2": {"kernel": ("mlp", "embed"), "bias": ("embed",)}}


# -- linen: nn.with_logical_partitioning + nn.with_logical_constraint -------------------------
def _li(axes, init):
  return nn.with_logical_partitioning(init, axes)


class LinenMLP(nn.Module):
  embed: int = EMBED
  mlp: int = MLP_DIM

  @nn.compact
  def __call__(self, x):
    a = AXES
    h = nn.Dense(self.mlp, kernel_init=_li(a["layer1"]["kernel"], nn.initializers.lecun_normal()),
                 bias_init=_li(a["layer1"]["bias"], nn.initializers.zeros), name="layer1")(x)
    h = nn.with_logical_constraint(nn.relu(h), ("batch", "mlp"))
    return nn.Dense(self.embed, kernel_init=_li(a["layer2"]["kernel"],
                                                nn.initializers.lecun_normal()),
                    bias_init=_li(a["layer2"]["bias"], nn.initializers.zeros),
                    name="layer2")(h)


# -- NNX: out_sharding metadata ---------------------------------------------------------------
class NNXMLP(nnx.Module):
  def __init__(self, rngs, embed=EMBED, mlp=MLP_DIM):
    meta = lambda k: {"out_sharding": k}
    self.layer1 = nnx.Linear(embed, mlp, rngs=rngs,
                             kernel_metadata=meta(AXES["layer1"]["kernel"]),
                             bias_metadata=meta(AXES["layer1"]["bias"]))
    self.layer2 = nnx.Linear(mlp, embed, rngs=rngs,
                             kernel_metadata=meta(AXES["layer2"]["kernel"]),
                             bias_metadata=meta(AXES["layer2"]["bias"]))

  def __call__(self, x):
    return self.layer2(partition.constrain(nnx.relu(self.layer1(x)), ("batch", "mlp")))


# -- Haiku: stock hk.nets.MLP + a path table --------------------------------------------------
HK_TABLE = partition.PathRules([(r"linear_0/w$", AXES["layer1"]["kernel"]),
                                (r"linear_0/b$", AXES["layer1"]["bias"]),
                                (r"linear_1/w$", AXES["layer2"]["kernel"]),
                                (r"linear_1/b$", AXES["layer2"]["bias"])])


def haiku_mlp(x, embed=EMBED, mlp=MLP_DIM):
  return hk.nets.MLP([mlp, embed])(x)


HK_NAMES = {"layer1": "mlp/~/linear_0", "layer2": "mlp/~/linear_1"}


def canonical(framework, tree):
  """{'layer1': {'kernel', 'bias'}, 'layer2': ...} from each framework's own layout."""
  if framework == "linen":
    return {k: dict(tree["params"][k]) for k in AXES}
  if framework == "nnx":
    return {k: {"kernel": tree[k]["kernel"], "bias": tree[k]["bias"]} for k in AXES}
  return {k: {"kernel": tree[HK_NAMES[k]]["w"], "bias": tree[HK_NAMES[k]]["b"]} for k in AXES}


def init_all(mesh, x):
  linen = partition.flax.init_sharded(LinenMLP(), jax.random.key(0), x, rules=RULES, mesh=mesh)
  model = partition.nnx.init_sharded(lambda: NNXMLP(nnx.Rngs(0)), rules=RULES, mesh=mesh)
  haiku = partition.haiku.init_sharded(hk.transform(haiku_mlp), jax.random.key(0), x,
                                       rules=RULES, mesh=mesh, param_axes=HK_TABLE)
  nnx_state = jax.tree.map(lambda v: v[...], nnx.state(model),
                           is_leaf=lambda v: isinstance(v, nnx.Variable))
  return {"linen": canonical("linen", nn.unbox(linen)), "nnx": canonical("nnx", nnx_state),
          "haiku": canonical("haiku", haiku)}, (linen, model, haiku)


@pytest.mark.parametrize("shape", [(4, 2), (2, 2, 2)])
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
@pytest.mark.slow
def test_same_partition_spec_tree_in_all_three(shape, axis_type):
  mesh = make_mesh(shape, MESHES[shape], axis_type)
  x = jnp.ones((8, EMBED))
  params, _ = init_all(mesh, x)
  specs = {k: jax.tree.map(lambda a: a.sharding.spec, v) for k, v in params.items()}
  # Independent reference: flax's resolver on the declared axes.
  ref = jax.tree.map(lambda axes: nn.logical_to_mesh_axes(axes, tuple(RULES)), AXES,
                     is_leaf=lambda x: isinstance(x, tuple))
  assert specs["linen"] == specs["nnx"] == specs["haiku"] == ref
  if shape == (4, 2):
    assert ref["layer1"]["kernel"] == P("fsdp", "tensor")
  # And the logical axes read back are the declared ones, in every framework.
  linen, model, haiku = _
  assert canonical("linen", partition.logical_axes(linen)) == AXES
  assert canonical("nnx", partition.logical_axes(model)) == AXES
  boxed = partition.haiku.annotate(hk.transform(haiku_mlp), jax.random.key(0), x,
                                   param_axes=HK_TABLE)
  assert canonical("haiku", partition.logical_axes(boxed)) == AXES


@pytest.mark.slow
def test_equal_weights_same_outputs_on_mesh_as_on_one_device():
  mesh = make_mesh((4, 2), ("fsdp", "tensor"), AxisType.Auto)
  x = jax.random.normal(jax.random.key(1), (8, EMBED))
  params, (linen, model, haiku) = init_all(mesh, x)
  w = {k: {n: np.asarray(a) for n, a in v.items()} for k, v in params["linen"].items()}
  # Load the linen weights into the NNX and Haiku models (equal weights everywhere).
  for k in AXES:
    getattr(model, k).kernel[...] = jax.device_put(w[k]["kernel"],
                                                   getattr(model, k).kernel[...].sharding)
    getattr(model, k).bias[...] = jax.device_put(w[k]["bias"],
                                                 getattr(model, k).bias[...].sharding)
    haiku[HK_NAMES[k]] = {"w": jax.device_put(w[k]["kernel"], haiku[HK_NAMES[k]]["w"].sharding),
                          "b": jax.device_put(w[k]["bias"], haiku[HK_NAMES[k]]["b"].sharding)}
  # Reference: numpy on one device.
  ref = np.maximum(np.asarray(x) @ w["layer1"]["kernel"] + w["layer1"]["bias"], 0)
  ref = ref @ w["layer2"]["kernel"] + w["layer2"]["bias"]
  f = hk.transform(haiku_mlp)
  with partition.axis_rules(RULES, mesh), jax.set_mesh(mesh):
    outs = {"linen": jax.jit(lambda v, x: LinenMLP().apply(v, x))(linen, x),
            "nnx": nnx.jit(lambda m, x: m(x))(model, x),
            "haiku": jax.jit(lambda p, x: f.apply(p, None, x))(haiku, x)}
  for name, y in outs.items():
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-5, err_msg=name)
  # Single-device runs of each framework agree too (rules do not change results).
  np.testing.assert_allclose(np.asarray(LinenMLP().apply(jax.device_get(linen), x)), ref,
                             rtol=1e-5, atol=1e-5)


BIG_E, BIG_M = 256, 1024  # a 1 MiB f32 kernel: 128 KiB per device on 8 devices


def _compiled_init(framework, mesh, x):
  """The program init_sharded runs: jit(init, out_shardings=<abstract_init's shardings>)."""
  get = lambda t: jax.tree.map(lambda a: a.sharding, partition.unbox(t))
  if framework == "linen":
    mod = LinenMLP(BIG_E, BIG_M)
    ab = partition.flax.abstract_init(mod, jax.random.key(0), x, rules=RULES, mesh=mesh)
    fn, args = mod.init, (jax.random.key(0), x)
  elif framework == "haiku":
    f = hk.transform(lambda x: haiku_mlp(x, BIG_E, BIG_M))
    ab = partition.haiku.abstract_init(f, jax.random.key(0), x, rules=RULES, mesh=mesh,
                                       param_axes=HK_TABLE)
    fn, args = f.init, (jax.random.key(0), x)
  else:
    build = lambda: NNXMLP(nnx.Rngs(0), BIG_E, BIG_M)
    _, ab = partition.nnx.abstract_init(build, rules=RULES, mesh=mesh)

    def fn():
      with nnx.use_eager_sharding(False):
        return nnx.state(build())
    args = ()
  with partition.axis_rules(RULES, mesh):
    compiled = jax.jit(fn, out_shardings=get(ab)).lower(*args).compile()
  return ab, compiled


@functools.cache
def _replicated_init_memory():
  """The reference of every framework: linen's init with replicated outputs on the same mesh
  and input (one program; compiled once, not once per framework)."""
  replicated = jax.sharding.NamedSharding(make_mesh((4, 2), ("fsdp", "tensor"), AxisType.Auto), P())
  return jax.jit(LinenMLP(BIG_E, BIG_M).init, out_shardings=replicated).lower(
      jax.random.key(0), jnp.ones((8, BIG_E))).compile().memory_analysis()


@pytest.mark.parametrize("framework", ["linen", "nnx", "haiku"])
def test_compiled_init_has_no_full_size_intermediate(framework):
  mesh = make_mesh((4, 2), ("fsdp", "tensor"), AxisType.Auto)
  x = jnp.ones((8, BIG_E))
  ab, compiled = _compiled_init(framework, mesh, x)
  mem = compiled.memory_analysis()
  full_kernel = BIG_E * BIG_M * 4
  per_device = sum(np.prod(a.sharding.shard_shape(a.shape)) * 4
                   for a in jax.tree.leaves(partition.unbox(ab)))
  n_leaves = len(jax.tree.leaves(partition.unbox(ab)))
  # Each device holds only its shards (plus 8 B per output of the result tuple).
  assert per_device <= mem.output_size_in_bytes <= per_device + 8 * n_leaves
  assert per_device < full_kernel // 2  # two kernels, each split 8 ways
  # No buffer as large as a full sharded kernel can exist: all scratch together is smaller.
  assert mem.temp_size_in_bytes < full_kernel, (mem.temp_size_in_bytes, full_kernel)
  # Reference: the same init with replicated outputs needs several full-size buffers.
  ref = _replicated_init_memory()
  assert ref.temp_size_in_bytes > 2 * full_kernel
  assert ref.output_size_in_bytes >= 2 * full_kernel


NO_MLP_RULE = partition.AxisRules([("batch", "data"), ("embed", None)])


def _init_big(framework, mesh, strict):
  x = jnp.ones((8, 128))
  if framework == "linen":
    return partition.flax.init_sharded(LinenMLP(embed=128, mlp=256), jax.random.key(0), x,
                                       rules=NO_MLP_RULE, mesh=mesh, strict=strict)
  if framework == "nnx":
    return partition.nnx.init_sharded(lambda: NNXMLP(nnx.Rngs(0), embed=128, mlp=256),
                                      rules=NO_MLP_RULE, mesh=mesh, strict=strict)
  return partition.haiku.init_sharded(
      hk.transform(lambda x: haiku_mlp(x, embed=128, mlp=256)), jax.random.key(0), x,
      rules=NO_MLP_RULE, mesh=mesh, param_axes=HK_TABLE, strict=strict)


@pytest.mark.parametrize("framework", ["linen", "nnx", "haiku"])
def test_never_silently_replicated_in_all_three(framework):
  # 'mlp' has no rule: both 128x256 kernels (128 KiB each) end up replicated on 8 devices.
  mesh = make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), AxisType.Auto)
  with pytest.warns(partition.PartitionWarning) as caught:
    _init_big(framework, mesh, strict=False)
  # one warning for the one cause, naming the name and the fix (three arrays share it)
  assert [w.category for w in caught] == [partition.PartitionWarning]
  text = str(caught[0].message)
  assert "logical axis 'mlp' has no rule, so" in text
  assert "(and 2 more array(s) for the same reason)" in text
  assert "Add a rule for 'mlp'" in text
  assert caught[0].filename == __file__  # the init_sharded call, not the adapter's code
  with pytest.raises(partition.PlacementError, match=r"logical axis 'mlp' has no rule") as e:
    _init_big(framework, mesh, strict=True)
  # Three parameters name 'mlp' (two kernels, one bias): one bullet each, one error.
  assert str(e.value).count("logical axis 'mlp' has no rule") == 3


def _init_undeclared(framework, mesh, strict):
  """A stock layer with no logical axes at all and no path table: a 256 KiB kernel."""
  x = jnp.ones((8, 256))
  rules = partition.AxisRules([("embed", "data"), ("mlp", "tensor")])
  if framework == "linen":
    return partition.flax.init_sharded(nn.Dense(256), jax.random.key(0), x, rules=rules,
                                       mesh=mesh, strict=strict)
  if framework == "nnx":
    return partition.nnx.init_sharded(lambda: nnx.Linear(256, 256, rngs=nnx.Rngs(0)),
                                      rules=rules, mesh=mesh, strict=strict)
  return partition.haiku.init_sharded(hk.transform(lambda x: hk.Linear(256)(x)),
                                      jax.random.key(0), x, rules=rules, mesh=mesh,
                                      strict=strict)


@pytest.mark.parametrize("framework", ["linen", "nnx", "haiku"])
def test_strict_refuses_parameters_that_declare_no_axes_in_all_three(framework):
  """strict=True dropped the replicated warning and raised nothing, though the warning says
  "pass strict=True to make this an error": the kernel was placed P() without a word."""
  mesh = make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), AxisType.Auto)
  with pytest.warns(partition.ReplicatedWarning,
                    match="or pass strict=True to make this an error") as caught:
    _init_undeclared(framework, mesh, strict=False)
  assert [w.filename for w in caught] == [__file__]
  with pytest.raises(partition.PlacementError) as e:
    _init_undeclared(framework, mesh, strict=True)
  kernel = {"linen": "params/kernel", "nnx": "kernel", "haiku": "linear/w"}[framework]
  bias = {"linen": "params/bias", "nnx": "bias", "haiku": "linear/b"}[framework]
  message = str(e.value)
  assert "2 problem(s)" in message
  assert f"  * {kernel} f32[256,256]: no logical axes, so it would be fully replicated" \
      in message
  assert f"  * {bias} f32[256]: no logical axes, so it would be fully replicated" in message
  assert "give unmatched parameters axes (a PathRules pattern" in message
