"""The benchmark suite's quick mode: output structure, every pair agreeing numerically, and
the reported bytes measured a second way.

Timing ratios are not asserted (they depend on the machine). The collective bytes of the
data- and tensor-parallel steps are recounted from the compiled HLO text by a short parser
here (not ``partition.collective_stats``, which tests/partition/base/test_hlo.py tests) and
against hand-worked figures; the serial-loop memory is read from ``memory_analysis()`` of the
same programs, compiled again here.
"""

import json
import math
import re

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import partition
from benchmarks import collectives, common, run, serial_loop_memory

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
      assert r["unit"] in ("s", "bytes", "iterations")  # iterations: a loop trip count
      assert r["ours"] > 0 and r["baseline"] > 0, r
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


BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f64": 8, "pred": 1}
COLLECTIVES = ("all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def _group_size(line: str) -> int:
  """The devices in one replica group of an HLO collective, in any of XLA's three spellings:
  ``mesh['a'=2,'b'=4] {'b'}``, ``[groups,size]<=[...]`` or ``{{0,1,...},...}``."""
  if m := re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line):
    sizes = {k: int(v) for k, v in re.findall(r"'(\w+)'=(\d+)", m.group(1))}
    return math.prod(sizes[k] for k in re.findall(r"'(\w+)'", m.group(2)))
  if m := re.search(r"replica_groups=\[\d+,(\d+)\]<=", line):
    return int(m.group(1))
  m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
  return len(m.group(1).split(","))


def _all_reduce_bytes(hlo: str) -> tuple[int, float]:
  """(count, bytes one device sends) of the all-reduces in ``hlo``, ring algorithm:
  ``2 S (n-1)/n`` for ``S`` bytes reduced over ``n`` devices."""
  count, sent = 0, 0.0
  for line in hlo.splitlines():
    if not (m := re.search(r"= (.*?) all-reduce(?:-start)?\(", line)):
      continue
    size = sum(BYTES[t] * math.prod(int(d) for d in dims.split(",") if d)
               for t, dims in re.findall(r"(\w+)\[([\d,]*)\]", m.group(1)))
    n = _group_size(line)
    count, sent = count + 1, sent + 2 * size * (n - 1) / n
  return count, sent


@pytest.mark.parametrize("strategy", ["DP", "TP"])
def test_collective_bytes_recounted_from_the_hlo(quick_run, strategy):
  _, data = quick_run
  section = {s["name"]: s for s in data["sections"]}["collectives"]
  reported = section["series"]["collective_bytes"][strategy]
  mesh, ours, _, args, _, _ = collectives.strategy_programs(strategy, quick=True)
  with jax.set_mesh(mesh):
    hlo = ours.lower(*args).compile().as_text()
  assert not [op for op in COLLECTIVES if f" {op}(" in hlo or f" {op}-start(" in hlo]
  count, sent = _all_reduce_bytes(hlo)
  assert reported["ops_ours"] == {"all-reduce": count}
  assert reported["ours"] == pytest.approx(sent)
  # by hand, quick sizes B = D = 32, H = 64, two blocks, 8 devices, f32:
  # DP reduces every gradient (2 blocks x 2 x 32 x 64) and the loss; TP the [B, D]
  # activations three times (two forward, one backward: the first block's input needs none)
  want = {"DP": 2 * (2 * 2 * 32 * 64 + 1) * 4 * 7 / 8, "TP": 3 * 2 * 32 * 32 * 4 * 7 / 8}
  assert sent == pytest.approx(want[strategy])
  row, = [r for r in section["rows"] if r["workload"].startswith(f"{strategy} ")
          and r["baseline_label"] == "analytic minimum"]
  assert row["ours"] == pytest.approx(sent) and row["baseline"] == pytest.approx(want[strategy])
  assert row["ratio"] == pytest.approx(1.0)


