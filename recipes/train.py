"""Train the ``layers`` Transformer with a sharding strategy chosen by config.

``python -m recipes.train`` trains the default recipe (``recipes/configs/default.yaml``) on 8
devices (virtual CPU devices when there is no accelerator). Every part is a config key:
``python -m recipes.train --config my.yaml framework=nnx preset=fsdp microbatches=4``.

The step is ``partition.value_and_grad`` (micro-batched, sharded gradients) + optax AdamW
under one ``jax.jit`` that donates the old state. Params and optimizer state are created
directly in their shards. Metrics go to ``out_dir/metrics.jsonl`` (one object per step),
checkpoints to ``out_dir/checkpoints`` (orbax), the loss curve to ``out_dir/loss.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

if __name__ == "__main__":
  # The CLI keeps XLA's C++ warnings (e.g. SPMD "involuntary full rematerialization" notes)
  # out of the progress display; TF_CPP_MIN_LOG_LEVEL=0 shows them. Set before jaxlib loads.
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from recipes.config import TrainConfig, TrainConfigError, load_config  # noqa: E402


def parse_args(argv: Sequence[str] | None) -> tuple[str | None, list[str]]:
  parser = argparse.ArgumentParser(
      prog="python -m recipes.train", description=__doc__.splitlines()[0],
      epilog="Overrides are key=value with dotted keys, e.g. model.num_layers=4 "
             "mesh='{data: 4, fsdp: 2}' optimizer.learning_rate=1e-3.")
  parser.add_argument("--config", help="a YAML config (default: recipes/configs/default.yaml)")
  parser.add_argument("overrides", nargs="*", help="key=value overrides")
  args = parser.parse_args(argv)
  return args.config, args.overrides


def default_config_path() -> pathlib.Path:
  return pathlib.Path(__file__).resolve().parent / "configs" / "default.yaml"


def setup_devices(config: TrainConfig) -> None:
  """Before any JAX computation: join a multi-process run if asked, and give the CPU
  backend as many virtual devices as the mesh needs (8 when it has a -1)."""
  import jax

  from recipes import distributed
  distributed.initialize(config.distributed)
  wanted = math.prod(v for v in config.mesh.values() if v > 0)
  if any(v == -1 for v in config.mesh.values()):
    wanted = max(wanted, 8)
  if config.distributed.local_devices:
    wanted = config.distributed.local_devices
  elif distributed.num_processes(config.distributed) > 1:
    wanted = max(1, wanted // distributed.num_processes(config.distributed))
  jax.config.update("jax_num_cpu_devices", wanted)


def make_mesh(config: TrainConfig):
  """The mesh of ``config.mesh`` (``-1`` fills), on the default backend if it has enough
  devices, else on the CPU's virtual devices."""
  import jax
  from jax.sharding import AxisType

  devices = jax.devices()
  sizes = dict(config.mesh)
  fixed = math.prod(v for v in sizes.values() if v > 0)
  if len(devices) < fixed and jax.default_backend() != "cpu":
    devices = jax.devices("cpu")
  for name, v in sizes.items():
    if v == -1:
      sizes[name] = max(1, len(devices) // fixed)
  total = math.prod(sizes.values())
  if total > len(devices):
    raise TrainConfigError(
        f"mesh={config.mesh} needs {total} devices, but {len(devices)} are available "
        f"({jax.default_backend()}). Use smaller sizes or -1 for one axis, e.g. "
        "mesh='{data: -1}'.")
  return jax.make_mesh(tuple(sizes.values()), tuple(sizes), devices=devices[:total],
                       axis_types=(AxisType.Auto,) * len(sizes))


def make_rules(config: TrainConfig):
  import partition
  from recipes.config import preset_path
  rules = partition.AxisRules.from_file(preset_path(config.preset))
  return rules.override(*config.rules) if config.rules else rules


def make_optimizer(config: TrainConfig):
  import optax
  o = config.optimizer
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, o.learning_rate, warmup_steps=min(o.warmup_steps, config.steps),
      decay_steps=max(config.steps, o.warmup_steps + 1), end_value=o.learning_rate * o.min_lr_ratio)
  parts = [optax.clip_by_global_norm(o.clip_norm)] if o.clip_norm > 0 else []
  parts.append(optax.adamw(schedule, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay))
  return optax.chain(*parts), schedule


