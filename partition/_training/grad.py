"""``partition.value_and_grad``: sharded, micro-batched gradients of an ordinary batched loss.

The loss stays what users write today: ``loss_fn(params, batch, *rest)``, a mean over the
batch, with the model seeing arrays that have their batch dim. The batch's logical axes
resolve through the rules:

* mesh axes for the batch axis give data parallelism: the batch dim stays sharded inside the
  model (so activation constraints, ``partition.constrain`` and flax's
  ``nn.with_logical_constraint``, apply to it as they would without this wrapper);
* a ``SerialLoop(k)`` (in the rules, or ``microbatches=k``) splits the batch into ``k``
  micro-batches that run one after another (an xmap loop axis, so one micro-batch's
  activations are alive at a time); micro-batch ``j`` holds rows ``j, j+k, j+2k, ...`` of each
  device's block, so no row leaves its device;
* parameters keep the shardings of their logical axes, and gradients come out with exactly
  those shardings, reduced only over the batch's mesh axes: with ``k > 1``, once after the
  loop for parameters replicated over those axes (each device accumulates its rows'
  gradients unreduced, see ``partition/_training/reduce_once.py``), per micro-batch for parameters
  sharded over them (FSDP: a carry of ``1/N`` the size); ``grad_reduction=`` chooses.

Example:
  >>> import jax, jax.numpy as jnp, numpy as np
  >>> import partition
  >>> mesh = jax.make_mesh((4, 2), ('data', 'model'))
  >>> rules = partition.AxisRules([('batch', 'data'), ('mlp', 'model')])
  >>> def loss_fn(params, batch):
  ...   return jnp.mean((batch['x'] @ params['w'] - batch['y']) ** 2)
  >>> step = partition.value_and_grad(
  ...     loss_fn, batch_axes={'x': ('batch', None), 'y': ('batch', 'mlp')},
  ...     param_axes={'w': (None, 'mlp')}, rules=rules, mesh=mesh, microbatches=2)
  >>> params = {'w': jnp.ones((3, 4))}
  >>> batch = {'x': jnp.ones((16, 3)), 'y': jnp.zeros((16, 4))}
  >>> loss, grads = step(params, batch)
  >>> grads['w'].sharding.spec
  P(None, 'model')
  >>> ref_loss, ref_grads = jax.value_and_grad(loss_fn)(params, batch)
  >>> bool(np.allclose(loss, ref_loss) and np.allclose(grads['w'], ref_grads['w']))
  True
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from partition._base import mesh as _mesh
from partition._base.errors import (
  AxisSizeError,
  PartitionError,
  SpecError,
  format_message,
  prefix_mismatch,
)
from partition._base.resources import SerialLoop
from partition._params.optim import resolve_param_axes
from partition._rules.context import axis_rules, current_rules, current_rules_mesh
from partition._rules.fallbacks import warn_fallbacks
from partition._rules.table import AxisRules, is_axes_leaf
from partition._training.reduce_once import SCHEDULES, reduce_once_step, uses_axes
from partition._xmap.api import xmap
from partition._xmap.specs import Logical, Mean

_MICRO = "__microbatch__"


class GradSpecError(PartitionError, ValueError):
  """``batch_axes`` / ``param_axes`` do not fit the batch or the parameters."""


def value_and_grad(loss_fn: Callable, *, batch_axes: Any, param_axes: Any = None,
                   rules: Any = None, mesh: jax.sharding.Mesh | None = None,
                   has_aux: bool = False, microbatches: int | None = None,
                   batch_axis: str | None = None, rng_argnums: int | Sequence[int] = (),
                   grad_reduction: str = "auto") -> Callable:
  """Like ``jax.value_and_grad(loss_fn)``, sharded by logical axes and micro-batched.

  Args:
    loss_fn: ``loss_fn(params, batch, *rest)`` -> scalar loss (a mean over the batch), or
      ``(loss, aux)`` with ``has_aux=True``. Differentiated with respect to ``params``.
    batch_axes: logical axes of the batch: a pytree prefix of ``batch`` whose leaves are
      tuples of logical names, one per dim, e.g. ``{'tokens': ('batch', 'length')}``.
    param_axes: logical axes of the parameters (a matching tree of tuples, ``None`` for "as
      the parameter is"), or a path table (``partition.PathRules`` or a list of ``(regex,
      axes)`` pairs); default: read from the tree
      with ``partition.logical_axes`` (flax boxes, ``partition.WithAxes``), else each
      parameter's own sharding (a committed array's, read before the jitted step; inside an
      enclosing ``jax.jit`` only Explicit axes show it).
    rules: an ``AxisRules`` (or pairs / a file path); default: the ``partition.axis_rules``
      context. ``None`` with no context: nothing is sharded (micro-batching still works).
    mesh: default: the ``axis_rules`` mesh, else the ``jax.set_mesh`` mesh.
    has_aux: ``loss_fn`` returns ``(loss, aux)``; ``aux`` is averaged over micro-batches.
    microbatches: number of sequential micro-batches ``k`` (default: the serial loops the
      rules give the batch axis, else 1).
    batch_axis: the logical name of the batch dim; default: the first name of the first
      leaf of ``batch_axes``. Every batch leaf must have it.
    rng_argnums: positions (in ``(params, batch, *rest)``) of PRNG keys; with ``k > 1``
      micro-batch ``j`` gets ``jax.random.fold_in(key, j)``, so dropout masks differ between
      micro-batches as they differ between the rows of one batch (``k = 1``: the key as is).
      Where gradients are reduced once (below), device shard ``i`` of micro-batch ``j`` gets
      ``fold_in(fold_in(key, j), i)``.
    grad_reduction: when the gradients of ``k > 1`` micro-batches are reduced over the
      batch's mesh axes:

      * ``'per_microbatch'``: in every iteration of the loop; the carry holds gradients in
        the parameters' shardings (for FSDP-sharded parameters: ``1/N`` of their size per
        device), and the reduction bytes are ``k`` times one reduction's.
      * ``'once'``: after the loop; each device accumulates its rows' gradients unreduced
        (a full-size carry per device) and one all-reduce (reduce-scatter for parameters
        sharded over the batch axes) follows the loop.
      * ``'auto'`` (default): once for the parameters replicated over the batch's mesh axes
        (the full-size carry is their own size: free), per micro-batch for the ones sharded
        over them (FSDP), where once would cost ``N`` times the carry memory.

      The results are the same up to float summation order. With ``k = 1`` or no batch
      mesh axes there is one schedule; on ``Explicit`` batch axes ``'auto'`` is per
      micro-batch and ``'once'`` a GradSpecError (it is built on ``Auto`` axes). Reducing
      once runs the loss per device shard of each micro-batch (a mean over the batch, as
      required above, averages the same; ``aux`` is averaged over the shards too); a model
      that cannot run per device shard (it pins the batch's mesh axes with its own
      ``PartitionSpec``, or runs its own ``shard_map`` such as ``partition.pipeline``) is
      reduced per micro-batch under ``'auto'``.

  Returns:
    ``step(params, batch, *rest) -> (loss, grads)`` (``((loss, aux), grads)`` with
    ``has_aux``), where ``grads`` has the structure and shardings of ``params``. It runs
    under ``jax.jit`` when called eagerly, and inlines into an enclosing ``jax.jit``.

  Raises:
    GradSpecError: ``batch_axes``/``param_axes`` do not fit the batch or the parameters.
    AxisSizeError: the batch does not divide into the mesh shards times ``microbatches``.
  """
  if not callable(loss_fn):
    raise SpecError(f"value_and_grad expects a callable loss_fn, got {loss_fn!r}.")
  if microbatches is not None and (isinstance(microbatches, bool) or not isinstance(
      microbatches, (int, np.integer)) or microbatches < 1):
    raise AxisSizeError(f"value_and_grad: microbatches must be a positive int, got "
                        f"{microbatches!r}.")
  _check_grad_reduction(grad_reduction)
  rng_argnums = (rng_argnums,) if isinstance(rng_argnums, int) else tuple(rng_argnums)
  if any(isinstance(i, bool) or not isinstance(i, int) or i < 2 for i in rng_argnums):
    raise SpecError(f"value_and_grad: rng_argnums={rng_argnums!r} must be positions >= 2 in "
                    "(params, batch, *rest): keys are extra arguments after the batch.")
  settings = _Settings(loss_fn, batch_axes, param_axes, rules, mesh, has_aux, microbatches,
                       batch_axis, rng_argnums, grad_reduction)
  jitted = jax.jit(settings.step, static_argnames="known")

  def step(params, batch, *rest):
    args = (params, batch, *rest)
    settings.check_batch(batch)
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(args)):
      return settings.step(*args)
    params, batch = settings.place(params, batch)
    # The committed params' shardings are read here, where they are concrete: inside the
    # jitted step a parameter without logical axes is a tracer whose Auto-axis sharding JAX
    # does not show, and its gradient would have nothing to keep.
    return jitted(params, batch, *rest, known=_KnownSpecs.of(settings, params))

  step.__name__ = f"value_and_grad_{getattr(loss_fn, '__name__', 'loss')}"
  step.__doc__ = loss_fn.__doc__
  return step


@dataclasses.dataclass(frozen=True)
class _Settings:
  """``value_and_grad``'s arguments, fixed when the step is built; ``step`` runs them."""

  loss_fn: Callable
  batch_axes: Any
  param_axes: Any
  rules: Any
  mesh: Any
  has_aux: bool
  microbatches: int | None
  batch_axis: str | None
  rng_argnums: tuple[int, ...]
  grad_reduction: str = "auto"
  # (rules, mesh, batch structure and shapes) already checked by check_batch
  _checked: set = dataclasses.field(default_factory=set, compare=False, repr=False)

  @property
  def rng_positions(self) -> list[int]:
    """The keys' positions in ``rest`` (after params and batch)."""
    return [i - 2 for i in self.rng_argnums]

  def context(self):
    rules = current_rules(self.rules)
    mesh = current_rules_mesh(self.mesh) if rules is not None else _mesh.current_mesh(self.mesh)
    return rules, mesh

  def check_batch(self, batch) -> None:
    """Checks ``batch_axes`` against the batch (a GradSpecError or AxisSizeError before
    anything is committed or traced), and gives one ``PartitionWarning`` per batch dim the
    rules leave replicated for want of a rule (a misspelt name) or a divisor: each device
    would then run the whole batch. Once per rules, mesh and batch shapes; the warning points
    at the caller of the step."""
    rules, mesh = self.context()
    if rules is None or mesh is None:
      return
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    key = (rules, mesh, jax.tree_util.tree_structure(batch),
           tuple(np.shape(x) for _, x in leaves))
    if key in self._checked:
      return
    split = _MicrobatchSplit.build(self, batch, rules, mesh)
    axes = jax.tree_util.tree_leaves(split.axes, is_leaf=is_axes_leaf)
    warn_fallbacks("partition.value_and_grad", [
        (f"batch{jax.tree_util.keystr(path)}", rules.resolve(a, np.shape(x), mesh))
        for (path, x), a in zip(leaves, axes)], rules, stacklevel=3)
    self._checked.add(key)

  def place(self, params, batch):
    """Commits uncommitted concrete inputs to their shardings before the jitted step (the
    step then reads every shard in place; on Explicit meshes jit also needs committed
    inputs to see the mesh's devices)."""
    rules, mesh = self.context()
    if rules is None or not isinstance(mesh, jax.sharding.Mesh):
      return params, batch
    specs = _param_specs(self.param_axes, params, rules, mesh)
    params = jax.tree.map(lambda s, sub: _commit(sub, mesh, s), specs, params, is_leaf=_is_spec)
    axes = _broadcast_axes(self.batch_axes, batch)
    batch = jax.tree.map(lambda a, x: _commit(x, mesh, rules.spec(a, np.shape(x), mesh)),
                         axes, batch, is_leaf=is_axes_leaf)
    return params, batch

  def step(self, params, batch, *rest, known: _KnownSpecs | None = None):
    """``(value, grads)``: reduced once after the micro-batch loop where that schedule
    applies, else by the per-micro-batch loop."""
    rules, mesh = self.context()
    split = _MicrobatchSplit.build(self, batch, rules, mesh)
    param_specs = (known.specs() if known is not None
                   else _param_specs(self.param_axes, params, rules, mesh))
    once = _reduce_once_rule(self, split, param_specs, rules, mesh)
    if once is not None:
      result = self._reduced_once(params, batch, rest, split, param_specs, once, rules, mesh)
      if result is not None:
        return result
    return self._xmapped(params, batch, rest, split, param_specs, rules, mesh)

  def _reduced_once(self, params, batch, rest, split, param_specs, once, rules, mesh):
    """The reduce-once schedule (``reduce_once.py``), or ``None`` where the model cannot run
    per device shard and ``'auto'`` falls back to the per-micro-batch loop."""
    try:
      with _mesh.in_context(mesh):
        return reduce_once_step(
            self.loss_fn, self.has_aux, params, batch, rest, rules=rules, mesh=mesh,
            batch_axes=split.axes, dims=split.dims, k=split.k, m=split.m,
            mesh_axes=split.mesh_axes, param_specs=param_specs, once=once,
            rng_positions=self.rng_positions)
    except ValueError as e:
      # A model that cannot run per device shard keeps the per-micro-batch loop under
      # 'auto': it pins the batch's mesh axes itself (with_sharding_constraint(x,
      # P('data', ...))), or runs its own shard_map (partition.pipeline over 'stage'). A
      # real mistake in the model fails the same way on that path, with its own message.
      if self.grad_reduction == "once":
        raise (_once_error(e, split.mesh_axes) if "spmd_axis_name" in str(e) else e) from e
      return None

  def _xmapped(self, params, batch, rest, split, param_specs, rules, mesh):
    """The k micro-batches as an xmap axis on a ``SerialLoop(k)``: a loop whose gradient
    carry stays in the parameters' shardings, so gradients are reduced over the batch's mesh
    axes in every iteration. The loop covers the whole axis, so xmap runs the model on each
    micro-batch as written (no size-1 vmap: ``_xmap/program.py``, ``_unit_level``). With
    k = 1 there is no loop: xmap just places the step."""
    looped = split.k > 1
    micro = jax.tree.map(split.to_micro, batch, split.dims) if looped else batch
    rest = self._keys_per_microbatch(rest, split.k) if looped else rest
    sharded = mesh is not None and rules is not None
    mapped = xmap(self._value_and_grad_in_context(rules, mesh),
                  in_axes=self._in_axes(split, param_specs, len(rest), looped, sharded),
                  out_axes=self._out_axes(param_specs, looped, sharded),
                  axis_resources=_loop_resources(split.k, rules, sharded),
                  mesh=mesh if sharded else None)
    with _mesh.in_context(mesh if sharded else None):
      return mapped(params, micro, *rest)

  def _keys_per_microbatch(self, rest, k):
    """Each PRNG key in ``rest`` as ``k`` keys, ``fold_in(key, j)`` for micro-batch ``j``."""
    rest = list(rest)
    for i in self.rng_positions:
      rest[i] = jax.vmap(lambda j, key=rest[i]: jax.random.fold_in(key, j))(jnp.arange(k))
    return rest

  def _value_and_grad_in_context(self, rules, mesh):
    """``jax.value_and_grad(loss_fn)`` run under the rules, on the mesh in context when
    traced (on Explicit meshes that is xmap's Auto region, whose axis types apply to the
    model's constraints)."""
    def per_micro(params, micro_batch, *rest):
      traced_mesh = jax.sharding.get_abstract_mesh()
      with axis_rules(rules, mesh if traced_mesh.empty else traced_mesh) \
          if rules is not None else contextlib.nullcontext():
        return jax.value_and_grad(self.loss_fn, has_aux=self.has_aux)(params, micro_batch,
                                                                      *rest)
    return per_micro

  def _in_axes(self, split, param_specs, n_rest, looped, sharded):
    """xmap's in_axes: params by their specs, the batch (and keys) named on the loop axis."""
    named = [_MICRO, ...] if looped else None
    param_in = param_specs if sharded else [...]
    batch_in = jax.tree.map(
        lambda axes: Logical(*axes, named=named) if sharded else (named or [...]),
        split.axes, is_leaf=is_axes_leaf)
    rest_in = tuple(named if i in self.rng_positions and looped else [...]
                    for i in range(n_rest))
    return (param_in, batch_in, *rest_in)

  def _out_axes(self, param_specs, looped, sharded):
    """xmap's out_axes: value (and aux) and gradients averaged over the loop axis, the
    gradients in their parameters' specs."""
    reduced = (lambda axes: Mean(_MICRO, axes=axes)) if looped else (lambda axes: axes)
    grad_out = (jax.tree.map(reduced, param_specs, is_leaf=_is_spec) if sharded
                else reduced([...]))
    value_out = (reduced([...]), reduced([...])) if self.has_aux else reduced([...])
    return (value_out, grad_out)


