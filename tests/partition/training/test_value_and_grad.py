"""``partition.value_and_grad``: equal to ``jax.value_and_grad`` of the full batch on one
device, for data / FSDP / tensor / FSDP+TP tables and k = 1, 2, 4 micro-batches; gradients
sharded exactly like their parameters."""

import re

import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import partition
from partition import SerialLoop

TABLES = {
    "dp": [("batch", "data")],
    "fsdp": [("batch", ("data", "fsdp")), ("embed", "fsdp")],
    "tp": [("batch", "data"), ("mlp", "tensor")],
    "fsdp_tp": [("batch", ("data", "fsdp")), ("embed", "fsdp"), ("mlp", "tensor")],
}
PARAM_AXES = {"w1": ("embed", "mlp"), "b1": ("mlp",), "w2": ("mlp", "embed")}
BATCH_AXES = {"x": ("batch", "embed"), "y": ("batch", "embed")}


def _mesh(axis_type=AxisType.Auto):
  return jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(axis_type,) * 3)


def _problem(rows=16, embed=8, mlp=8):
  rng = np.random.default_rng(0)
  params = {"w1": rng.normal(size=(embed, mlp)) / 3, "b1": rng.normal(size=(mlp,)),
            "w2": rng.normal(size=(mlp, embed)) / 3}
  batch = {"x": rng.normal(size=(rows, embed)), "y": rng.normal(size=(rows, embed))}
  as32 = lambda t: jax.tree.map(lambda a: np.asarray(a, np.float32), t)
  return as32(params), as32(batch)


def mlp_loss(params, batch):
  h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
  h = partition.constrain(h, ("batch", "mlp"))
  return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


def _assert_close(got, want):
  jax.tree.map(lambda g, w: np.testing.assert_allclose(np.asarray(g), np.asarray(w),
                                                      rtol=1e-5, atol=1e-6), got, want)


def _norm(spec):
  entries = list(spec)
  while entries and entries[-1] is None:
    entries.pop()
  return P(*entries)


def _assert_sharded_like_params(grads, rules, mesh, params):
  for name, g in grads.items():
    want = rules.spec(PARAM_AXES[name], params[name].shape, mesh)
    assert _norm(g.sharding.spec) == _norm(want), name


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("table", sorted(TABLES))
def test_equals_single_device_full_batch(table, k):
  mesh, rules = _mesh(), partition.AxisRules(TABLES[table])
  params, batch = _problem()
  step = partition.value_and_grad(mlp_loss, batch_axes=BATCH_AXES, param_axes=PARAM_AXES,
                                  rules=rules, mesh=mesh, microbatches=k)
  loss, grads = step(params, batch)
  ref_loss, ref_grads = jax.value_and_grad(mlp_loss)(params, batch)
  _assert_close((loss, grads), (ref_loss, ref_grads))
  _assert_sharded_like_params(grads, rules, mesh, params)


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("form", ["mesh=", "set_mesh", "axis_rules"])
def test_explicit_meshes_and_context_forms(form, k):
  mesh, rules = _mesh(AxisType.Explicit), partition.AxisRules(TABLES["fsdp_tp"])
  params, batch = _problem()
  kwargs = dict(batch_axes=BATCH_AXES, param_axes=PARAM_AXES, microbatches=k)
  if form == "mesh=":
    loss, grads = partition.value_and_grad(mlp_loss, rules=rules, mesh=mesh, **kwargs)(
        params, batch)
  elif form == "set_mesh":
    with jax.set_mesh(mesh):
      loss, grads = partition.value_and_grad(mlp_loss, rules=rules, **kwargs)(params, batch)
  else:
    with partition.axis_rules(rules, mesh):
      loss, grads = partition.value_and_grad(mlp_loss, **kwargs)(params, batch)
  _assert_close((loss, grads), jax.value_and_grad(mlp_loss)(params, batch))
  _assert_sharded_like_params(grads, rules, mesh, params)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["Auto", "Explicit"])
