"""xmap(axis_resources=AxisRules): rules from a file == the same resources inline == vmap."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from mesh_testlib import make_mesh

import partition
from partition import AxisRules, Mean, SerialLoop

MESHES = [((8,), ("data",)), ((4, 2), ("data", "tensor"))]
KINDS = [AxisType.Auto, AxisType.Explicit]


def write(tmp_path, text, name="rules.yaml"):
  path = tmp_path / name
  path.write_text(text)
  return AxisRules.from_file(path)


def loss(w, x):
  return jnp.sum(jnp.sin(x @ w) ** 2)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape, names", MESHES)
@pytest.mark.slow
def test_rules_file_equals_inline_equals_vmap(tmp_path, shape, names, kind):
  mesh = make_mesh(shape, names, kind)
  rules = write(tmp_path, "rules:\n  - [batch, data]\n  - [feature, tensor]\n")
  x = jnp.arange(16 * 4.0).reshape(16, 4) / 10
  fun = lambda row: jnp.sin(row) * jax.lax.psum(row.sum(), "batch")
  spec = dict(in_axes=(["batch", ...],), out_axes=["batch", ...], mesh=mesh)
  inline = {"batch": ("data",)}
  assert rules.xmap_resources(["batch"], mesh=mesh, sizes={"batch": 16}) == inline
  with jax.set_mesh(mesh):
    y_rules = partition.xmap(fun, axis_resources=rules, **spec)(x)
    y_inline = partition.xmap(fun, axis_resources=inline, **spec)(x)
  expected = jax.vmap(fun, axis_name="batch")(x)
  np.testing.assert_allclose(y_rules, y_inline, rtol=1e-6)
  np.testing.assert_allclose(y_rules, expected, rtol=1e-5)
  assert y_rules.sharding.spec == y_inline.sharding.spec


@pytest.mark.parametrize("fmt", ["yaml", "toml", "json"])
def test_gradient_accumulation_from_a_config_file(tmp_path, fmt):
  mesh = make_mesh((8,), ("data",), AxisType.Auto)
  rules = AxisRules([("batch", ("data", SerialLoop(4))), ("batch", "data")])
  rules.to_file(tmp_path / f"mb.{fmt}")
  rules = AxisRules.from_file(tmp_path / f"mb.{fmt}")
  w = jnp.linspace(0.0, 1.0, 8).reshape(4, 2)
  xs = jnp.arange(64 * 4.0).reshape(64, 4) / 100
  grad = jax.grad(loss)
  spec = dict(in_axes=({}, ["batch", ...]), out_axes=Mean("batch"), mesh=mesh)
  f_rules = partition.xmap(grad, axis_resources=rules, **spec)
  f_inline = partition.xmap(grad, axis_resources={"batch": ("data", SerialLoop(4))}, **spec)
  reference = jax.vmap(grad, (None, 0))(w, xs).mean(0)
  np.testing.assert_allclose(f_rules(w, xs), f_inline(w, xs), rtol=1e-6)
  np.testing.assert_allclose(f_rules(w, xs), reference, rtol=1e-5, atol=1e-6)
  assert "while" in f_rules.lower(w, xs).as_text()  # the loop is really there


def test_indivisible_batch_falls_back_to_the_next_rule():
  mesh = make_mesh((8,), ("data",), AxisType.Auto)
  rules = AxisRules.from_dict({"rules": [["batch", ["data", {"serial_loop": 4}]],
                                         ["batch", "data"]]})
  w, xs = jnp.ones((4, 2)), jnp.arange(8 * 4.0).reshape(8, 4) / 10  # 8 % (8 * 4) != 0
  assert rules.xmap_resources(["batch"], mesh=mesh, sizes={"batch": 8}) == {
      "batch": ("data",)}
  f = partition.xmap(jax.grad(loss), ({}, ["batch", ...]), Mean("batch"),
                     axis_resources=rules, mesh=mesh)
  np.testing.assert_allclose(f(w, xs), jax.vmap(jax.grad(loss), (None, 0))(w, xs).mean(0),
                             rtol=1e-5)
  assert "while" not in f.lower(w, xs).as_text()


@pytest.mark.slow
def test_two_axes_priority_and_unruled_names(tmp_path):
  mesh = make_mesh((4, 2), ("data", "tensor"), AxisType.Auto)
  rules = write(tmp_path, """
rules:
  - [batch, [data, tensor]]
  - [heads, tensor]
  - [batch, data]
""")
  x = jnp.arange(8 * 2 * 3.0).reshape(8, 2, 3)
  fun = lambda v: v * jax.lax.psum(v, "heads") + jax.lax.axis_index("other")
  spec = dict(in_axes=(["batch", "heads", "other"],), out_axes=["batch", "heads", "other"],
              mesh=mesh)
  # 'batch' takes data x tensor first, so 'heads' cannot use tensor; 'other' has no rule
  assert rules.xmap_resources(["batch", "heads", "other"], mesh=mesh,
                              sizes={"batch": 8, "heads": 2, "other": 3}) == {
      "batch": ("data", "tensor"), "heads": (), "other": ()}
  y = partition.xmap(fun, axis_resources=rules, **spec)(x)
  inline = partition.xmap(fun, axis_resources={"batch": ("data", "tensor")}, **spec)(x)
  ref = jax.vmap(jax.vmap(jax.vmap(fun, axis_name="other"), axis_name="heads"),
                 axis_name="batch")(x)
  np.testing.assert_allclose(y, inline)
  np.testing.assert_allclose(y, ref)
  # with 12 rows data x tensor = 8 does not divide: batch falls back to data, heads gets tensor
  assert rules.xmap_resources(["batch", "heads"], mesh=mesh,
                              sizes={"batch": 12, "heads": 2}) == {
      "batch": ("data",), "heads": ("tensor",)}
  x12 = jnp.arange(12 * 2 * 3.0).reshape(12, 2, 3)
  y12 = partition.xmap(fun, axis_resources=rules, **spec)(x12)
  np.testing.assert_allclose(y12, jax.vmap(jax.vmap(jax.vmap(
      fun, axis_name="other"), axis_name="heads"), axis_name="batch")(x12))


def test_named_loop_resource_from_rules():
  rules = AxisRules([("batch", "micro")])
  x = jnp.arange(8.0)
  with partition.serial_loop("micro", 4):
    assert rules.xmap_resources(["batch"], sizes={"batch": 8}) == {"batch": ("micro",)}
    y = partition.xmap(lambda v: v * 2, ["batch", ...], ["batch", ...],
                       axis_resources=rules)(x)
  np.testing.assert_allclose(y, 2 * np.arange(8.0))


def test_preset_microbatch_with_jit():
  import pathlib

  path = pathlib.Path(__file__).resolve().parents[3] / "recipes/presets/microbatch.yaml"
  rules = AxisRules.from_file(path)
  mesh = make_mesh((8,), ("data",), AxisType.Explicit)
  w, xs = jnp.ones((4, 2)), jnp.arange(32 * 4.0).reshape(32, 4) / 50
  step = jax.jit(partition.xmap(jax.grad(loss), ({}, ["batch", ...]), Mean("batch"),
                                axis_resources=rules))
  with jax.set_mesh(mesh):
    g = step(w, xs)
  np.testing.assert_allclose(g, jax.vmap(jax.grad(loss), (None, 0))(w, xs).mean(0),
                             rtol=1e-5, atol=1e-6)
