"""``partition.pipeline``: a scanned stack run as a GPipe / circular pipeline over ``stage``.

Every result is compared with the same stack run sequentially (``lax.scan``) on one device:
the loss and the gradients agree to fp32 rounding (rtol 1e-5), for 4 and 8 layers, 2 and 4
stages, GPipe and circular, with the batch on a data axis or the weights FSDP-sharded on the
other mesh axis. The compiled program is checked too: the parameters stay on their stage
(per-device bytes = total / stages, no all-gather over ``stage``) and the schedule's loop
runs ``r m + p - 1`` iterations.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from mesh_testlib import make_mesh

import partition
from partition import LayerCountError, MicrobatchError, PipelineError, StageAxisError

D, BATCH = 16, 16
RTOL = 1e-5
# Gradients are sums of O(1) terms over 16 rows and a few layers; entries that cancel to
# ~0 need an absolute floor at fp32 rounding of those terms (eps * magnitude ~ 1e-7).
ATOL = 1e-6


def layer(lp, h):
  return h + jnp.tanh(h @ lp["w"] + lp["b"])


def stack(num_layers):
  rng = np.random.default_rng(0)
  return {"w": jnp.asarray(rng.normal(size=(num_layers, D, D)) * 0.3, jnp.float32),
          "b": jnp.asarray(rng.normal(size=(num_layers, D)) * 0.1, jnp.float32)}


def batch(rows=BATCH):
  return jnp.asarray(np.random.default_rng(1).normal(size=(rows, D)), jnp.float32)


def sequential(params, x):
  return lax.scan(lambda h, lp: (layer(lp, h), None), x, params)[0]


def loss_sequential(params, x):
  return jnp.mean(sequential(params, x) ** 2)


@functools.cache
def sequential_reference(num_layers):
  """The one-device stack's output and (loss, grads) on ``stack(num_layers)``, ``batch()``:
  computed once per depth and shared by every test that compares against it."""
  params, x = stack(num_layers), batch()
  out = np.asarray(sequential(params, x))
  loss, grads = jax.value_and_grad(loss_sequential)(params, x)
  return out, float(loss), jax.tree.map(np.asarray, grads)


def place(mesh, params, x, other):
  """Weights on their stage (and FSDP-sharded over 'data' for other='fsdp'); the batch
  sharded over 'data' unless other is None."""
  w_spec = P("stage", "data") if other == "fsdp" else P("stage")
  params = {"w": jax.device_put(params["w"], NamedSharding(mesh, w_spec)),
            "b": jax.device_put(params["b"], NamedSharding(mesh, P("stage")))}
  x = jax.device_put(x, NamedSharding(mesh, P("data") if other else P()))
  return params, x


@functools.cache  # one jitted step per configuration: tests that compile the same one share it
def pipelined_value_and_grad(mesh, microbatches, repeats, **kw):
  def loss(params, x):
    y = partition.pipeline(layer, params, x, microbatches=microbatches, repeats=repeats,
                           stage_axis="stage", mesh=mesh, **kw)
    return jnp.mean(y ** 2)
  return jax.jit(jax.value_and_grad(loss))


def assert_tree_close(got, want):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=RTOL, atol=ATOL)


CASES = [(n, p, r, other)
         for n in (4, 8) for p in (2, 4) for r in (1, 2) for other in (None, "data", "fsdp")
         if n % (p * r) == 0]
FAST = [(8, 2, 2, "fsdp")]


def check_against_one_device(num_layers, stages, repeats, other, axis_type=AxisType.Auto):
  params, x = stack(num_layers), batch()
  _, want_loss, want_grads = sequential_reference(num_layers)
  mesh = make_mesh((stages, 8 // stages), ("stage", "data"), axis_type)
  with jax.set_mesh(mesh):
    placed = place(mesh, params, x, other)
    loss, grads = pipelined_value_and_grad(mesh, 4, repeats)(*placed)
  np.testing.assert_allclose(float(loss), want_loss, rtol=RTOL)
  assert_tree_close(grads, want_grads)
  # Gradients stay on their stage: total / stages bytes per device (less where XLA also
  # keeps the FSDP weight's gradient split over 'data'; the jit leaves that to propagation).
  for name, g in grads.items():
    spec = tuple(g.sharding.spec)
    assert spec[0] == "stage", (name, spec)
    shards = stages * (8 // stages if "data" in spec[1:] else 1)
    assert g.addressable_shards[0].data.nbytes * shards == g.nbytes, (name, g.sharding)


@pytest.mark.parametrize("num_layers,stages,repeats,other", FAST)
@pytest.mark.slow
def test_matches_one_device(num_layers, stages, repeats, other):
  check_against_one_device(num_layers, stages, repeats, other)


@pytest.mark.slow
@pytest.mark.parametrize("num_layers,stages,repeats,other", CASES)
def test_matches_one_device_matrix(num_layers, stages, repeats, other):
  check_against_one_device(num_layers, stages, repeats, other)


@pytest.mark.slow
@pytest.mark.parametrize("num_layers,stages,repeats,other", [(8, 4, 1, "data"),
                                                              (8, 2, 2, "fsdp")])
def test_matches_one_device_explicit_mesh(num_layers, stages, repeats, other):
  check_against_one_device(num_layers, stages, repeats, other, AxisType.Explicit)


# -- the compiled program -------------------------------------------------------------------

TRIP_COUNT = re.compile(r'known_trip_count":\{"n":"(\d+)"')
ALL_GATHER = re.compile(r"\sall-gather(?:-start)?\(.*replica_groups=.*")


def group_size(line: str) -> int:
  """Devices per replica group of one HLO collective line: the forms XLA prints are
  ``mesh['a'=2,'b'=4] {'b'}``, iota ``[groups,size]<=[...]`` and explicit ``{{0,1},...}``."""
  mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
  if mesh:
    sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", mesh.group(1))}
    return int(np.prod([sizes[a] for a in re.findall(r"'([^']+)'", mesh.group(2))]))
  iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
  if iota:
    return int(iota.group(2))
  lists = re.search(r"replica_groups=\{\{([\d,]+)\}", line)
  if lists:
    return len(lists.group(1).split(","))
  raise AssertionError(f"unparsed replica_groups in {line!r}")


def compiled_text(num_layers, stages, repeats, other, microbatches):
  params, x = stack(num_layers), batch(microbatches * 4)  # rows divisible by m x data
  mesh = make_mesh((stages, 8 // stages), ("stage", "data"), AxisType.Auto)
  with jax.set_mesh(mesh):
    placed = place(mesh, params, x, other)
    step = pipelined_value_and_grad(mesh, microbatches, repeats)
    return step.lower(*placed).compile().as_text()


@pytest.mark.parametrize("num_layers,stages,repeats,microbatches",
                         [(8, 4, 1, 4),
                          *[pytest.param(*c, marks=pytest.mark.slow)
                            for c in [(8, 2, 1, 6), (8, 2, 2, 4), (8, 4, 2, 6)]]])
def test_loop_runs_r_m_plus_p_minus_1_iterations(num_layers, stages, repeats, microbatches):
  hlo = compiled_text(num_layers, stages, repeats, "data", microbatches)
  trips = [int(n) for n in TRIP_COUNT.findall(hlo)]
  want = repeats * microbatches + stages - 1
  assert want == partition.PipelineShape("stage", stages, repeats, microbatches,
                                        num_layers).iterations
  # one loop forward, its transpose backward
  assert trips.count(want) == 2, trips


@pytest.mark.parametrize("num_layers,stages,repeats,other",
                         [(8, 4, 1, "fsdp"),
                          *[pytest.param(*c, marks=pytest.mark.slow)
                            for c in [(8, 4, 1, "data"), (8, 4, 2, "data"), (8, 2, 2, "fsdp")]]])
def test_no_all_gather_over_stage(num_layers, stages, repeats, other):
  hlo = compiled_text(num_layers, stages, repeats, other, 4)
  sizes = [group_size(g) for g in ALL_GATHER.findall(hlo)]
  if other == "data":
    assert sizes == []  # data parallel: parameters replicated over 'data', never gathered
  else:
    # FSDP gathers the weights over 'data' (size 8 / stages), never over 'stage'.
    assert sizes and all(s == 8 // stages for s in sizes), sizes
    assert stages != 8 // stages
  # the shift between stages is a collective-permute
  assert re.search(r"\scollective-permute(?:-start)?\(", hlo)


def test_parameter_bytes_per_device_are_total_over_stages():
  params, x = stack(8), batch()
  mesh = make_mesh((4, 2), ("stage", "data"), AxisType.Auto)
  with jax.set_mesh(mesh):
    placed, x_placed = place(mesh, params, x, "data")
    compiled = pipelined_value_and_grad(mesh, 4, 1).lower(placed, x_placed).compile()
  total = sum(a.nbytes for a in jax.tree.leaves(params))
  per_device = sum(a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(placed))
  assert per_device * 4 == total
  # the compiled step takes them as they are: its arguments per device are the stage's
  # parameters and the device's shard of the batch (split over data=2).
  x_bytes = BATCH * D * 4 // 2
  assert compiled.memory_analysis().argument_size_in_bytes == per_device + x_bytes


# -- rules, options, composition ------------------------------------------------------------


def test_stage_axis_from_rules_and_plain_scan_without_one():
  params, x = stack(8), batch()
  want = sequential_reference(8)[0]
  mesh = make_mesh((4, 2), ("stage", "data"), AxisType.Auto)
  rules = partition.AxisRules([("layers", "stage"), ("batch", "data")])
  with jax.set_mesh(mesh), partition.axis_rules(rules, mesh=mesh):
    placed = place(mesh, params, x, "data")
    compiled = jax.jit(lambda p, x: partition.pipeline(layer, p, x, microbatches=4)).lower(
        *placed).compile()
    got = compiled(*placed)
    hlo = compiled.as_text()
  np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
  assert re.search(r"\scollective-permute(?:-start)?\(", hlo)
  with partition.axis_rules([("layers", None)], mesh=mesh):
    plain = partition.pipeline(layer, params, x, microbatches=4)
  np.testing.assert_allclose(plain, want, rtol=RTOL, atol=ATOL)


@pytest.mark.slow
def test_remat_policy_consts_and_pytree_activations():
  params, x = stack(4), batch()
  scale = jnp.float32(0.5)

  def two_stream(lp, h, s):
    return {"a": layer(lp, h["a"]) * s + h["b"], "b": h["b"]}

  def reference(params, x):
    return lax.scan(lambda h, lp: (two_stream(lp, h, scale), None), x, params)[0]

  xs = {"a": x, "b": x[:, ::-1]}
  want, want_vjp = jax.vjp(reference, params, xs)
  mesh = make_mesh((2, 4), ("stage", "data"), AxisType.Auto)

  def run(params, xs):
    return partition.pipeline(two_stream, params, xs, microbatches=2, consts=(scale,),
                              stage_axis="stage", mesh=mesh, remat_policy="nothing_saveable")

  with jax.set_mesh(mesh):
    got, got_vjp = jax.vjp(jax.jit(run), params, xs)
    cot = jax.tree.map(jnp.ones_like, got)
    assert_tree_close(got, want)
    assert_tree_close(got_vjp(cot), want_vjp(cot))


@pytest.mark.slow
def test_composes_with_value_and_grad():
  params, x = stack(8), batch()
  y = jnp.zeros_like(x)

  def loss_fn(params, b):
    out = partition.pipeline(layer, params, b["x"], microbatches=4)
    return jnp.mean((out - b["y"]) ** 2)

  want_loss, want_grads = jax.value_and_grad(loss_fn)(params, {"x": x, "y": y})
  mesh = make_mesh((4, 2), ("stage", "data"), AxisType.Auto)
  rules = partition.AxisRules([("layers", "stage"), ("batch", "data")])
  step = partition.value_and_grad(
      loss_fn, batch_axes={"x": ("batch", None), "y": ("batch", None)},
      param_axes={"w": ("layers", None, None), "b": ("layers", None)}, rules=rules, mesh=mesh)
  with jax.set_mesh(mesh):
    loss, grads = step(params, {"x": x, "y": y})
  np.testing.assert_allclose(float(loss), float(want_loss), rtol=RTOL)
  assert_tree_close(grads, want_grads)
  assert grads["w"].sharding.spec[0] == "stage"


def test_plan_and_bubble():
  plan = partition.PipelineShape("stage", 4, 2, 8, 16)
  assert plan.iterations == 2 * 8 + 4 - 1
  assert plan.bubble == pytest.approx(3 / 19)
  assert partition.pipeline_bubble(4, 4) == pytest.approx(3 / 7)
  # the loop trip count is the schedule's length (one row per iteration)
  assert partition.pipeline_iterations(4, 8, 2) == len(plan.schedule()) == 19
  assert partition.pipeline_iterations(4, 4) == len(
      partition.PipelineShape("stage", 4, 1, 4, 4).schedule())
  # chunk c of the stack is on stage c mod p
  layers = [plan.stage_layers(s) for s in range(4)]
  assert layers[1] == (2, 3, 10, 11)
  assert sorted(sum(layers, ())) == list(range(16))
  assert "bubble=0.158" in repr(plan)


# -- rows on their devices ------------------------------------------------------------------

ROW_RULES = partition.AxisRules([("layers", "stage"), ("batch", "data")])


@functools.cache
def rules_value_and_grad(mesh, microbatches, rules=ROW_RULES):
  def loss(params, x):
    with partition.axis_rules(rules, mesh=mesh):
      y = partition.pipeline(layer, params, x, microbatches=microbatches)
    return jnp.mean(y ** 2)
  return jax.jit(jax.value_and_grad(loss))


@pytest.mark.parametrize("stages,microbatches,axis_type", [
    (4, 4, AxisType.Auto), (4, 8, AxisType.Auto), (2, 4, AxisType.Explicit)])
def test_batch_axis_rows_stay_and_gradients_reduce_over_data_once(stages, microbatches,
                                                                  axis_type):
  # With ('batch', 'data') each device pipelines its own rows, so the stage's weight
  # gradients are summed over 'data' once per step: the bytes of one all-reduce of the
  # stage's parameters, whatever the number of iterations (before: once per iteration).
  num_layers = 8
  params, x = stack(num_layers), batch()
  _, want_loss, want_grads = sequential_reference(num_layers)
  data = 8 // stages
  mesh = make_mesh((stages, data), ("stage", "data"), axis_type)
  step = rules_value_and_grad(mesh, microbatches)
  with jax.set_mesh(mesh):
    placed = place(mesh, params, x, "data")
    loss, grads = step(*placed)
    compiled = step.lower(*placed).compile()
  np.testing.assert_allclose(float(loss), want_loss, rtol=RTOL)
  assert_tree_close(grads, want_grads)
  stats = partition.collective_stats(compiled, mesh)
  stage_bytes = sum(a.nbytes for a in jax.tree.leaves(params)) / stages
  once = 2 * stage_bytes * (data - 1) / data
  loss_bytes = 2 * 4 * (data - 1) / data  # the mean's scalar
  assert stats.bytes("all-reduce", ("data",)) == pytest.approx(once + loss_bytes)
  for kind in ("all-gather", "all-to-all", "reduce-scatter"):
    assert stats.bytes(kind, ("data",)) == 0, (kind, stats.as_dict())


def test_batch_axis_shared_with_a_parameter_axis_stays_automatic():
  # ('embed', 'data') may shard a weight over 'data' (FSDP): that axis is not made manual
  # (the layer would see a weight shard) and the result is still the sequential stack's.
  rules = partition.AxisRules([("layers", "stage"), ("batch", "data"), ("embed", "data")])
  params, x = stack(8), batch()
  _, want_loss, want_grads = sequential_reference(8)
  mesh = make_mesh((4, 2), ("stage", "data"), AxisType.Auto)
  with jax.set_mesh(mesh):
    loss, grads = rules_value_and_grad(mesh, 4, rules)(*place(mesh, params, x, "fsdp"))
  np.testing.assert_allclose(float(loss), want_loss, rtol=RTOL)
  assert_tree_close(grads, want_grads)


def test_error_micro_batch_rows_do_not_split_over_the_batch_axes():
  mesh = make_mesh((4, 2), ("stage", "data"), AxisType.Auto)
  with pytest.raises(MicrobatchError, match=r"a micro-batch of 1 rows does not split over the "
                     r"2 devices of the batch's mesh axes \('data',\) \('batch' in the rules\)"
                     r"(.|\n)*2 rows per device\nUse a batch of 8 x N rows\.$"):  # no m fits
    with partition.axis_rules(ROW_RULES, mesh=mesh):
      partition.pipeline(layer, stack(8), batch(4), microbatches=4)


# -- errors ---------------------------------------------------------------------------------


def call(num_layers=8, stages=4, microbatches=4, repeats=1, rows=BATCH, **kw):
  mesh = make_mesh((stages, 8 // stages), ("stage", "data"), AxisType.Auto)
  kw.setdefault("stage_axis", "stage")
  return partition.pipeline(layer, stack(num_layers), batch(rows), microbatches=microbatches,
                            repeats=repeats, mesh=mesh, **kw)


def test_error_layers_not_divisible():
  with pytest.raises(LayerCountError, match=r"6 layers do not split into 4 stages x 1 "
                     r"repeats = 4 equal chunks(.|\n)*Use a layer count divisible by 4, "
                     r"or a stage axis whose size divides 6\.$"):  # no repeats fit: none named
    call(num_layers=6)
  with pytest.raises(ValueError, match=r"4 layers do not split into 4 stages x 2 repeats = 8"
                     r"(.|\n)*repeats in \[1\]"):
    call(num_layers=4, repeats=2)


def test_error_fewer_microbatches_than_stages_says_the_bubble():
  with pytest.raises(MicrobatchError, match=r"microbatches=2 is fewer than the 4 stages"
                     r"(.|\n)*bubble \(p-1\)/\(r\*m\+p-1\) would be 60%(.|\n)*"
                     r"microbatches=4 it is 43%"):
    call(microbatches=2)


def test_error_batch_not_divisible_by_microbatches():
  with pytest.raises(MicrobatchError, match=r"a batch of 10 rows does not split into 4 "
                     r"micro-batches(.|\n)*microbatches in \[5, 10\]"):
    call(rows=10)


def test_error_stage_axis_shared_with_another_logical_axis():
  rules = [("layers", "stage"), ("batch", "data"), ("mlp", "stage"), ("heads", ("data", "stage"))]
  with pytest.raises(StageAxisError, match=r"stage axis 'stage' is also used by other logical "
                     r"axes(.|\n)*\* 'heads' -> 'stage'(.|\n)*\* 'mlp' -> 'stage'(.|\n)*"
                     r"Map 'heads', 'mlp' to other mesh axes"):
    call(stage_axis=None, rules=rules)


def test_error_stage_axis_not_in_mesh_and_two_mesh_axes():
  with pytest.raises(StageAxisError, match=r"'stages' is not an axis of mesh\(stage=4 Auto, "
                     r"data=2 Auto\) \(did you mean 'stage'\?\)\."):
    call(stage_axis="stages")
  with pytest.raises(StageAxisError, match=r"map 'layers' to \('stage', 'data'\); a pipeline "
                     r"needs one stage mesh axis"):
    call(stage_axis=None, rules=[("layers", ("stage", "data"))])


def test_error_leaves_disagree_and_bad_remat_policy():
  params = {"w": jnp.zeros((8, D, D)), "b": jnp.zeros((4, D))}
  with pytest.raises(LayerCountError, match=r"disagree(.|\n)*params\['b'\]: 4"):
    partition.pipeline(layer, params, batch(), microbatches=4, stage_axis="stage",
                       mesh=make_mesh((4, 2), ("stage", "data"), AxisType.Auto))
  with pytest.raises(PipelineError, match="remat_policy='everything' is not in "
                     "jax.checkpoint_policies"):
    call(remat_policy="everything")


@pytest.mark.parametrize("stages,repeats,microbatches", [(4, 1, 8), (4, 2, 4), (2, 3, 5)])
def test_schedule_visits_every_chunk_once_in_order(stages, repeats, microbatches):
  plan = partition.PipelineShape("stage", stages, repeats, microbatches, stages * repeats)
  grid = plan.schedule()
  assert len(grid) == plan.iterations
  # micro-batch i on its trip k reaches stage s exactly once, one iteration after stage s-1
  # (and stage 0 after stage p-1 of the previous trip): the stack's chunks in order.
  for i in range(microbatches):
    times = [t for trip in range(repeats) for s in range(stages)
             for t, step in enumerate(grid) if step[s] == (i, trip)]
    assert len(times) == repeats * stages
    first = times[0]
    # consecutive chunks run in consecutive iterations, except waiting at stage 0 for a
    # later trip (m >= p: the micro-batch is back after p iterations, used after m)
    for trip in range(repeats):
      chunk_times = times[trip * stages:(trip + 1) * stages]
      assert chunk_times == list(range(chunk_times[0], chunk_times[0] + stages))
      assert chunk_times[0] == first + trip * microbatches
  idle = sum(cell is None for step in grid for cell in step)
  assert idle / (len(grid) * stages) == pytest.approx(plan.bubble)


def test_docs_diagrams_are_the_plans():
  import pathlib
  text = (pathlib.Path(__file__).resolve().parents[3] / "docs" / "pipeline.md").read_text()
  assert partition.PipelineShape("stage", 4, 1, 8, 8).diagram() in text
  assert partition.PipelineShape("stage", 4, 2, 4, 8).diagram() in text


@pytest.mark.parametrize("stages", [2, 4, 8])
@pytest.mark.parametrize("repeats", [2, 3, 4])
def test_circular_relayout_rounds_are_partial_permutations_of_minimal_count(stages, repeats):
  from partition._training.pipeline import _relayout_rounds
  rounds = _relayout_rounds(stages, repeats)
  # every chunk c = a r + b goes from its contiguous home a to stage c mod p, slot c // p
  want = sorted((a, (a * repeats + b) % stages, b, (a * repeats + b) // stages)
                for a in range(stages) for b in range(repeats))
  assert sorted(mv for rnd in rounds for mv in rnd) == want
  for rnd in rounds:  # one ppermute: no stage sends or receives twice
    assert len({mv[0] for mv in rnd}) == len({mv[1] for mv in rnd}) == len(rnd)
  transfers = [rnd for rnd in rounds if any(a != t for a, t, _, _ in rnd)]
  assert all(a != t for rnd in transfers for a, t, _, _ in rnd)
  busiest = max(max(sum(a != t for a, t, _, _ in want if a == s) for s in range(stages)),
                max(sum(a != t for a, t, _, _ in want if t == s) for s in range(stages)))
  assert len(transfers) == busiest


@pytest.mark.parametrize("preset,other", [("pipeline_parallel", "data"), ("fsdp_pp", "fsdp")])
@pytest.mark.slow
def test_presets_put_layers_on_stage(preset, other):
  import pathlib
  path = (pathlib.Path(__file__).resolve().parents[3] / "recipes" / "presets"
          / f"{preset}.yaml")
  rules = partition.AxisRules.from_file(path)
  mesh = make_mesh((2, 4), (other, "stage"), AxisType.Auto)
  # the stacked kernel of a block: layers on stage, the rest by the data/FSDP rules
  spec = rules.spec(("layers", "embed", "mlp"), (8, 16, 32), mesh=mesh)
  assert spec == (P("stage", "fsdp", None) if other == "fsdp" else P("stage", None, None))
  assert rules.spec(("batch", "length", "embed"), (16, 4, 16), mesh=mesh)[0] == other
  params, x = stack(8), batch()
  with jax.set_mesh(mesh), partition.axis_rules(rules, mesh=mesh):
    got = partition.pipeline(layer, params, x, microbatches=4)
  np.testing.assert_allclose(got, sequential_reference(8)[0], rtol=RTOL, atol=ATOL)


# -- the layers Transformer under pipeline rules --------------------------------------------


@functools.cache
def transformer_reference(microbatches, repeats):
  """The model, its batch and loss, and the one-device (loss, grads) at ``model.init``: the
  presets with the same pipeline fields (the same model and batch) share one reference."""
  import layers
  import layers.linen

  m = microbatches or 4  # stages = 4
  cfg = layers.TransformerConfig(vocab_size=64, embed_dim=16, mlp_dim=32, num_heads=4,
                                 num_kv_heads=2, head_dim=8, num_layers=4 * repeats,
                                 scan_layers=True, pipeline_microbatches=microbatches,
                                 pipeline_repeats=repeats)
  rng = np.random.default_rng(2)
  rows = 2 * m  # each micro-batch splits over the other mesh axis (size 2)
  tokens = jnp.asarray(rng.integers(0, 64, (rows, 8)), jnp.int32)
  targets = jnp.asarray(rng.integers(0, 64, (rows, 8)), jnp.int32)
  model = layers.linen.Transformer(cfg)

  def loss(params, tokens, targets):
    logp = jax.nn.log_softmax(model.apply(params, tokens).astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

  params = model.init(jax.random.key(0), tokens)
  want_loss, want_grads = jax.jit(jax.value_and_grad(loss))(params, tokens, targets)
  want_grads = [np.asarray(w) for w in jax.tree.leaves(partition.unbox(want_grads))]
  return model, loss, tokens, targets, float(want_loss), want_grads


@pytest.mark.slow
@pytest.mark.parametrize("preset,other,microbatches,repeats", [
    ("pipeline_parallel", "data", 0, 1), ("fsdp_pp", "fsdp", 0, 1),
    ("pipeline_parallel", "data", 8, 2)])  # TransformerConfig's pipeline fields
def test_layers_linen_transformer_pipelined_equals_one_device(preset, other, microbatches,
                                                              repeats):
  import pathlib

  import partition.flax

  stages = 4
  m = microbatches or stages
  model, loss, tokens, targets, want_loss, flat_want = transformer_reference(microbatches,
                                                                              repeats)
  rules = partition.AxisRules.from_file(
      pathlib.Path(__file__).resolve().parents[3] / "recipes" / "presets" / f"{preset}.yaml")
  mesh = make_mesh((2, stages), (other, "stage"), AxisType.Auto)
  with jax.set_mesh(mesh), partition.axis_rules(rules, mesh=mesh):
    placed = partition.flax.init_sharded(model, jax.random.key(0), tokens, rules=rules,
                                         mesh=mesh)
    step = jax.jit(jax.value_and_grad(loss)).lower(placed, tokens, targets).compile()
    got_loss, got_grads = step(placed, tokens, targets)
    hlo = step.as_text()
  np.testing.assert_allclose(float(got_loss), want_loss, rtol=RTOL)
  flat_got = jax.tree_util.tree_leaves_with_path(partition.unbox(got_grads))
  for (path, g), w in zip(flat_got, flat_want, strict=True):
    # atol scaled by the tensor's magnitude: the pipeline and the FSDP split reorder sums
    np.testing.assert_allclose(np.asarray(g), w, rtol=RTOL, atol=RTOL * np.abs(w).max(),
                               err_msg=jax.tree_util.keystr(path))
  # the forward and the backward schedule: r m + p - 1 iterations each (m = p by default)
  assert TRIP_COUNT.findall(hlo).count(str(repeats * m + stages - 1)) == 2
  # Inside the pipeline (the shard_map) nothing is gathered over 'stage' (size 4): each
  # stage's blocks stay on it. Outside it, XLA may split the tied-embedding logits over the
  # otherwise idle stage devices; that table is not stacked and lives on every stage.
  inside = [g for g in ALL_GATHER.findall(hlo) if "shard_map" in g]
  assert all(group_size(g) != 4 for g in inside)
