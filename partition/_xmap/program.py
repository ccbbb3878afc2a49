"""Builds the traced program of one xmap layout: nested ``jax.vmap`` and ``lax.scan`` levels.

``run(args)`` is called inside ``jax.jit`` tracing with the flat positional inputs. Each
level removes its sub-dim from the inputs and re-inserts it into the outputs:

* a vmap level returns ``(mapped, unmapped)`` with ``out_axes=(0, None)`` (so the output
  tree need not be known when the vmap is built), then moves each mapped dim to its place;
  ``Sum``/``Mean`` outputs are ``psum``-ed over the level's axis inside the body;
* a scan level slices the loop sub-dim as ``xs``, stacks mapped outputs as ``ys`` and
  accumulates reduced outputs in the carry (zeros sized from one ``jax.eval_shape`` of the
  user function, taken once per trace).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from partition._base.errors import OutputAxesError, format_message
from partition._xmap.layout import Label, Level, MapLayout
from partition._xmap.specs import AxisSpec, Reduction, flatten_specs, placed

# jax.vmap's complaint about a batched output under out_axes=None (old and current wording).
_BATCHED_BUT_NONE = re.compile(r"but out_axes is None|got axis spec None but output was batched")


@functools.cache
def reduced_dtype(dtype):
  """The dtype ``lax.psum`` gives (bool sums count: int32), so every resource agrees."""
  return jax.eval_shape(lambda v: jax.vmap(lambda a: lax.psum(a, "_"), axis_name="_")(v),
                        jax.ShapeDtypeStruct((1,), dtype)).dtype


class BodyTracer:
  """State of one trace: the layout, the user function, and what it returned."""

  def __init__(self, layout: MapLayout, fun: Callable, fun_name: str, in_treedef: Any,
               out_axes: Any,
               state_outputs: Callable | None = None, constrain: Callable | None = None):
    # state_outputs(spec, per-example shape, keypath) -> stated positional entries or None;
    # constrain(x, PartitionSpec) applies a sharding constraint (None: no mesh).
    self.state_outputs = state_outputs
    self.constrain = constrain
    self.out_stated: list[Any] = []
    self.layout = layout
    self.fun = fun
    self.fun_name = fun_name
    self.in_treedef = in_treedef
    self.out_axes = out_axes
    self.out_treedef = None
    self.out_specs: list[AxisSpec | Reduction] = []
    self.out_paths: list[str] = []
    self.final_labels: list[tuple[Label, ...]] = []
    self.out_structs: list[jax.ShapeDtypeStruct] = []

  # -- the user function, on per-example (positional) inputs
  def call_fun(self, args: Sequence[Any]) -> list[Any]:
    outs = self.fun(*jax.tree_util.tree_unflatten(self.in_treedef, list(args)))
    leaves, specs, paths, treedef = flatten_specs(self.out_axes, outs, "out_axes", self.fun_name)
    leaves = [jnp.asarray(x) for x in leaves]
    if self.out_treedef is None:
      self._record_outputs(treedef, specs, paths, leaves)
    return leaves

  def _record_outputs(self, treedef, specs, paths, leaves):
    self.out_treedef, self.out_specs, self.out_paths = treedef, specs, paths
    self.out_structs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
    errors = []
    for spec, path, x in zip(specs, paths, leaves):
      self.out_stated.append(self.state_outputs(placed(spec), x.shape, path)
                             if self.state_outputs else None)
      labels, error = self._final_labels(placed(spec), x.ndim)
      self.final_labels.append(labels)
      if error:
        errors.append(f"output{path} (per-example shape {x.shape}): {error}")
    if errors:
      raise OutputAxesError(format_message(
          f"xmap({self.fun_name}): outputs do not match out_axes.", bullets=errors,
          fix="Fix the out_axes entry (end a list with ... to accept any rank), or the "
              "function's output."))

  def _final_labels(self, spec: AxisSpec, ndim: int) -> tuple[tuple[Label, ...], str | None]:
    rank = ndim + len(spec.names)
    if spec.rank is not None and spec.rank != rank:
      return (), (f"out_axes {spec.user_repr} asserts rank {spec.rank}, but the result has "
                  f"rank {rank} ({ndim} positional + {len(spec.names)} named dims)")
    if spec.dims and max(spec.dims) >= rank:
      return (), (f"out_axes {spec.user_repr} places an axis at dim {max(spec.dims)}, which "
                  f"needs at least {max(spec.dims) + 1 - len(spec.names)} positional dims, "
                  f"but the result has {ndim}")
    labels: list[Label] = []
    positional = iter(range(ndim))
    for d in range(rank):
      name = spec.names[spec.dims.index(d)] if d in spec.dims else None
      if name is None:
        labels.append((None, next(positional)))
      else:
        labels.extend(lab for lab, _ in self.layout.axes[name].sub_dims())
    return tuple(labels), None

  # -- per output leaf, what a level does with it
  def mode(self, j: int, level: Level) -> tuple[str, Label | None]:
    spec = self.out_specs[j]
    for label in level.labels:
      if label[0] in placed(spec).names:
        return "map", label
      if isinstance(spec, Reduction) and label[0] in spec.names:
        return "reduce", label
    return "none", None

  def labels_after(self, j: int, k: int) -> list[Label]:
    """Labels of output ``j`` as returned by level ``k`` (levels ``k..`` applied)."""
    mapped = {lab for level in self.layout.levels[k:]
              for mode, lab in [self.mode(j, level)] if mode == "map"}
    return [lab for lab in self.final_labels[j] if lab[0] is None or lab in mapped]

  def struct_after(self, j: int, k: int) -> jax.ShapeDtypeStruct:
    base = self.out_structs[j]
    shape = tuple(base.shape[lab[1]] if lab[0] is None else self.layout.label_size(lab)
                  for lab in self.labels_after(j, k))
    reduced = any(self.mode(j, level)[0] == "reduce" for level in self.layout.levels[k:])
    return jax.ShapeDtypeStruct(shape, reduced_dtype(base.dtype) if reduced else base.dtype)

  # -- the levels
  def run(self, k: int, args: list[Any], labels: list[tuple[Label, ...]]) -> list[Any]:
    if k == len(self.layout.levels):
      return self.call_fun(args)
    level = self.layout.levels[k]
    if level.kind == "vmap":
      return self._vmap_level(k, level, args, labels)
    return self._scan_level(k, level, args, labels)

  def _vmap_level(self, k, level, args, labels):
    (label,) = level.labels
    in_axes = tuple(lab.index(label) if label in lab else None for lab in labels)
    inner = [tuple(x for x in lab if x != label) for lab in labels]
    if self._is_unit(level):
      return self._unit_level(k, level, args, in_axes, inner)

    def body(*xs):
      outs = self.run(k + 1, list(xs), inner)
      mapped, unmapped = [], []
      for j, v in enumerate(outs):
        mode, _ = self.mode(j, level)
        if mode == "reduce":
          v = lax.psum(v, level.bound_name)
        (mapped if mode == "map" else unmapped).append(v)
      return mapped, unmapped

    vmapped = jax.vmap(body, in_axes=in_axes, out_axes=(0, None), axis_name=level.bound_name,
                       axis_size=level.size, spmd_axis_name=level.spmd)
    try:
      mapped, unmapped = vmapped(*args)
    except ValueError as e:
      if isinstance(e, OutputAxesError) or not _BATCHED_BUT_NONE.search(str(e)):
        raise
      culprit = self._find_varying(level, body, in_axes, args)
      raise self._varies_error(level, culprit) from None
    return self._assemble(k, level, iter(mapped), iter(unmapped))

  def _is_unit(self, level) -> bool:
    """A size-1 level on no mesh axis (a serial loop that covers its whole axis), once the
    outputs are known and each one is placed or reduced along it: nothing can vary there,
    so a vmap would only add a unit batch dim to every op (dot_generals with a batch dim of
    1, transposes and sums over it: +19 % bytes in a micro-batched gradient)."""
    return (level.size == 1 and level.spmd is None and self.out_treedef is not None
            and all(self.mode(j, level)[0] != "none" for j in range(len(self.out_specs))))

  def _unit_level(self, k, level, args, in_axes, inner):
    """The level's sub-dim squeezed out of the inputs and re-inserted into the outputs; a
    reduction over one element is the element (in the dtype ``lax.psum`` gives)."""
    xs = [a if ax is None else jnp.squeeze(a, ax) for a, ax in zip(args, in_axes)]
    outs = self.run(k + 1, xs, inner)
    mapped, unmapped = [], []
    for j, v in enumerate(outs):
      if self.mode(j, level)[0] == "map":
        mapped.append(jnp.expand_dims(v, 0))
      else:
        unmapped.append(v.astype(reduced_dtype(v.dtype)))
    return self._assemble(k, level, iter(mapped), iter(unmapped))

  def _find_varying(self, level, body, in_axes, args) -> int | None:
    """Which unplaced output varies along ``level`` (error path only: probes each one)."""
    candidates = [j for j in range(len(self.out_specs)) if self.mode(j, level)[0] != "map"]
    for i, j in enumerate(candidates):
      probe = jax.vmap(lambda *xs, i=i: body(*xs)[1][i], in_axes=in_axes, out_axes=None,
                       axis_name=level.bound_name, axis_size=level.size,
                       spmd_axis_name=level.spmd)
      try:
        probe(*args)
      except ValueError as e:
        if _BATCHED_BUT_NONE.search(str(e)):
          return j
        raise
    return None

  def _scan_level(self, k, level, args, labels):
    if self.out_treedef is None:
      self._trace_shapes(args, labels)
    labelset = set(level.labels)
    where = [next((i for i, x in enumerate(lab) if x in labelset), None) for lab in labels]
    inner = [tuple(x for x in lab if x not in labelset) for lab in labels]
    xs = [jnp.moveaxis(a, w, 0) for a, w in zip(args, where) if w is not None]
    n_out = len(self.out_specs)
    modes = [self.mode(j, level)[0] for j in range(n_out)]
    carried = [j for j in range(n_out) if modes[j] != "map"]
    init = [self._place_carry(j, k, jnp.zeros(s.shape, s.dtype)) for j, s in
            ((j, self.struct_after(j, k + 1)) for j in carried)]

    def body(carry, x_slices):
      it = iter(x_slices)
      step_args = [next(it) if w is not None else a for a, w in zip(args, where)]
      outs = self.run(k + 1, step_args, inner)
      new_carry, ys = [], []
      c = iter(carry)
      for j, (v, mode) in enumerate(zip(outs, modes)):
        if mode == "map":
          ys.append(v)
        else:
          prev = next(c)
          new = (prev + v if mode == "reduce" else v).astype(prev.dtype)
          new_carry.append(self._place_carry(j, k, new))
      return new_carry, ys

    carry, ys = lax.scan(body, init, xs, length=level.size)
    return self._assemble(k, level, iter(ys), iter(carry))

  def _place_carry(self, j: int, k: int, x):
    """Keeps a loop carry where its output is stated to live (e.g. a gradient accumulator
    sharded like its parameter), so XLA reduce-scatters into it instead of replicating.
    Only carries made of positional dims alone are constrained."""
    stated = self.out_stated[j] if self.out_stated else None
    if stated is None or self.constrain is None:
      return x
    if any(lab[0] is not None for lab in self.labels_after(j, k + 1)):
      return x
    return self.constrain(x, PartitionSpec(*stated))

  def _assemble(self, k, level, mapped, unmapped):
    outs = []
    for j in range(len(self.out_specs)):
      mode, label = self.mode(j, level)
      if mode == "map":
        outs.append(jnp.moveaxis(next(mapped), 0, self.labels_after(j, k).index(label)))
      else:
        outs.append(next(unmapped))
    return outs

  def _trace_shapes(self, args, labels):
    """Traces the user function once on per-example shapes (for the loop carries)."""
    jax.eval_shape(lambda *xs: self.call_fun(xs), *per_example_structs(args, labels))

  def _varies_error(self, level, j):
    axis = level.labels[0][0]
    where = f"output{self.out_paths[j]}" if j is not None else "an output"
    spec = self.out_specs[j] if j is not None else None
    return OutputAxesError(format_message(
        f"xmap({self.fun_name}): {where} varies along axis {axis!r}, but its out_axes "
        f"{spec!r} does not place it.",
        fix=f"Add {axis!r} to that output's out_axes (e.g. {_spec_adding(spec, axis)}), or "
            f"reduce over it with partition.Sum({axis!r}) / partition.Mean({axis!r})."))


def _spec_adding(spec, axis) -> str:
  """``spec`` (an out_axes leaf) with ``axis`` added where no named dim is: a list stays a
  list (``['batch', 'classes', ...]``), a dict gains the first free dim."""
  names, dims = (spec.names, spec.dims) if spec is not None else ((), ())
  if tuple(dims) == tuple(range(len(dims))):
    ordered = [names[dims.index(d)] for d in range(len(dims))]
    return "[" + ", ".join(repr(n) for n in [*ordered, axis]) + ", ...]"
  free = next(d for d in range(len(dims) + 1) if d not in dims)
  return "{" + ", ".join(f"{d}: {n!r}" for d, n in [*zip(dims, names), (free, axis)]) + "}"


def per_example_structs(args, labels) -> list[jax.ShapeDtypeStruct]:
  """What the user function sees of each input: its positional dims only."""
  return [jax.ShapeDtypeStruct(tuple(d for d, lab in zip(jnp.shape(a), ls) if lab[0] is None),
                               jnp.result_type(a)) for a, ls in zip(args, labels)]


def split_inputs(layout: MapLayout, leaves, specs) -> tuple[list[Any], list[tuple[Label, ...]]]:
  """Reshapes each named dim into its sub-dims and labels every dim."""
  out, labels = [], []
  for x, spec in zip(leaves, specs):
    shape, labs = [], []
    for d, size in enumerate(jnp.shape(x)):
      name = spec.names[spec.dims.index(d)] if d in spec.dims else None
      if name is None:
        shape.append(size)
        labs.append((None, d))
      else:
        for lab, sub in layout.axes[name].sub_dims():
          shape.append(sub)
          labs.append(lab)
    out.append(x if tuple(shape) == jnp.shape(x) else jnp.reshape(x, shape))
    labels.append(tuple(labs))
  return out, labels


def merge_outputs(tracer: BodyTracer, outs: Sequence[Any]) -> list[Any]:
  """Merges each named axis' sub-dims back into one dim and finishes ``Mean``."""
  result = []
  for j, x in enumerate(outs):
    shape, labels = [], tracer.final_labels[j]
    for i, lab in enumerate(labels):
      if lab[0] is not None and i > 0 and labels[i - 1][0] == lab[0]:
        shape[-1] *= x.shape[i]
      else:
        shape.append(x.shape[i])
    x = x if tuple(shape) == x.shape else jnp.reshape(x, shape)
    spec = tracer.out_specs[j]
    if isinstance(spec, Reduction) and spec.kind == "mean":
      count = 1
      for name in spec.names:
        count *= tracer.layout.axes[name].size
      x = x / count
    result.append(x)
  return result