def test_inside_jit_train_step(axis_type):
  mesh, rules = _mesh(axis_type), partition.AxisRules(TABLES["fsdp_tp"])
  params, batch = _problem()
  shardings = {n: NamedSharding(mesh, rules.spec(a, params[n].shape, mesh))
               for n, a in PARAM_AXES.items()}
  params_sharded = jax.device_put(params, shardings)
  step = partition.value_and_grad(mlp_loss, batch_axes=BATCH_AXES, param_axes=PARAM_AXES,
                                  rules=rules, mesh=mesh, microbatches=2)

  @jax.jit
  def train_step(params, batch):
    loss, grads = step(params, batch)
    return loss, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

  with jax.set_mesh(mesh):
    loss, new = train_step(params_sharded, batch)
  ref_loss, ref_grads = jax.value_and_grad(mlp_loss)(params, batch)
  _assert_close((loss, new), (ref_loss, jax.tree.map(lambda p, g: p - 0.1 * g, params,
                                                     ref_grads)))
  for n in params:
    assert _norm(new[n].sharding.spec) == _norm(shardings[n].spec)


def test_loops_from_the_rules_table():
  mesh = _mesh()
  rules = partition.AxisRules([("batch", ("data", SerialLoop(4))), ("mlp", "tensor")])
  params, batch = _problem()
  step = partition.value_and_grad(mlp_loss, batch_axes=BATCH_AXES, param_axes=PARAM_AXES,
                                  rules=rules, mesh=mesh)
  _assert_close(step(params, batch), jax.value_and_grad(mlp_loss)(params, batch))
  text = jax.jit(step).lower(params, batch).compile().as_text()
  assert "while" in text  # the four micro-batches are a loop


@pytest.mark.parametrize("schedule", ["per_microbatch", "once"])
def test_microbatches_split_rows_strided_within_each_device(schedule):
  """Micro-batch j holds rows j, j+k, ... of each device's block: checked through a loss
  whose gradient records which rows it saw (aux = the per-micro-batch row ids). Reducing
  once, the loss runs per device shard of each micro-batch (aux averaged over both)."""
  mesh, rules = _mesh(), partition.AxisRules([("batch", "data")])
  k, rows = 2, 8
  ids = np.arange(rows, dtype=np.float32)

  def loss(params, batch):
    return jnp.sum(params["w"] * 0) + 0.0, batch["id"]

  seen = []

  def recording(params, batch):
    value, aux = loss(params, batch)
    jax.debug.callback(lambda a: seen.append(np.asarray(a)), aux)
    return value, aux

  step = partition.value_and_grad(recording, batch_axes={"id": ("batch",)},
                                  param_axes={"w": (None,)}, rules=rules, mesh=mesh,
                                  microbatches=k, has_aux=True, grad_reduction=schedule)
  (_, aux), _ = step({"w": np.ones(2, np.float32)}, {"id": ids})
  jax.effects_barrier()
  # devices hold blocks [0..3] and [4..7]; micro 0 = rows 0, 2 | 4, 6; micro 1 = 1, 3 | 5, 7
  if schedule == "per_microbatch":
    assert sorted(tuple(s) for s in seen) == [(0.0, 2.0, 4.0, 6.0), (1.0, 3.0, 5.0, 7.0)]
    np.testing.assert_allclose(aux, np.mean([[0, 2, 4, 6], [1, 3, 5, 7]], axis=0))
  else:
    assert sorted(tuple(s) for s in seen) == [(0.0, 2.0), (1.0, 3.0), (4.0, 6.0), (5.0, 7.0)]
    np.testing.assert_allclose(aux, np.mean([[0, 2], [4, 6], [1, 3], [5, 7]], axis=0))


@pytest.mark.parametrize("schedule", ["per_microbatch", "once"])
@pytest.mark.slow
def test_rng_is_folded_per_microbatch(schedule):
  mesh, rules = _mesh(), partition.AxisRules(TABLES["dp"])
  params, batch = _problem(rows=8)
  k = 2

  def dropout_loss(params, batch, rng):
    keep = jax.random.bernoulli(rng, 0.5, batch["x"].shape)
    x = jnp.where(keep, batch["x"] * 2, 0.0)
    return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"] - batch["y"]) ** 2)

  rng = jax.random.key(3)
  step = partition.value_and_grad(dropout_loss, batch_axes=BATCH_AXES, rules=rules,
                                  mesh=mesh, microbatches=k, rng_argnums=2,
                                  grad_reduction=schedule)
  params = {n: params[n] for n in ("w1", "w2")}
  loss, grads = step(params, batch, rng)
  # Reference: micro-batch j = rows j, j+k, ... of each device's block, key fold_in(rng, j);
  # reducing once, device shard i of it gets fold_in(fold_in(rng, j), i).
  per_device = 8 // 2
  block = lambda d, j: np.arange(d * per_device, (d + 1) * per_device)[j::k]
  rows = lambda m: jax.tree.map(lambda a: a[m], batch)
  if schedule == "per_microbatch":
    parts = [(np.concatenate([block(d, j) for d in range(2)]), jax.random.fold_in(rng, j))
             for j in range(k)]
  else:
    parts = [(block(d, j), jax.random.fold_in(jax.random.fold_in(rng, j), d))
             for j in range(k) for d in range(2)]
  refs = [jax.value_and_grad(dropout_loss)(params, rows(m), key) for m, key in parts]
  ref = jax.tree.map(lambda *xs: sum(xs) / len(parts), *refs)
  _assert_close((loss, grads), ref)
  # and the masks really differ between the parts: not the same as one shared key
  same = [jax.value_and_grad(dropout_loss)(params, rows(m), rng) for m, _ in parts]
  assert not np.allclose(loss, sum(s[0] for s in same) / len(parts))


