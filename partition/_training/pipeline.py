"""Pipeline parallelism as a named axis: the stacked ``layers`` axis on a ``stage`` mesh axis.

A scanned model keeps its blocks' parameters stacked along a leading ``layers`` axis (what
``nn.scan``, ``nnx.scan`` and ``hk.layer_stack`` produce). Mapping that axis to a mesh axis
with a rules line such as ``('layers', 'stage')`` puts ``L / p`` consecutive layers on each
of the ``p`` devices of the ``stage`` axis. :func:`pipeline` then runs the stack as a
pipeline: the batch is cut into ``m`` micro-batches, micro-batch ``i`` enters stage 0 at
iteration ``i``, and after every iteration each stage hands its activation to the next stage
with one ``lax.ppermute`` over ``stage``. The forward pass is one ``lax.scan`` of
``m + p - 1`` iterations (GPipe); the backward pass is JAX's transpose of that scan (the
``ppermute`` transposes to the reverse shift), so there is no hand-written backward.

Circular (interleaved) schedules, ``repeats=r``: each stage holds ``r`` chunks of
``L / (p r)`` layers, chunk ``c`` of the stack on stage ``c mod p``; a micro-batch goes round
the ring ``r`` times, and the loop runs ``r m + p - 1`` iterations. The bubble (the idle
share of stage-iterations) is ``(p - 1) / (m + p - 1)`` for GPipe and
``(p - 1) / (r m + p - 1)`` circular.

The stage axis is manual (``jax.shard_map(..., axis_names={stage})``); every other mesh axis
stays automatic, so data, FSDP and tensor shardings of the batch and the parameters carry
through the pipeline unchanged.

Example:
  >>> import jax, jax.numpy as jnp, numpy as np
  >>> import partition
  >>> mesh = jax.make_mesh((4, 2), ('stage', 'data'),
  ...                      axis_types=(jax.sharding.AxisType.Auto,) * 2)
  >>> def layer(w, h):
  ...   return h + jnp.tanh(h @ w)
  >>> ws = jnp.stack([jnp.eye(3) * (i + 1) / 10 for i in range(8)])   # 8 stacked layers
  >>> x = jnp.arange(24.0).reshape(8, 3) / 24
  >>> y = partition.pipeline(layer, ws, x, microbatches=4, stage_axis='stage', mesh=mesh)
  >>> ref = jax.lax.scan(lambda h, w: (layer(w, h), None), x, ws)[0]
  >>> bool(np.allclose(y, ref, rtol=1e-6))
  True
  >>> partition.pipeline_bubble(stages=4, microbatches=4)
  0.42857142857142855
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from partition._base import mesh as _mesh
from partition._base.errors import PartitionError, did_you_mean, format_message, fun_name
from partition._base.mesh import entry_mesh_axes, to_spec_entry
from partition._rules.context import axis_rules, current_rules, current_rules_mesh
from partition._training.reduce_once import placeholder_rules


class PipelineError(PartitionError, ValueError):
  """A pipeline cannot be built from these layers, micro-batches, rules or mesh."""


class StageAxisError(PipelineError):
  """No usable stage mesh axis: missing, not in the mesh, or shared with another axis."""


class LayerCountError(PipelineError):
  """The stacked layers do not split evenly into ``stages x repeats`` chunks."""


class MicrobatchError(PipelineError):
  """Too few micro-batches for the stages, or a batch they do not divide."""


def pipeline_bubble(stages: int, microbatches: int, repeats: int = 1) -> float:
  """The idle share of stage-iterations: ``(p - 1) / (r m + p - 1)``.

  Each of the ``p`` stages runs ``r m + p - 1`` iterations and does useful work in ``r m``
  of them (GPipe is ``r = 1``).

  >>> pipeline_bubble(4, 8), pipeline_bubble(4, 8, repeats=2)
  (0.2727272727272727, 0.15789473684210525)
  """
  return (stages - 1) / (repeats * microbatches + stages - 1)


def pipeline_iterations(stages: int, microbatches: int, repeats: int = 1) -> int:
  """Loop trip count of the schedule: ``r m + p - 1`` (GPipe: ``m + p - 1``)."""
  return repeats * microbatches + stages - 1


@dataclasses.dataclass(frozen=True)
class PipelineShape:
  """The static shape of one pipeline call (also what ``explain`` reports)."""

  stage_axis: str | None
  stages: int
  repeats: int
  microbatches: int
  num_layers: int

  @property
  def layers_per_chunk(self) -> int:
    return self.num_layers // (self.stages * self.repeats)

  @property
  def iterations(self) -> int:
    return pipeline_iterations(self.stages, self.microbatches, self.repeats)

  @property
  def bubble(self) -> float:
    return pipeline_bubble(self.stages, self.microbatches, self.repeats)

  def stage_layers(self, stage: int) -> tuple[int, ...]:
    """The stack indices of the layers stage ``stage`` applies, in the order it applies them.

    >>> PipelineShape('stage', 2, 2, 4, 8).stage_layers(1)
    (2, 3, 6, 7)
    """
    k = self.layers_per_chunk
    return tuple(rep * self.stages * k + stage * k + j
                 for rep in range(self.repeats) for j in range(k))

  def schedule(self) -> tuple[tuple[tuple[int, int] | None, ...], ...]:
    """Who works on what: ``[iteration][stage]`` -> ``(micro-batch, repeat)`` or ``None`` (idle).

    Stage ``s`` at iteration ``t`` holds item ``k = t - s`` (micro-batch ``k mod m`` on its
    ``k // m``-th trip round the ring) when ``0 <= k < r m``; the program runs exactly this.

    >>> PipelineShape('stage', 2, 1, 2, 2).schedule()
    (((0, 0), None), ((1, 0), (0, 0)), (None, (1, 0)))
    """
    total = self.repeats * self.microbatches
    return tuple(
        tuple((k % self.microbatches, k // self.microbatches) if 0 <= (k := t - s) < total
              else None for s in range(self.stages))
        for t in range(self.iterations))

  def diagram(self) -> str:
    """The forward schedule as text: one row per stage, one column per iteration.

    A cell is the micro-batch the stage works on (``.`` idle); circular schedules add the
    trip round the ring as a letter (``0a`` = micro-batch 0, first trip). The backward pass
    is the same picture run from right to left.

    >>> print(PipelineShape('stage', 2, 1, 3, 2).diagram())
    stage 0 |  0  1  2  .
    stage 1 |  .  0  1  2
    """
    width = 3 if self.repeats == 1 else 4
    rows = []
    for s in range(self.stages):
      cells = []
      for step in self.schedule():
        cell = step[s]
        text = "." if cell is None else (
            f"{cell[0]}" if self.repeats == 1 else f"{cell[0]}{chr(ord('a') + cell[1])}")
        cells.append(text.rjust(width - 1))
      rows.append(f"stage {s} | " + " ".join(cells))
    return "\n".join(rows)

  def __repr__(self) -> str:
    return (f"PipelineShape(stage_axis={self.stage_axis!r}, stages={self.stages}, "
            f"repeats={self.repeats}, microbatches={self.microbatches}, "
            f"layers={self.num_layers}, iterations={self.iterations}, "
            f"bubble={self.bubble:.3f})")


def pipeline(layer_fn: Callable, params: Any, x: Any, *, microbatches: int | None = None,
             repeats: int = 1, stage_axis: str | None = None, consts: Sequence[Any] = (),
             mesh: jax.sharding.Mesh | None = None, rules: Any = None,
             remat_policy: Callable | str | None = None, layers_axis: str = "layers",
             batch_axis: str = "batch") -> Any:
  """Applies a stack of layers as a pipeline over the ``stage`` mesh axis.

  Computes what ``lax.scan(lambda h, p: (layer_fn(p, h, *consts), None), x, params)[0]``
  computes, with the ``L`` stacked layers split into ``p`` stages (one per device of the
  stage axis) and the batch into ``microbatches`` micro-batches that flow through them.
  Gradients (``jax.grad`` of anything using the result, ``partition.value_and_grad``) are
  those of the sequential stack.

  Args:
    layer_fn: ``layer_fn(layer_params, h, *consts) -> h``: one layer; ``layer_params`` is
      one slice of ``params`` along the leading axis; ``h`` has the structure, shapes and
      dtypes of one micro-batch of ``x``.
    params: a pytree whose leaves all have the leading ``layers`` axis of size ``L``.
    x: an array or pytree of arrays with a leading batch dim (the same size in each leaf).
    microbatches: ``m``, the number of micro-batches; at least the number of stages
      (default: the number of stages). Micro-batch ``i`` holds rows ``i, i + m, i + 2m,
      ...``, so rows sharded over data axes stay on their devices.
    repeats: ``r``; 1 is GPipe; ``r > 1`` is the circular schedule (each stage holds ``r``
      chunks of ``L / (p r)`` layers, chunk ``c`` on stage ``c mod p``).
    stage_axis: the mesh axis of the stages; default: the mesh axis the rules give
      ``layers_axis``. With no stage axis (or one of size 1) the stack runs as a plain scan.
    consts: extra arguments passed unchanged to every ``layer_fn`` call (a mask, positions),
      replicated over the stages.
    mesh: default: the ``partition.axis_rules`` mesh, else the ``jax.set_mesh`` mesh.
    rules: default: the ``partition.axis_rules`` context.
    remat_policy: ``None`` (no rematerialisation), a ``jax.checkpoint_policies`` policy or
      its name (``'nothing_saveable'``): each layer is wrapped in ``jax.checkpoint``.
    layers_axis: the logical name of the stacked axis in the rules.
    batch_axis: the logical name of ``x``'s leading dim in the rules. The mesh axes it maps
      to that no other logical axis uses (so no parameter is sharded over them: ``data``,
      not ``fsdp``) run manual too, each device pipelining its own rows; the gradients of
      ``params`` are then summed over them once per step, not once per iteration.

  Returns:
    ``layer_fn`` applied ``L`` times, shaped like ``x``.

  Raises:
    StageAxisError: the stage axis is not in the mesh, the rules map ``layers_axis`` to
      several mesh axes, or another logical axis uses the stage axis too.
    LayerCountError: ``L`` is not divisible by ``stages x repeats`` (or leaves disagree on L).
    MicrobatchError: ``microbatches < stages``, the batch is not divisible by it, or a
      micro-batch's rows do not split over the mesh axes the rules give ``batch_axis``.
  """
  plan, mesh = _plan(layer_fn, params, x, microbatches, repeats, stage_axis, mesh, rules,
                     layers_axis)
  layer = _with_remat(layer_fn, remat_policy)
  if plan.stage_axis is None:
    return _apply_stack(layer, params, x, tuple(consts))
  rows = _row_axes(plan, x, current_rules(rules), mesh, batch_axis, layers_axis,
                   f"partition.pipeline({fun_name(layer_fn)})")
  micro = jax.tree.map(lambda a: _split_micro(a, plan.microbatches), x)
  body = _stage_program(layer, plan, rows)
  row_spec = PartitionSpec(None, to_spec_entry(rows))
  run = jax.shard_map(body, mesh=mesh, axis_names={plan.stage_axis, *rows},
                      in_specs=(PartitionSpec(plan.stage_axis), row_spec, PartitionSpec()),
                      out_specs=row_spec)
  out = run(params, micro, tuple(consts))
  return jax.tree.map(_join_micro, out)


def stage_axis(rules: Any = None, mesh: jax.sharding.Mesh | None = None,
               layers_axis: str = "layers") -> str | None:
  """The mesh axis :func:`pipeline` would run the stages on, or ``None`` (a plain scan).

  That is the mesh axis the rules give ``layers_axis``, when the mesh has it with size > 1.
  Model code uses it to decide whether its stacked layers run pipelined.

  >>> import jax, partition
  >>> mesh = jax.make_mesh((4, 2), ('stage', 'data'))
  >>> partition.stage_axis([('layers', 'stage')], mesh), partition.stage_axis([], mesh)
  ('stage', None)
  """
  rules = current_rules(rules)
  mesh = current_rules_mesh(mesh)
  if mesh is None:  # single-device code (e.g. an unsharded init): no stages to run on
    return None
  axis = _stage_axis(None, rules, mesh, layers_axis, "partition.stage_axis")
  return axis if axis is not None and dict(mesh.shape)[axis] > 1 else None


# -- the schedule ---------------------------------------------------------------------------


def _stage_program(layer: Callable, plan: PipelineShape, rows: tuple[str, ...]) -> Callable:
  """The per-stage program (inside ``shard_map``, manual over the stage axis and the
  ``rows`` axes of the batch)."""
  p, r, m, stage = plan.stages, plan.repeats, plan.microbatches, plan.stage_axis
  shift = [(i, (i + 1) % p) for i in range(p)]

  def body(local_params, micro, consts):
    if rows:
      # Each device differentiates its own rows: marking the parameters varying over the
      # row axes here, before the loop, puts the transpose (the sum of the devices'
      # gradients) here too, once; left to JAX, the cast happens at each use, in the loop,
      # and so does one all-reduce per iteration.
      local_params, consts = jax.tree.map(lambda a: lax.pcast(a, rows, to="varying"),
                                          (local_params, consts))
    # Activation constraints in the layers (partition.constrain, flax's logical constraints)
    # must name the mesh as seen inside shard_map: the stage and row axes are Manual here.
    with _inner_mesh_context(rows):
      return schedule(local_params, micro, consts)

  def schedule(local_params, micro, consts):
    s = lax.axis_index(stage)
    chunks = _circular_chunks(local_params, plan)  # [r, L/(p r), ...] in schedule order
    # The buffer starts as the micro-batches and ends as the outputs: stage 0 reads item
    # t (micro-batch t mod m) from slot t mod m at iteration t, and writes what comes back
    # round the ring into the slot of item t - (p - 1). With m >= p a slot is rewritten only
    # after it has been read (item k + m is read at iteration k + m >= k + p).
    buf = jax.tree.map(lambda a: lax.pcast(a, (stage,), to="varying"), micro)
    held = jax.tree.map(lambda a: jnp.zeros_like(a[0]), buf)

    def step(carry, t):
      buf, held = carry
      item = t - s
      rep = jnp.clip(item // m, 0, r - 1)
      fresh = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, t % m, keepdims=False), buf)
      h = jax.tree.map(lambda a, b: jnp.where(s == 0, a, b), fresh, held)
      chunk = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, rep, keepdims=False), chunks)
      h = _apply_stack(layer, chunk, h, consts)
      received = lax.ppermute(h, stage, shift)
      done = t - (p - 1)
      slot = jnp.maximum(done, 0) % m
      keep = (s == 0) & (done >= 0)
      buf = jax.tree.map(lambda a, v: _write_slot(a, v, slot, keep), buf, received)
      return (buf, received), None

    (buf, _), _ = lax.scan(step, (buf, held), jnp.arange(plan.iterations))
    # The outputs live on stage 0: one masked psum hands them to every stage (the result is
    # replicated over the stage axis, as out_specs=P() promises).
    return jax.tree.map(lambda a: lax.psum(jnp.where(s == 0, a, jnp.zeros_like(a)), stage),
                        buf)

  return body


def _inner_mesh_context(rows: tuple[str, ...]):
  rules = current_rules()
  if rules is None or current_rules_mesh() is None:
    return contextlib.nullcontext()
  # The row axes are renamed away: inside, each device holds its rows whole.
  return axis_rules(placeholder_rules(rules, rows) if rows else None,
                    mesh=jax.sharding.get_abstract_mesh())


def _write_slot(buf: jax.Array, value: jax.Array, slot: jax.Array, keep: jax.Array):
  old = lax.dynamic_index_in_dim(buf, slot, keepdims=False)
  return lax.dynamic_update_index_in_dim(buf, jnp.where(keep, value, old), slot, 0)


def _apply_stack(layer: Callable, stacked: Any, h: Any, consts: tuple) -> Any:
  return lax.scan(lambda c, lp: (layer(lp, c, *consts), None), h, stacked)[0]


def _circular_chunks(local_params: Any, plan: PipelineShape) -> Any:
  """This stage's layers as ``[r, L/(p r), ...]``: chunk ``rep`` = stack chunk ``rep p + s``.

  The ``layers -> stage`` sharding gives stage ``a`` the contiguous chunks ``a r .. a r + r
  - 1``; the circular schedule wants chunks ``s, s + p, ...``. Chunk ``c`` moves from stage
  ``c // r`` to stage ``c mod p`` (slot ``c // p``) in rounds of ``ppermute``s, each a
  partial permutation, so every chunk that moves is sent once (never an all-gather).
  """
  p, r, k, stage = plan.stages, plan.repeats, plan.layers_per_chunk, plan.stage_axis
  chunks = jax.tree.map(lambda a: a.reshape(r, k, *a.shape[1:]), local_params)
  if r == 1:
    return chunks
  s = lax.axis_index(stage)
  out = jax.tree.map(jnp.zeros_like, chunks)
  for moves in _relayout_rounds(p, r):
    # moves: (source stage, target stage, local chunk on the source, slot on the target);
    # within a round every stage sends at most one chunk and receives at most one.
    send = {a: b for a, _, b, _ in moves}
    recv = {t: slot for _, t, _, slot in moves}
    src = jnp.asarray([send.get(a, 0) for a in range(p)])
    dst_slot = jnp.asarray([recv.get(t, 0) for t in range(p)])
    got = jnp.asarray([t in recv for t in range(p)])
    piece = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, src[s], keepdims=False),  # noqa: B023
                         chunks)
    pairs = [(a, t) for a, t, _, _ in moves if a != t]
    if pairs:
      piece = lax.ppermute(piece, stage, pairs)
    out = jax.tree.map(lambda o, v: _write_slot(o, v, dst_slot[s], got[s]), out, piece)  # noqa: B023
  return out


def _relayout_rounds(p: int, r: int) -> list[list[tuple[int, int, int, int]]]:
  """Rounds of moves ``(source, target, local chunk, target slot)`` for chunk ``c = a r + b``
  from stage ``a`` to stage ``c mod p``, slot ``c // p``.

  The first rounds keep the chunks already in place (no transfer). The others are the
  transfers, coloured so that no stage sends or receives twice in a round (an edge colouring
  of the bipartite source -> target multigraph, Koenig: as many rounds as the busiest stage
  has transfers), so each round is one ``ppermute`` and the busiest stage sends only what
  it must.

  >>> _relayout_rounds(2, 2)
  [[(0, 0, 0, 0), (1, 1, 1, 1)], [(0, 1, 1, 0), (1, 0, 0, 1)]]
  """
  moves = [(a, (a * r + b) % p, b, (a * r + b) // p) for a in range(p) for b in range(r)]
  local = [[mv for mv in moves if mv[0] == mv[1] == a] for a in range(p)]
  kept = [[stage[k] for stage in local if k < len(stage)]
          for k in range(max(len(stage) for stage in local))]
  remote = [mv for mv in moves if mv[0] != mv[1]]
  colour_of = _edge_colouring([(a, t) for a, t, _, _ in remote])
  sent = [[mv for mv, c in zip(remote, colour_of) if c == colour]
          for colour in range(max(colour_of, default=-1) + 1)]
  return kept + sent


def _edge_colouring(edges: list[tuple[int, int]]) -> list[int]:
  """Colours bipartite ``(source, target)`` edges, no two of one colour at a vertex, with as
  many colours as the largest degree (the alternating-path proof of Koenig's theorem)."""
  degree = max([sum(1 for e in edges if e[0] == a) for a, _ in edges]
               + [sum(1 for e in edges if e[1] == t) for _, t in edges], default=0)
  at: dict[tuple[str, int], dict[int, int]] = {}  # vertex -> {colour: edge index}
  colour = [-1] * len(edges)

  def free(vertex):
    used = at.setdefault(vertex, {})
    return next(c for c in range(degree) if c not in used)

  for i, (a, t) in enumerate(edges):
    u, v = ("src", a), ("dst", t)
    alpha, beta = free(u), free(v)
    if alpha in at.setdefault(v, {}):
      # Swap alpha and beta along the path from v that alternates them; it cannot reach u
      # (bipartite), and afterwards alpha is free at both ends.
      path, vertex, want = [], v, alpha
      while want in at.get(vertex, {}):
        j = at[vertex][want]
        path.append(j)
        ea, et = edges[j]
        vertex = ("src", ea) if vertex[0] == "dst" else ("dst", et)
        want = beta if want == alpha else alpha
      for j in path:
        for end in (("src", edges[j][0]), ("dst", edges[j][1])):
          del at[end][colour[j]]
      for j in path:
        colour[j] = beta if colour[j] == alpha else alpha
        for end in (("src", edges[j][0]), ("dst", edges[j][1])):
          at[end][colour[j]] = j
    colour[i] = alpha
    at[u][alpha] = i
    at[v][alpha] = i
  return colour


def _split_micro(a: jax.Array, m: int) -> jax.Array:
  """``[B, ...] -> [m, B/m, ...]``, micro-batch ``i`` = rows ``i, i + m, ...`` (strided)."""
  return jnp.swapaxes(_reshape(a, (a.shape[0] // m, m, *a.shape[1:]), 1), 0, 1)


def _join_micro(a: jax.Array) -> jax.Array:
  return _reshape(jnp.swapaxes(a, 0, 1), (a.shape[0] * a.shape[1], *a.shape[2:]), 0)


def _reshape(a: jax.Array, shape: tuple[int, ...], keep_from: int) -> jax.Array:
  """Reshape splitting/merging the batch dim; Explicit meshes need the result's sharding."""
  sharding = getattr(jax.typeof(a), "sharding", None)
  spec = getattr(sharding, "spec", None)
  explicit = sharding is not None and _mesh.explicit_axes(getattr(sharding, "mesh", None))
  if not explicit or spec is None:
    return a.reshape(shape)
  spec = tuple(spec) + (None,) * (a.ndim - len(spec))
  # Splitting [B] -> [B/m, m] keeps B's mesh axes on B/m; merging [B/m, m] -> [B] puts them
  # back on B (the micro-batch dim m is never sharded).
  lead = (spec[0], None) if keep_from == 1 else (spec[0],)
  rest = spec[1:] if keep_from == 1 else spec[2:]
  return lax.reshape(a, shape, out_sharding=PartitionSpec(*lead, *rest))


def _with_remat(layer_fn: Callable, policy: Callable | str | None) -> Callable:
  if policy is None:
    return layer_fn
  if isinstance(policy, str):
    found = getattr(jax.checkpoint_policies, policy, None)
    if found is None:
      names = [n for n in dir(jax.checkpoint_policies) if not n.startswith("_")]
      raise PipelineError(
          f"partition.pipeline: remat_policy={policy!r} is not in jax.checkpoint_policies. "
          f"Use one of {', '.join(names)}, a policy function, or None.")
    policy = found
  return jax.checkpoint(layer_fn, policy=policy)


# -- validation -----------------------------------------------------------------------------


def _plan(layer_fn, params, x, microbatches, repeats, stage_axis, mesh, rules, layers_axis):
  api = f"partition.pipeline({fun_name(layer_fn)})"
  rules = current_rules(rules)
  mesh = current_rules_mesh(mesh)
  num_layers = _num_layers(params, api)
  stage_axis = _stage_axis(stage_axis, rules, mesh, layers_axis, api)
  stages = 1 if stage_axis is None else dict(mesh.shape)[stage_axis]
  microbatches = stages if microbatches is None else microbatches
  plan = PipelineShape(stage_axis if stages > 1 else None, stages, repeats, microbatches,
                      num_layers)
  if plan.stage_axis is None:
    return plan, mesh
  _check_counts(plan, x, api)
  return plan, mesh


def _num_layers(params, api: str) -> int:
  leaves = jax.tree_util.tree_leaves_with_path(params)
  if not leaves:
    raise LayerCountError(f"{api}: params has no arrays; pass the stacked layer parameters "
                          "(every leaf with a leading layers axis).")
  sizes = {jax.tree_util.keystr(path): (leaf.shape[0] if getattr(leaf, "ndim", 0) else None)
           for path, leaf in leaves}
  if len(set(sizes.values())) != 1 or None in sizes.values():
    raise LayerCountError(format_message(
        f"{api}: the leaves of params disagree on the size of the leading layers axis:",
        bullets=[f"params{k}: {'a scalar' if v is None else v}" for k, v in sizes.items()],
        fix="Every leaf must be stacked along axis 0 with one slice per layer "
            "(as nn.scan / nnx.scan / hk.layer_stack produce)."))
  return next(iter(sizes.values()))


def _stage_axis(stage_axis, rules, mesh, layers_axis, api) -> str | None:
  if stage_axis is None and rules is not None:
    targets = [v for n, v in rules.pairs if n == layers_axis]
    value = targets[0] if targets else None
    mesh_axes = [a for a in (value or ()) if isinstance(a, str)]
    if len(mesh_axes) > 1:
      raise StageAxisError(
          f"{api}: the rules map {layers_axis!r} to {tuple(mesh_axes)}; a pipeline needs one "
          f"stage mesh axis. Write a rule ({layers_axis!r}, 'stage') with a single mesh axis.")
    stage_axis = mesh_axes[0] if mesh_axes else None
  if stage_axis is None:
    return None
  if mesh is None:
    raise StageAxisError(f"{api}: stage axis {stage_axis!r} but no mesh. Pass mesh=, or use "
                         "jax.set_mesh(mesh) / partition.axis_rules(rules, mesh=mesh).")
  if stage_axis not in mesh.shape:
    raise StageAxisError(
        f"{api}: stage axis {stage_axis!r} is not an axis of {_mesh.describe(mesh)}"
        f"{did_you_mean(stage_axis, mesh.axis_names)}. Add a {stage_axis!r} axis to the mesh "
        f"or map {layers_axis!r} to one of {tuple(mesh.axis_names)}.")
  if rules is not None:
    sharing = sorted({n for n, v in rules.pairs
                      if n != layers_axis and v is not None and stage_axis in v})
    if sharing:
      raise StageAxisError(format_message(
          f"{api}: the stage axis {stage_axis!r} is also used by other logical axes:",
          context=[f"rules: {rules!r}"],
          bullets=[f"{n!r} -> {stage_axis!r}" for n in sharing],
          fix=f"The stage axis holds whole layers; no other array dim may be split over it. "
              f"Map {', '.join(repr(n) for n in sharing)} to other mesh axes (or None)."))
  return stage_axis


def _check_counts(plan: PipelineShape, x, api: str) -> None:
  p, r, m, n = plan.stages, plan.repeats, plan.microbatches, plan.num_layers
  context = [f"stage axis {plan.stage_axis!r}: {p} stages, repeats={r}, "
             f"microbatches={m}, {n} layers"]
  if not isinstance(r, int) or r < 1:
    raise PipelineError(f"{api}: repeats must be a positive int, got {r!r}.")
  if n % (p * r):
    options = [q for q in range(1, n + 1) if n % (p * q) == 0]
    raise LayerCountError(format_message(
        f"{api}: {n} layers do not split into {p} stages x {r} repeats = {p * r} equal "
        "chunks.", context=context,
        fix=f"Use a layer count divisible by {p * r}"
            + (f", or repeats in {options} for {p} stages" if options else "")
            + f", or a stage axis whose size divides {n}."))
  if not isinstance(m, int) or m < p:
    with_p = pipeline_bubble(p, p, r)
    bubble = f"{pipeline_bubble(p, m, r):.0%}" if isinstance(m, int) and m > 0 else "all"
    raise MicrobatchError(format_message(
        f"{api}: microbatches={m!r} is fewer than the {p} stages.", context=context,
        fix=f"Use microbatches >= {p}. With fewer the stages idle most of the time: the "
            f"bubble (p-1)/(r*m+p-1) would be {bubble} (with microbatches={p} it is "
            f"{with_p:.0%}, and more micro-batches shrink it); and a micro-batch coming round "
            "the ring would find stage 0 still busy."))
  sizes = {a.shape[0] if getattr(a, "ndim", 0) else None for a in jax.tree.leaves(x)}
  if len(sizes) != 1 or None in sizes:
    raise MicrobatchError(f"{api}: every leaf of x needs the same leading batch dim; got "
                          f"{sorted(sizes, key=str)}.")
  batch = sizes.pop()
  if batch % m:
    raise MicrobatchError(format_message(
        f"{api}: a batch of {batch} rows does not split into {m} micro-batches.",
        context=context,
        fix=f"Use a batch divisible by {m}"
            + (f", or microbatches in {fits}" if (fits := [
                q for q in range(p, batch + 1) if batch % q == 0]) else "") + "."))


def _row_axes(plan: PipelineShape, x, rules, mesh, batch_axis: str, layers_axis: str,
              api: str) -> tuple[str, ...]:
  """The mesh axes the stages run manual over besides the stage axis: those the rules give
  ``batch_axis`` that no other logical axis uses (a parameter may be sharded over those,
  e.g. ``fsdp``, and stays automatic). Checks that a micro-batch's rows split over all the
  batch's mesh axes, so that rows never leave their devices."""
  if rules is None or mesh is None:
    return ()
  sizes = dict(mesh.shape)
  batch = [a for a in entry_mesh_axes(_first(rules.spec((batch_axis,), None, mesh)))
           if a != plan.stage_axis and sizes[a] > 1]
  if not batch:
    return ()
  shards = math.prod(sizes[a] for a in batch)
  rows = jax.tree.leaves(x)[0].shape[0] // plan.microbatches
  if rows % shards:
    per_device = jax.tree.leaves(x)[0].shape[0] // shards
    fits = [q for q in range(plan.stages, per_device + 1) if per_device % q == 0]
    raise MicrobatchError(format_message(
        f"{api}: a micro-batch of {rows} rows does not split over the {shards} devices of "
        f"the batch's mesh axes {tuple(batch)} ({batch_axis!r} in the rules), so rows would "
        "leave their devices every iteration.",
        context=[f"stage axis {plan.stage_axis!r}: {plan.stages} stages, microbatches="
                 f"{plan.microbatches}; {per_device} rows per device"],
        fix="Use " + (f"microbatches in {fits} (dividing the {per_device} rows per device, "
                      f"at least {plan.stages}), or " if fits else "")
            + f"a batch of {plan.microbatches * shards} x N rows."))
  shared = {a for name, value in rules.pairs if name not in (batch_axis, layers_axis)
            for a in (value or ()) if isinstance(a, str)}
  return tuple(a for a in batch if a not in shared)


def _first(spec: PartitionSpec):
  return spec[0] if len(spec) else None
