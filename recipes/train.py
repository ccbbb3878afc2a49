"""Train the ``layers`` Transformer with a sharding strategy chosen by config.

``python -m recipes.train`` trains the default recipe (``recipes/configs/default.yaml``) on 8
devices: the accelerators when there are 8, else 8 virtual CPU devices (the run says which and
why); ``mesh=auto`` sizes the preset's axes to the devices present instead (one GPU: a mesh of
1). Every part is a config key:
``python -m recipes.train --config my.yaml framework=nnx preset=fsdp microbatches=4``.

The step (:func:`train_step`) is ``partition.value_and_grad`` (micro-batched, sharded
gradients) + optax AdamW under one ``jax.jit`` that donates the old state. Params and optimizer
state are created directly in their shards (:func:`init_model`). Input comes from Grain
(``recipes/data.py``). Metrics go to ``out_dir/metrics.jsonl`` (one object per step),
checkpoints to ``out_dir/checkpoints`` (orbax), the loss curve to ``out_dir/loss.png``.
``recipes/rundir.py`` keeps runs apart (a fresh run refuses a used ``out_dir``; ``resume=true``
checks the checkpoint fits) and turns SIGTERM / SIGINT into a checkpoint and a clean exit.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import math
import os
import pathlib
import sys
import warnings
from collections.abc import Sequence
from typing import Any

if __name__ == "__main__":
  # The CLI keeps XLA's C++ warnings (e.g. SPMD "involuntary full rematerialization" notes)
  # out of the progress display; TF_CPP_MIN_LOG_LEVEL=0 shows them. Set before jaxlib loads.
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# Importing these starts no backend: setup_devices still sets the CPU device count first.
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec  # noqa: E402

from partition.internal import did_you_mean, format_message, needs_extra  # noqa: E402

with needs_extra("recipes", by="recipes.train"):
  import optax

import partition  # noqa: E402
from partition import PartitionError  # noqa: E402
from recipes import checkpoint as ckpt_lib  # noqa: E402
from recipes import data, distributed, init_from, report, rundir  # noqa: E402
from recipes import model as model_lib  # noqa: E402
from recipes.config import (  # noqa: E402
  BATCH_AXIS,
  PRESETS,
  TrainConfig,
  TrainConfigError,
  example_mesh,
  load_config,
  preset_rules,
  serial_loops,
)


def parse_args(argv: Sequence[str] | None) -> tuple[str | None, list[str]]:
  parser = argparse.ArgumentParser(
      prog="python -m recipes.train", description=report.plain(__doc__.splitlines()[0]),
      # raw: argparse's wrapping split the example's quoted mesh across lines
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog="Overrides are key=value with dotted keys, e.g.\n"
             "  model.num_layers=4 mesh='{data: 4, fsdp: 2, tensor: 1}' "
             "optimizer.learning_rate=1e-3\n"
             "A new run refuses an out_dir that holds another run; resume=true continues it.\n"
             "SIGTERM/SIGINT stop after the current step with a checkpoint.")
  parser.add_argument("--config", help="a YAML file of the keys to change (every run starts "
                                       "from recipes/configs/default.yaml)")
  parser.add_argument("overrides", nargs="*", help="key=value overrides")
  args = parser.parse_args(argv)
  return args.config, args.overrides


def default_config_path() -> pathlib.Path:
  return pathlib.Path(__file__).resolve().parent / "configs" / "default.yaml"


def setup_devices(config: TrainConfig) -> None:
  """Before any JAX computation: join a multi-process run if asked, and give the CPU
  backend as many virtual devices as the mesh needs (8 when it has a -1). In a process where
  JAX already runs, its devices are kept (``make_mesh`` checks that there are enough)."""

  distributed.initialize(config.distributed)
  wanted = math.prod(v for v in config.mesh.values() if v > 0)
  if any(v == -1 for v in config.mesh.values()):
    wanted = max(wanted, 8)
  if config.distributed.local_devices:
    wanted = config.distributed.local_devices
  elif distributed.num_processes(config.distributed) > 1:
    wanted = max(1, wanted // distributed.num_processes(config.distributed))
  try:
    jax.config.update("jax_num_cpu_devices", wanted)
  except RuntimeError:
    # JAX already started in this process (a notebook, a second run): its devices stay, and
    # make_mesh says so if the mesh needs more of them.
    pass


def make_mesh(config: TrainConfig):
  """The mesh of ``config.mesh`` (``-1`` fills) on :func:`mesh_devices`."""
  return _mesh_and_note(config)[0]


def mesh_devices(config: TrainConfig) -> tuple[list, str]:
  """The devices the run's mesh goes on, and a line saying which and why.

  The default backend's devices (the accelerators) when there are enough for the fixed sizes
  of ``config.mesh``, else the CPU's virtual devices (a mesh of 8 on a one-GPU machine still
  runs, with a note that ``mesh=auto`` would use the GPU)."""
  devices, backend = jax.devices(), jax.default_backend()
  fixed = math.prod(v for v in config.mesh.values() if v > 0)
  if backend == "cpu":
    forced = (jax.config.jax_platforms or "").strip()
    return devices, (f"JAX_PLATFORMS={forced}" if forced else "no accelerator found")
  if len(devices) >= fixed:
    return devices, f"the {backend} devices present"
  have = f"{len(devices)} {backend} device{'s' if len(devices) > 1 else ''} " \
         f"({devices[0].device_kind})"
  return jax.devices("cpu"), (f"mesh={_mesh_text(config.mesh)} needs {fixed}, this machine has "
                              f"{have}; mesh=auto trains on {'them' if len(devices) > 1 else 'it'}")


def _mesh_and_note(config: TrainConfig):
  devices, why = mesh_devices(config)
  sizes = dict(config.mesh)
  fixed = math.prod(v for v in sizes.values() if v > 0)
  for name, v in sizes.items():
    if v == -1:
      sizes[name] = max(1, len(devices) // fixed)
  total = math.prod(sizes.values())
  if total > len(devices):
    raise TrainConfigError(
        f"mesh={config.mesh} needs {total} devices, but {len(devices)} are available "
        f"({devices[0].platform}). Use smaller sizes or -1 for one axis, e.g. "
        "mesh='{data: -1}', or mesh=auto (the preset's axes sized to the devices present).")
  mesh = jax.make_mesh(tuple(sizes.values()), tuple(sizes), devices=devices[:total],
                       axis_types=(AxisType.Auto,) * len(sizes))
  filled = [f"{k}=-1 fills them: {k}={sizes[k]}" for k, v in config.mesh.items() if v == -1]
  return mesh, f"devices: {devices_text(mesh)}: {'; '.join([why, *filled])}"


def devices_text(mesh) -> str:
  """``8 virtual CPU devices`` / ``1 x NVIDIA H200 (gpu)``: what a mesh runs on."""
  device = mesh.devices.flat[0]
  if device.platform == "cpu":
    return f"{mesh.size} {'virtual ' if mesh.size > 1 else ''}CPU device" + \
           ("s" if mesh.size > 1 else "")
  return f"{mesh.size} x {device.device_kind} ({device.platform})"


def _mesh_text(sizes: dict[str, int]) -> str:
  return "{" + ", ".join(f"{k}: {v}" for k, v in sizes.items()) + "}"


def make_rules(config: TrainConfig):
  """The preset's rules with ``config.rules`` applied. An explicit ``microbatches`` replaces
  a serial loop the preset gives ``batch`` (``load_config`` leaves ``microbatches=None`` for
  such presets unless the user set it)."""
  rules = preset_rules(config.preset)
  if config.microbatches is not None and serial_loops(rules):
    rules = rules.without_serial_loops(BATCH_AXIS)
  if not config.rules:
    return rules
  overridden = rules.override(*config.rules)
  _check_overrides(config, rules, overridden)
  return overridden


def _known_logical_names(rules) -> list[str]:
  """The names a rules override may set: the preset's, and every built-in preset's (together
  the layers model's logical axes)."""
  names = dict.fromkeys(rules.names)
  for path in sorted(PRESETS.glob("*.yaml")):
    names.update(dict.fromkeys(preset_rules(path.stem).names))
  return list(names)


def _check_overrides(config: TrainConfig, rules, overridden) -> None:
  """An override for a name the model never uses would be ignored (``rules=[mpl=tensor]``
  trained with ``mlp`` replicated): an error with the near name instead, which also lists
  the overrides' mesh axes that ``config.mesh`` lacks (all the override's mistakes at once;
  :func:`run_problems` checks those alone when every name is known)."""
  known = _known_logical_names(rules)
  unknown = [(token, name) for token, one in _overrides(config) for name in one.names
             if name not in known]
  if unknown:
    problems = [
        f"rules override {token!r} sets logical axis {name!r}, which the model does not "
        f"have{did_you_mean(name, known)}: the model's axes are {known}"
        for token, name in unknown]
    problems += _override_axis_problems(config, overridden, config.mesh)[0]
    raise TrainConfigError(format_message(
        f"config: {len(problems)} problem(s) with rules=.", bullets=problems))


def _override_axis_problems(config: TrainConfig, rules, mesh_shape) -> tuple[list[str], set]:
  """The ``rules=`` overrides' mesh axes that ``mesh_shape`` lacks (where the preset does not
  name them too: that is the preset's problem), one line each, and those axes."""
  missing = [a for a in rules.mesh_axes if a not in mesh_shape]
  preset_axes = preset_rules(config.preset).mesh_axes
  by_override = {}
  for token, one in _overrides(config):
    by_override.update({a: token for a in one.mesh_axes
                        if a in missing and a not in preset_axes and a not in by_override})
  return [
      f"rules override {token!r} names mesh axis {axis!r}, which mesh={_mesh_text(mesh_shape)}"
      f" does not have{did_you_mean(axis, [*mesh_shape, 'null'])}: fix the override, or add "
      f"{axis!r} to the mesh" for axis, token in by_override.items()], set(by_override)


def _overrides(config: TrainConfig) -> list[tuple[str, Any]]:
  """``(token, its rules)`` per ``rules=`` override (a bad token raises its own error)."""
  return [(token, partition.AxisRules([]).override(token)) for token in config.rules]


def effective_microbatches(config: TrainConfig, rules) -> int:
  """Micro-batches per step: ``config.microbatches``, else the rules' loop on batch, else 1."""
  return config.microbatches or math.prod(serial_loops(rules)) or 1


def check_run(config: TrainConfig, rules, mesh) -> None:
  """What the config alone decides, checked before anything is compiled: the mesh has the
  axes the rules shard over, ``expert_parallel``-style rules get a mixture-of-experts model,
  and the batch divides into its device shards x micro-batches.

  Raises:
    TrainConfigError: naming the key and the fix.
  """
  if problems := run_problems(config, rules, mesh):
    raise TrainConfigError(format_message(
        f"config: {len(problems)} problem(s) with this preset, mesh and batch.",
        bullets=problems))


def run_problems(config: TrainConfig, rules, mesh) -> list[str]:
  """:func:`check_run`'s problems, one line each (``[]``: the run may start)."""
  wanted = list(rules.mesh_axes)
  missing = [a for a in wanted if a not in mesh.shape]
  problems, by_override = _override_axis_problems(config, rules, dict(mesh.shape))
  if preset_missing := [a for a in missing if a not in by_override]:
    have = _mesh_text(config.mesh)
    problems.append(
        f"preset={config.preset} shards over the mesh axes {wanted}, but mesh={have} has no "
        f"{', '.join(repr(a) for a in preset_missing)}: use e.g. "
        f"{example_mesh(config.preset, wanted)} (or add "
        f"{', '.join(f'{a}: 1' for a in preset_missing)} to the mesh to replicate on purpose)")
  shards_experts = any(name == "expert" and value for name, value in rules)
  if shards_experts and not config.model.num_experts:
    problems.append(f"preset={config.preset} shards mixture-of-experts layers over 'expert', "
                    "but model.num_experts=0 (a dense model): set model.num_experts=4 "
                    "model.experts_per_token=2, or use another preset")
  problems += _pipeline_problems(config, rules, mesh) if not missing else []
  if not missing:
    axes = _batch_mesh_axes(rules, config, mesh)
    shards = math.prod(mesh.shape[a] for a in axes)
    k = effective_microbatches(config, rules)
    if config.batch_size % (shards * k):
      multiple = shards * k
      problems.append(
          f"batch_size={config.batch_size} does not divide into {shards} device shard(s) "
          f"(mesh axes {axes or '()'}) x {k} micro-batch(es): use a multiple of {multiple}, "
          f"e.g. batch_size={max(multiple, config.batch_size // multiple * multiple)}")
  return problems


def _batch_mesh_axes(rules, config: TrainConfig, mesh) -> tuple[str, ...]:
  """The mesh axes the batch is split over: those of the rule that fires, else (when no rule
  divides the batch, which would train replicated) those of the first rule that tried."""
  batch = rules.resolve(BATCH_AXES, (config.batch_size, config.seq_len), mesh).dims[0]
  value = batch.resources if batch.rule is not None or not batch.attempts else (
      batch.attempts[0].value)
  return tuple(r for r in value or () if isinstance(r, str) and mesh.shape.get(r, 1) > 1)


def _pipeline_problems(config: TrainConfig, rules, mesh) -> list[str]:
  """A preset that maps ``layers`` to a mesh axis pipelines the scanned block stack: without
  ``scan_layers`` there is no stack to split (the run would silently replicate it)."""
  stage = partition.stage_axis(rules, mesh)
  if stage is None:
    return []
  stages, layers_ = mesh.shape[stage], config.model.num_layers
  repeats, micro = config.model.pipeline_repeats, config.model.pipeline_microbatches
  chunks = stages * repeats
  problems = []
  if not config.model.scan_layers:
    problems.append(f"preset={config.preset} pipelines the block stack over '{stage}' "
                    f"({stages} stages), but model.scan_layers=false: set "
                    "model.scan_layers=true")
  if layers_ % chunks:
    what = f"{stages} pipeline stages" + (f" x {repeats} repeats" if repeats > 1 else "")
    problems.append(f"model.num_layers={layers_} does not split into {what} "
                    f"(mesh {stage}={stages}): use a multiple of {chunks}, e.g. "
                    f"model.num_layers={max(chunks, layers_ // chunks * chunks)}")
  if 0 < micro < stages:
    problems.append(f"model.pipeline_microbatches={micro} is fewer than the {stages} pipeline "
                    f"stages (mesh {stage}={stages}): every stage needs a micro-batch in "
                    f"flight; use model.pipeline_microbatches={stages} or more (0 = {stages})")
  problems += _pipeline_rows_problems(config, rules, mesh, stage, micro or stages)
  return problems


def _pipeline_rows_problems(config: TrainConfig, rules, mesh, stage: str, m: int) -> list[str]:
  """Each device pipelines its own rows (``partition.pipeline``): a step's micro-batch must
  split into ``m`` pipeline micro-batches of whole rows on every device of the batch's mesh
  axes (else a MicrobatchError when the step is traced). An uneven batch is the batch
  check's own line."""
  rows = tuple(a for a in _batch_mesh_axes(rules, config, mesh) if a != stage)
  shards = math.prod(mesh.shape[a] for a in rows)
  k, b = effective_microbatches(config, rules), config.batch_size
  per_device = b // shards
  if b % shards or per_device % (k * m) == 0:
    return []
  pm = (f"model.pipeline_microbatches=0 (one per stage: {m})"
        if not config.model.pipeline_microbatches else f"model.pipeline_microbatches={m}")
  fits = [q for q in range(mesh.shape[stage], per_device // k + 1) if (per_device // k) % q == 0]
  multiple = shards * k * m
  return [f"batch_size={b} over {shards} device(s) (mesh axes {rows or '()'}) is {per_device} "
          f"row(s) per device, which do not split into microbatches={k} x {pm} pipeline "
          f"micro-batches of whole rows: use a batch_size that is a multiple of {multiple} "
          f"(e.g. batch_size={multiple * max(1, b // multiple)})"
          + (f", or model.pipeline_microbatches in {fits}" if fits else "")
          + (", or fewer microbatches" if k > 1 else "")]


def warmup_length(config: TrainConfig) -> int:
  """The steps the learning rate warms up over: ``optimizer.warmup_steps``, shortened to
  ``steps`` for a run no longer than that (:func:`short_warmup_warning` says so)."""
  return min(config.optimizer.warmup_steps, config.steps)


def make_optimizer(config: TrainConfig):
  """AdamW (after global-norm clipping) and its learning-rate schedule: the rate at step
  ``i`` (0-based) rises linearly from 0 to ``optimizer.learning_rate`` over
  :func:`warmup_length` steps, then follows a cosine down to ``optimizer.min_lr_ratio`` x
  that at ``i = steps``."""
  o = config.optimizer
  warmup = warmup_length(config)
  # optax wants a decay phase after the warmup; a run that warms up to its end never reaches
  # it, so its length there does not matter.
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, o.learning_rate, warmup_steps=warmup, decay_steps=max(config.steps, warmup + 1),
      end_value=o.learning_rate * o.min_lr_ratio)
  parts = [optax.clip_by_global_norm(o.clip_norm)] if o.clip_norm > 0 else []
  parts.append(optax.adamw(schedule, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay))
  return optax.chain(*parts), schedule


def short_warmup_warning(config: TrainConfig) -> str | None:
  """For a run of ``steps <= optimizer.warmup_steps``: the warmup takes the whole run, so the
  rate never reaches ``optimizer.learning_rate`` nor decays; what it does instead and how to
  get a warmup and a decay. ``None`` for a run longer than its warmup."""
  o, steps = config.optimizer, config.steps
  if steps > o.warmup_steps:
    return None
  how = "is shortened to" if steps < o.warmup_steps else "takes"
  if steps == 1:
    rates = "its one step has learning rate 0 (where the warmup starts), so no weight changes"
  else:
    rates = (f"the learning rate rises linearly from 0 to "
             f"{o.learning_rate * (steps - 1) / steps:.3g} ({steps - 1}/{steps} of "
             f"optimizer.learning_rate={o.learning_rate:g}) at the last step and never decays")
  return (f"optimizer.warmup_steps={o.warmup_steps} is not shorter than steps={steps}, so the "
          f"warmup {how} the run's {steps} step(s): {rates}. For a warmup and then the "
          f"cosine decay, set optimizer.warmup_steps below {steps} (e.g. "
          f"optimizer.warmup_steps={steps // 10}) or steps above {o.warmup_steps} "
          "(docs/training.md#the-learning-rate-schedule).")


BATCH_AXES = ("batch", "length")


def masked_loss(apply, params, batch, *, chunked: bool = False):
  """Mean cross-entropy over the scored tokens, and their accuracy (teacher forcing).

  ``chunked``: the model computes the per-token loss itself (``apply(params, inputs,
  targets=...)``, chunked by ``config.model.loss_chunk``), so the full fp32 logits never
  exist; else from the logits ``apply`` returns. Same values either way.
  """
  if chunked:
    ce, correct = apply(params, batch["inputs"], targets=batch["targets"])
  else:
    logits = apply(params, batch["inputs"]).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    correct = logits.argmax(-1) == batch["targets"]
  mask = batch["mask"]
  count = jnp.maximum(mask.sum(), 1.0)
  correct = correct * mask
  # exact match: every scored token of the row right
  exact = ((correct.sum(-1) == mask.sum(-1)) & (mask.sum(-1) > 0)).mean()
  return (ce * mask).sum() / count, {"accuracy": correct.sum() / count, "exact_match": exact}


def train_step(state, batch, *, grad_fn, tx, schedule):
  """One optimizer step: sharded (micro-batched) gradients, AdamW, the step's metrics."""
  (loss, aux), grads = grad_fn(state["params"], batch)
  updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
  params = optax.apply_updates(state["params"], updates)
  metrics = {"loss": loss, **{f"train_{k}": v for k, v in aux.items()},
             "grad_norm": optax.tree.norm(grads), "learning_rate": schedule(state["step"])}
  return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics


def eval_step(params, batch, *, loss_fn, rules, mesh):
  """Loss, token accuracy and exact match of ``params`` on one batch."""
  with partition.axis_rules(rules, mesh):
    loss, aux = loss_fn(params, batch)
  return {"eval_loss": loss, **aux}


@dataclasses.dataclass
class Run:
  """Everything built from a config: mesh, rules, model, optimizer, jitted steps, data."""

  config: TrainConfig
  mesh: Any
  rules: Any
  model: Any
  tx: Any
  schedule: Any
  state: dict[str, Any]
  state_axes: dict[str, Any]
  batch_shardings: dict[str, Any]
  train_step: Any   # jitted train_step(state, batch) -> (state, metrics); donates state
  eval_step: Any    # jitted eval_step(params, batch) -> metrics
  data: Any         # recipes.data.Pipeline: data.batch(step, split) -> sharded global batch
  devices_note: str = ""  # which devices the mesh is on, and why


def init_model(config: TrainConfig, rules, mesh):
  """The model with its initial params, created in their shards: the ``init_from``
  checkpoint's weights (each device reads its own block), else random init from
  ``config.seed``. The one place where initial params are chosen."""
  if config.init_from:
    return init_from.build_model(config.init_from, config, rules=rules, mesh=mesh)
  example = model_lib.example_tokens(config.batch_size, config.seq_len)
  return model_lib.build(config.framework, config.model, seed=config.seed, example=example,
                         rules=rules, mesh=mesh)


def build_run(config: TrainConfig) -> Run:
  """Mesh, rules (checked against the config), model, optimizer state, steps and data."""



  mesh, devices_note = _mesh_and_note(config)
  rules = make_rules(config)
  check_run(config, rules, mesh)
  source = data.make_source(config)
  model = init_model(config, rules, mesh)
  tx, schedule = make_optimizer(config)
  opt_state = partition.optimizer_init(tx, model.params, param_axes=model.param_axes,
                                       rules=rules, mesh=mesh)
  opt_axes = partition.optimizer_axes(tx, model.params, param_axes=model.param_axes)
  replicated = NamedSharding(mesh, PartitionSpec())
  state = {"params": model.params, "opt_state": opt_state,
           "step": jax.device_put(jnp.zeros((), jnp.int32), replicated)}
  state_axes = {"params": model.param_axes, "opt_state": opt_axes, "step": None}
  spec = rules.spec(BATCH_AXES, (config.batch_size, config.seq_len), mesh)
  batch_shardings = {k: NamedSharding(mesh, spec) for k in ("inputs", "targets", "mask")}

  loss_fn = functools.partial(masked_loss, model.apply, chunked=config.model.loss_chunk > 0)
  grad_fn = partition.value_and_grad(loss_fn, batch_axes=BATCH_AXES, param_axes=model.param_axes,
                                     rules=rules, mesh=mesh, microbatches=config.microbatches,
                                     has_aux=True)
  step = jax.jit(functools.partial(train_step, grad_fn=grad_fn, tx=tx, schedule=schedule),
                 donate_argnums=(0,))
  evaluate_batch = jax.jit(functools.partial(eval_step, loss_fn=loss_fn, rules=rules,
                                             mesh=mesh))
  pipeline = data.Pipeline(source, config.seed, config.batch_size, batch_shardings)
  return Run(config, mesh, rules, model, tx, schedule, state, state_axes, batch_shardings,
             step, evaluate_batch, pipeline, devices_note)


def device_bytes(tree, mesh=None) -> int:
  """Bytes of ``tree`` held by one device of ``mesh`` (its first local one; default: the
  mesh of the tree's first ``NamedSharding``), counted over the shards it holds."""
  if mesh is None:
    mesh = next((x.sharding.mesh for x in jax.tree.leaves(tree)
                 if isinstance(x.sharding, NamedSharding)), None)
  first = mesh.local_devices[0] if mesh is not None else jax.local_devices()[0]
  total = 0
  for x in jax.tree.leaves(tree):
    for shard in x.addressable_shards:
      if shard.device == first:
        total += shard.data.nbytes
  return total


def evaluate(run: Run, params) -> dict[str, float]:
  results = [run.eval_step(params, run.data.batch(i, "eval"))
             for i in range(run.config.eval_batches)]
  return {k: float(np.mean([r[k] for r in results])) for k in results[0]}


class Stopped(Exception):
  """The run stopped early on purpose: a signal (after writing a checkpoint) or a loss that
  is not finite (keeping the last good checkpoint). ``exit_code`` is what the CLI returns."""

  def __init__(self, message: str, step: int, exit_code: int):
    super().__init__(message)
    self.step, self.exit_code = step, exit_code


def train(config: TrainConfig, *, progress: bool | str = True, out=None,
          log=None) -> dict[str, Any]:
  """Runs training; returns the summary (also printed to ``out`` and written to out_dir).

  A new run (``resume=false``) refuses an ``out_dir`` that holds another run; ``resume=true``
  continues the run there from its last checkpoint (the model must match; preset, mesh and
  micro-batches may change: the state is resharded; so may ``rundir.runtime_fields``, such as
  ``model.attention`` and ``model.remat``). A run of ``steps <= optimizer.warmup_steps``
  warns that its warmup is shortened (:func:`short_warmup_warning`). SIGTERM / SIGINT end
  the run after the current step with a checkpoint, and a loss that is not finite ends it
  keeping the last good one: both raise :class:`Stopped`.

  Args:
    config: the run.
    progress: ``True`` or ``'bar'``: a rich progress bar; ``'log'``: a line on ``log`` every
      ``log_every`` steps; ``False``: silent.
    out: where the summary table goes (default: ``sys.stdout``).
    log: where progress lines and notes (``resumed from step N of DIR``) go (default:
      ``sys.stderr``).
  """


  out = sys.stdout if out is None else out
  log = sys.stderr if log is None else log
  out_dir = pathlib.Path(config.out_dir)
  # In a multi-process run every process trains; process 0 alone writes and prints.
  primary = jax.process_index() == 0
  say = (lambda text: print(text, file=log, flush=True)) if primary else (lambda text: None)
  rundir.check_fresh(config)
  if note := rundir.numbered_note(config):
    say(note)
  run = build_run(config)
  say(run.devices_note)
  out_dir.mkdir(parents=True, exist_ok=True)
  ckpt = ckpt_lib.Checkpointer(out_dir / "checkpoints")
  metrics_log = report.MetricsLog(out_dir / "metrics.jsonl", write=primary)
  start = 0
  if config.resume:
    start = rundir.resume(config, run, ckpt, metrics_log, say)
  if primary and start < config.steps and (warning := short_warmup_warning(config)):
    # A Python warning, not a log line: like the library's PartitionWarnings, a caller can
    # filter it (a smoke test of a few steps warns on purpose), and the log stays the
    # devices line and the progress lines.
    warnings.warn(warning, UserWarning, stacklevel=2)
  extra = {"config": config.to_dict(), "rules": run.rules.to_dict()}
  tokens_per_step = config.batch_size * config.seq_len
  timer = report.Throughput(tokens_per_step)
  mode = "bar" if progress is True else progress or None
  with rundir.StopSignals() as signals, report.progress(
      config.steps, start, mode=mode if primary else None, every=config.log_every,
      stream=log) as bar:
    batch = run.data.batch(start) if start < config.steps else None
    for step in range(start, config.steps):
      run.state, metrics = run.train_step(run.state, batch)
      done = step + 1
      if done < config.steps:  # read the next batch while the device runs this step
        batch = run.data.batch(done)
      record = {"step": done, **{k: float(v) for k, v in metrics.items()}}
      timer.tick(done)
      record["tokens_per_s"] = timer.rate
      if not np.isfinite(record["loss"]):
        metrics_log.append(record)
        metrics_log.flush()
        ckpt.close()
        last = ckpt.latest_step()
        raise Stopped(
            f"the loss is {record['loss']} at step {done}: training diverged. Nothing was "
            f"saved for it; the last good checkpoint is "
            f"{f'step {last}' if last is not None else 'none'} in {ckpt.directory}. Lower "
            "optimizer.learning_rate (or raise optimizer.warmup_steps) and rerun "
            f"{'with resume=true' if last is not None else 'into a new out_dir'}.",
            done, exit_code=1)
      if done % config.eval_every == 0 or done == config.steps:
        record.update(evaluate(run, run.state["params"]))
      metrics_log.append(record)
      bar.update(done, record)
      periodic = config.checkpoint_every and done % config.checkpoint_every == 0
      stop = signals.agreed() if done < config.steps else None
      if periodic or stop or done == config.steps:
        metrics_log.flush()  # the log reaches every checkpoint a resumed run may start from
        ckpt.save(done, run.state, run.state_axes, extra)
      if stop:
        metrics_log.flush()
        ckpt.close()
        raise Stopped(f"stopped by {stop.name} after step {done}: checkpoint written to "
                      f"{ckpt.directory}. Continue with resume=true out_dir={config.out_dir}.",
                      done, exit_code=0 if stop.name == "SIGTERM" else 128 + stop.value)
  ckpt.close()
  metrics_log.flush()
  effective = effective_microbatches(config, run.rules)
  summary = {
      "framework": config.framework, "preset": config.preset,
      "mesh": dict(run.mesh.shape), "microbatches": effective,
      **report.step_fields(config.steps, start),
      "final_loss": metrics_log.last("loss"),
      "eval_loss": metrics_log.last("eval_loss"), "accuracy": metrics_log.last("accuracy"),
      "exact_match": metrics_log.last("exact_match"),
      "tokens_per_s": timer.rate or metrics_log.last("tokens_per_s"),
      "devices": devices_text(run.mesh),
      "param_bytes_per_device": device_bytes(run.state["params"], run.mesh),
      "optimizer_bytes_per_device": device_bytes(run.state["opt_state"], run.mesh),
      "param_bytes_total": sum(x.nbytes for x in jax.tree.leaves(run.state["params"])),
      "out_dir": str(out_dir),
  }
  stage = partition.stage_axis(run.rules, run.mesh)
  if stage is not None and config.model.scan_layers:   # a pipelined run (_pipeline_problems)
    stages = run.mesh.shape[stage]
    summary["pipeline"] = report.pipeline_fields(
        stages, config.model.pipeline_microbatches or stages, config.model.pipeline_repeats)
  if primary:
    summary = report.finish(summary, metrics_log.records, out_dir, plot=config.plot, out=out)
  return summary


def main(argv: Sequence[str] | None = None) -> int:
  """The command line: 0 done (or stopped by SIGTERM with a checkpoint), 2 a mistake in the
  config or arguments (a message, no traceback), 1 a diverged loss, 130 SIGINT."""
  try:
    path, overrides = parse_args(argv)
    config = load_config(path or default_config_path(), overrides)
    setup_devices(config)
    terminal = sys.stderr.isatty() or bool(os.environ.get("FORCE_PROGRESS"))
    with _cli_warnings():
      train(config, progress="bar" if terminal else "log")
  except PartitionError as e:  # TrainConfigError and every error of the partition library
    print(f"error: {e}", file=sys.stderr)
    return 2
  except Stopped as e:
    print(("" if e.exit_code == 0 else "error: ") + str(e), file=sys.stderr)
    return e.exit_code
  except KeyboardInterrupt:  # the steps turn SIGINT into Stopped; this is outside them
    print("error: stopped by SIGINT outside the training steps (while building or compiling "
          "the model, or writing the summary). Checkpoints already written are kept: "
          "resume=true continues from the last one; without one, run the command again.",
          file=sys.stderr)
    return 130
  return 0


@contextlib.contextmanager
def _cli_warnings():
  """Warnings on the command line read ``UserWarning: <message>``: the file and line of the
  ``warnings.warn`` call (this module's own) mean nothing to a user of the command."""
  shown = warnings.formatwarning
  warnings.formatwarning = lambda message, category, *_: f"{category.__name__}: {message}\n"
  try:
    yield
  finally:
    warnings.formatwarning = shown


if __name__ == "__main__":
  sys.exit(main())

