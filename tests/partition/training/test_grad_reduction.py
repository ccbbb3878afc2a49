"""``value_and_grad(grad_reduction=...)``: micro-batch gradients reduced once per step.

Every schedule equals ``jax.value_and_grad`` of the full batch on one device; the compiled
step's collectives (``partition.collective_stats``, loop trip counts included) show how many
times gradients of parameter size cross the batch's mesh axes.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding

import partition

AUTO = AxisType.Auto
PARAM_AXES = {"w1": ("embed", "mlp"), "b1": ("mlp",), "w2": ("mlp", "embed")}
BATCH_AXES = {"x": ("batch", "embed"), "y": ("batch", "embed")}
EMBED, MLP, ROWS = 16, 32, 64
# (mesh shape and names, rule pairs): tuples, so that a setup can key a cache
DP = (((8,), ("data",)), (("batch", "data"),))
FSDP = (((8,), ("fsdp",)), (("batch", "fsdp"), ("embed", "fsdp")))
FSDP_TP = (((2, 2, 2), ("data", "fsdp", "tensor")),
           (("batch", ("data", "fsdp")), ("embed", "fsdp"), ("mlp", "tensor")))


def mlp_loss(params, batch):
  h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
  h = partition.constrain(h, ("batch", "mlp"))
  return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


def _problem():
  rng = np.random.default_rng(1)
  params = {"w1": rng.normal(size=(EMBED, MLP)) / 4, "b1": rng.normal(size=(MLP,)),
            "w2": rng.normal(size=(MLP, EMBED)) / 6}
  batch = {"x": rng.normal(size=(ROWS, EMBED)), "y": rng.normal(size=(ROWS, EMBED))}
  return jax.tree.map(lambda a: np.asarray(a, np.float32), (params, batch))


def _step(setup, schedule, k=4, **kwargs):
  (shape, names), pairs = setup
  mesh = jax.make_mesh(shape, names, axis_types=(AUTO,) * len(names))
  rules = partition.AxisRules(pairs)
  step = partition.value_and_grad(mlp_loss, batch_axes=BATCH_AXES, param_axes=PARAM_AXES,
                                  rules=rules, mesh=mesh, microbatches=k,
                                  grad_reduction=schedule, **kwargs)
  return step, rules, mesh


@functools.cache  # the FSDP steps are read by two tests each: compiled once
def _compiled_stats(setup, schedule, k=4):
  step, rules, mesh = _step(setup, schedule, k)
  params, batch = _problem()
  params = {n: jax.device_put(p, NamedSharding(mesh, rules.spec(PARAM_AXES[n], p.shape, mesh)))
            for n, p in params.items()}
  batch = jax.device_put(batch, NamedSharding(mesh, rules.spec(("batch", "embed"),
                                                               (ROWS, EMBED), mesh)))
  with jax.set_mesh(mesh):
    compiled = jax.jit(step).lower(params, batch).compile()
  return partition.collective_stats(compiled, mesh), compiled


def _weight_reductions(stats, axes, kind):
  """Executions of ``kind`` over ``axes`` that carry a whole weight matrix's gradient."""
  weight = EMBED * MLP * 4
  return sum(op.count for op in stats.select(kind, axes) if op.array_bytes >= weight)


@pytest.mark.parametrize("schedule", ["auto", "per_microbatch", "once"])
@pytest.mark.parametrize("setup", [DP, FSDP, FSDP_TP], ids=["dp", "fsdp", "fsdp_tp"])
@pytest.mark.slow
def test_every_schedule_equals_the_full_batch_on_one_device(setup, schedule):
  params, batch = _problem()
  step, rules, mesh = _step(setup, schedule)
  loss, grads = step(params, batch)
  ref_loss, ref_grads = jax.value_and_grad(mlp_loss)(params, batch)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  for name, g in grads.items():
    np.testing.assert_allclose(g, ref_grads[name], rtol=1e-5, atol=1e-6, err_msg=name)
    want = rules.spec(PARAM_AXES[name], params[name].shape, mesh)
    assert g.sharding.is_equivalent_to(NamedSharding(mesh, want), g.ndim), name


@pytest.mark.slow
def test_data_parallel_reduces_gradients_once_with_4_microbatches():
  auto, _ = _compiled_stats(DP, "auto")
  per_micro, _ = _compiled_stats(DP, "per_microbatch")
  # w1 and w2 travel in all-reduces over 'data': 4 times per step per micro-batch, once here
  # (XLA may combine both gradients into one tuple all-reduce: count bytes, not ops).
  grads = 2 * EMBED * MLP * 4 + MLP * 4
  assert auto.bytes("all-reduce", "data") == pytest.approx(2 * grads * 7 / 8, rel=0.01)
  assert per_micro.bytes("all-reduce", "data") == pytest.approx(4 * 2 * grads * 7 / 8,
                                                                rel=0.01)
  assert 1 <= _weight_reductions(auto, "data", "all-reduce") <= 2  # one op per gradient
  assert _weight_reductions(per_micro, "data", "all-reduce") >= 4
  assert auto.count("reduce-scatter") == per_micro.count("reduce-scatter") == 0


