"""partition.flax (linen): sharded init vs flax's own resolver, with_axes, constraints."""

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
import partition.flax

LOGICAL = nn.with_logical_partitioning
INIT = nn.initializers.lecun_normal()
MESHES = {(8,): ("fsdp",), (4, 2): ("fsdp", "tensor"), (2, 2, 2): ("data", "fsdp", "tensor")}
RULES = [("batch", "data"), ("embed", "fsdp"), ("mlp", "tensor"), ("mlp", "fsdp")]
MESH = make_mesh((4, 2), ("fsdp", "tensor"), AxisType.Explicit)
AUTO_MESH = make_mesh((4, 2), ("fsdp", "tensor"), AxisType.Auto)


class Block(nn.Module):
  """A linen model annotated the flax way, with flax's own activation constraint."""

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(16, kernel_init=LOGICAL(INIT, ("embed", "mlp")),
                 bias_init=LOGICAL(nn.initializers.zeros, ("mlp",)))(x)
    h = nn.with_logical_constraint(nn.relu(h), ("batch", "mlp"))
    return nn.Dense(8, kernel_init=LOGICAL(INIT, ("mlp", "embed")))(h)


@pytest.mark.parametrize("shape", list(MESHES))
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_init_sharded_matches_flax_logical_to_mesh_sharding(shape, axis_type):
  mesh = make_mesh(shape, MESHES[shape], axis_type)
  x = jnp.ones((8, 8))
  variables = partition.flax.init_sharded(Block(), jax.random.key(0), x, rules=RULES,
                                          mesh=mesh)
  # Independent reference: flax's resolver on flax's own partition specs.
  abstract = jax.eval_shape(Block().init, jax.random.key(0), x)
  # flax places on the full table; axes this mesh lacks then act as size 1 (dropped).
  flax_specs = jax.tree.map(lambda names: nn.logical_to_mesh_axes(names, RULES),
                            nn.get_partition_spec(abstract),
                            is_leaf=lambda x: isinstance(x, P))
  ref = jax.tree.map(lambda spec: P(*(e if e in mesh.axis_names else None for e in spec)),
                     flax_specs, is_leaf=lambda x: isinstance(x, P))
  got = jax.tree.map(lambda a: a.sharding.spec, nn.unbox(variables))
  assert got == ref
  for leaf in jax.tree.leaves(variables):
    assert isinstance(leaf, jax.Array) and isinstance(leaf.sharding, NamedSharding)
  # Values equal an unsharded init.
  plain = Block().init(jax.random.key(0), x)
  for a, b in zip(jax.tree.leaves(variables), jax.tree.leaves(plain)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


@pytest.mark.parametrize("sharded_input", [False, True])
def test_init_sharded_under_set_mesh_with_explicit_axes(sharded_input):
  # flax's boxes and nn.with_logical_constraint call with_sharding_constraint, which asserts
  # on Explicit axes: init must still place every variable as it does on Auto axes.
  x = jnp.ones((8, 8))
  if sharded_input:
    x = jax.device_put(x, NamedSharding(MESH, P("fsdp")))
  ref = partition.flax.init_sharded(Block(), jax.random.key(0), jnp.ones((8, 8)),
                                    rules=RULES, mesh=AUTO_MESH)
  with jax.set_mesh(MESH):
    variables = partition.flax.init_sharded(Block(), jax.random.key(0), x, rules=RULES)
    abstract = partition.flax.abstract_init(Block(), jax.random.key(0), x, rules=RULES)
  for got, want, shape in zip(jax.tree.leaves(variables), jax.tree.leaves(ref),
                              jax.tree.leaves(abstract)):
    assert got.sharding.spec == want.sharding.spec == shape.sharding.spec
    assert got.sharding.mesh.axis_types == (AxisType.Explicit,) * 2
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)


def test_boxes_are_kept_and_apply_works():
  mesh = AUTO_MESH  # Explicit axes would need out_sharding= on matmuls
  x = jnp.ones((8, 8))
  variables = partition.flax.init_sharded(Block(), jax.random.key(0), x, rules=RULES,
                                          mesh=mesh)
  kernel = variables["params"]["Dense_0"]["kernel"]
  assert isinstance(kernel, nn.LogicallyPartitioned) and kernel.names == ("embed", "mlp")
  assert kernel.value.sharding.spec == P("fsdp", "tensor")
  with jax.set_mesh(mesh):
    y = jax.jit(Block().apply)(variables, x)
  np.testing.assert_allclose(np.asarray(y), np.asarray(
      Block().apply(Block().init(jax.random.key(0), x), x)), rtol=1e-5)


