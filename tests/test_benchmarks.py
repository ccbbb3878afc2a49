"""The benchmark suite's quick mode: output structure, and every pair agreeing numerically.

Timing ratios are not asserted (they depend on the machine); the collective-byte counting
(``partition.collective_stats``) is tested in tests/partition/test_hlo.py.
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
