"""The sharding report of a training config, without training (``python -m recipes.explain``).

For every parameter: its logical axes, ``PartitionSpec``, bytes per device and in total, and the
optimizer-state bytes per device that follow it; totals; warnings for large parameters left
fully replicated; and the memory per device of the compiled train step (XLA's
``memory_analysis``: arguments, outputs, aliased (donated) bytes, temporaries, generated code).

Nothing is allocated: the run is built under ``jax.eval_shape`` and the step is lowered from
``jax.ShapeDtypeStruct``s carrying their shardings. ``--devices N`` plans for a machine bigger
than this one (N virtual CPU devices; give one mesh axis ``-1`` to fill them)::

  python -m recipes.explain                                    # the default recipe, 8 devices
  python -m recipes.explain --devices 64 mesh='{fsdp: -1, tensor: 4}' model.num_layers=16
  python -m recipes.explain --json preset=fsdp                 # machine-readable numbers
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from typing import Any

if __name__ == "__main__":
  # As python -m recipes.train: XLA's C++ warnings (SPMD rematerialization notes) stay out of
  # the report; TF_CPP_MIN_LOG_LEVEL=0 shows them. Set before jaxlib loads.
  import os
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from partition import PartitionError  # noqa: E402
from partition.internal import deprecated_getattr  # noqa: E402
from recipes import report  # noqa: E402

REPLICATED_WARN_BYTES = 1 << 20  # a replicated parameter above 1 MiB is worth a warning


class ExplainError(PartitionError, ValueError):
  """The explain command was given arguments it cannot plan with."""


@dataclasses.dataclass(frozen=True)
class Memory:
  """Per-device bytes of the compiled step (XLA ``CompiledMemoryStats``)."""

  argument: int
  output: int
  alias: int
  temp: int
  generated_code: int

  @property
  def peak(self) -> int:
    """Arguments + outputs + temporaries, counting donated (aliased) buffers once."""
    return self.argument + self.output - self.alias + self.temp + self.generated_code

  def to_dict(self) -> dict[str, int]:
    return {**dataclasses.asdict(self), "peak": self.peak}


@dataclasses.dataclass(frozen=True)
class Explanation:
  """What ``recipes.explain`` found for one config: the report :func:`plan` returns (the
  planner, ``python -m recipes.plan``, chooses among configs; this describes one).

  Attributes:
    config: the ``TrainConfig``.
    mesh: the mesh the run would use.
    params: ``partition.explain`` report of the parameters.
    optimizer: ``partition.explain`` report of the optimizer state.
    optimizer_by_param: ``{param path: optimizer bytes per device}`` (``mu``, ``nu``, ...).
    state: the abstract train state (``ShapeDtypeStruct``s with their shardings).
    warnings: large fully replicated parameters.
    memory: the compiled step's per-device memory (``None`` when not compiled).
    pipeline: the pipeline schedule when the rules map ``layers`` to a mesh axis (stage
      assignment, iterations, bubble), else ``None``.
    attention: which attention implementation the model runs and why
      (``layers.attention_choice``), else ``None``.
  """

  config: Any
  mesh: Any
  params: Any
  optimizer: Any
  optimizer_by_param: dict[str, int]
  state: Any
  warnings: tuple[str, ...]
  memory: Memory | None
  pipeline: Any = None
  attention: Any = None

  @property
  def num_params(self) -> int:
    return sum(math.prod(r.shape) for r in self.params.rows)

  def totals(self) -> dict[str, int]:
    return {"num_params": self.num_params,
            "param_bytes_total": self.params.total_bytes,
            "param_bytes_per_device": self.params.bytes_per_device,
            "optimizer_bytes_total": self.optimizer.total_bytes,
            "optimizer_bytes_per_device": self.optimizer.bytes_per_device,
            "state_bytes_per_device": self.params.bytes_per_device
                                      + self.optimizer.bytes_per_device}

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready numbers (what ``--json`` prints)."""
    c = self.config
    rows = [{"path": r.path, "shape": list(r.shape), "dtype": r.dtype,
             "logical_axes": None if r.logical_axes is None else list(r.logical_axes),
             "spec": _spec_list(r.spec), "bytes_per_device": r.bytes_per_device,
             "bytes_total": r.bytes_total, "replicated": r.replicated,
             "optimizer_bytes_per_device": self.optimizer_by_param.get(r.path, 0)}
            for r in self.params.rows]
    return {"framework": c.framework, "preset": c.preset, "mesh": dict(self.mesh.shape),
            "num_devices": int(self.mesh.size), "platform": self.mesh.devices.flat[0].platform,
            "batch_size": c.batch_size, "seq_len": c.seq_len, "microbatches": c.microbatches,
            "params": rows, "totals": self.totals(), "warnings": list(self.warnings),
            "notes": list(self.params.notes),
            "memory": None if self.memory is None else self.memory.to_dict(),
            "pipeline": None if self.pipeline is None else _pipeline_dict(self.pipeline),
            "attention": None if self.attention is None else {
                "implementation": self.attention.implementation,
                "reason": self.attention.reason}}