def test_abstract_init_and_explain():
  mesh = MESH
  x = jnp.ones((8, 8))
  abstract = partition.flax.abstract_init(Block(), jax.random.key(0), x, rules=RULES,
                                          mesh=mesh)
  k = abstract["params"]["Dense_1"]["kernel"]
  assert isinstance(k, nn.LogicallyPartitioned)
  assert isinstance(k.value, jax.ShapeDtypeStruct)
  assert k.value.sharding.spec == P("tensor", "fsdp")
  report = partition.flax.explain(Block(), jax.random.key(0), x, rules=RULES, mesh=mesh)
  # Reference: bytes per device by hand. Dense_0 kernel (8,16) over 8 devices, bias (16,)
  # over tensor=2, Dense_1 kernel (16,8) over 8, bias (8,) replicated.
  assert report.bytes_per_device == 4 * (8 * 16 // 8 + 16 // 2 + 16 * 8 // 8 + 8)
  assert report.total_bytes == 4 * (8 * 16 + 16 + 16 * 8 + 8)


def test_path_table_annotates_stock_modules():
  class Stock(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(4)(nn.relu(nn.Dense(16)(x)))

  mesh = MESH
  table = partition.PathRules([(r"Dense_0/kernel$", ("embed", "mlp")),
                               (r"Dense_1/kernel$", ("mlp", "embed"))])
  variables = partition.flax.init_sharded(Stock(), jax.random.key(0), jnp.ones((8, 8)),
                                          rules=RULES, mesh=mesh, param_axes=table)
  specs = jax.tree.map(lambda a: a.sharding.spec, variables)
  assert specs == {"params": {"Dense_0": {"kernel": P("fsdp", "tensor"), "bias": P()},
                              "Dense_1": {"kernel": P("tensor", "fsdp"), "bias": P()}}}


def test_with_axes_turns_stock_dense_into_annotated_dense():
  Dense = partition.flax.with_axes(nn.Dense, params={"kernel": ("embed", "mlp"),
                                                     "bias": ("mlp",)},
                                   output=("batch", "mlp"))
  assert Dense.__name__ == "Dense" and issubclass(Dense, nn.Dense)

  class M(nn.Module):
    @nn.compact
    def __call__(self, x):
      return Dense(16)(x)

  mesh = AUTO_MESH
  x = jnp.ones((8, 8))
  variables = partition.flax.init_sharded(M(), jax.random.key(0), x, rules=RULES, mesh=mesh)
  assert list(variables["params"]) == ["Dense_0"]  # auto-naming unchanged
  assert partition.logical_axes(variables) == {"params": {"Dense_0": {
      "kernel": ("embed", "mlp"), "bias": ("mlp",)}}}
  ref = nn.logical_to_mesh_sharding(nn.get_partition_spec(variables), mesh, tuple(RULES))
  assert variables["params"]["Dense_0"]["kernel"].value.sharding.spec == \
      ref["params"]["Dense_0"]["kernel"].spec
  # The output constraint takes effect under the rules (one more sharding op in the HLO).
  with partition.axis_rules(RULES, mesh):
    text = jax.jit(M().apply).lower(variables, x).as_text()
  dense_vars = {"params": nn.unbox(variables)["params"]["Dense_0"]}
  plain = jax.jit(lambda v, x: nn.Dense(16).apply(v, x)).lower(dense_vars, x).as_text()
  assert text.count("sharding_constraint") == plain.count("sharding_constraint") + 1
  y = M().apply(variables, x)  # no mesh in context: the constraint is a no-op
  np.testing.assert_allclose(np.asarray(y), np.asarray(nn.Dense(16).apply(dense_vars, x)),
                             rtol=1e-6)


def test_with_axes_as_decorator_replaces_declared_axes():
  @partition.flax.with_axes(params={"w": ("embed", "mlp")})
  class Mine(nn.Module):
    @nn.compact
    def __call__(self, x):
      w = self.param("w", LOGICAL(INIT, ("old", "names")), (x.shape[-1], 3))
      return x @ w

  variables = jax.eval_shape(Mine().init, jax.random.key(0), jnp.ones((2, 4)))
  assert partition.logical_axes(variables) == {"params": {"w": ("embed", "mlp")}}


def test_with_axes_errors():
  Bad = partition.flax.with_axes(nn.Dense, params={"kernel": ("embed", "mlp", "kv")})
  with pytest.raises(ValueError, match=r"param 'kernel' has shape \(4, 3\) but was given "
                                       r"logical axes \('embed', 'mlp', 'kv'\)"):
    Bad(3).init(jax.random.key(0), jnp.ones((2, 4)))
  Typo = partition.flax.with_axes(nn.Dense, params={"kernal": ("embed", "mlp")})
  with pytest.raises(ValueError, match=r"'kernal' \(did you mean 'kernel'\?\) is not a param "
                                       r"of Dense"):
    Typo(3).init(jax.random.key(0), jnp.ones((2, 4)))
  with pytest.raises(TypeError, match="Pass a class such as nn.Dense"):
    partition.flax.with_axes(int, params={})
  with pytest.raises(TypeError, match=r"got the class flax.nnx.*use partition.nnx.with_axes"):
    partition.flax.with_axes(nnx.Linear, params={})
  with pytest.raises(TypeError, match=r"Pass the class, e.g. with_axes\(Dense, ...\)"):
    partition.flax.with_axes(nn.Dense(3), params={})
  with pytest.raises(TypeError, match=r"got the str 'em'. Write \('em',\) for one dim"):
    partition.flax.with_axes(nn.Dense, params={"kernel": "em"})
  with pytest.raises(TypeError, match=r"keys are param names \(str\), got 0"):
    partition.flax.with_axes(nn.Dense, params={0: ("embed", "mlp")})


@pytest.mark.slow
def test_with_axes_on_a_sub_module_name_is_an_error_naming_it():
  Attn = partition.flax.with_axes(nn.MultiHeadDotProductAttention,
                                  params={"query": ("embed", "heads", "kv")})
  x = jnp.ones((2, 3, 8))
  with pytest.raises(ValueError, match=r"'query' is a sub-module of "
                                       r"MultiHeadDotProductAttention, not a param") as e:
    Attn(num_heads=2, qkv_features=8).init(jax.random.key(0), x)
  assert "PathRules([(r'query/kernel$'" in str(e.value)


def test_init_sharded_argument_errors():
  mesh = AUTO_MESH
  x = jnp.ones((8, 8))
  cases = [
      ((Block, jax.random.key(0)), r"got the class .*Block. Pass an instance"),
      ((lambda x: x, jax.random.key(0)), r"got the function .*Pass a linen Module instance"),
      ((Block(), 0), r"rngs must be a PRNG key or a dict of them, got int 0. Pass "
                     r"jax.random.key\(0\)"),
      ((Block(), {"params": 1}), r"'params': int 1"),
  ]
  for (module, rngs), match in cases:
    with pytest.raises(TypeError, match=match) as e:
      partition.flax.init_sharded(module, rngs, x, rules=RULES, mesh=mesh)
    assert isinstance(e.value, partition.PartitionError)
  nnx_model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match=r"This is an NNX module: use partition.nnx.init_sharded"):
    partition.flax.explain(nnx_model, jax.random.key(0), x, rules=RULES, mesh=mesh)


def test_flax_axis_rules_is_a_deprecated_alias_of_partition_axis_rules():
  with pytest.warns(DeprecationWarning, match=r"partition\.flax\.axis_rules is deprecated .*"
                    r"use partition\.axis_rules \(it sets flax's nn\.logical_axis_rules too\)"):
    alias = partition.flax.axis_rules
  assert alias is partition.axis_rules


def test_flax_own_constraint_takes_effect_under_axis_rules():
  context = partition.axis_rules
  mesh = AUTO_MESH
  x = jnp.ones((8, 8))
  variables = partition.flax.init_sharded(Block(), jax.random.key(0), x, rules=RULES,
                                          mesh=mesh)
  with jax.set_mesh(mesh):  # fresh functions: jit's trace cache ignores flax's rules
    without = jax.jit(lambda v, x: Block().apply(v, x)).lower(variables, x).as_text()
    with context(RULES, mesh):
      with_rules = jax.jit(lambda v, x: Block().apply(v, x)).lower(variables, x).as_text()
  # flax drops nn.with_logical_constraint without rules; ours sets flax's rules too.
  assert with_rules.count("sharding_constraint") > without.count("sharding_constraint")
  assert partition.current_rules() is None


def test_errors_without_rules_or_mesh():
  with pytest.raises(ValueError, match=r"Pass rules=partition.AxisRules"):
    partition.flax.init_sharded(Block(), jax.random.key(0), jnp.ones((2, 8)),
                                mesh=make_mesh((8,), ("fsdp",), AxisType.Explicit))
  with pytest.raises(ValueError, match=r"needs a concrete device mesh.*found no mesh"):
    partition.flax.init_sharded(Block(), jax.random.key(0), jnp.ones((2, 8)), rules=RULES)


def test_rules_and_mesh_from_context():
  mesh = MESH
  with partition.axis_rules(RULES, mesh):
    variables = partition.flax.init_sharded(Block(), jax.random.key(0), jnp.ones((8, 8)))
  assert variables["params"]["Dense_0"]["kernel"].value.sharding.spec == P("fsdp", "tensor")


def test_installed_flax_table_places_like_axis_rules():
  # The table partition.axis_rules installs for flax keeps size-1 axes (flax's "used" check
  # must see them) and maps rules whose axes the mesh lacks to None (never to the name).
  mesh = make_mesh((2, 1, 4), ("x", "one", "x2"), AxisType.Explicit)
  rules = partition.AxisRules([("a", ("x", "one")), ("b", "one"), ("b", "x2"),
                               ("mlp", "tensor"), ("c", "x2")])
  with partition.axis_rules(rules, mesh):
    table = nn.get_logical_axis_rules()
  assert dict(table)["mlp"] is None and ("a", ("x", "one")) in table

  def drop_size_one(spec):
    def keep(e):
      kept = tuple(a for a in ((e,) if isinstance(e, str) else e or ()) if mesh.shape[a] > 1)
      return None if not kept else kept[0] if len(kept) == 1 else kept
    return P(*(keep(e) for e in spec))

  for axes in [("a", "b"), ("b", "c"), ("mlp", "a"), ("c", "b", "a")]:
    want = drop_size_one(nn.logical_to_mesh_axes(axes, table))
    assert rules.spec(axes, (8,) * len(axes), mesh) == want, axes
  assert rules.spec(("a", "b"), (8, 8), mesh) == P("x", "x2")  # 'one' is taken by 'a'
