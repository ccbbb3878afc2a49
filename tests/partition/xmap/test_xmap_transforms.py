"""JAX transformations of an xmap with mesh resources, eager and under ``jax.jit``, with
``mesh=`` and with ``jax.set_mesh``, on Auto and Explicit meshes. Reference: the same
transformation of the positional function ``jnp.sin(x) * 2`` (or ``x * 3``, for the linear
transpose) on one device."""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from mesh_testlib import make_mesh

import partition
from partition import xmap

X = np.arange(32.0, dtype=np.float32).reshape(8, 4) / 10


def _f(v):
  return jnp.sin(v) * 2


def _linear(v):
  return v * 3


def _transforms(f, g):
  """name -> (transformed xmap call, the same on the positional functions)."""
  ones = jnp.ones_like(X)
  return {
      "value_and_grad": (lambda: jax.value_and_grad(lambda v: f(v).sum())(X),
                         lambda: jax.value_and_grad(lambda v: _f(v).sum())(X)),
      "vjp": (lambda: (lambda y, pull: pull(jnp.ones_like(y)))(*jax.vjp(f, X)),
              lambda: jax.vjp(_f, X)[1](ones)),
      "jvp": (lambda: jax.jvp(f, (X,), (ones,)), lambda: jax.jvp(_f, (X,), (ones,))),
      "vmap": (lambda: jax.vmap(f)(jnp.stack([X, 2 * X])),
               lambda: jax.vmap(_f)(jnp.stack([X, 2 * X]))),
      "linear_transpose": (lambda: jax.linear_transpose(g, X)(g(X)),
                           lambda: jax.linear_transpose(_linear, X)(_linear(X))),
      "checkpoint": (lambda: jax.grad(lambda v: jax.checkpoint(f)(v).sum())(X),
                     lambda: jax.grad(lambda v: jax.checkpoint(_f)(v).sum())(X)),
  }


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("form", ["mesh=", "set_mesh"])
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["Auto", "Explicit"])
@pytest.mark.parametrize("transform", ["value_and_grad", "vjp", "jvp", "vmap",
                                       "linear_transpose", "checkpoint"])
def test_transformation_matrix(transform, axis_type, form, jitted):
  mesh = make_mesh((4, 2), ("data", "model"), axis_type)
  explicit_eager = axis_type == AxisType.Explicit and form == "mesh=" and not jitted
  if explicit_eager and transform in ("value_and_grad", "checkpoint", "linear_transpose"):
    # These apply eager jnp ops (sum, the cotangent's construction) to Explicit-typed
    # arrays outside jit: plain JAX needs jax.set_mesh for that too (checked below).
    pytest.skip("eager ops on Explicit arrays need jax.set_mesh (JAX's rule, see "
                "test_plain_jax_needs_set_mesh_for_eager_explicit_ops)")
  kw = dict(axis_resources={"b": "data", "f": "model"},
            mesh=mesh if form == "mesh=" else None)
  f = xmap(_f, ["b", "f"], ["b", "f"], **kw)
  g = xmap(_linear, ["b", "f"], ["b", "f"], **kw)
  got_fn, want_fn = _transforms(f, g)[transform]
  if jitted:
    got_fn = jax.jit(got_fn)
  context = jax.set_mesh(mesh) if form == "set_mesh" else contextlib.nullcontext()
  with context:
    got = got_fn()
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                      rtol=1e-6, atol=1e-6), got, want_fn())


def test_plain_jax_needs_set_mesh_for_eager_explicit_ops():
  """Pins the JAX rule the skips above rely on: eager grad over an Explicit-sharded jit
  output without jax.set_mesh fails in plain JAX too. If JAX lifts it, drop the skips."""
  mesh = make_mesh((4, 2), ("data", "model"), AxisType.Explicit)
  sharded = jax.jit(lambda v: jax.sharding.reshard(
      jnp.sin(v), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))))
  with pytest.raises(ValueError, match="Length of device assignment"):
    jax.grad(lambda v: sharded(v).sum())(X)
  with jax.set_mesh(mesh):
    np.testing.assert_allclose(jax.grad(lambda v: sharded(v).sum())(X), np.cos(X), rtol=1e-6)


