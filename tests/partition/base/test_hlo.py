"""``partition.collective_stats``: collectives of compiled programs, per kind and mesh axis.

References are independent: programs whose collectives are fixed by construction
(``shard_map`` with one ``psum`` / ``all_gather`` / ``psum_scatter`` / ``all_to_all`` /
``ppermute``), and hand-written HLO lines whose byte counts follow from the ring formulas.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from mesh_testlib import make_mesh

import partition
from partition._base.hlo import HloParseError

AUTO = jax.sharding.AxisType.Auto


def _shard_map(f, mesh, in_spec, out_spec, x):
  g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_spec, out_specs=out_spec,
                                check_vma=False))
  return g.lower(x).compile()


@pytest.mark.parametrize("axes", [("a",), ("b",), ("a", "b")])
def test_psum_is_one_all_reduce_over_its_axes(axes):
  mesh = make_mesh((4, 2), ("a", "b"), AUTO)
  x = jnp.ones((8, 16), jnp.float32)  # per device [2, 8] under P('a', 'b')
  stats = partition.collective_stats(
      _shard_map(lambda v: jax.lax.psum(v, axes), mesh, P("a", "b"), P("a", "b"), x), mesh)
  n = int(np.prod([mesh.shape[a] for a in axes]))
  assert stats.count() == 1 and stats.count("all-reduce", axes) == 1
  assert stats.bytes("all-reduce", axes) == pytest.approx(2 * (2 * 8 * 4) * (n - 1) / n)


def test_all_gather_and_psum_scatter_bytes():
  mesh = make_mesh((4, 2), ("a", "b"), AUTO)
  x = jnp.ones((16, 8), jnp.float32)
  gathered = partition.collective_stats(_shard_map(
      lambda v: jax.lax.all_gather(v, "a", tiled=True), mesh, P("a"), P(), x), mesh)
  assert gathered.count("all-gather", "a") == 1
  assert gathered.bytes("all-gather") == pytest.approx(16 * 8 * 4 * 3 / 4)  # S = gathered
  scattered = partition.collective_stats(_shard_map(
      lambda v: jax.lax.psum_scatter(v, "a", tiled=True), mesh, P(), P("a"), x), mesh)
  assert scattered.count("reduce-scatter", "a") == 1
  assert scattered.bytes("reduce-scatter") == pytest.approx(16 * 8 * 4 * 3 / 4)  # S = full


def test_all_to_all_and_ppermute():
  mesh = make_mesh((4, 2), ("a", "b"), AUTO)
  x = jnp.ones((16, 8), jnp.float32)  # per device [4, 8] under P('a')
  a2a = partition.collective_stats(_shard_map(
      lambda v: jax.lax.all_to_all(v, "a", 0, 1, tiled=True), mesh, P("a"), P("a"), x), mesh)
  assert a2a.count("all-to-all", "a") == 1
  assert a2a.bytes("all-to-all") == pytest.approx(4 * 8 * 4 * 3 / 4)
  perm = [(i, (i + 1) % 2) for i in range(2)]
  shifted = partition.collective_stats(_shard_map(
      lambda v: jax.lax.ppermute(v, "b", perm), mesh, P("a"), P("a"), x), mesh)
  assert shifted.count("collective-permute", "b") == 1
  assert shifted.bytes("collective-permute") == 4 * 8 * 4


def test_device_ids_are_positions_in_the_mesh():
  """A mesh over the devices in reverse order: groups still map to the named axis."""
  mesh = make_mesh((4, 2), ("a", "b"), AUTO, devices=jax.devices()[::-1])
  x = jnp.ones((8, 16), jnp.float32)
  for axis in ("a", "b"):
    stats = partition.collective_stats(
        _shard_map(lambda v: jax.lax.psum(v, axis), mesh, P("a", "b"), P("a", "b"), x),  # noqa: B023
        mesh)
    assert stats.count("all-reduce", axis) == 1, stats


def test_cpu_all_reduce_plus_dynamic_slice_is_a_reduce_scatter():
  """jit's FSDP gradient: XLA:CPU all-reduces the full gradient and slices each shard."""
  mesh = make_mesh((4, 2), ("a", "b"), AUTO)
  w_s, x_s = NamedSharding(mesh, P("a", None)), NamedSharding(mesh, P("a", None))
  loss = lambda w, x: jnp.mean(jnp.tanh(x @ w) ** 2)
  compiled = jax.jit(jax.grad(loss), in_shardings=(w_s, x_s), out_shardings=w_s).lower(
      jnp.ones((16, 8)), jnp.ones((32, 16))).compile()
  stats = partition.collective_stats(compiled, mesh)
  full = 16 * 8 * 4
  assert stats.count("all-reduce") == 0
  (rs,) = stats.select("reduce-scatter", "a")
  if "reduce-scatter(" not in compiled.as_text():  # XLA:CPU's spelling
    assert rs.lowered_as == "all-reduce + dynamic-slice"
  assert rs.bytes == pytest.approx(full * 3 / 4)
  assert stats.count("all-gather", "a") == 1


def test_all_reduce_used_whole_stays_an_all_reduce():
  text = "\n".join([
      "ENTRY %main (p: f32[8]) -> f32[4] {",
      "  %p = f32[8]{0} parameter(0)",
      "  %ar = f32[8]{0} all-reduce(%p), replica_groups=[1,8]<=[8], to_apply=%add",
      "  %ds = f32[1]{0} dynamic-slice(%ar, %i), dynamic_slice_sizes={1}",
      "  ROOT %t = (f32[8]{0}, f32[1]{0}) tuple(%ar, %ds)",
      "}"])
  stats = partition.collective_stats(text)
  assert stats.count("all-reduce") == 1 and stats.count("reduce-scatter") == 0
  assert stats.bytes() == pytest.approx(2 * 32 * 7 / 8)


