"""``python -m recipes.plan``: roofline terms against hand-computed figures for one layer, the
Scaling Book's critical batch sizes on either side of each threshold, CLI errors, and (slow)
the compiled figures a search reports against numbers worked out on paper for a tiny model
(data parallel at N = 8 in this process and N = 16 in a subprocess) and against the compile
of a real run of the same plan, and the written config training.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from plan_testlib import TINY, plan_config, run_plan

import layers
import partition
from recipes import chips, plan, plan_model, roofline, train
from recipes.config import load_config

REPO = Path(__file__).resolve().parents[2]


def _rules(preset):
  from recipes.config import preset_path
  return partition.AxisRules.from_file(preset_path(preset))


# -- roofline terms, by hand -----------------------------------------------------------------


def test_wire_bytes_are_the_ring_formulas():
  assert roofline.wire_bytes("all-reduce", 1000, 4) == 2 * 1000 * 3 / 4
  assert roofline.wire_bytes("all-gather", 1000, 4) == 1000 * 3 / 4
  assert roofline.wire_bytes("reduce-scatter", 1000, 4) == 1000 * 3 / 4
  assert roofline.wire_bytes("all-reduce", 1000, 1) == 0.0


def _mlp_layer(d, f, itemsize=2):
  """One MLP layer W_in[D, F], W_out[F, D] (the Scaling Book's model of a layer)."""
  return [plan_model.ParamShape("w_in", (d, f), itemsize, ("embed", "mlp")),
          plan_model.ParamShape("w_out", (f, d), itemsize, ("mlp", "embed"))]


def _mlp_model(d, f):
  # one head of size 2 and seq_len 2: attention FLOPs (4 s H d_head per token) are 16 per
  # token, against 4 D F for the matmuls.
  return layers.TransformerConfig(vocab_size=16, embed_dim=d, mlp_dim=f, num_heads=1,
                                  num_kv_heads=1, head_dim=2, num_layers=1, max_len=2,
                                  dtype="bfloat16", param_dtype="bfloat16")


def test_one_layer_data_parallel_terms_by_hand():
  d, f, n, tokens = 1024, 4096, 16, 16 * 4096
  chip = chips.get_chip("v5p")
  est = plan_model.estimate(_mlp_layer(d, f), _mlp_model(d, f), _rules("data_parallel"),
                            {"data": n}, batch=tokens // 2, seq_len=2, microbatches=1,
                            remat="none", chip=chip)
  # FLOPs per device: forward 2 * (2 D F) per token + attention 4 * s * H * d_head = 16.
  fwd = (2 * 2 * d * f + 16) * tokens / n
  assert est.flops == {"forward": fwd, "backward": 2 * fwd}
  # gradients (bf16, 2 D F elements) all-reduced once over 'data', in the backward
  grad = 2 * d * f * 2
  assert est.comm_phase == {"forward": {}, "backward": {"data": 2 * grad * (n - 1) / n}}
  # one axis of a 3-D torus used by one mesh axis: all three links (book: n_axes = 3)
  assert est.comm_s["backward"]["data"] == pytest.approx(2 * grad * (n - 1) / n / (3 * 1.8e11))
  # state: params + two Adam moments + gradients, all replicated
  assert est.memory["params"] == grad and est.memory["optimizer"] == 2 * grad
  t = roofline.step_time(flops=est.flops, hbm_bytes={"forward": 0, "backward": 0},
                         comm_s=est.comm_s, chip=chip, model_flops=est.model_flops, devices=n)
  assert t.compute_s["backward"] == pytest.approx(2 * fwd / 4.59e14)
  assert t.step_s == pytest.approx(fwd / 4.59e14 + max(2 * fwd / 4.59e14,
                                                       est.comm_s["backward"]["data"]))
  assert t.mfu == pytest.approx(3 * fwd * n / (n * 4.59e14 * t.step_s))


def test_one_layer_fsdp_and_tensor_terms_by_hand():
  d, f, tokens = 512, 2048, 4 * 1024
  chip = chips.get_chip("v5e")
  mesh = {"data": 1, "fsdp": 4, "tensor": 2}
  est = plan_model.estimate(_mlp_layer(d, f), _mlp_model(d, f), _rules("fsdp_tp"), mesh,
                            batch=tokens // 2, seq_len=2, microbatches=2, remat="none",
                            chip=chip)
  shard = 2 * d * f * 2 / 2          # a weight's bf16 bytes on one tensor shard, gathered
  gather = shard * 3 / 4             # both weights, ring all-gather over fsdp=4
  per_device_tokens = tokens / 4 / 2  # batch over fsdp, 2 micro-batches
  tp = 2 * (per_device_tokens * d * 2) * 1 / 2   # all-reduce [T, D] bf16 over tensor=2
  assert est.comm_phase["forward"] == pytest.approx({"fsdp": gather, "tensor": 2 * tp * 2})
  assert est.comm_phase["backward"] == pytest.approx(
      {"fsdp": gather + 2 * gather, "tensor": 2 * tp * 2})   # gather + 2 reduce-scatters
  # v5e is a 2-D torus: fsdp (the larger axis) and tensor get one link each
  links = roofline.axis_links(mesh, chip)
  assert links["fsdp"].bandwidth == links["tensor"].bandwidth == 9e10
  assert est.memory["params"] == 2 * d * f * 2 / 8


@pytest.mark.parametrize("chip_name,preset,mesh_axes,critical", [
    ("v5p", "data_parallel", ("data",), 4.59e14 / (3 * 1.8e11)),   # DP over a 3-D pod: ~850
    ("v5p", "fsdp", ("data", "fsdp"), 4.59e14 / (3 * 1.8e11)),      # FSDP, 3 axes: ~850
    ("v5e", "data_parallel", ("data",), 1.97e14 / (2 * 9e10)),      # 2-D torus
])
def test_communication_bound_either_side_of_the_scaling_book_threshold(
    chip_name, preset, mesh_axes, critical):
  """Below C / (n_axes W_ici) tokens per chip DP and FSDP are communication-bound, above it
  compute-bound (large D, F so the (n-1)/n and attention terms are negligible)."""
  d, f, n = 8192, 32768, 256
  chip = chips.get_chip(chip_name)
  mesh = dict.fromkeys(mesh_axes, 1)
  mesh[mesh_axes[-1]] = n
  for factor, bound in ((0.85, "communication"), (1.15, "compute")):
    tokens = 2 * int(critical * factor / 2) * n   # whole rows of seq_len 2 per chip
    est = plan_model.estimate(_mlp_layer(d, f), _mlp_model(d, f), _rules(preset), mesh,
                              batch=tokens // 2, seq_len=2, microbatches=1, remat="none",
                              chip=chip)
    t = roofline.step_time(flops=est.flops, hbm_bytes={"forward": 0, "backward": 0},
                           comm_s=est.comm_s, chip=chip, model_flops=est.model_flops,
                           devices=n)
    assert t.bound == bound, (factor, t)
    if bound == "communication":
      assert t.bound_axes == mesh_axes[-1]


def test_one_axis_data_parallel_critical_batch_is_2550_on_v5p():
  chip = chips.get_chip("v5p")
  assert chip.bf16_flops / chip.ici_bandwidth == pytest.approx(2550, rel=1e-3)


def test_dcn_axis_and_hierarchical_collective():
  chip = chips.get_chip("v5p")
  mesh = {"data": 2, "fsdp": 8}
  links = roofline.axis_links(mesh, chip, hosts=2)
  assert links["data"].dcn and links["data"].bandwidth == 2.5e10 / 4
  t = roofline.collective_seconds(("data", "fsdp"), "all-reduce", 1600, mesh, links)
  assert t == pytest.approx(2 * 1600 * 7 / 8 / (3 * 1.8e11) + 2 * 200 * 1 / 2 / (2.5e10 / 4))


def test_an_axis_across_hosts_and_inside_them_is_hierarchical():
  """MaxText's dcn_fsdp=2 x ici_fsdp=64: one fsdp axis of 128 over two slices costs what a
  DCN axis of 2 and an ICI axis of 64 cost (it was priced all at DCN speed: this gather 40x
  too slow, MaxText's 405B step on v6e 7.4x)."""
  chip = chips.get_chip("v6e")
  hybrid = {"data": 1, "fsdp": 128, "tensor": 4}
  split = {"dcn": 2, "fsdp": 64, "tensor": 4}
  links = roofline.axis_links(hybrid, chip, hosts=2)
  split_links = roofline.axis_links(split, chip, hosts=2)
  assert links["fsdp"].dcn and links["fsdp"].hosts == 2
  assert not links["tensor"].dcn and not split_links["fsdp"].dcn
  for kind in ("all-gather", "reduce-scatter", "all-reduce"):
    assert roofline.collective_seconds(("fsdp",), kind, 1e9, hybrid, links) == pytest.approx(
        roofline.collective_seconds(("dcn", "fsdp"), kind, 1e9, split, split_links))
  # by hand: 63/64 of 1 GB over 1 ICI link, then 1/64 of it halved over DCN
  t = roofline.collective_seconds(("fsdp",), "all-gather", 1e9, hybrid, links)
  assert t == pytest.approx(1e9 * 63 / 64 / 1.8e11 + 1e9 / 64 / 2 / (2.5e10 / 8))
  # measured ring bytes of the same gather give the same seconds
  wire = roofline.wire_bytes("all-gather", 1e9, 128)
  assert roofline.wire_seconds(("fsdp",), wire, hybrid, links) == pytest.approx(t)


def test_compiled_ring_bytes_over_ici_and_dcn_axes_are_priced_hierarchically():
  """A compile's bytes per axis group (no array size kept) cost what the analytic collective
  that sends them costs: ICI first, 1/n_ICI over the DCN (they were all at DCN speed)."""
  chip = chips.get_chip("v5p")
  mesh = {"data": 2, "fsdp": 4}
  links = roofline.axis_links(mesh, chip, hosts=2)
  # by hand: 3/4 of 1 GB over fsdp's 3 ICI links, then 1/2 of its 1/4 GB over DCN (twice
  # both for an all-reduce); the ring bytes a compile reports are 7/8 of that (x 2)
  gather = 1e9 * 3 / 4 / (3 * 1.8e11) + 0.25e9 / 2 / (2.5e10 / 4)
  for kind, want in (("all-reduce", 2 * gather), ("all-gather", gather)):
    wire = roofline.wire_bytes(kind, 1e9, 8)
    got = roofline.wire_seconds(("data", "fsdp"), wire, mesh, links)
    assert got == pytest.approx(want), kind
  # by hand, the all-reduce: 2 x 3/4 of 1 GB over fsdp's 3 links, 2 x 1/2 of 1/4 GB over DCN
  t = roofline.collective_seconds(("data", "fsdp"), "all-reduce", 1e9, mesh, links)
  assert t == pytest.approx(2 * 1e9 * 3 / 4 / (3 * 1.8e11) + 2 * 0.25e9 / 2 / (2.5e10 / 4))


# -- candidates and CLI errors ---------------------------------------------------------------


def test_factorisations_and_distinct_candidates():
  assert sorted(plan.factorisations(8, 3)) == sorted(
      t for t in __import__("itertools").product([1, 2, 4, 8], repeat=3) if math.prod(t) == 8)
  cfg = plan_config()
  params = plan.model_params(cfg)
  cands, _ = plan.candidates(cfg, params, ["data_parallel", "fsdp"], 8, ["none"], 1)
  # fsdp with fsdp=1 is data parallelism: kept once
  assert [c.mesh for c in cands].count((("data", 8),)) == 1
  assert (("data", 8), ("fsdp", 1)) not in [c.mesh for c in cands]


def test_unknown_chip_exits_2_with_did_you_mean(tmp_path):
  code, _, err = run_plan("--devices", "8", "--chip", "tpu-v5x", "--out", str(tmp_path / "b.yaml"))
  assert code == 2
  assert "--chip 'tpu-v5x' is not in the chip table (did you mean 'tpu-v5" in err
  assert "tpu-v5p" in err


def test_devices_that_do_not_factor_the_batch_exit_2(tmp_path):
  code, _, err = run_plan("--devices", "7", "--chip", "v5e", "--preset", "fsdp", "--compile", "0",
                      "--out", str(tmp_path / "b.yaml"), *TINY)
  assert code == 2
  assert "no plan for 7 devices: preset fsdp: no factorisation of 7 over its mesh axes " \
         "('data', 'fsdp') splits batch_size=16" in err


def test_unknown_preset_exits_2(tmp_path):
  code, _, err = run_plan("--devices", "8", "--chip", "v5e", "--preset", "fdsp", "--compile", "0",
                      "--out", str(tmp_path / "b.yaml"), *TINY)
  assert code == 2 and "(did you mean 'fsdp'" in err


@pytest.mark.parametrize("value", ["0", "-3", "two"])
def test_max_microbatches_below_one_is_an_argparse_error(value, capsys):
  with pytest.raises(SystemExit) as e:
    plan.parse_args(["--devices", "8", "--chip", "v5e", "--max-microbatches", value])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "argument --max-microbatches" in err and "use --max-microbatches 1 or more" in err


def test_max_microbatches_has_help(capsys):
  with pytest.raises(SystemExit):
    plan.parse_args(["--help"])
  help_text = " ".join(capsys.readouterr().out.split())
  assert "the most micro-batches per step to search" in help_text


# 8.6 G parameters (a 2M-word vocabulary of width 4096): 16 bytes each of state, 17 GB per
# device even under fsdp=8, above a v5e's 16 GB
TOO_BIG = ["model.vocab_size=2097152", "model.embed_dim=4096", "model.num_layers=1"]


def test_no_plan_fits_exits_1_ranks_closest_first_and_leaves_no_stale_plan(tmp_path):
  out = tmp_path / "best.yaml"
  out.write_text("# written by python -m recipes.plan --devices 8 --chip v5e (earlier)\n"
                 "preset: fsdp\n")
  code, text, err = run_plan("--devices", "8", "--chip", "v5e", "--compile", "0", "--json",
                         "--preset", "data_parallel", "--preset", "fsdp", "--remat", "full",
                         "--top", "50", "--out", str(out), "--cache", "", "--no-plot",
                         *TINY, *TOO_BIG)
  assert code == 1
  assert "error: no plan fits 8 x tpu-v5e" in err and "--remat full" in err
  assert not out.exists()                      # the earlier run's plan is gone
  doc = json.loads(text)
  assert doc["config"] is None and not any(p["fits"] for p in doc["plans"])
  memory = [p["memory_per_device"] for p in doc["plans"]]
  assert memory == sorted(memory) and len(memory) > 2   # closest to fitting first
  assert doc["plans"][0]["preset"] == "fsdp"


def test_no_plan_fits_keeps_a_config_the_planner_did_not_write(tmp_path):
  out = tmp_path / "mine.yaml"
  out.write_text("preset: fsdp\n")
  code, _, err = run_plan("--devices", "8", "--chip", "v5e", "--compile", "0", "--preset", "fsdp",
                      "--remat", "full", "--out", str(out), "--cache", "", "--no-plot",
                      *TINY, *TOO_BIG)
  assert code == 1 and out.read_text() == "preset: fsdp\n"
  assert "is not the planner's, so it was left as it is" in " ".join(err.split())


@pytest.mark.slow
def test_analytic_search_json_and_outputs(tmp_path):
  out = tmp_path / "best.yaml"
  code, text, _ = run_plan("--devices", "8", "--chip", "h100", "--compile", "0", "--json",
                       "--top", "3", "--out", str(out), "--cache", "", *TINY)
  assert code == 0
  doc = json.loads(text)
  assert len(doc["plans"]) == 3 and doc["candidates"] > 3
  # ranked by step time to 4 significant digits (ties: the bare roofline, then memory)
  steps = [float(f"{p['step_s']:.4g}") for p in doc["plans"]]
  assert steps == sorted(steps) and all(p["fits"] for p in doc["plans"])
  assert out.exists() and out.with_suffix(".png").exists()
  best = load_config(out)
  assert best.preset == doc["plans"][0]["preset"] and best.mesh == doc["plans"][0]["mesh"]


# -- compiled figures against numbers on paper and a real run's compile (slow) ---------------

# The TINY model on paper (vocab V=16, embed D=16, mlp F=32 and L=1 from TINY; heads H=4,
# kv_heads K=2, head_dim d=16 from recipes/configs/default.yaml), in float32 parameters:
#   embedding V*D = 256; qkv D*K*(H/K + 2)*d = 2048 (each kv group: its H/K query heads, k, v);
#   attention out H*d*D = 1024; SwiGLU wi D*2*F = 1024, wo F*D = 512; three norm scales 3*D.
TINY_PARAMS = 256 + 2048 + 1024 + 1024 + 512 + 3 * 16            # = 4912
STATE_BYTES = 3 * 4 * TINY_PARAMS + 3 * 4   # params, Adam mu and nu (f32), three int32 counters
# (the step, Adam's count, the schedule's count). Under data parallelism every device holds
# all of it, and the step's one collective is the all-reduce of the f32 gradients together
# with the four f32 sums the loss and metrics take over the batch (masked cross-entropy,
# token count, correct tokens, exact matches): ring bytes 2 S (N-1)/N per device.
DP_REDUCED_BYTES = 4 * TINY_PARAMS + 4 * 4


def _batch_bytes_per_device(devices):
  # inputs and targets (int32) and the mask (float32), batch_size/N rows of seq_len 8
  return 3 * 4 * (16 // devices) * 8


def _search_one(tmp_path, devices, preset):
  cfg = plan_config()
  # attention='xla': the kernel the CPU compile runs, so its memory is the plan's figure;
  # one micro-batch: no loop in the step
  found = plan.search(cfg, devices=devices, chip=chips.get_chip("v5e"), presets=[preset],
                      remats=["none"], max_microbatches=1, compile_top=1,
                      cache=plan.Cache(tmp_path / "cache.json"), attention="xla")
  top = next(r for r in found.results if r.compiled)
  return plan.candidate_config(cfg, top.candidate), top


def real_step(cfg_path) -> dict:
  """The config's run built for real (``train.build_run``: allocated, initialised) and its
  train step compiled on its own state and first batch, as training does, on this process's
  devices. Reads ``memory_analysis()`` directly and counts the bytes of the arrays' shards on
  the first device; shares no code with the planner's abstract compile."""
  import jax

  cfg = load_config(cfg_path)
  run = train.build_run(cfg)
  batch = run.data.batch(0)
  m = run.train_step.lower(run.state, batch).compile().memory_analysis()
  first = jax.devices()[0]
  shard_bytes = lambda tree: sum(s.data.nbytes for x in jax.tree.leaves(tree)
                                 for s in x.addressable_shards if s.device == first)
  return {"argument": int(m.argument_size_in_bytes), "alias": int(m.alias_size_in_bytes),
          # every live byte of the step once: donated (aliased) arguments are also outputs
          "peak": int(m.argument_size_in_bytes + m.output_size_in_bytes
                      - m.alias_size_in_bytes + m.temp_size_in_bytes
                      + m.generated_code_size_in_bytes),
          "state_shards": shard_bytes(run.state), "batch_shards": shard_bytes(batch)}


# real_step in a process with n devices (this test file's folder is put on its path)
REAL_STEP_SCRIPT = """
import json, sys
import jax
jax.config.update('jax_num_cpu_devices', {n})
sys.path.insert(0, {folder!r})
from test_plan import real_step
print(json.dumps(real_step(sys.argv[1])))
"""


def _real_step_in_subprocess(cfg_path, n):
  script = REAL_STEP_SCRIPT.format(n=n, folder=str(Path(__file__).parent))
  out = subprocess.run([sys.executable, "-c", script, str(cfg_path)],
                       capture_output=True, text=True, cwd=REPO, timeout=600,
                       env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"})
  assert out.returncode == 0, out.stderr[-2000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


def _check_data_parallel_on_paper(top, devices):
  assert top.candidate.mesh == (("data", devices),)
  memory = top.compiled["memory"]
  assert memory["alias"] == STATE_BYTES                 # the donated state, whole on each
  assert memory["argument"] == STATE_BYTES + _batch_bytes_per_device(devices)
  ring = 2 * DP_REDUCED_BYTES * (devices - 1) / devices
  assert top.compiled["collective_bytes"] == pytest.approx({"data": ring})


@pytest.mark.slow
def test_compiled_data_parallel_plan_against_paper_at_8(tmp_path):
  cfg, top = _search_one(tmp_path, 8, "data_parallel")
  _check_data_parallel_on_paper(top, 8)
  assert top.compiled["collective_bytes"]["data"] == 34412.0   # 2 * 19664 * 7/8
  path = tmp_path / "c.yaml"
  path.write_text(plan.config_yaml(cfg))
  real = real_step(path)   # this process has 8 devices: no subprocess to start
  assert real["argument"] == top.compiled["memory"]["argument"]
  assert real["peak"] == top.memory == top.compiled["memory"]["peak"]


@pytest.mark.slow
def test_compiled_data_parallel_plan_against_paper_at_16(tmp_path):
  cfg, top = _search_one(tmp_path, 16, "data_parallel")
  _check_data_parallel_on_paper(top, 16)
  path = tmp_path / "c.yaml"
  path.write_text(plan.config_yaml(cfg))
  real = _real_step_in_subprocess(path, 16)
  assert real["peak"] == top.memory


@pytest.mark.slow
def test_compiled_fsdp_tp_plan_against_the_real_run_at_8(tmp_path):
  cfg, top = _search_one(tmp_path, 8, "fsdp_tp")
  path = tmp_path / "c.yaml"
  path.write_text(plan.config_yaml(cfg))
  real = real_step(path)
  memory = top.compiled["memory"]
  # the planner's abstract state is sharded as the real one: the same shard bytes
  assert memory["alias"] == real["state_shards"]
  assert memory["argument"] == real["state_shards"] + real["batch_shards"]
  assert memory["alias"] < STATE_BYTES                   # sharded: less than a whole copy
  assert real["peak"] == top.memory == memory["peak"]
  # traffic only over the mesh axes that have more than one device
  used = {a for a, v in top.candidate.mesh if v > 1}
  groups = top.compiled["collective_bytes"]
  assert groups and all(set(k.split(",")) <= used and v > 0 for k, v in groups.items())


@pytest.mark.slow
def test_written_config_trains_unchanged(tmp_path):
  out = tmp_path / "best.yaml"
  code, _, err = run_plan("--devices", "8", "--chip", "v5e", "--compile", "1", "--out", str(out),
                      "--cache", str(tmp_path / "cache.json"), "--preset", "fsdp_tp",
                      "--remat", "none", *TINY, "steps=2", "eval_every=1",
                      "checkpoint_every=0", "plot=false")
  assert code == 0, err
  assert train.main(["--config", str(out)]) == 0
  summary = json.loads((Path(load_config(out).out_dir) / "summary.json").read_text())
  assert summary["steps"] == 2 and summary["mesh"] == load_config(out).mesh