@pytest.mark.slow
def test_flax_linen_model_with_logical_constraints():
  """A linen model declaring axes with with_logical_partitioning and constraining its
  activations with nn.with_logical_constraint (flax's own API)."""

  class Mlp(nn.Module):
    constrained: bool = True

    @nn.compact
    def __call__(self, x):
      h = nn.Dense(16, kernel_init=nn.with_logical_partitioning(
          nn.initializers.lecun_normal(), ("embed", "mlp")), use_bias=False)(x)
      h = jnp.tanh(h)
      if self.constrained:
        h = nn.with_logical_constraint(h, ("batch", "mlp"))
      return nn.Dense(8, kernel_init=nn.with_logical_partitioning(
          nn.initializers.lecun_normal(), ("mlp", "embed")), use_bias=False)(h)

  mesh, rules = _mesh(), partition.AxisRules(TABLES["fsdp_tp"])
  model = Mlp()
  _, batch = _problem()
  boxed = model.init(jax.random.key(0), batch["x"])["params"]

  def loss(params, batch):
    return jnp.mean((model.apply({"params": params}, batch["x"]) - batch["y"]) ** 2)

  step = partition.value_and_grad(loss, batch_axes=BATCH_AXES, rules=rules, mesh=mesh,
                                  microbatches=2)
  loss_value, grads = step(boxed, batch)
  _assert_close((loss_value, grads), jax.value_and_grad(loss)(boxed, batch))
  kernel = grads["Dense_0"]["kernel"].value
  assert _norm(kernel.sharding.spec) == P("fsdp", "tensor")
  # flax's constraint took effect inside the micro-batch loop: one more constraint than the
  # same model without it, placing the hidden activation's mlp dim on 'tensor'.
  def constraints(model):
    step = partition.value_and_grad(
        lambda p, b: jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2),
        batch_axes=BATCH_AXES, rules=rules, mesh=mesh, microbatches=2)
    return str(jax.make_jaxpr(step)(boxed, batch)).count("sharding_constraint")
  assert constraints(Mlp(constrained=True)) > constraints(Mlp(constrained=False))


@pytest.mark.slow
def test_haiku_model_with_path_rules():
  def forward(x):
    return hk.nets.MLP([16, 8], activation=jnp.tanh)(x)

  f = hk.without_apply_rng(hk.transform(forward))
  _, batch = _problem()
  params = f.init(jax.random.key(0), batch["x"])
  param_axes = partition.PathRules([(r".*/w$", ("embed", "mlp")), (r".*/b$", ("mlp",))])

  def loss(params, batch):
    return jnp.mean((f.apply(params, batch["x"]) - batch["y"]) ** 2)

  mesh, rules = _mesh(), partition.AxisRules(TABLES["fsdp_tp"])
  step = partition.value_and_grad(loss, batch_axes=BATCH_AXES, param_axes=param_axes,
                                  rules=rules, mesh=mesh, microbatches=4)
  _assert_close(step(params, batch), jax.value_and_grad(loss)(params, batch))


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["Auto", "Explicit"])
def test_fsdp_accumulation_hlo(axis_type):
  """FSDP + 4 micro-batches: inputs and gradient outputs carry the params' shardings, the
  arguments take only their shards' bytes, and no all-reduce carries a full parameter."""
  mesh, rules = _mesh(axis_type), partition.AxisRules(TABLES["fsdp"])
  params, batch = _problem(rows=32, embed=16, mlp=16)
  shardings = {n: NamedSharding(mesh, rules.spec(a, params[n].shape, mesh))
               for n, a in PARAM_AXES.items()}
  batch_sharding = NamedSharding(mesh, P(("data", "fsdp")))
  params_s = jax.device_put(params, shardings)
  batch_s = jax.device_put(batch, batch_sharding)
  step = partition.value_and_grad(mlp_loss, batch_axes=BATCH_AXES, param_axes=PARAM_AXES,
                                  rules=rules, mesh=mesh, microbatches=4)
  with jax.set_mesh(mesh):
    compiled = jax.jit(step).lower(params_s, batch_s).compile()
  (params_in, batch_in), _ = compiled.input_shardings
  _, grads_out = compiled.output_shardings
  for n in params:
    assert _norm(params_in[n].spec) == _norm(shardings[n].spec)
    assert _norm(grads_out[n].spec) == _norm(shardings[n].spec)
  sharded_bytes = (sum(params[n].nbytes // np.prod([mesh.shape[a] for a in
                                                     jax.tree.leaves(tuple(shardings[n].spec))])
                       for n in params) + sum(b.nbytes for b in batch.values()) // 4)
  assert compiled.memory_analysis().argument_size_in_bytes == sharded_bytes
  text = compiled.as_text()
  assert not re.search(r"f32\[16,16\]\{[^}]*\} all-reduce\(", text)
  assert "while" in text