def _spec_list(spec) -> list:
  return [list(e) if isinstance(e, tuple) else e for e in tuple(spec)]


# -- building the plan -----------------------------------------------------------------------


def abstract_run(config):
  """``(run, state)``: ``train.build_run(config)`` traced under ``jax.eval_shape``, so no
  parameter is allocated; ``state`` is ``ShapeDtypeStruct``s with the shardings the real
  run gives them (from the recorded logical axes, as a checkpoint restore computes them).

  The returned ``run``'s own arrays are leaked tracers: use only its mesh, rules, axes,
  shardings and jitted functions.
  """
  import jax

  from recipes import train
  built = {}

  def build():
    built["run"] = train.build_run(config)
    return built["run"].state

  shapes = jax.eval_shape(build)
  run = built["run"]
  return run, with_shardings(shapes, run.state_axes, run.rules, run.mesh)


def with_shardings(shapes, axes_tree, rules, mesh):
  """``shapes`` as ``ShapeDtypeStruct``s sharded by their logical axes through ``rules``.

  ``axes_tree`` is a prefix of ``shapes`` whose leaves are logical-axes tuples or ``None``.
  """
  import jax
  from jax.sharding import NamedSharding, PartitionSpec

  # Only a plain tuple of names is an axes leaf: optax states are namedtuples, and one whose
  # fields are all None (ScaleByScheduleState(count=None)) must stay a subtree.
  is_axes = lambda a: a is None or (type(a) is tuple and all(
      n is None or isinstance(n, str) for n in a))

  def place(axes, subtree):
    def one(leaf):
      named = axes is not None and any(a is not None for a in axes) and len(leaf.shape) > 0
      spec = rules.spec(axes, tuple(leaf.shape), mesh) if named else PartitionSpec()
      return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, spec))
    return jax.tree.map(one, subtree)

  return jax.tree.map(place, axes_tree, shapes, is_leaf=is_axes)


def optimizer_by_param(param_paths: Sequence[str], optimizer_report) -> dict[str, int]:
  """Optimizer bytes per device attributed to the parameter each state leaf mirrors (the
  longest parameter path its path ends with; e.g. ``1/0/mu/embed/embedding``)."""
  by_length = sorted(param_paths, key=len, reverse=True)
  out = dict.fromkeys(param_paths, 0)
  for row in optimizer_report.rows:
    owner = next((p for p in by_length if row.path.endswith("/" + p)), None)
    if owner is not None:
      out[owner] += row.bytes_per_device
  return out


def compile_train_step(run, state):
  """Lowers and compiles ``run.train_step`` on abstract inputs (``state`` and a batch of
  ``run``'s shape and shardings); the compiled program."""
  import jax
  import numpy as np
  c = run.config
  shape = (c.batch_size, c.seq_len)
  dtypes = {"inputs": np.int32, "targets": np.int32, "mask": np.float32}
  batch = {k: jax.ShapeDtypeStruct(shape, dtypes[k], sharding=s)
           for k, s in run.batch_shardings.items()}
  return run.train_step.lower(state, batch).compile()


def memory_of(compiled) -> Memory:
  """The per-device memory of a compiled program (``compiled.memory_analysis()``)."""
  stats = compiled.memory_analysis()
  return Memory(argument=int(stats.argument_size_in_bytes),
                output=int(stats.output_size_in_bytes), alias=int(stats.alias_size_in_bytes),
                temp=int(stats.temp_size_in_bytes),
                generated_code=int(stats.generated_code_size_in_bytes))


def compile_memory(run, state) -> Memory:
  """Compiles ``run.train_step`` on abstract inputs; its per-device memory."""
  return memory_of(compile_train_step(run, state))