@pytest.mark.parametrize("schedule, times", [("per_microbatch", 4), ("auto", 4), ("once", 1)])
def test_fsdp_reduce_scatters_per_microbatch_or_once(schedule, times):
  stats, compiled = _compiled_stats(FSDP, schedule)
  weights = 2 * EMBED * MLP * 4
  assert stats.bytes("reduce-scatter", "fsdp") == pytest.approx(times * weights * 7 / 8,
                                                                rel=0.01)
  # b1 is replicated over 'fsdp': reduced once whenever that is free ('auto', 'once')
  b1 = 2 * MLP * 4 * 7 / 8
  small = [op for op in stats.select("all-reduce", "fsdp") if op.array_bytes >= MLP * 4]
  assert sum(op.count for op in small) == (4 if schedule == "per_microbatch" else 1), small
  assert sum(op.bytes for op in small) >= b1 * (4 if schedule == "per_microbatch" else 1)


def _loop_state(compiled) -> str:
  (line,) = [x for x in compiled.as_text().splitlines() if " while(" in x]
  return line.split(" while(")[0]


def test_fsdp_carry_is_the_shard_per_microbatch_and_full_size_once():
  """The loop state holds w1's gradient as its [16/8, 32] shard or, once, whole per device."""
  _, per_micro = _compiled_stats(FSDP, "per_microbatch")
  _, once = _compiled_stats(FSDP, "once")
  full = rf"f32\[(1,)?{EMBED},{MLP}\]"  # also the gathered weight, a loop invariant
  assert re.search(rf"f32\[{EMBED // 8},{MLP}\]", _loop_state(per_micro))
  assert not re.search(rf"f32\[{EMBED // 8},{MLP}\]", _loop_state(once))
  assert len(re.findall(full, _loop_state(once))) == len(re.findall(full,
                                                                    _loop_state(per_micro))) + 1


def test_rng_keys_differ_between_device_shards_and_microbatches():
  params, batch = _problem()
  seen = []

  def noisy(params, batch, key):
    noise = jax.random.normal(key, ())
    jax.debug.callback(lambda v: seen.append(float(v)), noise)
    return mlp_loss(params, batch) + 0 * noise

  (shape, names), pairs = DP
  mesh = jax.make_mesh(shape, names, axis_types=(AUTO,))
  step = partition.value_and_grad(noisy, batch_axes=BATCH_AXES, param_axes=PARAM_AXES,
                                  rules=partition.AxisRules(pairs), mesh=mesh, microbatches=2,
                                  rng_argnums=2)
  step(params, batch, jax.random.key(0))
  jax.effects_barrier()
  assert len(seen) == 16 and len(set(seen)) == 16  # 2 micro-batches x 8 shards


@pytest.mark.parametrize("bad", ["always", None, 1, "Once"])
def test_bad_grad_reduction_is_a_clear_error(bad):
  with pytest.raises(partition.GradSpecError, match=r"grad_reduction=.* is not a schedule; "
                     r"choose one of 'auto', 'per_microbatch', 'once'"):
    partition.value_and_grad(mlp_loss, batch_axes=BATCH_AXES, grad_reduction=bad)
  with pytest.raises(ValueError):  # GradSpecError refines ValueError
    partition.value_and_grad(mlp_loss, batch_axes=BATCH_AXES, grad_reduction=bad)


def test_once_over_data_and_fsdp_reduce_scatters_then_all_reduces_the_shard():
  """ZeRO's order: reduce-scatter over the axis the weight is sharded on ('fsdp'), then an
  all-reduce of the shard over the other batch axis ('data'); never a full-size all-reduce
  over both."""
  stats, _ = _compiled_stats(FSDP_TP, "once")
  weight = EMBED * MLP * 4 / 2  # w1, w2 after the tensor axis
  assert stats.bytes("reduce-scatter", "fsdp") == pytest.approx(2 * weight / 2)
  assert stats.bytes("all-reduce", "data") >= 2 * (2 * (weight / 2) / 2)
  assert not [op for op in stats.select("all-reduce", ("data", "fsdp"))
              if op.array_bytes >= weight / 2]


def test_once_on_explicit_batch_axes_is_a_clear_error():
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  step = partition.value_and_grad(mlp_loss, batch_axes=BATCH_AXES, param_axes=PARAM_AXES,
                                  rules=partition.AxisRules([("batch", "data")]), mesh=mesh,
                                  microbatches=4, grad_reduction="once")
  with pytest.raises(partition.GradSpecError, match=r"batch's mesh axes \['data'\] are "
                     r"Explicit.*AxisType.Auto.*grad_reduction='auto'"):
    step(*_problem())
  # 'auto' keeps the per-micro-batch loop there, and is right
  params, batch = _problem()
  auto = partition.value_and_grad(mlp_loss, batch_axes=BATCH_AXES, param_axes=PARAM_AXES,
                                  rules=partition.AxisRules([("batch", "data")]), mesh=mesh,
                                  microbatches=4)
  _, grads = auto(params, batch)
  np.testing.assert_allclose(grads["w1"], jax.grad(mlp_loss)(params, batch)["w1"], rtol=1e-5,
                             atol=1e-6)