def _loop_resources(k: int, rules, sharded: bool):
  """xmap's axis_resources: the micro-batch axis on a ``SerialLoop(k)``, the rest by
  ``rules``."""
  resources = {_MICRO: (SerialLoop(k),)} if k > 1 else {}
  return _RulesWith(rules, resources) if sharded else resources


def _check_grad_reduction(grad_reduction) -> None:
  if not isinstance(grad_reduction, str) or grad_reduction not in SCHEDULES:
    raise GradSpecError(
        f"value_and_grad: grad_reduction={grad_reduction!r} is not a schedule; choose one of "
        f"{', '.join(repr(s) for s in SCHEDULES)} ('auto': reduce once after the micro-batch "
        "loop where the parameter is replicated over the batch's mesh axes, per micro-batch "
        "where it is sharded over them).")


def _once_error(e: ValueError, mesh_axes) -> GradSpecError:
  return GradSpecError(format_message(
      "value_and_grad(grad_reduction='once'): the loss constrains an array to the batch's "
      f"mesh axes {mesh_axes} itself, but reducing once runs the loss per device shard of "
      "each micro-batch, where those axes hold the shards.",
      context=[f"JAX says: {str(e).splitlines()[0]}"],
      fix="Constrain activations by logical name (partition.constrain, "
          "nn.with_logical_constraint), or use grad_reduction='per_microbatch'."))


