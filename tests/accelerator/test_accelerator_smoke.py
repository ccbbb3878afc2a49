"""On the machine's GPU / TPU: the self-check, the default job, and a preset's steps against
the same steps on the CPU (see conftest.py for how these run and when they are skipped)."""

import json

import numpy as np
import pytest

# The README's default job, cut to three steps for the comparisons.
STEPS = ["steps=3", "eval_every=3", "eval_batches=1", "checkpoint_every=0", "plot=false",
         "log_every=1"]
# The model's longest chain of matmuls from the tokens to the loss: per block the fused QKV
# projection, the attention scores, their product with V, the output projection, the fused
# gate/up projection and the down projection (6), two blocks, then the tied logits: 13. Each
# adds at most 2 u of relative error (both inputs rounded to the backend's matmul precision),
# so a loss or gradient norm moves by at most about 26 u: 32 u is the tolerance, and the
# float32 summation-order differences between two meshes (1e-4) its floor.
CHAIN = 16


def _ok(proc):
  assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
  return proc


def _metrics(out_dir):
  return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def test_selfcheck_passes(accelerator):
  proc = _ok(accelerator.run("-m", "partition", timeout=300))
  count = 8 if accelerator.backend == "cpu" else accelerator.count  # the CPU gets 8 virtual
  assert f"backend          {accelerator.backend}" in proc.stdout
  assert f"devices          {count} x {accelerator.kind}" in proc.stdout
  assert "[ok] forward over mesh (data, model)" in proc.stdout
  assert "[ok] Mean over ('data', SerialLoop(4))" in proc.stdout
  assert "all checks passed" in proc.stdout


def _devices_note(proc):
  """The run's line saying which devices it uses (a backend may log before it)."""
  lines = [line for line in proc.stderr.splitlines() if line.startswith("devices: ")]
  assert len(lines) == 1, proc.stderr[-3000:]
  return lines[0]


def _devices_line(accelerator, count):
  if accelerator.backend == "cpu":
    return f"{count} virtual CPU devices: JAX_PLATFORMS=cpu"
  return f"{count} x {accelerator.kind} ({accelerator.backend}): the {accelerator.backend} " \
         "devices present"


def test_default_job_with_mesh_auto_trains_on_the_local_devices(accelerator, tmp_path):
  # The README's command plus mesh=auto: the preset's axes, every device on 'data'.
  out = tmp_path / "auto"
  proc = _ok(accelerator.run("-m", "recipes.train", "mesh=auto", f"out_dir={out}", "plot=false",
                             timeout=600))
  count = 8 if accelerator.backend == "cpu" else accelerator.count
  assert _devices_note(proc) == (f"devices: {_devices_line(accelerator, count)}; "
                                 f"data=-1 fills them: data={count}")
  summary = json.loads((out / "summary.json").read_text())
  assert summary["mesh"] == {"data": count, "fsdp": 1, "tensor": 1}
  assert summary["accuracy"] >= 0.95  # the README's claim for the default recipe
  # fsdp = tensor = 1: every device holds every parameter and both Adam moments of each.
  assert summary["param_bytes_per_device"] == summary["param_bytes_total"] > 0
  assert summary["optimizer_bytes_per_device"] >= 2 * summary["param_bytes_total"]


def test_default_job_as_printed_says_where_it_runs_and_counts_bytes_there(accelerator,
                                                                          tmp_path):
  # `python -m recipes.train` unchanged: a (2, 2, 2) mesh. With fewer than 8 accelerators it
  # runs on 8 virtual CPU devices and says so; the per-device figures are those devices'.
  out = tmp_path / "default"
  proc = _ok(accelerator.run("-m", "recipes.train", *STEPS, f"out_dir={out}", timeout=600))
  first = _devices_note(proc)
  if accelerator.backend != "cpu" and accelerator.count < 8:
    many = "s" if accelerator.count > 1 else ""
    assert first == (
        "devices: 8 virtual CPU devices: mesh={data: 2, fsdp: 2, tensor: 2} needs 8, this "
        f"machine has {accelerator.count} {accelerator.backend} device{many} "
        f"({accelerator.kind}); mesh=auto trains on {'them' if many else 'it'}")
  else:
    assert first == f"devices: {_devices_line(accelerator, 8)}"
  summary = json.loads((out / "summary.json").read_text())
  assert 0 < summary["param_bytes_per_device"] < summary["param_bytes_total"]  # FSDP x TP
  assert summary["optimizer_bytes_per_device"] > 0


@pytest.fixture(scope="module")
def cpu_reference(accelerator, tmp_path_factory):
  """The same three steps of the fsdp_tp preset on 8 virtual CPU devices (JAX's defaults)."""
  out = tmp_path_factory.mktemp("cpu")
  _ok(accelerator.run("-m", "recipes.train", *STEPS, f"out_dir={out}", timeout=600,
                      env={"JAX_PLATFORMS": "cpu"}))
  return _metrics(out)


@pytest.mark.parametrize("precision", ["default", "highest"])
def test_preset_steps_equal_the_cpu_run_within_the_backends_precision(accelerator, tmp_path,
                                                                      cpu_reference, precision):
  out = tmp_path / precision
  env = {"JAX_DEFAULT_MATMUL_PRECISION": "highest"} if precision == "highest" else {}
  _ok(accelerator.run("-m", "recipes.train", *STEPS, "mesh=auto", f"out_dir={out}",
                      timeout=600, env=env))
  u = accelerator.unit_roundoff if precision == "default" else 2.0**-24
  rtol = max(2 * CHAIN * u, 1e-4)
  got = _metrics(out)
  assert [r["step"] for r in got] == [r["step"] for r in cpu_reference] == [1, 2, 3]
  for key in ("loss", "grad_norm"):  # (accuracies are counts of argmaxes: not continuous)
    np.testing.assert_allclose([r[key] for r in got], [r[key] for r in cpu_reference],
                               rtol=rtol, err_msg=f"{key} at {precision} precision")