BATCH_AXES = ("batch", "length")


def masked_loss(apply, params, batch):
  """Mean cross-entropy over the scored tokens, and their accuracy (teacher forcing)."""
  import jax.numpy as jnp
  import optax
  logits = apply(params, batch["inputs"]).astype(jnp.float32)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
  mask = batch["mask"]
  count = jnp.maximum(mask.sum(), 1.0)
  correct = (logits.argmax(-1) == batch["targets"]) * mask
  # exact match: every scored token of the row right
  exact = ((correct.sum(-1) == mask.sum(-1)) & (mask.sum(-1) > 0)).mean()
  return (ce * mask).sum() / count, {"accuracy": correct.sum() / count, "exact_match": exact}


@dataclasses.dataclass
class Run:
  """Everything built from a config: mesh, rules, model, optimizer, jitted steps."""

  config: TrainConfig
  mesh: Any
  rules: Any
  model: Any
  tx: Any
  schedule: Any
  state: dict[str, Any]
  state_axes: dict[str, Any]
  batch_shardings: dict[str, Any]
  train_step: Any
  eval_step: Any
  source: Any


def build_run(config: TrainConfig) -> Run:
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding

  import partition
  from recipes import data
  from recipes import model as model_lib

  mesh = make_mesh(config)
  rules = make_rules(config)
  source = data.make_source(config)
  example = model_lib.example_tokens(config.batch_size, config.seq_len)
  model = model_lib.build(config.framework, config.model, seed=config.seed, example=example,
                          rules=rules, mesh=mesh)
  tx, schedule = make_optimizer(config)
  opt_state = partition.optimizer_init(tx, model.params, param_axes=model.param_axes,
                                       rules=rules, mesh=mesh)
  opt_axes = partition.optimizer_axes(tx, model.params, param_axes=model.param_axes)
  replicated = NamedSharding(mesh, jax.sharding.PartitionSpec())
  state = {"params": model.params, "opt_state": opt_state,
           "step": jax.device_put(jnp.zeros((), jnp.int32), replicated)}
  state_axes = {"params": model.param_axes, "opt_state": opt_axes, "step": None}
  spec = rules.spec(BATCH_AXES, (config.batch_size, config.seq_len), mesh)
  batch_shardings = {k: NamedSharding(mesh, spec) for k in ("inputs", "targets", "mask")}

  loss_fn = lambda params, batch: masked_loss(model.apply, params, batch)
  grad_fn = partition.value_and_grad(loss_fn, batch_axes=BATCH_AXES, param_axes=model.param_axes,
                                     rules=rules, mesh=mesh, microbatches=config.microbatches,
                                     has_aux=True)

  def step_fn(state, batch):
    import optax
    (loss, aux), grads = grad_fn(state["params"], batch)
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    metrics = {"loss": loss, **{f"train_{k}": v for k, v in aux.items()},
               "grad_norm": optax.tree.norm(grads),
               "learning_rate": schedule(state["step"])}
    return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

  def eval_fn(params, batch):
    with partition.axis_rules(rules, mesh):
      loss, aux = loss_fn(params, batch)
    return {"eval_loss": loss, **aux}

  train_step = jax.jit(step_fn, donate_argnums=(0,))
  eval_step = jax.jit(eval_fn)
  return Run(config, mesh, rules, model, tx, schedule, state, state_axes, batch_shardings,
             train_step, eval_step, source)


def device_bytes(tree) -> int:
  """Bytes of ``tree`` held by the first device (its shards)."""
  import jax
  first = jax.local_devices()[0]
  total = 0
  for x in jax.tree.leaves(tree):
    for shard in x.addressable_shards:
      if shard.device == first:
        total += shard.data.nbytes
  return total


