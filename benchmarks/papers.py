"""Section 8: communication and memory of a training step vs the papers' analytic figures.

The ``layers`` Transformer (2 layers, grouped-query attention, embedding tied to the output
projection; 4 experts per layer for ``expert_parallel``) takes one AdamW step under each
preset on 8 devices, built as in section 6: ours (``init_sharded`` + ``optimizer_init`` +
``partition.value_and_grad``, default ``grad_reduction='auto'``) and the hand-written flax +
``jit`` program (``jax.value_and_grad``, a ``lax.scan`` over strided micro-batches for
``k > 1``). Per device, from the compiled programs:

* **collective bytes**: ``partition.collective_stats`` (ring bytes, loop trip counts, XLA:CPU's
  all-reduce + dynamic-slice counted as the reduce-scatter it stands for) against
  :func:`analytic_bytes`, the sum of the papers' terms for the config, and against the
  hand-written program;
* **argument bytes** against params + Adam moments + step count + the batch, each array at
  the size its sharding leaves on one device (:func:`analytic_argument_bytes`);
* **temp bytes** against the hand-written program (the analytic gradient bytes are in the
  metric's label: temps also hold activations).

The analytic terms (``S``: bytes of an array as model parallelism leaves it on a device;
``n``: devices of the reduction's axes; 4-byte floats):

* gradients and parameters, ZeRO (Rajbhandari et al., "ZeRO: Memory Optimizations Toward
  Training Trillion Parameter Models", SC'20, §5 and §7.1), over the mesh axes the tokens
  are split on (the batch's and, with sequence parallelism, the sequence's: each sequence
  device computes its chunk's share of every replicated weight's gradient, so the gradient
  is summed over data x sequence, as Megatron-Core's context parallelism reduces it over
  its data x context group): a parameter replicated over those axes is all-reduced once per
  step, ``2 S (n-1)/n`` (data parallelism, whatever
  the micro-batch count); one sharded over ``f`` of them (ZeRO-3 / FSDP) is all-gathered
  once (``S (f-1)/f``; the gathered weights are kept for the backward pass, so not the
  paper's second gather), its gradient reduce-scattered (``S (f-1)/f``) and the shard
  all-reduced over the other batch axes (``2 (S/f) (r-1)/r``), per micro-batch on the
  ``'per_microbatch'`` schedule that ``grad_reduction='auto'`` gives FSDP parameters (as
  ZeRO's partitioned gradients are reduced every micro-step), once with
  ``grad_reduction='once'`` — see :func:`zero_bytes`;
* tensor parallelism, Megatron-LM (Shoeybi et al., 2019, §3): per layer two all-reduces of
  the ``[tokens, embed]`` activations forward and two backward, plus one forward all-reduce
  after the vocabulary-parallel embedding lookup and one backward after the output
  projection — see :func:`megatron_bytes`;
* sequence parallelism: attention all-gathers K and V over the sequence axis forward and
  reduce-scatters their gradients backward — see :func:`sequence_bytes`;
* expert parallelism, GShard (Lepikhin et al., 2020, §2.2) / Switch Transformer: two
  all-to-alls of the dispatched ``[experts, capacity, embed]`` tokens forward (dispatch,
  combine) and two backward — see :func:`expert_bytes`.

Scalars (the loss, the cross-entropy's per-token max and sum over a sharded vocabulary)
are left out: under 1 % of every row here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import layers
import layers.linen
import partition
from benchmarks.common import (
  BYTES_TARGET,
  MEMORY_TARGET,
  Row,
  Section,
  auto_mesh,
  flax_rules,
  log,
  memory,
)
from benchmarks.train_step import (
  BATCH_AXES,
  PRESETS,
  cross_entropy,
  micro_scan,
  sharded_inputs,
)
from partition.internal import entry_mesh_axes

NAME = "papers"
TITLE = "8. communication and memory per step vs Megatron-LM / ZeRO / GShard"
F32 = 4
#: (preset, mesh shape, mesh axis names, micro-batches[, grad_reduction])
CASES = (
    ("data_parallel", (8,), ("data",), 1),
    ("fsdp", (2, 4), ("data", "fsdp"), 1),
    ("tensor_parallel", (4, 2), ("data", "tensor"), 1),
    ("fsdp_tp", (2, 2, 2), ("data", "fsdp", "tensor"), 1),
    ("sequence_parallel", (2, 4), ("data", "sequence"), 1),
    ("expert_parallel", (2, 4), ("data", "expert"), 1),
    ("data_parallel", (8,), ("data",), 4),
    ("fsdp", (2, 4), ("data", "fsdp"), 4),
    ("fsdp", (2, 4), ("data", "fsdp"), 4, "once"),
)

QUICK_CASES = (CASES[2], CASES[6])  # tensor_parallel, data_parallel k=4


def config(quick: bool, experts: int = 0) -> layers.TransformerConfig:
  if quick:
    return layers.TransformerConfig(vocab_size=64, embed_dim=32, mlp_dim=64, num_heads=4,
                                    num_kv_heads=2, head_dim=8, num_layers=2,
                                    num_experts=experts)
  return layers.TransformerConfig(vocab_size=512, embed_dim=128, mlp_dim=512, num_heads=4,
                                  num_kv_heads=2, head_dim=32, num_layers=2,
                                  num_experts=experts)


# ------------------------------------------------------------------------ analytic terms


def _ring(kind: str, size: float, n: int) -> float:
  """Bytes one device sends: all-reduce ``2 S (n-1)/n``, the others ``S (n-1)/n``."""
  return 0.0 if n <= 1 else (2 if kind == "all-reduce" else 1) * size * (n - 1) / n


def zero_bytes(param_axes: Any, params: Any, rules: partition.AxisRules, mesh: Any,
               batch_mesh_axes: tuple[str, ...], k: int = 1) -> float:
  """Gradient reduction and parameter gathering per device and step (ZeRO §5, §7.1).

  ``batch_mesh_axes``: the mesh axes the tokens are split on (``Case.token_mesh_axes``).

  For each parameter: ``S`` = its bytes after the model-parallel axes of its spec (those not
  carrying the batch, plus a batch axis its ``expert`` dim lies on: expert weights are used
  where they are, never gathered); ``f`` = the other batch axes of its spec (FSDP), ``r`` =
  the batch axes it is replicated over. Adds ``all-gather(S, f)``, ``reduce-scatter(S, f)``
  and ``all-reduce(S/f, r)``; the two gradient terms ``k`` times when the parameter is
  sharded over batch axes (reduced per micro-batch), once otherwise.
  """
  total = 0.0
  flat_axes = jax.tree.leaves(param_axes, is_leaf=lambda x: isinstance(x, tuple))
  for logical, x in zip(flat_axes, jax.tree.leaves(params)):
    spec = rules.spec(logical, x.shape, mesh)
    placed = [(name, axis) for name, e in zip(logical, spec) for axis in entry_mesh_axes(e)]
    local, fsdp = x.size * F32, 1
    for name, axis in placed:
      if axis in batch_mesh_axes and name != "expert":
        fsdp *= mesh.shape[axis]
      else:
        local /= mesh.shape[axis]
    used = {axis for _, axis in placed}
    replicated = math.prod(mesh.shape[a] for a in batch_mesh_axes if a not in used)
    times = k if fsdp > 1 else 1
    total += _ring("all-gather", local, fsdp)
    total += times * (_ring("reduce-scatter", local, fsdp)
                      + _ring("all-reduce", local / fsdp, replicated))
  return total


def megatron_bytes(cfg: layers.TransformerConfig, tokens: int, t: int) -> float:
  """Megatron-LM §3: ``4 L + 2`` all-reduces of ``[tokens, embed]`` over the ``t`` tensor
  devices (``tokens`` per data-parallel replica): 2 per layer forward (after attention and
  after the MLP), 2 backward (their input gradients, with Q/K/V and gate/up each one
  matmul), 1 after the vocabulary-parallel embedding lookup, 1 backward at the output."""
  return (4 * cfg.num_layers + 2) * _ring("all-reduce", tokens * cfg.embed_dim * F32, t)


def sequence_bytes(cfg: layers.TransformerConfig, tokens: int, q: int) -> float:
  """Per layer: all-gather K and V (``[tokens, kv_heads, head_dim]``, ``tokens`` the whole
  sequences a device's rows hold) over the ``q`` sequence devices, reduce-scatter their
  gradients backward.

  ``tokens`` is ``rows * length`` (the gathered K/V a device holds, read in the HLO:
  ``f32[rows, length, kv_heads, head_dim]``); an earlier version multiplied it by ``q``
  once more, counting each gather ``q`` times its size."""
  kv = tokens * cfg.num_kv_heads * cfg.head_dim * F32
  return cfg.num_layers * 2 * (_ring("all-gather", kv, q) + _ring("reduce-scatter", kv, q))


def expert_bytes(cfg: layers.TransformerConfig, rows: int, length: int, e: int,
                 capacity_factor: float = 1.25) -> float:
  """GShard §2.2: per MoE layer 4 all-to-alls over the ``e`` expert devices of a device's
  dispatched tokens ``[rows, experts, capacity, embed]`` (``rows`` its sequences): dispatch
  and combine forward, their transposes backward."""
  # the model's capacity rule (layers' MoE docs): ceil(factor * length * top_k / experts)
  slots = max(1, math.ceil(capacity_factor * length * cfg.experts_per_token / cfg.num_experts))
  dispatched = rows * cfg.num_experts * slots * cfg.embed_dim * F32
  return cfg.num_layers * 4 * _ring("all-to-all", dispatched, e)


def analytic_terms(case: Case) -> dict[str, float]:
  """The papers' collective bytes per device for one step of ``case``, by term: ``zero``
  (gradients and FSDP gathers over the batch's mesh axes), ``megatron`` (the tensor axis),
  ``sequence``, ``expert``."""
  cfg, mesh, batch_axes = case.cfg, case.mesh, case.batch_mesh_axes
  k = 1 if case.grad_reduction == "once" else case.k  # gradient reductions per step
  terms = {"zero": zero_bytes(case.axes, case.params, case.rules, mesh,
                             case.token_mesh_axes, k)}
  replicas = math.prod(mesh.shape[a] for a in batch_axes)
  if "tensor" in mesh.shape:
    terms["megatron"] = megatron_bytes(cfg, case.n * case.length // replicas,
                                       mesh.shape["tensor"])
  if "sequence" in mesh.shape:
    q = mesh.shape["sequence"]
    terms["sequence"] = sequence_bytes(cfg, case.n * case.length // replicas, q)
  if "expert" in mesh.shape and cfg.num_experts:
    terms["expert"] = expert_bytes(cfg, case.n // replicas, case.length, mesh.shape["expert"])
  return terms


def analytic_bytes(case: Case) -> float:
  """The sum of :func:`analytic_terms`."""
  return sum(analytic_terms(case).values())


def analytic_argument_bytes(case: Case) -> float:
  """Params + Adam's two moments (each at its per-device shard size), Adam's step count,
  and the batch's token and target ids (their per-device rows)."""
  params = sum(_local_bytes(x, case.rules.spec(a, x.shape, case.mesh), case.mesh)
               for a, x in zip(jax.tree.leaves(case.axes, is_leaf=lambda v: isinstance(
                   v, tuple)), jax.tree.leaves(case.params)))
  batch = sum(_local_bytes(x, x.sharding.spec, case.mesh) for x in jax.tree.leaves(case.batch))
  return 3 * params + 4 + batch


def _local_bytes(x: Any, spec: Any, mesh: Any) -> float:
  split = math.prod(mesh.shape[a] for e in spec for a in entry_mesh_axes(e))
  return x.size * x.dtype.itemsize / split


# ------------------------------------------------------------------------------- programs


@dataclasses.dataclass
class Case:
  """One preset's step: both programs, their arguments and what the formulas need."""

  label: str
  cfg: layers.TransformerConfig
  rules: partition.AxisRules
  mesh: Any
  k: int
  n: int
  length: int
  params: Any
  axes: Any
  batch: Any
  batch_mesh_axes: tuple[str, ...]
  grad_reduction: str = "auto"
  ours: Any = None
  base: Any = None
  args: tuple = ()

  @property
  def token_mesh_axes(self) -> tuple[str, ...]:
    """The mesh axes the tokens are split on: the batch's, then the sequence's (``length``)
    where the rules shard it; weights' gradients are summed over all of them."""
    length = entry_mesh_axes(tuple(self.rules.spec(("length",), (self.length,), self.mesh))[0]
                    if self.length else None)
    return self.batch_mesh_axes + tuple(a for a in length if a not in self.batch_mesh_axes)

  def context(self):
    @contextlib.contextmanager
    def both():
      with jax.set_mesh(self.mesh), partition.axis_rules(self.rules, self.mesh):
        yield
    return both()


def build(preset: str, shape: tuple[int, ...], names: tuple[str, ...], k: int,
          quick: bool, grad_reduction: str = "auto") -> Case:
  rules = partition.AxisRules.from_file(PRESETS / f"{preset}.yaml")
  mesh = auto_mesh(shape, names)
  cfg = config(quick, experts=4 if preset == "expert_parallel" else 0)
  model = layers.linen.Transformer(cfg)
  n, length = (32, 8) if quick else (32, 32)
  rng = np.random.default_rng(8)
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (n, length + 1)), jnp.int32)
  tx = optax.adamw(1e-3)
  loss = cross_entropy(model)
  params, axes, opt_state, batch, rows = sharded_inputs(model, tokens, tx, rules, mesh)
  batch_mesh_axes = entry_mesh_axes(tuple(rows.spec)[0] if len(rows.spec) else None)
  m = math.prod(mesh.shape[a] for a in batch_mesh_axes)
  label = preset + (f" k={k}" if k > 1 else "") + (
      f" {grad_reduction}" if grad_reduction != "auto" else "")
  case = Case(label, cfg, rules, mesh, k, n, length, params, axes, batch, batch_mesh_axes,
              grad_reduction)

  with partition.axis_rules(rules, mesh):
    abstract = jax.eval_shape(model.init, jax.random.key(0), tokens[:, :-1])
  shard = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh,
                                      flax_rules(rules))["params"]
  opt_shard = jax.tree.map(lambda x: x.sharding, opt_state)
  vg = partition.value_and_grad(loss, batch_axes=BATCH_AXES, param_axes=axes, rules=rules,
                                mesh=mesh, microbatches=k, grad_reduction=grad_reduction)
  base_vg = micro_scan(loss, k, m, shard, rows) if k > 1 else jax.value_and_grad(loss)

  def ours(params, opt_state, batch):
    value, grads = vg(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  def base(params, opt_state, batch):
    value, grads = base_vg(params, batch)
    grads = lax.with_sharding_constraint(grads, shard)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  case.ours = jax.jit(ours)
  case.base = jax.jit(base, in_shardings=(shard, opt_shard, rows),
                      out_shardings=(shard, opt_shard, NamedSharding(mesh, P())))
  case.args = (params, opt_state, batch)
  return case


# ------------------------------------------------------------------------------ section


def run(quick: bool) -> Section:
  section = Section(NAME, TITLE)
  series = {}
  for preset, shape, names, k, *schedule in (QUICK_CASES if quick else CASES):
    case = build(preset, shape, names, k, quick, *schedule)
    with case.context():
      compiled = [f.lower(*case.args).compile() for f in (case.ours, case.base)]
      out_ours, out_base = (c(*case.args) for c in compiled)
      section.check(case.label, (out_ours[2], out_ours[1]), (out_base[2], out_base[1]))
    stats = [partition.collective_stats(c, case.mesh) for c in compiled]
    mem = [memory(c) for c in compiled]
    terms = analytic_terms(case)
    minimum = sum(terms.values())
    args_min = analytic_argument_bytes(case)
    workload = f"{case.label} mesh {dict(case.mesh.shape)}"
    log(f"  {workload}: ours {stats[0]!r}\n    hand-written {stats[1].total_bytes:.0f} B, "
        f"analytic {minimum:.0f} B {terms}")
    ratio = stats[0].total_bytes / minimum
    section.rows += [
        Row(NAME, workload, f"collective bytes/device vs analytic ({_ops(stats[0])})",
            stats[0].total_bytes, minimum, "bytes", BYTES_TARGET,
            excess_note(case, stats[0], terms) if ratio > BYTES_TARGET else "",
            baseline_label="analytic (papers)"),
        Row(NAME, workload, f"collective bytes/device vs hand-written jit ({_ops(stats[1])})",
            stats[0].total_bytes, stats[1].total_bytes, "bytes", 1.0),
        Row(NAME, workload, "argument bytes/device vs params+Adam+batch",
            mem[0]["argument"], args_min, "bytes", 1.0, baseline_label="analytic"),
        Row(NAME, workload, f"temp bytes/device vs hand-written jit (the gradients alone: "
            f"{args_min / 3 / 2**10:.0f} KiB)", mem[0]["temp"], mem[1]["temp"], "bytes",
            MEMORY_TARGET),
    ]
    series[case.label] = {"ours": stats[0].total_bytes, "hand_written": stats[1].total_bytes,
                          "analytic": minimum, "analytic_terms": terms,
                          "collectives_ours": stats[0].as_dict(),
                          "collectives_hand_written": stats[1].as_dict(),
                          "argument_bytes": mem[0]["argument"], "argument_analytic": args_min,
                          "temp_ours": mem[0]["temp"], "temp_hand_written": mem[1]["temp"]}
  section.series["papers"] = series
  return section


def excess_note(case: Case, stats: Any, terms: dict[str, float]) -> str:
  """Where the measured bytes exceed the analytic terms: per term, the collectives over its
  mesh axes (measured), with what they are."""
  batch = set(case.token_mesh_axes)
  model_axis = {"megatron": "tensor", "sequence": "sequence", "expert": "expert"}
  parts = []
  for term, want in terms.items():
    if term == "zero":  # over batch axes only; the tokens' all-to-alls are the expert term
      ops = [op for op in stats.ops if op.axes and set(op.axes) <= batch
             and op.kind != "all-to-all"]
    elif term == "expert":
      ops = stats.select("all-to-all")
    else:
      ops = [op for op in stats.ops if op.axes == (model_axis[term],)]
    got = sum(op.bytes for op in ops)
    if got > want * BYTES_TARGET:
      kinds = {}
      for op in ops:
        kinds[op.kind] = kinds.get(op.kind, 0) + op.count
      parts.append(f"{term}: {got / 2**10:.1f} KiB measured vs {want / 2**10:.1f} KiB "
                   f"({', '.join(f'{n} {k}' for k, n in kinds.items())})")
  rest = stats.total_bytes - sum(terms.values())
  return "; ".join(parts + [f"+{rest / 2**10:.1f} KiB in all"])


def _ops(stats: Any) -> str:
  return ", ".join(f"{int(v['count'])} {kind} {'x'.join(axes) if axes else '?'}"
                   for (kind, axes), v in sorted(stats.table().items(), key=str)) or "none"