def _reduce_once_rule(settings: _Settings, split: _MicrobatchSplit, param_specs, rules,
                      mesh):
  """``once(spec)`` for the parameters whose gradients are reduced after the micro-batch
  loop, or ``None`` where the per-micro-batch schedule (the xmap loop) runs everything."""
  if (settings.grad_reduction == "per_microbatch" or split.k == 1 or split.m == 1
      or rules is None or not isinstance(mesh, jax.sharding.Mesh)):
    return None
  axes = split.mesh_axes
  types = dict(zip(mesh.axis_names, mesh.axis_types))
  explicit = [a for a in axes if types.get(a) == jax.sharding.AxisType.Explicit]
  if explicit and settings.grad_reduction == "once":
    raise GradSpecError(
        f"value_and_grad(grad_reduction='once'): the batch's mesh axes {explicit} are "
        "Explicit; reducing once is built on Auto axes. Use a mesh with AxisType.Auto for "
        "them, or grad_reduction='auto' (per micro-batch on Explicit axes).")
  specs = jax.tree_util.tree_leaves(param_specs, is_leaf=_is_spec) if param_specs else [None]
  if None in specs:
    # A parameter whose sharding is unknown here (traced inside the caller's jit on Auto
    # axes, with no logical axes): the loop below would hand XLA an unconstrained sum, and
    # its gradient would come back replicated. The per-micro-batch loop leaves it to
    # propagation from the parameter, which keeps the parameter's sharding.
    if settings.grad_reduction == "once":
      raise GradSpecError(format_message(
          "value_and_grad(grad_reduction='once'): the shardings of some parameters are "
          "unknown (they have no logical axes, and inside an enclosing jax.jit JAX does not "
          "show an Auto-axis sharding), so their reduced gradients could not be put back "
          "on them.",
          bullets=_unknown_paths(param_specs),
          fix="Give param_axes= (or declare the axes in the model), call the step outside "
              "jax.jit with committed parameters, or use grad_reduction='auto'."))
    return None
  if settings.grad_reduction == "once":
    return lambda spec: True
  if explicit:
    return None
  if all(uses_axes(s, axes) for s in specs):
    return None  # every parameter is sharded over the batch axes: per micro-batch (today's)
  return lambda spec: not uses_axes(spec, axes)