def _host_batch(run: Run, step: int, split: str = "train"):
  from recipes import data
  host = run.source.batch(run.config.seed, step, run.config.batch_size, split)
  return data.global_batch(host, run.batch_shardings)


def evaluate(run: Run, params) -> dict[str, float]:
  import numpy as np
  results = [run.eval_step(params, _host_batch(run, i, "eval"))
             for i in range(run.config.eval_batches)]
  return {k: float(np.mean([r[k] for r in results])) for k in results[0]}


def train(config: TrainConfig, *, progress: bool = True, out=sys.stdout,
          stop_after: int | None = None) -> dict[str, Any]:
  """Runs training; returns the summary (also printed and written to out_dir).

  ``stop_after`` ends the run after that step as a killed job would: no final checkpoint,
  no summary (returns ``{}``). ``resume=true`` then continues from the last checkpoint.
  """
  import jax

  from recipes import checkpoint as ckpt_lib
  from recipes import report

  out_dir = pathlib.Path(config.out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  run = build_run(config)
  ckpt = ckpt_lib.Checkpointer(out_dir / "checkpoints")
  # In a multi-process run every process trains; process 0 alone writes and prints.
  primary = jax.process_index() == 0
  metrics_log = report.MetricsLog(out_dir / "metrics.jsonl", write=primary)
  start = 0
  if config.resume and ckpt.latest_step() is not None:
    start = ckpt.latest_step()
    run.state = ckpt.restore_like(start, run.state)
    metrics_log.truncate_after(start)
  elif not config.resume:
    metrics_log.reset()
  extra = {"config": config.to_dict(), "rules": run.rules.to_dict()}
  tokens_per_step = config.batch_size * config.seq_len
  timer = report.Throughput(tokens_per_step)
  last_eval: dict[str, float] = {}
  with report.progress_bar(config.steps, start, enabled=progress and primary) as bar:
    for step in range(start, config.steps):
      batch = _host_batch(run, step)
      run.state, metrics = run.train_step(run.state, batch)
      done = step + 1
      record = {"step": done, **{k: float(v) for k, v in metrics.items()}}
      timer.tick(done, block=metrics["loss"])
      record["tokens_per_s"] = timer.rate
      if done % config.eval_every == 0 or done == config.steps:
        last_eval = evaluate(run, run.state["params"])
        record.update(last_eval)
      metrics_log.append(record)
      if config.checkpoint_every and done % config.checkpoint_every == 0:
        ckpt.save(done, run.state, run.state_axes, extra)
      bar.update(done, record)
      if stop_after is not None and done >= stop_after:
        metrics_log.flush()
        ckpt.close()
        return {}
  if ckpt.latest_step() != config.steps:
    ckpt.save(config.steps, run.state, run.state_axes, extra)
  ckpt.close()
  metrics_log.flush()
  summary = {
      "framework": config.framework, "preset": config.preset,
      "mesh": dict(run.mesh.shape), "microbatches": config.microbatches,
      "steps": config.steps, "final_loss": metrics_log.last("loss"),
      "eval_loss": last_eval.get("eval_loss"), "accuracy": last_eval.get("accuracy"),
      "exact_match": last_eval.get("exact_match"), "tokens_per_s": timer.rate,
      "param_bytes_per_device": device_bytes(run.state["params"]),
      "optimizer_bytes_per_device": device_bytes(run.state["opt_state"]),
      "param_bytes_total": sum(x.nbytes for x in jax.tree.leaves(run.state["params"])),
      "out_dir": str(out_dir),
  }
  if primary:
    report.write_json(out_dir / "summary.json", summary)
    if config.plot:
      report.plot_losses(metrics_log.records, out_dir / "loss.png")
    report.print_summary(summary, out)
  return summary


def main(argv: Sequence[str] | None = None) -> int:
  try:
    path, overrides = parse_args(argv)
    config = load_config(path or default_config_path(), overrides)
    setup_devices(config)
    train(config, progress=sys.stderr.isatty() or bool(os.environ.get("FORCE_PROGRESS")))
  except TrainConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())

