"""Random junk at ``partition.xmap`` and ``partition.value_and_grad``: every call either works
(and then equals the positional reference) or raises a ``PartitionError`` that is also a
``ValueError``/``TypeError`` and names the API — never another exception type, never a hang."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType
from mesh_testlib import make_mesh

import partition
from partition import xmap

NAMES = st.sampled_from(["i", "j", "batch", "x", "y", "data"])
ATOMS = st.one_of(NAMES, st.integers(-3, 5), st.floats(allow_nan=False, width=16), st.none(),
                  st.just(...), st.text(max_size=3))
JUNK = st.recursive(ATOMS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.one_of(st.integers(-2, 3), NAMES), inner,
                                                 max_size=3)), max_leaves=8)
SPECS = st.one_of(JUNK, st.lists(st.one_of(NAMES, st.none()), max_size=3).map(lambda s: s + [...]),
                  st.dictionaries(st.integers(-1, 2), NAMES, max_size=2))
RESOURCES = st.one_of(st.none(), JUNK, st.dictionaries(NAMES, st.one_of(
    NAMES, st.none(), st.lists(NAMES, max_size=2), st.builds(partition.SerialLoop,
                                                             st.integers(1, 4))), max_size=2))
SIZES = st.one_of(st.none(), JUNK, st.dictionaries(NAMES, st.integers(-1, 9), max_size=2))

MESH = make_mesh((4, 2), ("x", "y"), AxisType.Auto)
X = jnp.arange(24.0).reshape(4, 6)


def _check(error: Exception) -> None:
  assert isinstance(error, partition.PartitionError), repr(error)
  assert isinstance(error, (ValueError, TypeError)), repr(error)
  assert "xmap" in str(error) or "Sum" in str(error) or "Mean" in str(error), str(error)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(in_axes=SPECS, out_axes=SPECS, sizes=SIZES, resources=RESOURCES,
       use_mesh=st.booleans())
def test_xmap_junk_specs_and_resources(in_axes, out_axes, sizes, resources, use_mesh):
  try:
    f = xmap(lambda v: v * 2, in_axes, out_axes, axis_sizes=sizes, axis_resources=resources,
             mesh=MESH if use_mesh else None)
    got = f(X)
  except partition.PartitionError as e:
    _check(e)
    return
  # Accepted: then it computed the positional program x * 2, with named axes moved and, for
  # out_axes naming axes only axis_sizes defines, broadcast (possibly over size 0).
  got, want = np.asarray(got), np.asarray(X * 2)
  assert got.size % want.size == 0
  if got.size:
    assert np.isin(got, want).all() and np.isin(want, got).all()


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(arg=JUNK)
def test_xmap_junk_arguments(arg):
  f = xmap(lambda v: v, ["i", ...], ["i", ...])
  try:
    f(arg)
  except partition.PartitionError as e:
    _check(e)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(batch_axes=JUNK, microbatches=st.one_of(st.none(), st.integers(-1, 5), ATOMS))
def test_value_and_grad_junk(batch_axes, microbatches):
  loss = lambda p, b: jnp.mean(b["x"] @ p["w"])
  params, batch = {"w": jnp.ones((6, 2))}, {"x": X}
  try:
    step = partition.value_and_grad(loss, batch_axes=batch_axes, microbatches=microbatches)
    value, grads = step(params, batch)
  except partition.PartitionError as e:
    assert isinstance(e, (ValueError, TypeError)), repr(e)
    assert "value_and_grad" in str(e) or "xmap" in str(e), str(e)
    return
  ref_value, ref_grads = jax.value_and_grad(loss)(params, batch)
  np.testing.assert_allclose(value, ref_value, rtol=1e-5)
  np.testing.assert_allclose(grads["w"], ref_grads["w"], rtol=1e-5)
