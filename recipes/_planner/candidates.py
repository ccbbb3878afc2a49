"""What the planner searches over: the candidate plans of a config, and how one becomes a
config ``python -m recipes.train`` runs.

A :class:`Candidate` is a preset, a mesh (one factorisation of the device count over the
preset's mesh axes), a micro-batch count and a remat policy. :func:`candidates` lists the
distinct ones (two plans whose every sharding agrees once size-1 axes are dropped are one);
:func:`model_params` gives the parameter shapes the analytic screen prices them with.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from partition import PartitionError
from recipes import plan_model


class PlanError(PartitionError, ValueError):
  """The plan command was given arguments it cannot plan with."""


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One plan: a preset, a mesh (axis -> size, outermost first), micro-batches and remat."""

  preset: str
  mesh: tuple[tuple[str, int], ...]
  microbatches: int
  remat: str

  @property
  def mesh_dict(self) -> dict[str, int]:
    return dict(self.mesh)

  def label(self) -> str:
    mesh = "x".join(f"{k}{v}" for k, v in self.mesh if v > 1) or "1"
    return f"{self.preset} [{mesh}] k={self.microbatches} remat={self.remat}"

  def __repr__(self) -> str:
    return f"Candidate({self.label()})"


def factorisations(n: int, k: int) -> list[tuple[int, ...]]:
  """Every ordered ``k``-tuple of positive ints whose product is ``n``.

  >>> factorisations(4, 2)
  [(1, 4), (2, 2), (4, 1)]
  """
  if k == 1:
    return [(n,)]
  return [(d,) + rest for d in range(1, n + 1) if n % d == 0
          for rest in factorisations(n // d, k - 1)]


def powers_of_two(limit: int) -> list[int]:
  """1, 2, 4, ... up to ``limit``.

  >>> powers_of_two(6)
  [1, 2, 4]
  """
  return [2 ** i for i in range(int(math.log2(max(1, limit))) + 1)]


def preset_rules(config, preset: str):
  """The ``AxisRules`` of ``preset`` with the config's own rule overrides applied."""
  import partition
  from recipes.config import preset_path
  rules = partition.AxisRules.from_file(preset_path(preset))
  return rules.override(*config.rules) if config.rules else rules


def candidates(config, params, presets: Sequence[str], devices: int,
               remats: Sequence[str], max_microbatches: int) -> tuple[list[Candidate], dict]:
  """Distinct candidates (two plans whose every spec matches after dropping size-1 axes
  are one) that ``python -m recipes.train`` would run (:func:`refusals`), and per preset why
  none was kept (``{}`` if some were)."""
  out, seen, empty = [], set(), {}
  for preset in presets:
    rules = preset_rules(config, preset)
    axes = plan_model.mesh_axes_of(rules)
    check = _refusals_of(config, preset)
    refused: dict[str, None] = {}     # train's reasons, in order, each once
    idle_refused: dict[str, None] = {}   # ... on meshes with an idle axis
    valid = kept = 0
    for sizes in factorisations(devices, len(axes)):
      mesh = dict(zip(axes, sizes))
      counts = _microbatch_counts(config, rules, mesh, max_microbatches)
      sig = plan_model.sharding_signature(params, rules, mesh, config.batch_size,
                                          config.seq_len)
      idle = _has_idle_axis(mesh, sig)
      runnable = []
      for k in counts:
        problems = check(mesh, k)
        (idle_refused if idle else refused).update(dict.fromkeys(problems))
        if not problems:
          runnable.append(k)
      if idle or not runnable:
        continue
      valid += 1
      for k in runnable:
        for remat in remats:
          if (sig, k, remat) not in seen:
            seen.add((sig, k, remat))
            out.append(Candidate(preset, tuple(mesh.items()), k, remat))
            kept += 1
    if not kept:
      # an idle axis train refuses to fill (a pipeline over an unscanned stack) is the
      # cause where some mesh was valid, else the batch that splits over no mesh is
      why = list(refused) + (list(idle_refused) if valid else [])
      empty[preset] = _why_none(config, devices, axes, valid, why)
  return out, empty


def refusals(config, c: Candidate) -> list[str]:
  """Why ``python -m recipes.train`` would refuse the candidate's config, one line each
  (``[]``: it runs): ``train.run_problems`` (the check train itself makes before it compiles:
  mesh axes, layer count over pipeline stages x repeats, ``scan_layers``, the batch over its
  shards x micro-batches and, pipelined, over the pipeline micro-batches per device)."""
  return _refusals_of(config, c.preset)(c.mesh_dict, c.microbatches)


def _refusals_of(config, preset: str):
  """``(mesh, k) -> refusals`` for ``preset``, its rules built once."""
  import jax

  from recipes import train
  rules = None

  def check(mesh: dict[str, int], k: int) -> list[str]:
    nonlocal rules
    one = dataclasses.replace(config, preset=preset, mesh=dict(mesh), microbatches=k)
    if rules is None:
      rules = train.make_rules(one)   # the same for every mesh and k (microbatches is set)
    amesh = jax.sharding.AbstractMesh(tuple(mesh.values()), tuple(mesh))
    return train.run_problems(one, rules, amesh)
  return check


def _has_idle_axis(mesh: dict[str, int], signature) -> bool:
  """A mesh axis of size > 1 that neither splits the batch nor holds a shard: its devices
  would be idle copies."""
  used = {a for spec in signature[:-1] for dim in spec for a in dim}
  return any(v > 1 and a not in used for a, v in mesh.items())


def _microbatch_counts(config, rules, mesh: dict[str, int], limit: int) -> list[int]:
  """Powers of two up to ``limit`` that divide the rows each device holds."""
  rows, _ = plan_model.batch_groups(rules, mesh, config.batch_size, config.seq_len)
  per_device_rows = config.batch_size // math.prod(mesh[a] for a in rows)
  return [k for k in powers_of_two(min(limit, per_device_rows)) if per_device_rows % k == 0]


def _why_none(config, devices: int, axes, valid: int, refused: list[str]) -> str:
  """Why a preset kept no plan: what train refuses (the real cause, e.g.
  ``model.scan_layers=false`` for a pipeline preset), then duplicates or an uneven batch."""
  why = []
  if refused:
    shown = "; ".join(refused[:3]) + (f" (and {len(refused) - 3} more)" if len(refused) > 3
                                      else "")
    why.append(f"python -m recipes.train would refuse its plans: {shown}")
  if valid:
    why.append(("the others are" if refused else "every plan is") + " one an earlier "
               "preset already gives (same shardings)")
  elif not refused:
    why.append(f"no factorisation of {devices} over its mesh axes {axes} splits "
               f"batch_size={config.batch_size} x seq_len={config.seq_len} evenly")
  return "; ".join(why)


# -- model shapes (the one place that builds a run) ------------------------------------------


def model_params(config) -> list[plan_model.ParamShape]:
  """The model's parameters (shapes, dtypes, logical axes) without allocating them: the
  run is traced under ``jax.eval_shape`` on a one-device mesh (shapes do not depend on it)."""
  import jax
  import numpy as np
  one = dataclasses.replace(config, preset="data_parallel", mesh={"data": 1}, rules=(),
                            microbatches=1)
  run, state = abstract_run(one)
  axes = run.state_axes["params"]
  is_axes = lambda a: a is None or (type(a) is tuple and all(
      n is None or isinstance(n, str) for n in a))
  flat_axes = jax.tree.leaves(axes, is_leaf=is_axes)
  flat = jax.tree_util.tree_flatten_with_path(state["params"])[0]
  return [plan_model.ParamShape("/".join(str(getattr(k, "key", k)) for k in path),
                                tuple(leaf.shape), int(np.dtype(leaf.dtype).itemsize), ax)
          for (path, leaf), ax in zip(flat, flat_axes)]


def abstract_run(config):
  """``recipes.explain.abstract_run`` of :func:`runnable_here` ``(config)``: the run traced
  without allocation (wrapped here so a move of that function touches one line)."""
  from recipes import explain
  return explain.abstract_run(runnable_here(config))


def runnable_here(config):
  """``config`` with a fused attention kernel this process cannot run (cuDNN off an NVIDIA
  GPU, the Pallas kernel off a TPU) replaced by ``'blockwise'``: a plan for a GPU made on a
  CPU still traces (parameter shapes do not depend on the kernel) and compiles (for its
  collectives; a fused kernel's memory is the estimate's, ``search._memory_per_device``).
  The plan written and ``--measure`` keep the user's kernel."""
  import layers
  model = config.model
  if model.attention not in ("cudnn", "pallas"):
    return config
  try:
    layers.attention_choice(model, batch=config.batch_size, length=config.seq_len)
  except layers.AttentionError:
    return dataclasses.replace(config, model=dataclasses.replace(model, attention="blockwise"))
  return config


def candidate_config(config, c: Candidate):
  """``config`` with the candidate's preset, mesh, micro-batches and remat."""
  model = dataclasses.replace(config.model, remat=c.remat)
  return dataclasses.replace(config, preset=c.preset, mesh=c.mesh_dict,
                             microbatches=c.microbatches, model=model)


def config_yaml(config) -> str:
  """``config`` as a YAML document ``load_config`` reads back to an equal config."""
  import yaml
  d = config.to_dict()
  if all(v is None for v in d.get("distributed", {}).values()):
    d.pop("distributed", None)
  return yaml.safe_dump(d, sort_keys=False)
