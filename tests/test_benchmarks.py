"""The benchmark suite's quick mode: output structure, and every pair agreeing numerically.

Timing ratios are not asserted (they depend on the machine); the collective-byte parser is
checked against programs whose collectives are known.
"""

import json
import math

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import common, run

ROW_KEYS = {"section", "workload", "metric", "ours", "baseline", "unit", "target", "note",
            "ratio", "status", "ours_label", "baseline_label"}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
  out = tmp_path_factory.mktemp("bench")
  assert run.main(["--quick", "--out", str(out)]) == 0
  return out, json.loads((out / "results.json").read_text())


def test_every_section_ran_with_rows_and_checks(quick_run):
  _, data = quick_run
  assert [s["name"] for s in data["sections"]] == [m.NAME for m in run.SECTIONS]
  assert data["meta"]["quick"] is True and data["meta"]["devices"] == 8
  for s in data["sections"]:
    assert s["rows"], s["name"]
    assert s["checks"], s["name"]


def test_rows_are_consistent(quick_run):
  _, data = quick_run
  for s in data["sections"]:
    for r in s["rows"]:
      assert set(r) == ROW_KEYS
      assert r["unit"] in ("s", "bytes")
      assert r["ours"] > 0 and r["baseline"] > 0, r
      assert math.isclose(r["ratio"], r["ours"] / r["baseline"])
      if r["target"] is None:
        assert r["status"] == "info"
      else:
        assert r["status"] == ("PASS" if r["ratio"] <= r["target"] + 1e-9 else "MISS")


def test_every_pair_agreed(quick_run):
  _, data = quick_run
  for s in data["sections"]:
    for c in s["checks"]:
      assert c["agreed"], f"{s['name']}/{c['workload']}: max abs err {c['max_abs_err']}"
    timed = {r["workload"] for r in s["rows"] if r["unit"] == "s"}
    checked = {c["workload"] for c in s["checks"]}
    if s["name"] != "rules_resolution":  # its check is named after what it compares
      assert timed <= checked, s["name"]


def test_memory_and_collective_series(quick_run):
  _, data = quick_run
  by_name = {s["name"]: s for s in data["sections"]}
  mem = by_name["serial_loop_memory"]["series"]["memory_vs_k"]
  assert mem["k"] == [1, 2, 4, 8, 16, 32]
  assert mem["serial_loop"] == sorted(mem["serial_loop"], reverse=True)  # shrinks with k
  coll = by_name["collectives"]["series"]["collective_bytes"]
  assert set(coll) == {"DP", "FSDP", "TP", "FSDP k=4"}
  assert coll["DP"]["ops_ours"] == {"all-reduce": 1}
  assert coll["TP"]["ops_ours"] == {"all-reduce": 3}