def explain_config(config, *, compile: bool = True,
                   replicated_warn_bytes: int = REPLICATED_WARN_BYTES) -> Explanation:
  """The sharding report of ``config`` on the devices JAX has now.

  Args:
    config: a ``recipes.config.TrainConfig``.
    compile: also lower and compile the train step for its memory per device.
    replicated_warn_bytes: warn about fully replicated parameters at least this large.

  Returns:
    An :class:`Explanation` (``.to_dict()`` for numbers, :func:`render` for tables).

  Example:
    >>> from recipes.config import load_config
    >>> from recipes.explain import explain_config
    >>> cfg = load_config(overrides=['model.num_layers=1', 'preset=data_parallel',
    ...                              'mesh={data: -1}'])
    >>> p = explain_config(cfg, compile=False)
    >>> p.totals()['num_params'], p.params.rows[0].path, p.params.rows[0].logical_axes
    (38080, 'blocks_0/attn/out/kernel', ('heads', 'head_dim', 'embed'))
    >>> p.params.bytes_per_device == p.params.total_bytes  # only 'data': params replicated
    True
  """
  import partition
  run, state = abstract_run(config)
  params = partition.explain(state["params"], run.state_axes["params"], run.rules, run.mesh)
  optimizer = partition.explain(state["opt_state"], run.state_axes["opt_state"], run.rules,
                                run.mesh)
  warnings = tuple(
      f"{r.path} {r.shape} is fully replicated on {params.num_devices} devices "
      f"({_human(r.bytes_total)} on each): give its "
      f"logical axes {r.logical_axes} a rule (rules=[...]) or another preset"
      for r in params.rows if r.replicated and r.bytes_total >= replicated_warn_bytes)
  memory = compile_memory(run, state) if compile else None
  return Explanation(config, run.mesh, params, optimizer,
              optimizer_by_param([r.path for r in params.rows], optimizer), state, warnings,
              memory, pipeline_plan(config, run.rules, run.mesh),
              attention_choice(config, run.rules, run.mesh))


def attention_choice(config, rules, mesh):
  """The attention implementation the model runs (``model.attention``; ``'auto'`` decides from
  the backend, dtype, head_dim, the causal mask and the sequence length) and why."""
  import layers
  return layers.attention_choice(config.model, batch=config.batch_size, length=config.seq_len,
                    rules=rules, mesh=mesh)


def pipeline_plan(config, rules, mesh):
  """The ``partition.PipelineShape`` the scanned blocks run with, or ``None`` (no stage axis):
  ``model.pipeline_microbatches`` micro-batches (0: one per stage) and
  ``model.pipeline_repeats`` chunks per stage."""
  import partition
  stage = partition.stage_axis(rules, mesh)
  if stage is None or not config.model.scan_layers:
    return None
  stages, model = mesh.shape[stage], config.model
  return partition.PipelineShape(stage, stages, model.pipeline_repeats,
                                model.pipeline_microbatches or stages, model.num_layers)


def _pipeline_dict(plan) -> dict[str, Any]:
  return {"stage_axis": plan.stage_axis, "stages": plan.stages, "repeats": plan.repeats,
          "microbatches": plan.microbatches, "iterations": plan.iterations,
          "bubble": plan.bubble,
          "stage_layers": [list(plan.stage_layers(s)) for s in range(plan.stages)]}


def _human(n: int) -> str:
  from partition.internal import human_bytes
  return human_bytes(n)


# -- output ----------------------------------------------------------------------------------


def render(p: Explanation, out=sys.stdout) -> None:
  """Rich tables: per-parameter sharding, totals, warnings and the step's memory."""
  from rich.console import Console
  from rich.table import Table

  console = Console(file=out, width=160)
  mesh = " x ".join(f"{k}={v}" for k, v in p.mesh.shape.items())
  table = Table(title=f"{p.config.framework} / {p.config.preset} on {mesh} "
                      f"({p.mesh.size} {p.mesh.devices.flat[0].platform} devices)")
  for name in ("parameter", "shape", "dtype", "logical axes", "spec", "per device", "total",
               "optimizer per device"):
    # long names wrap inside their cell (fold): a path is never cut short
    table.add_column(name, justify="right" if name in ("per device", "total",
                                                       "optimizer per device") else "left",
                     overflow="fold")
  for r in p.params.rows:
    axes = "-" if r.logical_axes is None else ", ".join(map(str, r.logical_axes))
    spec = str(r.spec) + (" [red](replicated)[/red]" if r.replicated else "")
    table.add_row(r.path, str(r.shape), r.dtype, axes, spec, _human(r.bytes_per_device),
                  _human(r.bytes_total), _human(p.optimizer_by_param.get(r.path, 0)))
  console.print(table)
  console.print(_totals_table(p))
  if p.memory is not None:
    console.print(_memory_table(p.memory))
  if p.pipeline is not None:
    console.print(_pipeline_table(p.pipeline))
  if p.attention is not None:
    console.print(f"attention: {p.attention}", highlight=False)
  for w in p.warnings:
    console.print(f"[yellow]warning:[/yellow] {w}", highlight=False)
  for note in p.params.notes:
    console.print(f"note: {note}", highlight=False)


