"""Independent tests of ``partition.xmap`` semantics, derived from the original xmap.

References are numpy or plain ``jax.vmap(axis_name=...)``; integer data is compared
exactly, float32 with rtol 1e-6. Resources (mesh axes, serial loops) never change results.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec
from mesh_testlib import make_mesh

import partition
from partition import Mean, SerialLoop, Sum, xmap

RTOL = 1e-6


def _close(a, b):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=1e-6)


def _equal(a, b):
  a, b = np.asarray(a), np.asarray(b)
  assert a.shape == b.shape, (a.shape, b.shape)
  assert a.dtype == b.dtype, (a.dtype, b.dtype)
  np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def mesh42():
  return make_mesh((4, 2), ("x", "y"), AxisType.Auto)


@pytest.fixture(scope="module")
def mesh8():
  return make_mesh((8,), ("x",), AxisType.Auto)


def _ints(*shape):
  return jnp.arange(int(np.prod(shape)), dtype=jnp.int32).reshape(shape)


def _floats(*shape, seed=0):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape).astype(np.float32))


# ------------------------------------------------------------------------------- specs


def test_dict_spec_on_inner_dim():
  x = _ints(2, 3, 4)
  seen = []

  def f(a):
    seen.append(a.shape)
    return a * 2

  out = xmap(f, ({1: "j"},), {1: "j"})(x)
  assert seen[-1] == (2, 4)
  _equal(out, x * 2)


def test_dict_spec_moves_axis_to_front():
  x = _ints(2, 3, 4)
  out = xmap(lambda a: a + 1, ({1: "j"},), {0: "j"})(x)
  _equal(out, np.moveaxis(np.asarray(x) + 1, 1, 0))


def test_list_spec_with_none_and_exact_rank():
  x = _ints(2, 3, 4)
  out = xmap(lambda a: a.sum(0), ([None, "j", None],), ["j", None])(x)
  _equal(out, np.asarray(x).sum(0).astype(np.int32))


def test_list_spec_with_ellipsis_any_rank():
  f = xmap(lambda a: a * 3, (["i", ...],), ["i", ...])
  for shape in [(4,), (4, 2), (4, 2, 3)]:
    x = _ints(*shape)
    _equal(f(x), x * 3)


def test_empty_specs_mean_unmapped():
  w = _ints(3)
  x = _ints(4, 3)
  for spec in ({}, [...], None):
    out = xmap(lambda w, x: w * x, (spec, ["i", ...]), ["i", ...])(w, x)
    _equal(out, np.asarray(w)[None] * np.asarray(x))


def test_two_named_axes_one_input():
  x = _ints(2, 3, 4)
  out = xmap(lambda a: a * 10, ({0: "a", 2: "b"},), ["b", "a", ...])(x)
  _equal(out, np.transpose(np.asarray(x) * 10, (2, 0, 1)))


def test_pytree_prefix_one_spec_for_dict():
  tree = {"w": _ints(4, 3), "b": _ints(4), "nested": (_ints(4, 2, 2),)}
  seen = {}

  def f(t):
    seen.update(jax.tree.map(lambda a: a.shape, t))
    return jax.tree.map(lambda a: a + 1, t)

  out = xmap(f, (["i", ...],), ["i", ...])(tree)
  assert seen["w"] == (3,) and seen["b"] == () and seen["nested"] == ((2, 2),)
  jax.tree.map(lambda o, a: _equal(o, a + 1), out, tree)


def test_pytree_specs_per_key():
  tree = {"a": _ints(4, 3), "b": _ints(3, 4)}
  out = xmap(lambda t: t["a"] + t["b"], ({"a": ["i", ...], "b": [None, "i"]},), ["i", ...])(tree)
  _equal(out, np.asarray(tree["a"]) + np.asarray(tree["b"]).T)


def test_top_level_list_of_specs_is_a_tuple():
  x, y = _ints(4, 3), _ints(3)
  out_list = xmap(lambda a, b: a * b, [["i", ...], [...]], ["i", ...])(x, y)
  out_tuple = xmap(lambda a, b: a * b, (["i", ...], [...]), ["i", ...])(x, y)
  _equal(out_list, out_tuple)
  _equal(out_list, np.asarray(x) * np.asarray(y))


def test_list_of_out_specs_for_tuple_output():
  x = _ints(4, 3)
  a, b = xmap(lambda v: (v, v.sum()), (["i", ...],), [["i", ...], ["i"]])(x)
  _equal(a, x)
  _equal(b, np.asarray(x).sum(1).astype(np.int32))


def test_multiple_outputs_with_different_specs():
  x = _ints(4, 3)

  def f(v):
    return {"same": v, "moved": v[:, None] * jnp.ones((1, 2), jnp.int32), "total": v.sum()}

  out = xmap(f, (["i", ...],),
             {"same": ["i", ...], "moved": [None, "i", ...], "total": Sum("i")})(x)
  xn = np.asarray(x)
  _equal(out["same"], x)
  _equal(out["moved"], np.moveaxis(np.broadcast_to(xn[:, :, None], (4, 3, 2)), 0, 1))
  _equal(out["total"], np.int32(xn.sum()))


@pytest.mark.parametrize("spec", [[None, "i", ...], {1: "i"}], ids=["list", "dict"])
def test_out_axes_at_nonzero_position(spec):
  x = _ints(4, 3, 2)
  out = xmap(lambda v: v + 1, (["i", ...],), spec)(x)
  _equal(out, np.moveaxis(np.asarray(x) + 1, 0, 1))


def test_out_axes_at_last_position():
  x = _ints(4, 3, 2)
  out = xmap(lambda v: v, (["i", ...],), {2: "i"})(x)
  _equal(out, np.moveaxis(np.asarray(x), 0, 2))


# ------------------------------------------------------------------------- broadcasting


def test_broadcast_output_not_depending_on_axis():
  out = xmap(lambda v: jnp.int32(7), (["i", ...],), ["i", ...])(_ints(5))
  _equal(out, np.full((5,), 7, np.int32))


def test_broadcast_along_axis_from_axis_sizes():
  x = _ints(4, 2)
  out = xmap(lambda v: v.sum(), (["i", ...],), ["i", "j", ...], axis_sizes={"j": 3})(x)
  _equal(out, np.broadcast_to(np.asarray(x).sum(1)[:, None], (4, 3)).astype(np.int32))


def test_broadcast_of_unmapped_input(mesh42):
  w = _ints(3)
  f = xmap(lambda w, x: w, ([...], ["i", ...]), ["i", ...], axis_resources={"i": "x"},
           mesh=mesh42)
  _equal(f(w, _ints(8)), np.broadcast_to(np.asarray(w), (8, 3)))


@pytest.mark.parametrize("resources", [None, {"k": "x"}, {"k": ("x", "y")}],
                         ids=["none", "mesh", "mesh_tuple"])
def test_axis_sizes_axis_with_axis_index(resources, mesh42):
  f = xmap(lambda v: v + lax.axis_index("k"), ([...],), ["k", ...], axis_sizes={"k": 8},
           axis_resources=resources, mesh=mesh42)
  _equal(f(jnp.zeros(2, jnp.int32)),
         np.broadcast_to(np.arange(8, dtype=np.int32)[:, None], (8, 2)))


@pytest.mark.parametrize("resources", [{"k": SerialLoop(2)}, {"k": ("x", SerialLoop(2))}],
                         ids=["loop", "mesh_loop"])
def test_axis_sizes_axis_on_loop(resources, mesh42):
  # No collective over a loop axis is allowed; an axis_sizes axis still broadcasts / reduces.
  kw = dict(axis_sizes={"k": 8}, axis_resources=resources, mesh=mesh42)
  w = _ints(2)
  _equal(xmap(lambda v: v * 2, ([...],), ["k", ...], **kw)(w),
         np.broadcast_to(np.asarray(w) * 2, (8, 2)))
  _equal(xmap(lambda v: v * 2, ([...],), Sum("k"), **kw)(w), np.asarray(w) * 16)


def test_axis_sizes_only_with_no_arguments():
  out = xmap(lambda: lax.axis_index("k") * 2, (), ["k", ...], axis_sizes={"k": 5})()
  _equal(out, np.arange(5, dtype=np.int32) * 2)


def test_axis_sizes_consistent_with_input_is_accepted():
  x = _ints(4)
  _equal(xmap(lambda v: v, (["i", ...],), ["i", ...], axis_sizes={"i": 4})(x), x)


# -------------------------------------------------------------------------- collectives

N = 8


def _perm(n):
  return [(j, (j + 1) % n) for j in range(n)]


COLLECTIVES = {
    "psum": lambda v: lax.psum(v, "i"),
    "pmean": lambda v: lax.pmean(v, "i"),
    "pmax": lambda v: lax.pmax(v, "i"),
    "pmin": lambda v: lax.pmin(v, "i"),
    "all_gather": lambda v: lax.all_gather(v, "i"),
    "all_gather_tiled": lambda v: lax.all_gather(v, "i", tiled=True),
    "axis_index": lambda v: v * 0 + lax.axis_index("i").astype(v.dtype),
    "ppermute": lambda v: lax.ppermute(v, "i", _perm(N)),
    "all_to_all": lambda v: lax.all_to_all(v, "i", 0, 0),
    "psum_scatter": lambda v: lax.psum_scatter(v, "i", scatter_dimension=0),
    "psum_scatter_tiled": lambda v: lax.psum_scatter(v, "i", scatter_dimension=0, tiled=True),
    "axis_size": lambda v: v * 0 + lax.psum(1, "i"),
    "psum_mixed": lambda v: v - lax.pmean(v, "i") + lax.pmax(v, "i"),
}

COLLECTIVE_RESOURCES = {
    "none": None,
    "mesh": {"i": "x"},
    "mesh_tuple": {"i": ("x", "y")},
}


@pytest.mark.parametrize("res", sorted(COLLECTIVE_RESOURCES))
@pytest.mark.parametrize("name", sorted(COLLECTIVES))
def test_collective_matches_vmap(name, res):
  fun = COLLECTIVES[name]
  x = _floats(N, N, 2) if name not in ("all_gather", "all_gather_tiled") else _floats(N, 2)
  expected = jax.vmap(fun, axis_name="i")(x)
  mesh = make_mesh((4, 2), ("x", "y"), AxisType.Auto)
  if res == "mesh":
    mesh = make_mesh((8,), ("x",), AxisType.Auto)
  f = xmap(fun, (["i", ...],), ["i", ...], axis_resources=COLLECTIVE_RESOURCES[res], mesh=mesh)
  out = f(x)
  assert out.shape == expected.shape
  _close(out, expected)


def test_collective_on_int_data_exact(mesh8):
  x = _ints(N, 3)
  for fun in (lambda v: lax.psum(v, "i"), lambda v: lax.pmax(v, "i"),
              lambda v: lax.ppermute(v, "i", _perm(N)), lambda v: lax.axis_index("i") + v):
    expected = jax.vmap(fun, axis_name="i")(x)
    _equal(xmap(fun, (["i", ...],), ["i", ...], axis_resources={"i": "x"}, mesh=mesh8)(x),
           expected)


def test_psum_one_is_axis_size():
  out = xmap(lambda v: lax.psum(1, "i"), (["i", ...],), [...])(_ints(6))
  assert int(out) == 6


def test_psum_over_two_axes_matches_vmap(mesh42):
  x = _floats(4, 2, 3)
  fun = lambda v: lax.psum(v, ("i", "j"))
  expected = jax.vmap(jax.vmap(fun, axis_name="j"), axis_name="i")(x)
  out = xmap(fun, (["i", "j", ...],), ["i", "j", ...], axis_resources={"i": "x", "j": "y"},
             mesh=mesh42)(x)
  _close(out, expected)


def test_collective_with_unmapped_result_is_broadcast_free():
  x = _floats(N, 3)
  out = xmap(lambda v: lax.psum(v, "i"), (["i", ...],), [...])(x)
  _close(out, np.asarray(x).sum(0))


# ----------------------------------------------------------------------------- Sum/Mean

SUM_RESOURCES = {
    "vector": None,
    "mesh": {"i": "x"},
    "mesh_tuple": {"i": ("x", "y")},
    "loop": {"i": SerialLoop(4)},
    "mesh_loop": {"i": ("x", SerialLoop(2))},
    "mesh_two_loops": {"i": ("x", SerialLoop(2), SerialLoop(2))},
}


@pytest.mark.parametrize("res", sorted(SUM_RESOURCES))
def test_sum_mean_over_one_axis(res, mesh42):
  x = _ints(16, 3)
  kw = dict(axis_resources=SUM_RESOURCES[res], mesh=mesh42)
  _equal(xmap(lambda v: v * 2, (["i", ...],), Sum("i"), **kw)(x),
         (np.asarray(x) * 2).sum(0).astype(np.int32))
  xf = _floats(16, 3)
  _close(xmap(lambda v: jnp.sin(v), (["i", ...],), Mean("i"), **kw)(xf),
         np.sin(np.asarray(xf)).mean(0))


MIXED = {
    "vec_vec": None,
    "mesh_loop": {"i": "x", "j": SerialLoop(2)},
    "loop_mesh": {"i": SerialLoop(2), "j": "y"},
    "mesh_mesh": {"i": "x", "j": "y"},
    "loop_loop": {"i": SerialLoop(2), "j": SerialLoop(2)},
    "meshloop_vec": {"i": ("x", SerialLoop(2))},
}


@pytest.mark.parametrize("res", sorted(MIXED))
@pytest.mark.slow
def test_sum_over_mixed_axes(res, mesh42):
  x = _ints(8, 4, 3)
  kw = dict(axis_resources=MIXED[res], mesh=mesh42)
  xn = np.asarray(x)
  _equal(xmap(lambda v: v + 1, (["i", "j", ...],), Sum("i", "j"), **kw)(x),
         (xn + 1).sum((0, 1)).astype(np.int32))
  _equal(xmap(lambda v: v, (["i", "j", ...],), Sum("i", axes=["j", ...]), **kw)(x),
         xn.sum(0).astype(np.int32))
  _equal(xmap(lambda v: v, (["i", "j", ...],), Sum("j", axes=[None, "i", ...]), **kw)(x),
         xn.sum(1).T.astype(np.int32))
  xf = _floats(8, 4, 3)
  _close(xmap(lambda v: v * v, (["i", "j", ...],), Mean("i", "j"), **kw)(xf),
         (np.asarray(xf) ** 2).mean((0, 1)))


@pytest.mark.parametrize("res", sorted(SUM_RESOURCES))
def test_sum_of_output_constant_along_axis(res, mesh42):
  # Summing an output that does not vary along 'i' multiplies by the axis size.
  out = xmap(lambda v: jnp.int32(3), (["i", ...],), Sum("i"), axis_resources=SUM_RESOURCES[res],
             mesh=mesh42)(_ints(16))
  _equal(out, np.int32(48))


@pytest.mark.parametrize("res", sorted(SUM_RESOURCES))
def test_sum_mean_of_bool_output(res, mesh42):
  # As lax.psum under vmap: summing booleans counts them (int32), whatever the resources.
  x = _ints(16)
  expected = jax.vmap(lambda v: lax.psum(v > 4, "i"), axis_name="i")(x)[0]
  kw = dict(axis_resources=SUM_RESOURCES[res], mesh=mesh42)
  _equal(xmap(lambda v: v > 4, (["i", ...],), Sum("i"), **kw)(x), expected)
  _close(xmap(lambda v: v > 4, (["i", ...],), Mean("i"), **kw)(x), np.float32(11 / 16))


@pytest.mark.parametrize("res", sorted(SUM_RESOURCES))
def test_broadcast_output_with_resources(res, mesh42):
  out = xmap(lambda v: jnp.int32(7), (["i", ...],), ["i", ...], axis_resources=SUM_RESOURCES[res],
             mesh=mesh42)(_ints(16))
  _equal(out, np.full((16,), 7, np.int32))


@pytest.mark.parametrize("res", sorted(SUM_RESOURCES))
@pytest.mark.slow
def test_grad_through_sum_matches_positional(res, mesh42):
  x = _floats(16, 3)
  w = _floats(3, seed=2)
  expected = jax.grad(lambda w: jnp.sum(jnp.sin(x * w)))(w)
  f = xmap(lambda w, v: jnp.sum(jnp.sin(v * w)), ([...], ["i", ...]), Sum("i"),
           axis_resources=SUM_RESOURCES[res], mesh=mesh42)
  _close(jax.grad(lambda w: f(w, x))(w), expected)


@pytest.mark.slow
def test_grad_through_psum_matches_positional(mesh8):
  x = _floats(8, 3)
  w = _floats(3, seed=2)
  expected = jax.grad(lambda w: jnp.sum(jnp.sin(x * w)))(w)
  f = xmap(lambda w, v: lax.psum(jnp.sum(jnp.sin(v * w)), "i"), ([...], ["i", ...]), [...],
           axis_resources={"i": "x"}, mesh=mesh8)
  _close(jax.grad(lambda w: f(w, x))(w), expected)


def test_mean_of_int_data_is_float():
  out = xmap(lambda v: v, (["i", ...],), Mean("i"))(_ints(4))
  _close(out, np.float32(1.5))


def test_sum_with_other_output_mapped(mesh42):
  x = _floats(8, 3)
  total, per = xmap(lambda v: (v, jnp.tanh(v)), (["i", ...],), (Sum("i"), ["i", ...]),
                    axis_resources={"i": ("x", SerialLoop(2))}, mesh=mesh42)(x)
  _close(total, np.asarray(x).sum(0))
  _close(per, np.tanh(np.asarray(x)))


def test_gradient_accumulation_mean(mesh42):
  w = _floats(3, 2)
  x = _floats(16, 3, seed=1)
  loss = lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2)
  expected = jax.grad(lambda w: jnp.mean(jax.vmap(lambda xi: loss(w, xi))(x)))(w)
  g = xmap(jax.grad(loss), ([...], ["batch", ...]), Mean("batch"),
           axis_resources={"batch": ("x", SerialLoop(4))}, mesh=mesh42)(w, x)
  _close(g, expected)


# ---------------------------------------------------------------------------- loops


def test_two_axes_each_with_a_loop():
  x = _ints(4, 6, 2)
  out = xmap(lambda v: v * 3, (["i", "j", ...],), ["j", "i", ...],
             axis_resources={"i": SerialLoop(2), "j": SerialLoop(3)})(x)
  _equal(out, np.swapaxes(np.asarray(x) * 3, 0, 1))


def test_one_axis_two_loops_with_mesh(mesh42):
  x = _ints(16, 2)
  out = xmap(lambda v: v * 2, (["i", ...],), ["i", ...],
             axis_resources={"i": ("x", SerialLoop(2), SerialLoop(2))}, mesh=mesh42)(x)
  _equal(out, x * 2)


def test_loop_preserves_order_of_elements(mesh42):
  # Each element must come back at its own index (mesh-major split, loops, chunk).
  x = _ints(32)
  for res in [SerialLoop(4), ("x", SerialLoop(2)), ("x", "y", SerialLoop(2)),
              ("x", SerialLoop(2), SerialLoop(2))]:
    out = xmap(lambda v: v, (["i", ...],), ["i", ...], axis_resources={"i": res},
               mesh=mesh42)(x)
    _equal(out, x)


def test_named_serial_loop_shared_by_two_axes():
  a, b = _ints(4), _ints(6)
  with partition.serial_loop("l", 2):
    out_a, out_b = xmap(lambda u, v: (u * 2, v + 1), (["i", ...], ["j", ...]),
                        (["i", ...], ["j", ...]), axis_resources={"i": "l", "j": "l"})(a, b)
  _equal(out_a, a * 2)
  _equal(out_b, b + 1)


def test_named_serial_loop_shared_with_sums():
  a, b = _floats(4, 2), _floats(6, 2, seed=1)
  with partition.serial_loop("l", 2):
    sa, sb = xmap(lambda u, v: (u, v * 2), (["i", ...], ["j", ...]), (Sum("i"), Mean("j")),
                  axis_resources={"i": "l", "j": "l"})(a, b)
  _close(sa, np.asarray(a).sum(0))
  _close(sb, (np.asarray(b) * 2).mean(0))


def test_loop_with_unmapped_and_closure_values():
  w = _floats(3)
  c = jnp.float32(2.5)
  x = _floats(8, 3, seed=1)
  out = xmap(lambda w, v: w * v + c, ([...], ["i", ...]), ["i", ...],
             axis_resources={"i": SerialLoop(4)})(w, x)
  _close(out, np.asarray(w) * np.asarray(x) + 2.5)


# --------------------------------------------------------------------------- nesting


def test_direct_nesting_of_xmapped_functions():
  # xmap(xmap(f)) — the inner XMapped object is the outer function.
  x = _floats(2, 3)
  inner = xmap(lambda a: lax.psum(a, "j"), (["j", ...],), [...])
  outer = xmap(inner, (["i", ...],), ["i", ...])
  _close(outer(x), np.asarray(x).sum(1))


def test_nesting_through_lambda_with_outer_collective(mesh42):
  x = _floats(4, 2, 3)
  inner = xmap(lambda a: a - lax.pmean(a, "i"), (["j", ...],), ["j", ...])
  outer = xmap(lambda a: inner(a), (["i", ...],), ["i", ...], axis_resources={"i": "x"},
               mesh=mesh42)
  expected = np.asarray(x) - np.asarray(x).mean(0, keepdims=True)
  _close(outer(x), expected)


# ------------------------------------------------------------------ caching / jit API


def test_repeated_calls_do_not_retrace():
  calls = []

  def f(v):
    calls.append(1)
    return v * 2

  g = xmap(f, (["i", ...],), ["i", ...], axis_resources={"i": SerialLoop(2)})
  x = _floats(4, 3)
  g(x)
  n = len(calls)
  assert n >= 1
  for _ in range(3):
    g(x + 1)
  assert len(calls) == n
  g(_floats(6, 3))  # new shape: traces again
  assert len(calls) > n


def test_repeated_calls_with_mesh_do_not_retrace(mesh42):
  calls = []

  def f(v):
    calls.append(1)
    return lax.psum(v, "i")

  g = xmap(f, (["i", ...],), [...], axis_resources={"i": "x"}, mesh=mesh42)
  x = _floats(4, 3)
  g(x)
  n = len(calls)
  g(x * 2)
  assert len(calls) == n
  # Committed inputs: jax.jit itself traces once more when an argument switches from
  # uncommitted to committed; after that, equal shapes and shardings must hit the cache.
  xs = jax.device_put(x, NamedSharding(mesh42, PartitionSpec("x")))
  g(xs)
  n = len(calls)
  g(xs * 1)
  g(jax.device_put(x * 3, NamedSharding(mesh42, PartitionSpec("x"))))
  assert len(calls) == n


def test_loop_traces_fun_a_bounded_number_of_times():
  calls = []

  def f(v):
    calls.append(1)
    return v

  xmap(f, (["i", ...],), Sum("i"), axis_resources={"i": SerialLoop(4)})(_floats(8))
  assert len(calls) <= 2, len(calls)


def test_donate_argnums(mesh42):
  x = jnp.ones((8, 3))
  y = jnp.ones((8, 3))
  out = xmap(lambda a, b: a + b, (["i", ...], ["i", ...]), ["i", ...], donate_argnums=0)(x, y)
  _close(out, np.full((8, 3), 2.0, np.float32))
  assert x.is_deleted()
  assert not y.is_deleted()


def test_donate_argnums_with_mesh(mesh42):
  x = jax.device_put(jnp.ones((8, 3)), NamedSharding(mesh42, PartitionSpec("x")))
  out = xmap(lambda a: a * 2, (["i", ...],), ["i", ...], axis_resources={"i": "x"},
             mesh=mesh42, donate_argnums=(0,))(x)
  _close(out, np.full((8, 3), 2.0, np.float32))
  assert x.is_deleted()


def test_lower_returns_lowered_and_compiles(mesh42):
  f = xmap(lambda v: lax.psum(v, "i"), (["i", ...],), [...], axis_resources={"i": "x"},
           mesh=mesh42)
  x = _floats(8, 3)
  lowered = f.lower(x)
  assert isinstance(lowered, jax.stages.Lowered)
  assert isinstance(lowered.as_text(), str)
  compiled = lowered.compile()
  assert isinstance(compiled, jax.stages.Compiled)
  _close(compiled(x), np.asarray(x).sum(0))


def test_lower_with_shape_dtype_struct():
  f = xmap(lambda v: v * 2, (["i", ...],), ["i", ...], axis_resources={"i": SerialLoop(2)})
  lowered = f.lower(jax.ShapeDtypeStruct((4, 3), jnp.float32))
  assert isinstance(lowered, jax.stages.Lowered)
  x = _floats(4, 3)
  _close(lowered.compile()(x), np.asarray(x) * 2)


def test_jit_of_xmap():
  x = _floats(8, 3)
  f = jax.jit(xmap(lambda v: v - lax.pmean(v, "i"), (["i", ...],), ["i", ...]))
  _close(f(x), np.asarray(x) - np.asarray(x).mean(0))


# ---------------------------------------------------------- resources never change results


def named_program(w, x):  # w: [D], x: [D] for one (b, f)
  y = jnp.tanh(w * x)
  return y, y.sum(), y * 0 + lax.axis_index("f").astype(y.dtype)


def _no_index_program(w, x):
  y = jnp.tanh(w * x)
  return y, y.sum(), y * 0


def _reference(w, x):
  wn, xn = np.asarray(w), np.asarray(x)
  y = np.tanh(wn[None, :, :] * xn[:, None, :])  # [b, f, d]
  return y, y.sum(-1), np.broadcast_to(np.arange(wn.shape[0], dtype=np.float32)[None, :, None],
                                       y.shape)


RESOURCE_VARIANTS = {
    "none": {},
    "x": {"b": "x"},
    "xy": {"b": ("x", "y")},
    "x_and_y": {"b": "x", "f": "y"},
    "loop": {"b": SerialLoop(4)},
    "x_loop": {"b": ("x", SerialLoop(2))},
    "named_loop": {"b": "l"},
    "x_loop_f_loop": {"b": ("x", SerialLoop(2)), "f": SerialLoop(2)},
}


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
@pytest.mark.parametrize("variant", sorted(RESOURCE_VARIANTS))
def test_results_unchanged_across_resources(variant, axis_type):
  mesh = make_mesh((4, 2), ("x", "y"), axis_type)
  w, x = _floats(4, 3), _floats(16, 3, seed=1)
  res = RESOURCE_VARIANTS[variant]
  fun = named_program
  if "f" in res and isinstance(res["f"], SerialLoop):
    fun = _no_index_program  # axis_index over a loop axis is an error
  with contextlib.ExitStack() as stack:
    stack.enter_context(partition.serial_loop("l", 2))
    if axis_type == AxisType.Explicit:
      stack.enter_context(jax.set_mesh(mesh))
    f = xmap(fun, (["f", ...], ["b", ...]), (["b", "f", ...], ["b", "f"], ["b", "f", ...]),
             axis_resources=res, mesh=mesh)
    y, s, idx = f(w, x)
    y, s, idx = np.asarray(y), np.asarray(s), np.asarray(idx)
  ry, rs, ridx = _reference(w, x)
  _close(y, ry)
  _close(s, rs)
  if not ("f" in res and isinstance(res["f"], SerialLoop)):
    _equal(idx, ridx)


@pytest.mark.parametrize("variant", ["none", "x", "loop", "x_loop", "x_and_y"])
def test_sum_results_unchanged_across_resources_explicit(variant):
  mesh = make_mesh((4, 2), ("x", "y"), AxisType.Explicit)
  x = _floats(16, 4, seed=3)
  with jax.set_mesh(mesh), partition.serial_loop("l", 2):
    res = dict(RESOURCE_VARIANTS[variant])
    res = {k: v for k, v in res.items() if k == "b"}
    out = xmap(jnp.sin, (["b", ...],), Mean("b"), axis_resources=res, mesh=mesh)(x)
    out = np.asarray(out)
  _close(out, np.sin(np.asarray(x)).mean(0))


# ------------------------------------------------------------------- committed inputs


def test_committed_input_on_one_device(mesh42):
  x = jax.device_put(_floats(8, 3), jax.devices()[3])
  f = xmap(lambda v: v * 2, (["i", ...],), ["i", ...], axis_resources={"i": "x"}, mesh=mesh42)
  _close(f(x), np.asarray(x) * 2)


def test_committed_input_sharded_on_other_axis(mesh42):
  x = jax.device_put(_floats(8, 4), NamedSharding(mesh42, PartitionSpec(None, "x")))
  f = xmap(lambda v: v * 2, (["i", ...],), ["i", ...], axis_resources={"i": "y"}, mesh=mesh42)
  _close(f(x), np.asarray(x) * 2)


def test_committed_input_sharded_on_other_mesh():
  other = make_mesh((2, 4), ("a", "b"), AxisType.Auto)
  x = jax.device_put(_floats(8, 4), NamedSharding(other, PartitionSpec("b", "a")))
  mesh = make_mesh((4, 2), ("x", "y"), AxisType.Auto)
  f = xmap(lambda v: v + 1, (["i", ...],), ["i", ...], axis_resources={"i": ("x", "y")},
           mesh=mesh)
  _close(f(x), np.asarray(x) + 1)


def test_committed_input_with_loop_resources(mesh42):
  x = jax.device_put(_floats(8, 4), NamedSharding(mesh42, PartitionSpec("y")))
  f = xmap(lambda v: v, (["i", ...],), Sum("i"), axis_resources={"i": ("x", SerialLoop(2))},
           mesh=mesh42)
  _close(f(x), np.asarray(x).sum(0))


# -------------------------------------------------------------------------- set_mesh


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_set_mesh_context_instead_of_mesh_argument(axis_type):
  mesh = make_mesh((4, 2), ("x", "y"), axis_type)
  x = _floats(8, 3)
  f = xmap(lambda v: lax.psum(v, "i"), (["i", ...],), ["i", ...], axis_resources={"i": "x"})
  with jax.set_mesh(mesh):
    out = np.asarray(f(x))
  _close(out, np.broadcast_to(np.asarray(x).sum(0), (8, 3)))


def test_set_mesh_context_inside_jit():
  mesh = make_mesh((4, 2), ("x", "y"), AxisType.Auto)
  x = _floats(8, 3)
  f = xmap(lambda v: v * 2, (["i", ...],), ["i", ...], axis_resources={"i": ("x", "y")})
  with jax.set_mesh(mesh):
    out = np.asarray(jax.jit(f)(x))
  _close(out, np.asarray(x) * 2)
