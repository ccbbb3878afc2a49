"""A serial loop covering its whole axis runs the function as written (no size-1 vmap)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import partition


def _loss(p, x):
  h = jnp.tanh(x.astype(jnp.bfloat16) @ p["w1"].astype(jnp.bfloat16))
  return jnp.mean((h @ p["w2"].astype(jnp.bfloat16)).astype(jnp.float32) ** 2)


def _by_hand(p, xs):
  def body(total, x):
    return jax.tree.map(jnp.add, total, jax.grad(_loss)(p, x)), None
  return jax.lax.scan(body, jax.tree.map(jnp.zeros_like, p), xs)[0]


def test_a_whole_axis_loop_costs_what_a_hand_written_scan_costs():
  rng = np.random.default_rng(0)
  p = {"w1": jnp.asarray(rng.normal(size=(64, 256)), jnp.float32),
       "w2": jnp.asarray(rng.normal(size=(256, 64)), jnp.float32)}
  xs = jnp.asarray(rng.normal(size=(4, 8, 64)), jnp.float32)
  # 'micro' has size 4 on SerialLoop(4): each iteration holds one element of it.
  looped = partition.xmap(jax.grad(_loss), in_axes=([...], ["micro", ...]),
                          out_axes=partition.Sum("micro"),
                          axis_resources={"micro": partition.SerialLoop(4)})
  for a, b in zip(jax.tree.leaves(looped(p, xs)), jax.tree.leaves(jax.jit(_by_hand)(p, xs))):
    np.testing.assert_allclose(a, b, rtol=1e-6)
  # A size-1 vmap inside the loop would batch every op with a unit dim: weight-gradient dots
  # with a batch dim of 1 and the transposes and sums around them (measured +19 % bytes).
  cost = lambda f: jax.jit(f).lower(p, xs).compile().cost_analysis()
  got, want = cost(looped), cost(_by_hand)
  assert got["flops"] <= want["flops"] * 1.01, (got["flops"], want["flops"])
  assert got["bytes accessed"] <= want["bytes accessed"] * 1.01, (got, want)


def test_an_output_that_varies_along_a_whole_axis_loop_is_still_an_error():
  f = partition.xmap(lambda x: x * 2, in_axes=["micro", ...], out_axes=[...],
                     axis_resources={"micro": partition.SerialLoop(4)})
  with pytest.raises(partition.OutputAxesError, match=r"varies along axis 'micro'"):
    f(jnp.ones((4, 3)))


def test_bool_sums_over_a_whole_axis_loop_count_as_psum_does():
  f = partition.xmap(lambda x: x > 0, in_axes=["micro", ...], out_axes=partition.Sum("micro"),
                     axis_resources={"micro": partition.SerialLoop(4)})
  expected = jax.vmap(lambda x: jax.lax.psum(x > 0, "m"), axis_name="m")(jnp.arange(-4, 4.0)
                                                                          .reshape(4, 2))[0]
  got = f(jnp.arange(-4, 4.0).reshape(4, 2))
  assert got.dtype == expected.dtype
  np.testing.assert_array_equal(got, expected)