def _pipeline_table(plan):
  from rich.table import Table
  table = Table(title=f"pipeline over '{plan.stage_axis}'", min_width=100,
                caption=f"{plan.stages} stages x {plan.repeats} repeat(s), "
                        f"{plan.microbatches} micro-batches: {plan.iterations} iterations, "
                        f"bubble (p-1)/(r m+p-1) = {plan.bubble:.1%}")
  table.add_column("stage")
  table.add_column("layers (in the order applied)", overflow="fold")
  for s in range(plan.stages):
    table.add_row(str(s), ", ".join(map(str, plan.stage_layers(s))))
  return table


def _totals_table(p: Explanation):
  from rich.table import Table
  t = p.totals()
  table = Table(title="totals", show_header=True)
  for name in ("", "per device", "total"):
    table.add_column(name, justify="left" if not name else "right")
  table.add_row(f"parameters ({t['num_params']:,})", _human(t["param_bytes_per_device"]),
                _human(t["param_bytes_total"]))
  table.add_row("optimizer state", _human(t["optimizer_bytes_per_device"]),
                _human(t["optimizer_bytes_total"]))
  table.add_row("params + optimizer", _human(t["state_bytes_per_device"]),
                _human(t["param_bytes_total"] + t["optimizer_bytes_total"]))
  return table


def _memory_table(m: Memory):
  from rich.table import Table
  table = Table(title="compiled train step, per device (XLA memory_analysis)")
  table.add_column("")
  table.add_column("bytes", justify="right")
  for name, value in (("arguments (state + batch)", m.argument), ("outputs", m.output),
                      ("aliased (donated state)", m.alias), ("temporaries", m.temp),
                      ("generated code", m.generated_code),
                      ("peak = arguments + outputs - aliased + temp + code", m.peak)):
    table.add_row(name, _human(value))
  return table


# -- command line ----------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      prog="python -m recipes.explain", description=report.plain(__doc__.splitlines()[0]),
      epilog="Overrides are key=value with dotted keys, as for python -m recipes.train.")
  parser.add_argument("--config", help="a YAML config (default: recipes/configs/default.yaml)")
  parser.add_argument("--devices", type=int, default=None, metavar="N",
                      help="plan for N devices (N virtual CPU devices; the mesh must use "
                           "all N: give one axis -1)")
  parser.add_argument("--json", action="store_true", help="print the numbers as JSON")
  parser.add_argument("--no-compile", action="store_true",
                      help="skip compiling the train step (no memory analysis)")
  parser.add_argument("--warn-replicated", type=int, default=REPLICATED_WARN_BYTES,
                      metavar="BYTES", help="warn about fully replicated parameters at least "
                                            "this large (default 1 MiB)")
  parser.add_argument("overrides", nargs="*", help="key=value overrides")
  return parser.parse_args(argv)


def setup_devices(config, devices: int | None) -> None:
  """Before any JAX computation: N virtual CPU devices for ``--devices N``, else the
  devices ``python -m recipes.train`` would use."""
  if devices is None:
    from recipes import train
    train.setup_devices(config)
    return
  import jax
  jax.config.update("jax_platforms", "cpu")  # planning happens on virtual CPU devices
  jax.config.update("jax_num_cpu_devices", devices)


def check_mesh_size(config, devices: int | None) -> None:
  """With ``--devices N``: N is positive and the mesh uses all N devices (else the plan
  would be for fewer). The mesh the error suggests also passes the training job's own
  checks (the batch divides into its shards), so following it does not fail next."""
  if devices is None:
    return
  if devices < 1:
    raise ExplainError(f"--devices {devices}: give a positive number of devices, e.g. "
                       "--devices 64.")
  sizes = list(config.mesh.values())
  fixed = math.prod(v for v in sizes if v > 0)
  fills = -1 in sizes
  if (fills and devices % fixed) or (not fills and fixed != devices):
    raise ExplainError(
        f"mesh={config.mesh} does not use the {devices} devices of --devices {devices} "
        f"(its sizes multiply to {fixed}{' and -1 cannot fill the rest' if fills else ''}). "
        f"Give one axis -1 to fill them, e.g. "
        f"{fitting_mesh(config.mesh, devices, _run_problem(config))}, or "
        f"sizes whose product is {devices}.")


