"""partition.optimizer_init: optax state sharded like its params, equal to the unsharded one."""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P
from mesh_testlib import make_mesh

import partition

RULES = partition.AxisRules([("batch", ("data", "fsdp")), ("embed", "fsdp"),
                             ("mlp", "tensor"), ("vocab", "tensor")])
AXES = {"embed": ("vocab", "embed"), "w_in": ("embed", "mlp"), "w_out": ("mlp", "embed"),
        "scale": ("embed",), "bias": None}


@pytest.fixture(scope="module")
def mesh():
  return make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), AxisType.Explicit)


def make_params(key=0):
  ks = jax.random.split(jax.random.key(key), 5)
  shapes = {"embed": (16, 8), "w_in": (8, 16), "w_out": (16, 8), "scale": (8,), "bias": (8,)}
  return {n: jax.random.normal(k, s) for k, (n, s) in zip(ks, shapes.items())}


def boxed(params):
  return {n: v if AXES[n] is None else partition.WithAxes(v, AXES[n])
          for n, v in params.items()}


def mask(params):
  return {n: v.ndim == 2 for n, v in params.items()}


OPTIMIZERS = {
    "adamw": (lambda: optax.adamw(1e-2), lambda s: [s[0].mu, s[0].nu], lambda s: s[0].count),
    "sgd_momentum": (lambda: optax.sgd(1e-2, momentum=0.9), lambda s: [s[0].trace], None),
    "chain_clip_adamw": (lambda: optax.chain(optax.clip_by_global_norm(1.0),
                                             optax.adamw(1e-2)),
                         lambda s: [s[1][0].mu, s[1][0].nu], lambda s: s[1][0].count),
    "masked_adamw": (lambda: optax.masked(optax.adamw(1e-2), mask),
                     lambda s: [s.inner_state[0].mu, s.inner_state[0].nu],
                     lambda s: s.inner_state[0].count),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.slow
def test_moments_take_param_shardings_and_one_step_equals_unsharded(name, mesh):
  make_tx, moments, count = OPTIMIZERS[name]
  tx = make_tx()
  params = make_params()
  # Independent reference for the shardings: the rules resolved on the params alone.
  expected = RULES.tree_shardings(AXES, mesh, shapes=params)
  state = partition.optimizer_init(tx, boxed(params), rules=RULES, mesh=mesh)
  for tree in moments(state):
    for n, leaf in tree.items():
      if isinstance(leaf, optax.MaskedNode):
        assert name == "masked_adamw" and params[n].ndim == 1
        continue
      assert leaf.sharding == expected[n], (n, leaf.sharding)
  assert expected["w_in"].spec == P("fsdp", "tensor")
  if count is not None:
    c = count(state)
    assert isinstance(c.sharding, NamedSharding) and c.sharding.spec == P()
    assert c.sharding.mesh == mesh and not isinstance(c.sharding, SingleDeviceSharding)

  # One update step, sharded, against the same step on unsharded host copies.
  grads = make_params(1)
  sharded_params = jax.device_put(params, expected)
  sharded_grads = jax.device_put(grads, expected)
  updates, new_state = jax.jit(tx.update)(sharded_grads, state, sharded_params)
  ref_updates, ref_state = tx.update(grads, tx.init(params), params)
  for n in params:
    np.testing.assert_allclose(np.asarray(updates[n]), np.asarray(ref_updates[n]),
                               rtol=1e-6, atol=1e-7)
  for got, want in zip(jax.tree.leaves(new_state), jax.tree.leaves(ref_state)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)


def test_default_params_context_and_path_rules_give_the_same_state(mesh):
  tx = optax.adam(1e-3)
  params = make_params()
  with partition.axis_rules(RULES, mesh):
    from_boxes = partition.optimizer_init(tx, boxed(params))
  from_tree = partition.optimizer_init(tx, params, param_axes=AXES, rules=RULES, mesh=mesh)
  table = partition.PathRules([(r"^w_in$", ("embed", "mlp")), (r"^w_out$", ("mlp", "embed")),
                               (r"^embed$", ("vocab", "embed")), (r"^scale$", ("embed",))])
  from_table = partition.optimizer_init(tx, params, param_axes=table, rules=RULES, mesh=mesh)
  # a list of (regex, axes) pairs is a path table here too, as in the adapters' param_axes=
  from_pairs = partition.optimizer_init(tx, params, param_axes=list(table.pairs), rules=RULES,
                                        mesh=mesh)
  for a, b, c, d in zip(jax.tree.leaves(from_boxes), jax.tree.leaves(from_tree),
                        jax.tree.leaves(from_table), jax.tree.leaves(from_pairs)):
    assert a.sharding == b.sharding == c.sharding == d.sharding


def test_optimizer_axes_keep_empty_state_and_masked_node():
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.masked(optax.adamw(1e-2), mask))
  axes = partition.optimizer_axes(tx, boxed(make_params()))
  assert isinstance(axes[0], optax.EmptyState)
  inner = axes[1].inner_state[0]
  assert inner.mu["w_in"] == ("embed", "mlp") and inner.nu["w_out"] == ("mlp", "embed")
  assert isinstance(inner.mu["scale"], optax.MaskedNode)
  assert inner.count is None