def test_errors_name_the_leaf_and_the_fix():
  mesh, rules = _mesh(), partition.AxisRules(TABLES["fsdp"])
  params, batch = _problem()
  bad_axes = {"x": ("batch",), "y": ("batch", "embed")}
  step = partition.value_and_grad(mlp_loss, batch_axes=bad_axes, rules=rules, mesh=mesh)
  with pytest.raises(partition.GradSpecError, match=r"batch\['x'\] has shape \(16, 8\)"):
    step(params, batch)
  step = partition.value_and_grad(mlp_loss, batch_axes=BATCH_AXES, rules=rules, mesh=mesh,
                                  microbatches=3)
  with pytest.raises(partition.AxisSizeError, match=r"divide into 4 device shard\(s\) x 3 "
                                                    r"micro-batch(?s:.*)multiple of 12"):
    step(params, batch)
  with pytest.raises(partition.AxisSizeError, match="microbatches must be a positive int"):
    partition.value_and_grad(mlp_loss, batch_axes=BATCH_AXES, microbatches=0)
  with pytest.raises(partition.GradSpecError, match=r"not a pytree prefix of the batch"):
    partition.value_and_grad(mlp_loss, batch_axes={"z": ("batch",)}, rules=rules,
                             mesh=mesh)(params, batch)
  with pytest.raises(partition.SpecError, match=r"rng_argnums=\(1,\)"):
    partition.value_and_grad(mlp_loss, batch_axes=BATCH_AXES, rng_argnums=1)


def test_batch_fallbacks_warn_once_naming_the_leaf():
  # A misspelt batch name or a batch no rule divides replicates the batch on every device:
  # value_and_grad says so itself (not as an "xmap axis"), once per cause, at the caller.
  import warnings
  mesh, rules = _mesh(), partition.AxisRules(TABLES["fsdp"])
  params, batch = _problem(rows=6)
  loss = lambda p, b: jnp.mean((jnp.tanh(b["x"] @ p["w1"] + p["b1"]) @ p["w2"] - b["y"]) ** 2)
  typo = {"x": ("bacth", "embed"), "y": ("bacth", "embed")}
  cases = [(typo, batch, r"value_and_grad: logical axis 'bacth' has no rule \(did you mean "
                         r"'batch'\?\), so batch\['x'\] dim 0 is replicated \(and 1 more"),
           (BATCH_AXES, batch, r"value_and_grad: batch\['x'\] dim 0 'batch' \(size 6\) is "
                               r"replicated: no rule for it divides the dim")]
  for axes, data, message in cases:
    step = partition.value_and_grad(loss, batch_axes=axes, rules=rules, mesh=mesh)
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      got = step(params, data)
      step(params, data)
    texts = [str(w.message) for w in caught]
    assert len(texts) == 1 and re.search(message, texts[0]), texts
    assert caught[0].category is partition.PartitionWarning
    assert caught[0].filename == __file__
    _assert_close(got, jax.value_and_grad(loss)(params, data))
  # Stated in the rules (a null rule): intended, silent.
  quiet = partition.AxisRules([("bacth", None)] + TABLES["fsdp"])
  step = partition.value_and_grad(loss, batch_axes=typo, rules=quiet, mesh=mesh)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    step(params, batch)


