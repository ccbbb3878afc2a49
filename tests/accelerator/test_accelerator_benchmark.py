"""``python -m benchmarks.accelerator``: the CPU smoke run in the suite; the GPU targets of
issue 29 where an accelerator is present (marked ``accelerator``)."""

import jax
import pytest

from benchmarks import accelerator


@pytest.mark.slow
def test_smoke_run_on_cpu_writes_every_measurement(tmp_path):
  out = tmp_path / "results.json"
  result = accelerator.run(out=out)
  assert out.exists() and result["device"]["platform"] == jax.devices()[0].platform
  names = [r["name"] for r in result["rows"]]
  assert names[1].startswith("reference") and names[2] == "ours, microbatches=4"
  for r in result["rows"]:
    assert "error" not in r, r
    assert r["tokens_per_s"] == pytest.approx(r["batch"] * r["length"] / r["step_s"])
  # the two models are the same Llama: their PaLM FLOPs per token agree
  n = result["num_params"]
  assert n == sum(x.size for x in jax.tree.leaves(accelerator.reference_init(
      accelerator.size_for(jax.devices()[0]).config, jax.random.key(0))))
  curve = result["attention_memory_curve"]
  assert curve[-1]["blockwise"] < curve[-1]["xla"]
  flops = result["blockwise_causal_flops"]
  assert flops["pairs_ratio"] == 36 / 64 and flops["ratio"] <= 0.65, flops
  assert "| run |" in accelerator.markdown(result)


@pytest.mark.accelerator
def test_gpu_targets():
  if jax.devices()[0].platform == "cpu":
    pytest.skip("needs an accelerator (the issue's GPU targets)")
  result = accelerator.run(out=None)
  s = result["summary"]
  assert s["ours_over_reference_time"] <= 1.0
  assert s["ours_over_reference_temp"] <= 1.1
  assert s["microbatches4_over_k1_time"] <= 1.08