@dataclasses.dataclass(frozen=True)
class _RulesWith:
  """An ``axis_resources`` that resolves ``Logical`` leaves with ``rules`` and places the
  xmap's own axes as ``resources`` says (the micro-batch axis is not a logical name)."""

  rules: AxisRules
  resources: dict

  def spec(self, *args, **kwargs):
    return self.rules.spec(*args, **kwargs)

  def xmap_resources(self, names, **_):
    return {n: self.resources.get(n, ()) for n in names}

  def __hash__(self):
    return hash((self.rules, tuple(self.resources.items())))


@dataclasses.dataclass(frozen=True)
class _MicrobatchSplit:
  """How the batch is cut: ``k`` micro-batches of the batch dim ``dims`` of every leaf,
  ``m`` devices along it."""

  axes: Any       # the batch_axes tree, broadcast to one tuple per leaf
  dims: Any       # per leaf: the position of the batch dim
  k: int
  m: int
  mesh_axes: tuple[str, ...] = ()  # the mesh axes of the batch dim

  @staticmethod
  def build(settings: _Settings, batch, rules, mesh) -> _MicrobatchSplit:
    axes = _broadcast_axes(settings.batch_axes, batch)
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    axes_leaves = jax.tree_util.tree_leaves(axes, is_leaf=is_axes_leaf)
    name = settings.batch_axis or (axes_leaves[0][0] if axes_leaves and axes_leaves[0] else None)
    problems, dims = [], []
    for (path, x), a in zip(leaves, axes_leaves):
      where = f"batch{jax.tree_util.keystr(path)}"
      if len(a) != np.ndim(x):
        problems.append(f"{where} has shape {np.shape(x)}, but its batch_axes {a!r} name "
                        f"{len(a)} dims")
      elif name not in a:
        problems.append(f"{where}: batch_axes {a!r} has no {name!r} dim")
      dims.append(a.index(name) if name in a else 0)
    if problems:
      raise GradSpecError(format_message(
          "value_and_grad: batch_axes does not fit the batch.", bullets=problems,
          fix="Give every batch leaf one logical name per dim, including the batch axis "
              f"{name!r} (or set batch_axis=)."))
    size = np.shape(leaves[0][1])[dims[0]] if leaves else 0
    mesh_axes, loops = _batch_resources(name, size, axes_leaves, leaves, dims, rules, mesh)
    k = settings.microbatches or math.prod(lp for lp in loops) or 1
    if loops and settings.microbatches and settings.microbatches != math.prod(loops):
      raise AxisSizeError(f"value_and_grad: microbatches={settings.microbatches}, but the rules "
                          f"give the batch axis {name!r} serial loops {loops}; choose one.")
    m = _mesh.resource_size(mesh, mesh_axes) if mesh_axes else 1
    bad = [f"batch{jax.tree_util.keystr(p)} has {np.shape(x)[d]} rows along {name!r}"
           for (p, x), d in zip(leaves, dims) if np.shape(x)[d] != size or size % (m * k)]
    if bad:
      raise AxisSizeError(format_message(
          f"value_and_grad: the batch must divide into {m} device shard(s) x {k} "
          "micro-batch(es) of equal size.", bullets=bad,
          fix=f"Use a batch size that is a multiple of {m * k} (the same in every leaf)."))
    treedef = jax.tree_util.tree_structure(batch)
    return _MicrobatchSplit(jax.tree_util.tree_unflatten(treedef, axes_leaves),
                      jax.tree_util.tree_unflatten(treedef, dims), k, m, tuple(mesh_axes))

  def to_micro(self, x, dim: int):
    """``(..., N, ...)`` -> ``(k, ..., N/k, ...)``: micro-batch ``j`` holds rows ``j, j+k, ...``
    of each device's block of ``N/m`` rows (a reshape within each device's rows)."""
    shape = np.shape(x)
    n, k, m = shape[dim], self.k, self.m
    x = jnp.reshape(x, shape[:dim] + (m, n // (m * k), k) + shape[dim + 1:])
    x = jnp.moveaxis(x, dim + 2, 0)
    return jnp.reshape(x, (k,) + shape[:dim] + (n // k,) + shape[dim + 1:])


def _prefix(axes_tree, tree, what: str, fix: str):
  """``(structure, axes leaves, subtrees of tree)`` for an axes tree that is a pytree prefix
  of ``tree``, or a GradSpecError saying which argument does not fit."""
  structure = None
  try:
    structure = jax.tree_util.tree_structure(axes_tree, is_leaf=is_axes_leaf)
    subtrees = structure.flatten_up_to(tree)
  except (ValueError, TypeError) as e:
    detail = str(e) if structure is None else prefix_mismatch(structure, tree)
    raise GradSpecError(format_message(
        f"value_and_grad: {what} is not a pytree prefix of the "
        f"{'batch' if what == 'batch_axes' else 'parameters'}.",
        context=[f"details: {detail}"], fix=fix)) from None
  axes = structure.flatten_up_to(axes_tree) if structure.num_leaves else []
  return structure, axes, subtrees


def _broadcast_axes(batch_axes, batch):
  """``batch_axes`` (a prefix of ``batch``) -> one axes tuple per batch leaf."""
  _, axes, subtrees = _prefix(
      batch_axes, batch, "batch_axes",
      "Give batch_axes the batch's structure with one axes tuple per array, e.g. "
      "{'tokens': ('batch', 'length')}, or one tuple for all arrays.")
  bad = [a for a in axes if isinstance(a, str) or not isinstance(a, (tuple, list))]
  if bad:
    raise GradSpecError(f"value_and_grad: batch_axes leaves must be tuples of logical names, "
                        f"got {bad[0]!r}; write e.g. ('batch', 'length').")
  per_leaf = [tuple(a) for a, sub in zip(axes, subtrees)
              for _ in jax.tree_util.tree_leaves(sub)]
  return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(batch), per_leaf)


def _batch_resources(name, size, axes_leaves, leaves, dims, rules, mesh):
  """The mesh axes the batch dim is sharded over (as the rules place the first leaf) and the
  serial-loop lengths the rules give the batch axis (resolved as xmap resolves them: a rule
  whose mesh axes and loops do not divide the batch falls back to the next one)."""
  if rules is None:
    return (), ()
  # warn=False: check_batch says it in the batch's terms (the leaf, not an "xmap axis")
  resources = rules.xmap_resources([name], mesh=mesh, sizes={name: size},
                                   warn=False).get(name, ())
  loops = tuple(r.length for r in resources if isinstance(r, SerialLoop))
  if mesh is None or not leaves:
    return (), loops
  x = leaves[0][1]
  spec = rules.spec(axes_leaves[0], np.shape(x), mesh)
  entry = tuple(spec)[dims[0]] if len(spec) > dims[0] else None
  return _mesh.entry_mesh_axes(entry), loops


def _param_specs(param_axes, params, rules, mesh):
  """One PartitionSpec per parameter subtree (box or array): from its logical axes, else
  from its own sharding, else ``None`` (left to propagation)."""
  if rules is None or mesh is None:
    return None
  structure, axes, subtrees = _prefix(
      resolve_param_axes(params, param_axes), params, "param_axes",
      "Give one logical-axes tuple (or None) per parameter, in the params' structure; or "
      "leave param_axes=None to read the axes the model declared.")
  specs = [_param_spec(a, sub, rules, mesh) for a, sub in zip(axes, subtrees)]
  return jax.tree_util.tree_unflatten(structure, specs)


def _param_spec(axes, subtree, rules, mesh) -> PartitionSpec | None:
  (leaf,) = jax.tree_util.tree_leaves(subtree) or (None,)
  if axes is not None:
    return rules.spec(tuple(axes), np.shape(leaf), mesh)
  return _own_spec(leaf, mesh)


def _own_spec(leaf, mesh) -> PartitionSpec | None:
  """The spec ``leaf`` is placed with on ``mesh``'s axes, or ``None`` where that is unknown:
  a concrete array's ``NamedSharding``; for a tracer, its type's sharding when every axis of
  that mesh is Explicit (on Auto axes a tracer's type does not carry its sharding)."""
  if isinstance(leaf, jax.core.Tracer):
    sharding = getattr(jax.typeof(leaf), "sharding", None)
    abstract = getattr(sharding, "mesh", None)
    if abstract is None or abstract.empty or any(
        t != jax.sharding.AxisType.Explicit for t in abstract.axis_types):
      return None
  else:
    sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, NamedSharding):
      return None
  spec = sharding.spec
  names = set(getattr(mesh, "axis_names", ()))
  return spec if all(a in names for e in spec for a in _mesh.entry_mesh_axes(e)) else None


def _unknown_paths(param_specs) -> list[str]:
  paths = jax.tree_util.tree_leaves_with_path(param_specs, is_leaf=_is_spec)
  return [f"params{jax.tree_util.keystr(p)}" for p, s in paths if s is None]


@dataclasses.dataclass(frozen=True)
class _KnownSpecs:
  """The parameters' specs as read outside jit, hashable (a static argument of the step)."""

  leaves: tuple
  treedef: Any

  @staticmethod
  def of(settings: _Settings, params) -> _KnownSpecs | None:
    rules, mesh = settings.context()
    if rules is None or not isinstance(mesh, jax.sharding.Mesh):
      return None
    leaves, treedef = jax.tree_util.tree_flatten(
        _param_specs(settings.param_axes, params, rules, mesh), is_leaf=_is_spec)
    return _KnownSpecs(tuple(leaves), treedef)

  def specs(self):
    return jax.tree_util.tree_unflatten(self.treedef, self.leaves)


def _commit(tree, mesh, spec: PartitionSpec | None):
  """``device_put`` the uncommitted arrays of ``tree`` onto ``spec`` (replicated if None)."""
  sharding = NamedSharding(mesh, spec if spec is not None else PartitionSpec())
  return jax.tree.map(lambda x: x if getattr(x, "committed", False) else jax.device_put(
      x, sharding), tree)


def _is_spec(s) -> bool:
  return s is None or isinstance(s, PartitionSpec)