def test_serial_loop_memory_read_again_from_memory_analysis(quick_run):
  _, data = quick_run
  section = {s["name"]: s for s in data["sections"]}["serial_loop_memory"]
  series = section["series"]["memory_vs_k"]
  n, d, f = series["n"], series["d"], serial_loop_memory.f
  xs = jax.ShapeDtypeStruct((n, d), jnp.float32)

  def temp(program):
    return program.lower(xs).compile().memory_analysis().temp_size_in_bytes

  vector = temp(jax.jit(jax.vmap(f)))
  for i, k in enumerate(series["k"]):
    loop = temp(partition.xmap(f, ["b", ...], ["b", ...],
                               axis_resources={"b": partition.SerialLoop(k)}))
    floor = temp(jax.jit(lambda xs, k=k: lax.map(f, xs, batch_size=n // k)))
    assert (series["serial_loop"][i], series["lax_map"][i]) == (loop, floor), k
    assert series["vmap_over_k"][i] == pytest.approx(vector / k)
    rows = [r for r in section["rows"] if r["workload"] == f"N={n} D={d} k={k}"]
    assert [(r["ours"], r["baseline"]) for r in rows] == [(loop, floor), (loop, vector)]
    assert [r["ratio"] for r in rows] == pytest.approx([loop / floor, loop / vector])


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


def test_papers_section_reduces_data_parallel_gradients_once(quick_run):
  _, data = quick_run
  series = {s["name"]: s for s in data["sections"]}["papers"]["series"]["papers"]
  assert set(series) == {"tensor_parallel", "data_parallel k=4"}
  dp = series["data_parallel k=4"]
  assert dp["collectives_ours"]["all-reduce"]["data"]["count"] == 1
  assert dp["collectives_hand_written"]["all-reduce"]["data"]["count"] == 4  # per micro-batch
  assert dp["argument_bytes"] == dp["argument_analytic"]


def test_papers_formulas_by_hand():
  import numpy as np

  import layers
  from benchmarks import papers

  cfg = layers.TransformerConfig(vocab_size=16, embed_dim=8, mlp_dim=16, num_heads=2,
                                 num_kv_heads=1, head_dim=4, num_layers=2, num_experts=4,
                                 experts_per_token=2)
  # Megatron: (4 L + 2) all-reduces of [16 tokens, 8] floats over 2 devices
  assert papers.megatron_bytes(cfg, 16, 2) == (4 * 2 + 2) * 2 * 16 * 8 * 4 / 2
  # K and V of 32 tokens, 1 kv head of 4: gathered and reduce-scattered over 4, per layer
  assert papers.sequence_bytes(cfg, 32, 4) == 2 * 2 * 2 * (32 * 4 * 4) * 3 / 4
  # 2 rows x 4 experts x capacity ceil(1.25 * 8 * 2 / 4) = 5 slots x 8, 4 all-to-alls a layer
  assert papers.expert_bytes(cfg, 2, 8, 4) == 2 * 4 * (2 * 4 * 5 * 8 * 4) * 3 / 4
  mesh = common.auto_mesh((2, 4), ("data", "fsdp"))
  rules = partition.AxisRules([("batch", ("data", "fsdp")), ("embed", "fsdp")])
  params = {"w": np.zeros((8, 4), np.float32), "b": np.zeros((4,), np.float32)}
  axes = {"w": ("embed", "mlp"), "b": ("mlp",)}
  w, b = 8 * 4 * 4, 4 * 4
  # w (FSDP over 4): gather 3/4 w, reduce-scatter 3/4 w (k times), all-reduce w/4 over data;
  # b replicated: one all-reduce over all 8 devices, whatever k
  for k in (1, 4):
    want = w * 3 / 4 + k * (w * 3 / 4 + 2 * (w / 4) / 2) + 2 * b * 7 / 8
    assert papers.zero_bytes(axes, params, rules, mesh, ("data", "fsdp"), k) == \
        pytest.approx(want)


def test_merge_keeps_the_other_sections(tmp_path):
  from benchmarks import report

  path = tmp_path / "results.json"
  path.write_text(json.dumps({"meta": {"quick": False}, "sections": [
      {"name": "a", "rows": [1]}, {"name": "b", "rows": [2]}]}))
  new = {"meta": {"quick": True}, "sections": [{"name": "b", "rows": [3]},
                                               {"name": "c", "rows": [4]}]}
  out = report.merged(path, new, ["a", "b", "c"])
  assert [s["rows"] for s in out["sections"]] == [[1], [3], [4]]
  assert out["meta"]["quick"] is False and out["meta"]["last_run"]["sections"] == ["b", "c"]
