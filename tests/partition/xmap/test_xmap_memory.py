"""SerialLoop(k) keeps one chunk of intermediates alive: compiled temp memory against the
``lax.map(batch_size=)`` floor and against plain vectorisation.

The per-example function materialises a ``[D, D]`` intermediate (``sin(outer(x, x))``) that
XLA cannot fuse into the reduction, so the vectorised program needs ``N * D * D`` floats of
scratch and a chunked one ``N / k * D * D``.
"""

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from partition import SerialLoop, Sum, xmap

N, D = 64, 256
FLOOR_FACTOR = 1.05  # at most this much above lax.map(batch_size=N // k)
VECTOR_FACTOR = 1.3  # at most VECTOR_FACTOR / k of jit(vmap(f))


def per_example(x):
  return jnp.sin(jnp.outer(x, x)).sum()


def _temp(lowered) -> int:
  return lowered.compile().memory_analysis().temp_size_in_bytes


XS = jax.ShapeDtypeStruct((N, D), jnp.float32)


@pytest.fixture(scope="module")
def vectorised_temp():
  temp = _temp(jax.jit(jax.vmap(per_example)).lower(XS))
  assert temp >= N * D * D * 4, "the intermediate was fused away; the test would be vacuous"
  return temp


@pytest.mark.parametrize("k", [2, 4])
def test_mapped_output_memory(k, vectorised_temp):
  ours = _temp(xmap(per_example, ["b", ...], ["b", ...],
                    axis_resources={"b": SerialLoop(k)}).lower(XS))
  floor = _temp(jax.jit(lambda xs: lax.map(per_example, xs, batch_size=N // k)).lower(XS))
  assert ours <= FLOOR_FACTOR * floor, (ours, floor)
  assert ours <= VECTOR_FACTOR / k * vectorised_temp, (ours, vectorised_temp)


@pytest.mark.parametrize("k", [2, 4])
def test_sum_output_memory(k, vectorised_temp):
  ours = _temp(xmap(per_example, ["b", ...], Sum("b"),
                    axis_resources={"b": SerialLoop(k)}).lower(XS))
  floor = _temp(jax.jit(lambda xs: lax.map(per_example, xs, batch_size=N // k).sum())
                .lower(XS))
  assert ours <= FLOOR_FACTOR * floor, (ours, floor)
  assert ours <= VECTOR_FACTOR / k * vectorised_temp, (ours, vectorised_temp)


@pytest.mark.parametrize("k", [2, 4])
def test_grad_memory(k):
  """Gradient accumulation: Sum of per-example grads of w in sin(outer(w * x, x))."""
  def loss(w, x):
    return jnp.sin(jnp.outer(w * x, x)).sum()

  g = jax.grad(loss)
  w = jax.ShapeDtypeStruct((D,), jnp.float32)
  ours = _temp(xmap(g, ([...], ["b", ...]), Sum("b"),
                    axis_resources={"b": SerialLoop(k)}).lower(w, XS))
  floor = _temp(jax.jit(lambda w, xs: lax.map(lambda x: g(w, x), xs, batch_size=N // k)
                        .sum(0)).lower(w, XS))
  vector = _temp(jax.jit(lambda w, xs: jax.vmap(g, (None, 0))(w, xs).sum(0)).lower(w, XS))
  assert ours <= FLOOR_FACTOR * floor, (ours, floor)
  assert ours <= VECTOR_FACTOR / k * vector, (ours, vector)