def test_plots_are_pngs(quick_run):
  pytest.importorskip("matplotlib")
  out, _ = quick_run
  names = sorted(p.name for p in (out / "plots").iterdir())
  assert names == ["collectives.png", "ratios.png", "serial_loop_memory.png"]
  for name in names:
    assert (out / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_section_is_rejected(capsys):
  with pytest.raises(SystemExit):
    run.main(["--only", "nope"])
  assert "unknown section(s) ['nope']" in capsys.readouterr().err


# --------------------------------------------------------------------- HLO byte counting


def _compiled(f, x, in_spec, out_spec, mesh):
  return jax.jit(f, in_shardings=NamedSharding(mesh, in_spec),
                 out_shardings=NamedSharding(mesh, out_spec)).lower(x).compile()


def test_collectives_count_an_all_gather():
  mesh = common.auto_mesh((8,), ("d",))
  x = jnp.ones((64, 32), jnp.float32)
  c = common.collectives(_compiled(lambda v: v * 2, x, P("d"), P(), mesh).as_text(), 8)
  assert c["all-gather"]["count"] == 1
  assert c["all-gather"]["result_bytes"] == 64 * 32 * 4
  assert c["total"]["wire_bytes"] == pytest.approx(64 * 32 * 4 * 7 / 8)


def test_collectives_count_an_all_reduce_over_a_sub_group():
  mesh = common.auto_mesh((4, 2), ("a", "b"))
  x = jnp.ones((16, 8), jnp.float32)
  c = common.collectives(_compiled(lambda v: v.sum(0), x, P("a"), P(), mesh).as_text(), 8)
  assert c["all-reduce"]["count"] == 1
  assert c["all-reduce"]["result_bytes"] == 8 * 4
  assert c["total"]["wire_bytes"] == pytest.approx(2 * 8 * 4 * 3 / 4)  # groups of 4


@pytest.mark.parametrize("line, size", [
    ("x = f32[8] all-reduce(y), replica_groups={{0,1},{2,3},{4,5},{6,7}}", 2),
    ("x = f32[8] all-reduce(y), replica_groups=[2,4]<=[8]", 4),
    ("x = f32[8] all-reduce(y), replica_groups=mesh['a'=4,'b'=2] {'a','b'}", 8),
    ("x = f32[8] all-reduce(y), replica_groups=mesh['a'=4,'b'=2] {'b'}", 2),
    ("x = f32[8] all-reduce(y), replica_groups={}", 8),
])
def test_group_size_forms(line, size):
  assert common.group_size(line, 8) == size


def test_reduce_scatter_and_tuple_bytes():
  text = "\n".join([
      "%rs = bf16[4,8]{1,0} reduce-scatter(%p), replica_groups=[1,8]<=[8], dimensions={0}",
      "%ar = (f32[10]{0}, f32[6]{0}) all-reduce(%a, %b), replica_groups=[1,2]<=[2]",
  ])
  c = common.collectives(text, 8)
  assert c["reduce-scatter"]["result_bytes"] == 4 * 8 * 2
  assert c["reduce-scatter"]["wire_bytes"] == pytest.approx(4 * 8 * 2 * 8 * 7 / 8)
  assert c["all-reduce"]["result_bytes"] == 16 * 4
  assert c["all-reduce"]["wire_bytes"] == pytest.approx(2 * 16 * 4 * 1 / 2)


def test_compact_table_for_the_readme(quick_run):
  from benchmarks import report

  _, data = quick_run
  table = report.compact_markdown(data).splitlines()
  targeted = [r for s in data["sections"] for r in s["rows"] if r["target"] is not None]
  memory_rows = [r for r in targeted if r["section"] == "serial_loop_memory"]
  assert len(table) == 2 + len(targeted) - len(memory_rows) + 2  # memory folded to 2 rows
  assert all(line.count("|") == 8 for line in table)
  statuses = [line.split("|")[6].strip() for line in table[2:]]
  assert set(statuses) <= {"PASS", "MISS"}


def test_async_collectives_count_once_with_their_result():
  """GPU HLO: ``*-start`` ops (gathers return (operand, result)), ``*-done`` not counted."""
  text = "\n".join([
      "%ags = (f32[4,8]{1,0}, f32[32,8]{1,0}) all-gather-start(%p), replica_groups=[1,8]<=[8]",
      "%agd = f32[32,8]{1,0} all-gather-done(%ags)",
      "%ars = f32[16]{0} all-reduce-start(%q), replica_groups=[1,8]<=[8], to_apply=%add",
      "%ard = f32[16]{0} all-reduce-done(%ars)",
  ])
  c = common.collectives(text, 8)
  assert c["all-gather"] == {"count": 1, "result_bytes": 32 * 8 * 4, "in_loops": 0,
                             "wire_bytes": pytest.approx(32 * 8 * 4 * 7 / 8)}
  assert c["all-reduce"]["count"] == 1 and c["all-reduce"]["result_bytes"] == 16 * 4


def test_collectives_in_a_loop_count_per_iteration():
  """A psum inside a 4-step lax.scan runs 4 times per call (known_trip_count)."""
  mesh = common.auto_mesh((8,), ("d",))

  def f(x):  # x: [8, 4] sharded on rows; each step all-reduces a [4] partial sum
    def step(acc, i):
      return acc + jax.lax.with_sharding_constraint((x * i).sum(0), NamedSharding(mesh, P())), None
    return jax.lax.scan(step, jnp.zeros(4), jnp.arange(4.0))[0]

  text = _compiled(f, jnp.ones((8, 4)), P("d"), P(), mesh).as_text()
  c = common.collectives(text, 8)
  assert c["all-reduce"]["count"] == 4 and c["all-reduce"]["in_loops"] == 1
  assert c["all-reduce"]["result_bytes"] == 4 * 4 * 4
