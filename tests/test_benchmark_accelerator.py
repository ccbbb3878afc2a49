"""``python -m benchmarks.accelerator`` on the CPU: the tiny model's smoke run, in the suite.

(Its targets on a GPU are asserted by tests/accelerator/test_accelerator_targets.py.)"""

import jax
import pytest

from benchmarks import accelerator

pytestmark = pytest.mark.slow   # compiles nine small training steps


def test_smoke_run_on_cpu_writes_every_measurement(tmp_path):
  out = tmp_path / "results.json"
  result = accelerator.run(out=out)
  assert out.exists() and result["device"]["platform"] == jax.devices()[0].platform == "cpu"
  names = [r["name"] for r in result["rows"]]
  assert names[:3] == ["ours (xla)", "reference (xla)", "ours, microbatches=4"]
  assert names[3:] == ["ours 1x512 (xla, remat none)"]  # the main rows' 4 x 128 tokens: no remat
  for r in result["rows"]:
    assert "error" not in r, r
    assert r["tokens_per_s"] == pytest.approx(r["batch"] * r["length"] / r["step_s"])
  # the two models are the same Llama: their parameters, and so their PaLM FLOPs, agree
  n = result["num_params"]
  assert n == sum(x.size for x in jax.tree.leaves(accelerator.reference_init(
      accelerator.size_for(jax.devices()[0]).config, jax.random.key(0))))
  curve = result["attention_memory_curve"]
  assert curve[-1]["blockwise"] < curve[-1]["xla"]
  flops = result["blockwise_causal_flops"]
  assert flops["pairs_ratio"] == 36 / 64 and flops["ratio"] <= 0.65, flops
  assert "| run |" in accelerator.markdown(result)
