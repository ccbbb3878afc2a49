"""``python -m recipes.train`` as 2 local processes x 4 CPU devices (``jax.distributed``, gloo
collectives over loopback) against 1 process x 8 devices: the same losses, eval numbers and
checkpointed params.

The children are the real entry point started with ``subprocess`` and the
``distributed.*`` flags; this test process (8 CPU devices from conftest) runs the one-process
reference with ``train.train`` while they work, then reads what they wrote.
"""

import json
import os
import signal
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import AxisType
from mesh_testlib import make_mesh

from recipes import checkpoint, train
from recipes.config import load_config

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # two training subprocesses
TIMEOUT_S = 240
TINY = ["model.embed_dim=16", "model.mlp_dim=32", "model.num_layers=1", "batch_size=16",
        "seq_len=8", "steps=3", "eval_every=3", "eval_batches=1", "checkpoint_every=0",
        "preset=fsdp_tp", "mesh={data: 2, fsdp: 2, tensor: 2}", "microbatches=2"]


def _start_cluster(start_processes, out_dir: Path, *extra: str):
  flags = TINY + list(extra) + [f"out_dir={out_dir}", "plot=true",
                                "distributed.num_processes=2", "distributed.local_devices=4"]
  return start_processes(2, lambda i, port: [
      "-m", "recipes.train", *flags, f"distributed.coordinator=127.0.0.1:{port}",
      f"distributed.process_id={i}"], cwd=REPO)


def _records(out_dir: Path) -> list[dict]:
  return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_processes_train_like_one(tmp_path, start_processes):
  procs = _start_cluster(start_processes, tmp_path / "mp")
  try:
    ref_dir = tmp_path / "ref"
    train.train(load_config(train.default_config_path(),
                            TINY + [f"out_dir={ref_dir}", "plot=false"]),
                progress=False, out=open(os.devnull, "w"))
  finally:
    stdouts = [out for out, _ in procs.wait(TIMEOUT_S, "multi-process training")]
  ours, ref = _records(tmp_path / "mp"), _records(ref_dir)
  assert [r["step"] for r in ours] == [1, 2, 3]
  np.testing.assert_allclose([r["loss"] for r in ours], [r["loss"] for r in ref], rtol=1e-5)
  for key in ("eval_loss", "accuracy", "grad_norm"):
    np.testing.assert_allclose(ours[-1][key], ref[-1][key], rtol=1e-5)
  # process 0 alone prints the summary (and writes metrics.jsonl, summary.json, loss.png)
  final = f"{ref[-1]['loss']:.4f}"
  assert "final train loss" in stdouts[0] and final in stdouts[0], stdouts
  assert "final train loss" not in stdouts[1], stdouts
  # the plot comes from process 0 only; the checkpoint was written by both processes together
  assert (tmp_path / "mp" / "loss.png").read_bytes()[:4] == b"\x89PNG"
  mesh = make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), AxisType.Explicit)
  restored = []
  for out in (tmp_path / "mp", ref_dir):
    ckpt = checkpoint.Checkpointer(out / "checkpoints")
    assert ckpt.all_steps() == [3]
    restored.append(ckpt.restore_on(3, mesh)[0])
    ckpt.close()
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                       rtol=1e-5, atol=1e-7), *restored)


def test_sigterm_to_one_process_stops_both_after_the_same_step(tmp_path, start_processes):
  """A scheduler signals one host: both processes stop after the same step (they agree after
  every step), write that step's checkpoint together and exit 0."""
  procs = _start_cluster(start_processes, tmp_path / "mp", "steps=60", "eval_every=60",
                         "log_every=1")
  for line in procs[0].stderr:  # process 0 logs a line per step (stderr is a pipe)
    if line.startswith("step 3/"):
      procs[1].send_signal(signal.SIGTERM)
      break
  outs = procs.wait(TIMEOUT_S, "SIGTERM to one of two training processes")  # both exit 0
  ckpt = checkpoint.Checkpointer(tmp_path / "mp" / "checkpoints")
  step = ckpt.latest_step()
  ckpt.close()
  assert 3 <= step < 60
  assert f"stopped by SIGTERM after step {step}" in outs[0][1]  # process 0 was not signalled
  assert [r["step"] for r in _records(tmp_path / "mp")] == list(range(1, step + 1))
