"""Positional (unnamed) dims through xmap: they keep their sharding, or take a stated one.

References: numpy / plain jax on one device for values; the compiled program's
``input_shardings`` / ``output_shardings`` / ``memory_analysis()`` / HLO for placement.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from mesh_testlib import make_mesh

import partition
from partition import Logical, Mean, SerialLoop, xmap

TYPES = pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit],
                                ids=["Auto", "Explicit"])


def _loss(w, x):
  return jnp.sum(jnp.tanh(x @ w) ** 2)


def _data(rows=16):
  rng = np.random.default_rng(0)
  return (rng.normal(size=(8, 4)).astype(np.float32),
          rng.normal(size=(rows, 8)).astype(np.float32))


def _reference_grad(w, x):
  return jax.grad(lambda w: jnp.mean(jax.vmap(_loss, (None, 0))(w, x)))(w)


def _norm(spec):
  """A PartitionSpec without trailing Nones (P('data', None) places like P('data'))."""
  entries = list(spec)
  while entries and entries[-1] is None:
    entries.pop()
  return P(*entries)


def _collectives(text):
  return {op: len(re.findall(rf"\b{op}(?:-start)?\(", text))
          for op in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")}


@TYPES
@pytest.mark.slow
def test_fsdp_accumulation_keeps_parameter_sharding(axis_type):
  mesh = make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_type)
  w_np, x_np = _data()
  spec = P("fsdp", "tensor")
  w = jax.device_put(w_np, NamedSharding(mesh, spec))
  x = jax.device_put(x_np, NamedSharding(mesh, P("data")))
  grad = xmap(jax.grad(_loss), in_axes=([...], ["batch", ...]),
              out_axes=Mean("batch", axes=spec),
              axis_resources={"batch": ("data", SerialLoop(4))}, mesh=mesh)
  with jax.set_mesh(mesh):
    got = grad(w, x)
  np.testing.assert_allclose(got, _reference_grad(w_np, x_np), rtol=1e-5, atol=1e-7)
  assert _norm(got.sharding.spec) == spec

  compiled = grad.lower(w, x).compile()
  (w_in, x_in), _ = compiled.input_shardings
  assert _norm(w_in.spec) == spec and _norm(x_in.spec) == P("data")
  assert _norm(compiled.output_shardings.spec) == spec
  # argument bytes per device are the shards': w over 4 devices, x over 2.
  assert compiled.memory_analysis().argument_size_in_bytes == w_np.nbytes // 4 + x_np.nbytes // 2
  text = compiled.as_text()
  counts = _collectives(text)
  assert counts["all-gather"] == 0 and counts["all-to-all"] == 0
  # The gradient is only reduced over the batch's mesh axis, on its own shard: no
  # all-reduce ever carries the full (8, 4) parameter.
  assert counts["all-reduce"] >= 1
  assert not re.search(r"f32\[8,4\]\{[^}]*\} all-reduce\(", text)
  assert re.search(r"f32\[4,2\]\{[^}]*\} all-reduce\(", text)


@TYPES
def test_committed_input_keeps_positional_sharding(axis_type):
  mesh = make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_type)
  w_np, x_np = _data()
  w = jax.device_put(w_np, NamedSharding(mesh, P("fsdp", "tensor")))
  f = xmap(lambda w, x: jnp.tanh(x @ w), in_axes=([...], ["batch", ...]),
           out_axes=["batch", ...], axis_resources={"batch": "data"}, mesh=mesh)
  with jax.set_mesh(mesh):
    got = f(w, x_np)
  np.testing.assert_allclose(got, np.tanh(x_np @ w_np), rtol=1e-5, atol=1e-6)
  compiled = f.lower(w, x_np).compile()
  (w_in, x_in), _ = compiled.input_shardings
  assert _norm(w_in.spec) == P("fsdp", "tensor")   # not replicated
  assert _norm(x_in.spec) == P("data")


def test_committed_input_drops_mesh_axes_its_named_dim_takes():
  mesh = make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), AxisType.Auto)
  x_np = np.arange(32.0, dtype=np.float32).reshape(8, 4)
  x = jax.device_put(x_np, NamedSharding(mesh, P("fsdp", "data")))  # dim 1 on 'data'
  f = xmap(lambda v: v * 2, in_axes=["batch", ...], out_axes=["batch", ...],
           axis_resources={"batch": "data"}, mesh=mesh)
  np.testing.assert_allclose(f(x), x_np * 2)
  (x_in,), _ = f.lower(x).compile().input_shardings
  assert _norm(x_in.spec) == P("data")


def test_uncommitted_outputs_are_left_to_propagation():
  """Unstated positional output dims are UNCONSTRAINED: the result follows its input."""
  mesh = make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), AxisType.Auto)
  w_np, _ = _data()
  w = jax.device_put(w_np, NamedSharding(mesh, P("fsdp", "tensor")))
  f = xmap(lambda w: jnp.sin(w) * 2, in_axes=[...], out_axes=[...], mesh=mesh,
           axis_resources={})
  got = f(w)
  np.testing.assert_allclose(got, np.sin(w_np) * 2, rtol=1e-6)
  assert _norm(got.sharding.spec) == P("fsdp", "tensor")


@TYPES
def test_logical_leaves_resolve_through_rules(axis_type):
  mesh = make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_type)
  rules = partition.AxisRules([("batch", "data"), ("embed", "fsdp"), ("mlp", "tensor")])
  w_np, x_np = _data()
  f = xmap(lambda w, x: jnp.tanh(x @ w),
           in_axes=(Logical("embed", "mlp"), Logical("embed", named=["batch", ...])),
           out_axes=Logical("mlp", named=["batch", ...]), axis_resources=rules, mesh=mesh)
  with jax.set_mesh(mesh):
    got = f(w_np, x_np)
  np.testing.assert_allclose(got, np.tanh(x_np @ w_np), rtol=1e-5, atol=1e-6)
  assert _norm(got.sharding.spec) == P("data", "tensor")
  compiled = f.lower(w_np, x_np).compile()
  (w_in, x_in), _ = compiled.input_shardings
  assert (_norm(w_in.spec), _norm(x_in.spec)) == (P("fsdp", "tensor"), P("data", "fsdp"))


def test_logical_leaves_use_the_rules_context():
  mesh = make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), AxisType.Auto)
  rules = partition.AxisRules([("embed", "fsdp"), ("mlp", "tensor")])
  w_np, _ = _data()
  f = xmap(lambda w: w * 3, in_axes=Logical("embed", "mlp"), out_axes=P("tensor"), mesh=mesh)
  with partition.axis_rules(rules, mesh):
    got = f(w_np)
  np.testing.assert_allclose(got, w_np * 3)
  assert _norm(got.sharding.spec) == P("tensor")
  with pytest.raises(partition.ResourceError, match=r"no rules to resolve logical axes"):
    f(w_np)


@pytest.mark.parametrize("mesh_from", ["mesh=", "axis_rules"])
def test_named_axes_use_the_rules_context_as_logical_dims_do(mesh_from):
  """Without axis_resources, under partition.axis_rules a named axis is placed by its rule,
  like a Logical dim of the same xmap; the axis_rules mesh serves when no other is given."""
  mesh = make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), AxisType.Auto)
  rules = partition.AxisRules([("batch", "data"), ("embed", "fsdp")])
  w_np, x_np = _data()
  f = xmap(lambda w, x: x @ w, in_axes=(Logical("embed", None), ["batch", ...]),
           out_axes=["batch", ...], **({"mesh": mesh} if mesh_from == "mesh=" else {}))
  with partition.axis_rules(rules, mesh):
    got = f(w_np, x_np)
    (w_in, x_in), _ = f.lower(w_np, x_np).compile().input_shardings
  np.testing.assert_allclose(got, x_np @ w_np, rtol=1e-5, atol=1e-6)
  assert _norm(got.sharding.spec) == P("data")
  assert (_norm(w_in.spec), _norm(x_in.spec)) == (P("fsdp"), P("data"))
  # An explicit axis_resources still decides: {} vectorises the named axis.
  g = xmap(lambda x: x * 2, in_axes=["batch", ...], out_axes=["batch", ...],
           axis_resources={}, mesh=mesh)
  with partition.axis_rules(rules, mesh):
    assert g.lower(x_np).compile().input_shardings[0][0].is_fully_replicated


def test_positional_sharding_inside_jit_is_kept():
  """Inside an enclosing jit the inputs are tracers: xmap must not replicate them."""
  mesh = make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), AxisType.Auto)
  w_np, x_np = _data()
  spec = P("fsdp", "tensor")
  grad = xmap(jax.grad(_loss), in_axes=([...], ["batch", ...]),
              out_axes=Mean("batch", axes=spec),
              axis_resources={"batch": ("data", SerialLoop(2))}, mesh=mesh)
  step = jax.jit(lambda w, x: w - 0.1 * grad(w, x),
                 in_shardings=(NamedSharding(mesh, spec), NamedSharding(mesh, P("data"))))
  got = step(w_np, x_np)
  np.testing.assert_allclose(got, w_np - 0.1 * _reference_grad(w_np, x_np), rtol=1e-5,
                             atol=1e-6)
  text = step.lower(w_np, x_np).compile().as_text()
  assert not re.search(r"f32\[8,4\]\{[^}]*\} all-(reduce|gather)\(", text)


@pytest.mark.parametrize("out_axes, shape, match", [
    (Logical(named=["batch", ...]), None, None),  # a valid spelling, for contrast
    (P("nope"), (8, 4, 6), r"mesh axes \['nope'\] that the mesh"),
    (P(None, None, "fsdp"), (8, 4, 6), r"3 entries, but the value has 2 positional dims"),
    (P(None, ("fsdp", "tensor", "data")), (8, 4, 3), r"not divisible by the 8 devices"),
])
def test_stated_output_sharding_errors(out_axes, shape, match):
  mesh = make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), AxisType.Auto)
  x = np.ones(shape or (8, 4, 6), np.float32)
  if match is None:
    f = xmap(lambda v: v * 2, ["batch", ...], out_axes, axis_resources={"batch": "data"},
             mesh=mesh)
    np.testing.assert_allclose(f(x), x * 2)
    return
  f = xmap(lambda v: v.sum(0), in_axes=[...], out_axes=out_axes, axis_resources={}, mesh=mesh)
  with pytest.raises(partition.ResourceError, match=match) as e:
    f(x)
  assert "out_axes for output" in str(e.value)


def test_stated_output_clash_with_named_dim_is_an_error():
  mesh = make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), AxisType.Auto)
  f = xmap(lambda v: v, ["batch", ...], Logical("embed", named=["batch", ...]),
           axis_resources=partition.AxisRules([("batch", "data"), ("embed", "data")]),
           mesh=mesh)
  with pytest.raises(partition.ResourceError,
                     match=r"positional dim 0 uses mesh axes \['data'\] that another dim"):
    f(np.ones((8, 4), np.float32))


def test_stated_input_clash_with_named_dim_is_an_error():
  mesh = make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), AxisType.Auto)
  f = xmap(lambda x: x, in_axes=Logical("embed", named=["batch", ...]),
           out_axes=["batch", ...], axis_resources=partition.AxisRules(
               [("batch", "data"), ("embed", "data")]), mesh=mesh)
  with pytest.raises(partition.ResourceError,
                     match=r"in_axes for argument\[0\] states a sharding(?s:.*)"
                           r"positional dim 0 uses mesh axes \['data'\]"):
    f(np.ones((8, 4), np.float32))


def test_logical_spelling_errors():
  with pytest.raises(partition.SpecError, match=r"not Logical\(\('embed', 'mlp'\)\)"):
    Logical(("embed", "mlp"))
  with pytest.raises(partition.SpecError, match=r"named= takes a dict or list spec"):
    xmap(lambda x: x, Logical("a", named=P("x")), [...])


def test_int_keyed_containers_are_not_spec_leaves():
  """NNX keeps lists of layers as {0: {...}, 1: {...}}: a container of specs, not a
  {dim: name} leaf."""
  mesh = make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), AxisType.Auto)
  params = {"blocks": {0: {"w": np.ones((8, 4), np.float32)},
                       1: {"w": np.full((8, 4), 2.0, np.float32)}}}
  specs = {"blocks": {0: {"w": P("fsdp")}, 1: {"w": P(None, "tensor")}}}
  f = xmap(lambda p: jax.tree.map(lambda w: w * 3, p), in_axes=(specs,), out_axes=specs,
           mesh=mesh)
  got = f(params)
  np.testing.assert_allclose(got["blocks"][1]["w"], params["blocks"][1]["w"] * 3)
  assert _norm(got["blocks"][0]["w"].sharding.spec) == P("fsdp")
  assert _norm(got["blocks"][1]["w"].sharding.spec) == P(None, "tensor")