def test_without_rules_or_mesh_it_is_plain_accumulation():
  params, batch = _problem()
  step = partition.value_and_grad(mlp_loss, batch_axes=BATCH_AXES, microbatches=4)
  _assert_close(step(params, batch), jax.value_and_grad(mlp_loss)(params, batch))


@pytest.mark.slow
def test_model_with_hard_coded_sharding_constraint():
  """A model that pins its activations with with_sharding_constraint(y, P('data', None))
  (inside plain xmap this fails: vmap's spmd_axis_name cannot appear in the spec)."""
  mesh, rules = _mesh(), partition.AxisRules(TABLES["dp"])
  params, batch = _problem()

  def loss(params, batch):
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    h = jax.lax.with_sharding_constraint(h, NamedSharding(mesh, P("data", None)))
    return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)

  step = partition.value_and_grad(loss, batch_axes=BATCH_AXES, param_axes=PARAM_AXES,
                                  rules=rules, mesh=mesh, microbatches=2)
  _assert_close(step(params, batch), jax.value_and_grad(loss)(params, batch))
  # reducing once runs the loss per device shard, where 'data' holds the shards: an error
  once = partition.value_and_grad(loss, batch_axes=BATCH_AXES, param_axes=PARAM_AXES,
                                  rules=rules, mesh=mesh, microbatches=2,
                                  grad_reduction="once")
  with pytest.raises(partition.GradSpecError, match=r"(?s)constrains an array to the batch's "
                     r"mesh axes \('data',\).*grad_reduction='per_microbatch'"):
    once(params, batch)


def test_param_axes_as_a_list_of_path_pairs_is_a_path_table():
  """param_axes= means the same as in the adapters: (regex, axes) pairs are a path table."""
  mesh, rules = _mesh(), partition.AxisRules(TABLES["fsdp_tp"])
  params, batch = _problem()
  pairs = [(r"^w1$", ("embed", "mlp")), (r"^b1$", ("mlp",)), (r"^w2$", ("mlp", "embed"))]
  step = partition.value_and_grad(mlp_loss, batch_axes=BATCH_AXES, param_axes=pairs,
                                  rules=rules, mesh=mesh)
  loss, grads = step(params, batch)
  _assert_close((loss, grads), jax.value_and_grad(mlp_loss)(params, batch))
  _assert_sharded_like_params(grads, rules, mesh, params)


def test_microbatch_loop_costs_what_a_hand_written_scan_costs():
  """XLA's cost_analysis of the compiled k = 4 step (bf16 compute on fp32 params, no mesh)
  against the same loop written by hand with lax.scan: nothing is recomputed per micro-step
  beyond what the hand-written loop does (the loss's own weight casts, the accumulation).
  XLA counts a loop body once, so both read as one micro-step plus what runs around it."""
  rng = np.random.default_rng(0)
  params = {"w1": jnp.asarray(rng.normal(size=(64, 256)), jnp.float32),
            "w2": jnp.asarray(rng.normal(size=(256, 64)), jnp.float32)}
  batch = {"x": jnp.asarray(rng.normal(size=(32, 64)), jnp.float32)}
  k = 4

  def loss(p, b):
    h = jnp.tanh(b["x"].astype(jnp.bfloat16) @ p["w1"].astype(jnp.bfloat16))
    return jnp.mean((h @ p["w2"].astype(jnp.bfloat16)).astype(jnp.float32) ** 2)

  def by_hand(p, b):  # micro-batch j = rows j, j+k, ..., as value_and_grad cuts them
    mb = jax.tree.map(lambda x: jnp.moveaxis(x.reshape(-1, k, *x.shape[1:]), 1, 0), b)
    step = lambda acc, m: (jax.tree.map(jnp.add, acc, jax.value_and_grad(loss)(p, m)), None)
    zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, p))
    return jax.tree.map(lambda x: x / k, jax.lax.scan(step, zero, mb)[0])

  ours = partition.value_and_grad(loss, batch_axes={"x": ("batch", "embed")},
                                  microbatches=k)
  cost = lambda f: jax.jit(f).lower(params, batch).compile().cost_analysis()
  got, want = cost(ours), cost(by_hand)
  assert got["flops"] <= want["flops"] * 1.01, (got["flops"], want["flops"])
  assert got["bytes accessed"] <= want["bytes accessed"] * 1.01, (got, want)
  # and the same numbers as the hand-written loop (the same bf16 arithmetic, in order)
  for a, b in zip(jax.tree.leaves(jax.jit(ours)(params, batch)),
                  jax.tree.leaves(jax.jit(by_hand)(params, batch))):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