def _run_problem(config):
  """``sizes -> what recipes.train would refuse about config on a mesh of these sizes`` (None:
  nothing). Axes the rules name but the mesh lacks count as size 1: a missing axis is its
  own error, whatever the sizes."""
  import jax

  from recipes import train
  rules = train.make_rules(config)

  def problem(mesh: dict[str, int]) -> str | None:
    mesh = {**mesh, **{a: 1 for a in rules.mesh_axes if a not in mesh}}
    found = train.run_problems(dataclasses.replace(config, mesh=mesh), rules,
                               jax.sharding.AbstractMesh(tuple(mesh.values()), tuple(mesh)))
    return "; ".join(found) or None
  return problem


def fitting_mesh(mesh: dict[str, int], devices: int, problem=lambda sizes: None) -> str:
  """A command-line mesh close to ``mesh`` that uses exactly ``devices`` devices: its ``-1``
  axis (else the first) fills the rest, the other axes shrink to sizes that divide what is
  left, as little as they can and so that ``problem`` (``sizes -> None, or why the run would
  refuse them``) finds nothing. Axes never grow (a size that divides no dim would replicate
  everything): where every such mesh has a problem, the closest, followed by that problem.

  >>> fitting_mesh({'data': 3, 'fsdp': -1}, 64)
  "mesh='{data: 2, fsdp: -1}'"
  >>> fitting_mesh({'data': 4, 'fsdp': 2, 'tensor': 2}, 16)
  "mesh='{data: -1, fsdp: 2, tensor: 2}'"
  >>> six_layers = lambda sizes: None if 6 % sizes['stage'] == 0 else '6 layers, 4 stages'
  >>> fitting_mesh({'data': 2, 'stage': 4}, 8, six_layers)
  "mesh='{data: -1, stage: 2}'"
  >>> fitting_mesh({'data': 2, 'stage': 4}, 8, lambda sizes: 'batch 3 does not divide')
  "mesh='{data: -1, stage: 4}' (then: batch 3 does not divide)"
  """
  names = list(mesh)
  fill = next((k for k, v in mesh.items() if v == -1), names[0])
  others = [k for k in names if k != fill]

  def shrunk(left: int, axes: list[str]):
    if not axes:
      yield {}
      return
    for d in (d for d in range(max(mesh[axes[0]], 1), 0, -1) if left % d == 0):
      for rest in shrunk(left // d, axes[1:]):
        yield {axes[0]: d, **rest}

  candidates = sorted(shrunk(devices, others),
                      key=lambda sizes: sum(math.log(mesh[k] / sizes[k]) for k in others))

  def text(sizes: dict[str, int]) -> str:
    return "mesh='{" + ", ".join(f"{k}: {sizes.get(k, -1)}" for k in names) + "}'"

  def problem_of(sizes: dict[str, int]) -> str | None:
    return problem({k: sizes.get(k, devices // math.prod(sizes.values())) for k in names})

  for sizes in candidates[:256]:
    if problem_of(sizes) is None:
      return text(sizes)
  return f"{text(candidates[0])} (then: {problem_of(candidates[0])})"


def main(argv: Sequence[str] | None = None) -> int:
  from recipes import train
  from recipes.config import TrainConfigError, load_config
  try:
    args = parse_args(argv)
    config = load_config(args.config or train.default_config_path(), args.overrides)
    check_mesh_size(config, args.devices)
    setup_devices(config, args.devices)
    p = explain_config(config, compile=not args.no_compile,
                       replicated_warn_bytes=args.warn_replicated)
  except (TrainConfigError, PartitionError) as e:  # config, rules, mesh: say what to fix
    print(f"error: {e}", file=sys.stderr)
    return 2
  if args.json:
    print(json.dumps(p.to_dict(), indent=2))
  else:
    render(p)
  return 0


if __name__ == "__main__":
  sys.exit(main())


# Old names kept for one release: ``recipes.explain.<old>`` still works and warns.
__getattr__ = deprecated_getattr("recipes.explain", {
    "Plan": ("recipes.explain.Explanation (the same class, renamed: 'plan' names the planner, "
             "python -m recipes.plan)", lambda: Explanation),
    "plan": ("recipes.explain.explain_config", lambda: explain_config),
})
