"""constrain and the axis_rules context: Auto / Explicit / mixed meshes, compiled programs."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from mesh_testlib import make_mesh

import partition
from partition import AxisRules

MESHES = [((8,), ("a",)), ((4, 2), ("a", "b")), ((2, 2, 2), ("a", "b", "c"))]


def rules_for(names):
  return AxisRules([("batch", names[0]), ("embed", names[1:] or None)])


def expected_spec(names):
  rest = names[1:]
  return P(names[0]) if not rest else P(names[0], rest[0] if len(rest) == 1 else rest)


def make_f():
  # A fresh function per context: jit caches traces by function, and the rules context is
  # read at trace time (like flax's axis_rules), so it is not part of jit's cache key.
  return lambda x: partition.constrain(jnp.sin(x * 2), ("batch", "embed"))


def same(spec, expected):
  strip = lambda s: tuple(s)[:max([i + 1 for i, e in enumerate(s) if e is not None] or [0])]
  return strip(spec) == strip(expected)


@pytest.mark.parametrize("shape, names", MESHES)
def test_auto_mesh_uses_with_sharding_constraint(shape, names):
  mesh = make_mesh(shape, names, AxisType.Auto)
  x, f = jnp.arange(64.0).reshape(8, 8), make_f()
  with partition.axis_rules(rules_for(names), mesh):
    assert "sharding_constraint" in str(jax.make_jaxpr(f)(x))
    assert "sharding_constraint" in jax.jit(f).lower(x).as_text()
    y = jax.jit(f)(x)
  assert same(y.sharding.spec, expected_spec(names))
  np.testing.assert_allclose(y, np.sin(2 * np.arange(64.0).reshape(8, 8)), rtol=1e-6)


@pytest.mark.parametrize("shape, names", MESHES)
def test_explicit_mesh_uses_reshard(shape, names):
  mesh = make_mesh(shape, names, AxisType.Explicit)
  x, f = jnp.arange(64.0).reshape(8, 8), make_f()
  with jax.set_mesh(mesh), partition.axis_rules(rules_for(names)):
    jaxpr = str(jax.make_jaxpr(f)(x))
    assert "reshard" in jaxpr and "sharding_constraint" not in jaxpr
    assert "sharding_constraint" in jax.jit(f).lower(x).as_text()
    y = jax.jit(f)(x)
    assert same(y.sharding.spec, expected_spec(names))
    np.testing.assert_allclose(y, np.sin(2 * np.arange(64.0).reshape(8, 8)), rtol=1e-6)


def test_mixed_mesh_splits_the_spec():
  mesh = make_mesh((4, 2), ("data", "tensor"), (AxisType.Explicit, AxisType.Auto))
  rules = AxisRules([("batch", "data"), ("embed", "tensor")])
  x, f = jnp.ones((8, 4)), make_f()
  with jax.set_mesh(mesh), partition.axis_rules(rules):
    jaxpr = str(jax.make_jaxpr(f)(x))
    assert "reshard" in jaxpr and "sharding_constraint" in jaxpr
    assert jax.jit(f)(x).sharding.spec == P("data", "tensor")


def test_eager_constrain_places_the_array():
  mesh = make_mesh((4, 2), ("data", "tensor"), AxisType.Auto)
  y = partition.constrain(jnp.ones((8, 4)), ("batch", "embed"),
                          rules=[("batch", "data"), ("embed", "tensor")], mesh=mesh)
  assert y.sharding.spec == P("data", "tensor")
  assert y.addressable_shards[0].data.shape == (2, 2)


def test_no_mesh_is_a_no_op():
  x = jnp.ones((3, 5))
  assert partition.constrain(x, ("batch", "embed")) is x
  with partition.axis_rules([("batch", "data")]):
    assert partition.constrain(x, ("batch", "embed")) is x
    assert jax.jit(lambda x: partition.constrain(x, ("batch", None)))(x).shape == (3, 5)


@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit])
def test_mesh_without_rules_raises(kind):
  mesh = make_mesh((8,), ("data",), kind)
  x = jnp.ones((8,))
  with pytest.raises(partition.NoRulesError, match=r"(?s)found a mesh but no axis rules.*"
                                                   r"partition\.axis_rules\(rules\)"):
    partition.constrain(x, ("batch",), mesh=mesh)
  with jax.set_mesh(mesh):
    with pytest.raises(ValueError, match="rules=partition.AxisRules"):
      jax.jit(lambda x: partition.constrain(x, ("batch",)))(x)


def test_explicit_arguments_win_over_context():
  mesh = make_mesh((4, 2), ("data", "tensor"), AxisType.Auto)
  g = lambda x: partition.constrain(x, ("batch", "embed"), rules=[("embed", "data")])
  with partition.axis_rules([("batch", "data")], mesh):
    assert jax.jit(g)(jnp.ones((8, 8))).sharding.spec == P(None, "data")


def test_shape_aware_fallback_and_errors():
  mesh = make_mesh((4, 2), ("data", "tensor"), AxisType.Auto)
  rules = AxisRules([("batch", "data"), ("batch", "tensor")])
  with partition.axis_rules(rules, mesh):
    assert jax.jit(lambda x: partition.constrain(x, ("batch",)))(jnp.ones(6)).sharding.spec \
        == P("tensor")
    with pytest.raises(ValueError, match=r"(?s)partition\.constrain.*name 1 dims but the "
                                         r"shape \(2, 3\) has 2"):
      partition.constrain(jnp.ones((2, 3)), ("batch",))
    with pytest.raises(partition.ResolutionError, match="'bacth' has no rule"):
      partition.constrain(jnp.ones(8), ("bacth",), strict=True)


def test_pytree_constrain():
  mesh = make_mesh((4, 2), ("data", "tensor"), AxisType.Auto)
  tree = {"h": jnp.ones((8, 4)), "mask": jnp.ones(8), "z": jnp.ones(3)}
  axes = {"h": ("batch", "embed"), "mask": ("batch",), "z": None}
  with partition.axis_rules([("batch", "data"), ("embed", "tensor")], mesh):
    out = jax.jit(lambda t: partition.constrain(t, axes))(tree)
  assert out["h"].sharding.spec == P("data", "tensor")
  assert out["mask"].sharding.spec == P("data")
  assert out["z"].sharding.spec == P()


def test_gradients_flow_through_constrain():
  mesh = make_mesh((8,), ("data",), AxisType.Auto)
  loss = lambda x: jnp.sum(jnp.sin(partition.constrain(x, ("batch", None))) ** 2)
  x = jnp.arange(16.0).reshape(8, 2) / 10
  with partition.axis_rules([("batch", "data")], mesh):
    g = jax.jit(jax.grad(loss))(x)
  np.testing.assert_allclose(g, jax.grad(lambda x: jnp.sum(jnp.sin(x) ** 2))(x), rtol=1e-6)


# -- the context ----------------------------------------------------------------------------


def test_context_nests_and_restores():
  mesh = make_mesh((8,), ("data",), AxisType.Auto)
  assert partition.current_rules() is None
  with partition.axis_rules([("a", "x")], mesh) as outer:
    assert partition.current_rules() is outer and partition.current_rules_mesh() is mesh
    with partition.axis_rules([("a", "y")]):
      assert partition.current_rules() == AxisRules([("a", "y")])
      assert partition.current_rules_mesh() is mesh  # the mesh is inherited
    with partition.axis_rules(None, mesh=None):
      assert partition.current_rules() is outer
    assert partition.current_rules() is outer
  assert partition.current_rules() is None and partition.current_rules_mesh() is None


def test_context_restores_after_an_exception():
  with pytest.raises(RuntimeError):
    with partition.axis_rules([("a", "x")]):
      raise RuntimeError
  assert partition.current_rules() is None


def test_context_is_per_thread():
  barrier = threading.Barrier(2)
  seen = {}

  def worker(name, axis):
    with partition.axis_rules([("batch", axis)]):
      barrier.wait()
      seen[name] = partition.current_rules()
      barrier.wait()

  threads = [threading.Thread(target=worker, args=(n, a)) for n, a in (("t1", "x"), ("t2", "y"))]
  with partition.axis_rules([("batch", "main")]):
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    assert partition.current_rules() == AxisRules([("batch", "main")])
  assert seen == {"t1": AxisRules([("batch", "x")]), "t2": AxisRules([("batch", "y")])}


def test_bad_mesh_argument():
  with pytest.raises(ValueError, match="must be a jax.sharding.Mesh"):
    with partition.axis_rules([("a", "x")], mesh="data"):
      pass


def test_auto_rules_mesh_under_explicit_set_mesh_is_a_mesh_error():
  """JAX would raise a bare AssertionError ("acts as an assert when all axes ... Explicit")."""
  auto = make_mesh((4, 2), ("a", "b"), AxisType.Auto)
  explicit = make_mesh((4, 2), ("a", "b"), AxisType.Explicit)
  for call in (lambda x: partition.constrain(x, ("batch", "embed")),
               jax.jit(lambda x: partition.constrain(x, ("batch", "embed")))):
    with jax.set_mesh(explicit), partition.axis_rules(rules_for(("a", "b")), auto):
      with pytest.raises(partition.MeshError) as info:
        call(jnp.ones((8, 4)))
    message = str(info.value)
    assert "the rules mesh and the jax.set_mesh mesh differ in which axes are Explicit" in message
    assert "rules mesh (axis_rules or mesh=): mesh(a=4 Auto, b=2 Auto)" in message
    assert "jax.set_mesh mesh: mesh(a=4 Explicit, b=2 Explicit)" in message
    assert "Use one mesh for both" in message


def test_explicit_rules_mesh_traced_outside_set_mesh_is_a_mesh_error():
  """JAX would fail at dispatch with "Length of device assignment 1"; eagerly it works."""
  explicit = make_mesh((4, 2), ("a", "b"), AxisType.Explicit)
  with partition.axis_rules(rules_for(("a", "b")), explicit):
    eager = partition.constrain(jnp.ones((8, 4)), ("batch", "embed"))
    assert eager.sharding.spec == P("a", "b")
    with pytest.raises(partition.MeshError) as info:
      jax.jit(lambda x: partition.constrain(x, ("batch", "embed")))(jnp.ones((8, 4)))
  message = str(info.value)
  assert "the rules mesh has Explicit axes ['a', 'b']" in message
  assert "traced outside jax.set_mesh" in message
  assert "inside `with jax.set_mesh(mesh):`" in message
  with jax.set_mesh(explicit), partition.axis_rules(rules_for(("a", "b")), explicit):
    traced = jax.jit(lambda x: partition.constrain(x, ("batch", "embed")))(jnp.ones((8, 4)))
  assert traced.sharding.spec == P("a", "b")