def test_explain_reads_an_optax_state(mesh):
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
  params = make_params()
  state = partition.optimizer_init(tx, boxed(params), rules=RULES, mesh=mesh)
  report = partition.explain(state, partition.optimizer_axes(tx, boxed(params)), RULES, mesh)
  rows = {r.path: r for r in report.rows}
  # Independent reference: the bytes each device actually holds.
  for path, leaf in [("1/0/mu/w_in", state[1][0].mu["w_in"]),
                     ("1/0/count", state[1][0].count)]:
    shard = leaf.addressable_shards[0].data
    assert rows[path].bytes_per_device == shard.size * shard.dtype.itemsize
  assert rows["1/0/mu/w_in"].spec == P("fsdp", "tensor")


def test_bad_tx_is_a_clear_error(mesh):
  with pytest.raises(TypeError, match=r"tx must be an optax GradientTransformation, got "
                                      r"function(.|\n)*optax.adamw\(1e-3\)"):
    partition.optimizer_init(optax.adam, make_params(), rules=RULES, mesh=mesh)
  with pytest.raises(partition.PartitionError, match="needs axis rules"):
    partition.optimizer_init(optax.adam(1e-3), make_params(), mesh=mesh)


def test_state_axes_give_the_state_shardings_through_tree_shardings(mesh):
  # The checkpoint-target use: AxisRules.tree_shardings over optimizer_axes reproduces the
  # shardings optimizer_init created (EmptyState / MaskedNode nodes included).
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.masked(optax.adamw(1e-2), mask))
  params = make_params()
  state = partition.optimizer_init(tx, boxed(params), rules=RULES, mesh=mesh)
  axes = partition.optimizer_axes(tx, boxed(params))
  specs = RULES.tree_specs(axes, state, mesh)
  got = jax.tree.leaves(state)
  want = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
  assert len(got) == len(want) == 1 + 2 * 3  # count + mu/nu of the three 2-D params
  for leaf, spec in zip(got, want):
    assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, spec), leaf.ndim)
  # partition.logical_axes on a plain optax state: every leaf unannotated, nodes kept.
  plain_axes = partition.logical_axes(state)
  assert isinstance(plain_axes[0], optax.EmptyState)
  assert all(a is None for a in jax.tree.leaves(plain_axes, is_leaf=lambda x: x is None))


@pytest.mark.slow
def test_nnx_state_update_with_value_and_grad_gradients(mesh):
  """On an nnx.State the optimizer state keeps the Param wrappers (the structure
  tx.init(state) has), so tx.update accepts the gradients value_and_grad returns for it."""
  from flax import nnx

  import partition.nnx

  model = partition.nnx.init_sharded(lambda: nnx.Linear(
      8, 4, kernel_metadata={"out_sharding": ("embed", "mlp")},
      bias_metadata={"out_sharding": ("mlp",)}, rngs=nnx.Rngs(0)), rules=RULES, mesh=mesh)
  graphdef, state = nnx.split(model, nnx.Param)
  axes = partition.logical_axes(state)
  tx = optax.adamw(1e-2)
  opt_state = partition.optimizer_init(tx, state, rules=RULES, mesh=mesh)
  assert jax.tree.structure(opt_state) == jax.tree.structure(tx.init(state))
  assert jax.tree.leaves(opt_state[0].mu["kernel"])[0].sharding.spec == P("fsdp", "tensor")
  x = np.ones((4, 8), np.float32)
  loss = lambda s, b: (nnx.merge(graphdef, s)(b["x"]) ** 2).mean()
  step = partition.value_and_grad(loss, batch_axes={"x": ("batch", "embed")}, param_axes=axes,
                                  rules=RULES, mesh=mesh)
  _, grads = step(state, {"x": x})
  updates, _ = tx.update(grads, opt_state, state)
  host = jax.tree.map(np.asarray, state)  # the unsharded reference, on one device
  _, ref_grads = jax.value_and_grad(loss)(host, {"x": x})
  ref_updates, _ = tx.update(ref_grads, tx.init(host), host)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                      rtol=1e-5, atol=1e-7), updates,
               ref_updates)