def test_fresh_xmap_objects_share_compiled_programs():
  traces = []

  def body(v):
    traces.append(1)
    return v * 2

  mesh = make_mesh((8,), ("data",), AxisType.Explicit)
  for _ in range(4):  # a fresh xmap per step, as in a training loop
    f = xmap(body, ["b", ...], ["b", ...], axis_resources={"b": "data"}, mesh=mesh)
    np.testing.assert_allclose(f(X), X * 2)
  assert len(traces) == 1
  # different specs or resources are different programs
  xmap(body, ["b", ...], ["b", ...], axis_resources={}, mesh=mesh)(X)
  assert len(traces) == 2


def test_value_and_grad_of_xmap_outside_jit_under_set_mesh():
  """The README pattern: grad of an xmapped loss, eagerly, under jax.set_mesh (Auto)."""
  mesh = make_mesh((4, 2), ("data", "model"), AxisType.Auto)
  loss = xmap(lambda w, x: jnp.tanh(x @ w).sum(), ([...], ["batch", ...]),
              partition.Sum("batch"), axis_resources={"batch": "data"})
  w = np.ones((4, 3), np.float32) / 4
  with jax.set_mesh(mesh):
    value, grad = jax.value_and_grad(loss)(w, X)
  ref_value, ref_grad = jax.value_and_grad(lambda w: jnp.tanh(X @ w).sum())(w)
  np.testing.assert_allclose(value, ref_value, rtol=1e-5)
  np.testing.assert_allclose(grad, ref_grad, rtol=1e-5)


W = np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3)


def _mixed_transforms(f, how):
  """name -> (transformed call of ``f(w, x)`` differentiating/mapping ``w`` only, with ``x`` a
  concrete jax.Array either closed over or passed and not differentiated), for ``f`` the
  xmap and for the positional reference."""
  x = jnp.asarray(X)  # a committed-looking jax.Array, not numpy: it carries a memory kind

  def call(fn):
    return (lambda w: fn(w, x)) if how == "closed" else fn

  def args(w):
    return (w,) if how == "closed" else (w, x)

  ws = jnp.stack([jnp.asarray(W), 2 * jnp.asarray(W)])
  return {
      "value_and_grad": lambda fn: jax.value_and_grad(
          lambda *a: (call(fn)(*a) ** 2).sum())(*args(jnp.asarray(W))),
      "vjp": lambda fn: (lambda y, pull: pull(jnp.ones_like(y)))(
          *jax.vjp(lambda w: call(fn)(*args(w)), jnp.asarray(W))),
      "jvp": lambda fn: jax.jvp(lambda w: call(fn)(*args(w)), (jnp.asarray(W),),
                                (jnp.ones_like(W),)),
      "vmap": lambda fn: jax.vmap(lambda w: call(fn)(*args(w)))(ws),
      "checkpoint": lambda fn: jax.grad(
          lambda w: jax.checkpoint(lambda w: call(fn)(*args(w)))(w).sum())(jnp.asarray(W)),
  }


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("form", ["mesh=", "set_mesh"])
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["Auto", "Explicit"])
@pytest.mark.parametrize("how", ["closed", "nondiff"])
@pytest.mark.parametrize("transform", ["value_and_grad", "vjp", "jvp", "vmap", "checkpoint"])
def test_transformation_matrix_with_concrete_arguments(transform, how, axis_type, form,
                                                       jitted):
  """Mixes of traced and concrete arguments: the differentiated weight is traced, the
  batch is a concrete jax.Array, closed over or passed and not differentiated (issue 19: eager
  grad under jax.set_mesh raised JAX's "Memory kinds passed to jax.jit")."""
  mesh = make_mesh((4, 2), ("data", "model"), axis_type)
  if axis_type == AxisType.Explicit and form == "mesh=" and not jitted and transform in (
      "value_and_grad", "checkpoint"):
    pytest.skip("eager ops on Explicit arrays need jax.set_mesh (JAX's rule, see "
                "test_plain_jax_needs_set_mesh_for_eager_explicit_ops)")
  f = xmap(lambda w, x: jnp.tanh(x @ w), ({}, ["b", ...]), ["b", ...],
           axis_resources={"b": "data"}, mesh=mesh if form == "mesh=" else None)
  got_fn = functools.partial(_mixed_transforms(f, how)[transform], f)
  if jitted:
    got_fn = jax.jit(got_fn)
  context = jax.set_mesh(mesh) if form == "set_mesh" else contextlib.nullcontext()
  with context:
    got = got_fn()
  want = _mixed_transforms(None, how)[transform](lambda w, x: jnp.tanh(x @ w))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                      rtol=1e-5, atol=1e-6), got, want)