def test_tuple_all_reduce_splits_its_sliced_operand():
  text = "\n".join([
      "ENTRY %main (a: f32[16], b: f32[8]) -> f32[2] {",
      "  %ar = (f32[16]{0}, f32[8]{0}) all-reduce(%a, %b), replica_groups=[1,8]<=[8]",
      "  %g0 = f32[16]{0} get-tuple-element(%ar), index=0",
      "  %g1 = f32[8]{0} get-tuple-element(%ar), index=1",
      "  %s0 = f32[2]{0} dynamic-slice(%g0, %i), dynamic_slice_sizes={2}",
      "  ROOT %r = (f32[2]{0}, f32[8]{0}) tuple(%s0, %g1)",
      "}"])
  stats = partition.collective_stats(text)
  assert stats.bytes("reduce-scatter") == pytest.approx(64 * 7 / 8)
  assert stats.bytes("all-reduce") == pytest.approx(2 * 32 * 7 / 8)


@pytest.mark.parametrize("groups, axes", [
    ("replica_groups={{0,2,4,6},{1,3,5,7}}", ("a",)),
    ("replica_groups={{0,1},{2,3},{4,5},{6,7}}", ("b",)),
    ("replica_groups=[2,4]<=[4,2]T(1,0)", ("a",)),
    ("replica_groups=[4,2]<=[8]", ("b",)),
    ("replica_groups=[1,8]<=[8]", ("a", "b")),
    ("replica_groups={}", ("a", "b")),
    ("replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=2] {'axis_1'}", ("a",)),
    ("replica_groups=mesh['x'=4,'y'=2] {'x','y'}", ("a", "b")),
    # device order [4,2]T(1,0): position (i, j) of the 2 x 4 mesh holds device 2 j + i
    ("replica_groups=mesh['x'=2,'y'=1,'z'=4], device_ids=([4,2]T(1,0)) {'z'}", ("a",)),
    ("replica_groups=mesh['x'=2,'y'=1,'z'=4], device_ids=([4,2]T(1,0)) {'x'}", ("b",)),
    ("replica_groups=mesh['x'=2,'y'=4], device_ids=(0,2,4,6,1,3,5,7) {'x'}", ("b",)),
    ("replica_groups={{0,1,2,3},{4,5,6,7}}", None),  # half of 'a' x 'b': no product of axes
])
def test_replica_group_forms_map_to_mesh_axes(groups, axes):
  text = f"%x = f32[8]{{0}} all-reduce(%y), {groups}, to_apply=%add"
  (op,) = partition.collective_stats(text, make_mesh((4, 2), ("a", "b"), AUTO)).ops
  assert op.axes == axes
  assert op.group_size == {("a",): 4, ("b",): 2, None: 4}.get(axes, 8)


def test_ops_in_a_loop_count_once_per_iteration():
  mesh = make_mesh((8,), ("d",), AUTO)

  def f(x):  # each of 4 steps all-reduces a [4] partial sum
    def step(acc, i):
      part = jax.lax.with_sharding_constraint((x * i).sum(0), NamedSharding(mesh, P()))
      return acc + part, None
    return jax.lax.scan(step, jnp.zeros(4), jnp.arange(4.0))[0]

  compiled = jax.jit(f, in_shardings=NamedSharding(mesh, P("d")),
                     out_shardings=NamedSharding(mesh, P())).lower(jnp.ones((8, 4))).compile()
  stats = partition.collective_stats(compiled, mesh)
  assert stats.count("all-reduce", "d") == 4
  assert stats.bytes("all-reduce") == pytest.approx(4 * 2 * 16 * 7 / 8)


def test_async_starts_count_their_result_once():
  text = "\n".join([
      "%ags = (f32[4,8]{1,0}, f32[32,8]{1,0}) all-gather-start(%p), replica_groups=[1,8]<=[8]",
      "%agd = f32[32,8]{1,0} all-gather-done(%ags)",
      "%ars = f32[16]{0} all-reduce-start(%q), replica_groups=[1,8]<=[8], to_apply=%add",
      "%ard = f32[16]{0} all-reduce-done(%ars)",
      "%cps = (f32[4]{0}, f32[4]{0}, u32[], u32[]) collective-permute-start(%r), "
      "source_target_pairs={{0,1},{1,0}}",
  ])
  stats = partition.collective_stats(text)
  assert stats.count() == 3
  assert stats.bytes("all-gather") == pytest.approx(32 * 8 * 4 * 7 / 8)
  assert stats.bytes("all-reduce") == pytest.approx(2 * 64 * 7 / 8)
  assert stats.bytes("collective-permute") == 16


def test_table_and_dict_views_agree():
  text = "\n".join([
      "%a = f32[8]{0} all-reduce(%y), replica_groups={{0,2,4,6},{1,3,5,7}}",
      "%b = bf16[8]{0} all-reduce(%z), replica_groups={{0,2,4,6},{1,3,5,7}}",
  ])
  stats = partition.collective_stats(text, make_mesh((4, 2), ("a", "b"), AUTO))
  assert stats.table() == {("all-reduce", ("a",)): {"count": 2,
                                                    "bytes": pytest.approx(2 * 48 * 3 / 4)}}
  assert stats.as_dict()["all-reduce"]["a"]["count"] == 2
  assert "all-reduce over ('a',)" in repr(stats)


def test_bad_inputs_have_clear_errors():
  with pytest.raises(HloParseError, match="cannot read the replica groups of %x"):
    partition.collective_stats("%x = f32[8]{0} all-reduce(%y), replica_groups=weird")
  with pytest.raises(ValueError, match="unknown kind 'allreduce'"):
    partition.collective_stats("").count("allreduce")
