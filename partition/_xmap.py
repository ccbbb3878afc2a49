"""``partition.xmap``: run a function over named axes, placed on a mesh, loops, or vectors.

Inside the mapped function, named dims are gone from the positional shapes and ``jax.lax``
collectives (``psum``, ``pmean``, ``all_gather``, ``axis_index``, ``ppermute``, ...) refer to
them by name, exactly as under ``jax.vmap(axis_name=...)``. ``axis_resources`` decides only
*where* each axis is computed: vectorised (default), sharded over mesh axes, or split into
sequential chunks by serial loops. It never changes the results.

Example:
  >>> import jax, jax.numpy as jnp
  >>> import partition
  >>> def matvec(w, x):  # w is shared, x is one example: the 'batch' dim is gone
  ...   return w @ x
  >>> f = partition.xmap(matvec, in_axes=([...], ['batch', ...]), out_axes=['batch', ...])
  >>> f(jnp.eye(3), jnp.ones((5, 3))).shape
  (5, 3)

  Gradient accumulation over 4 micro-batches, averaged over the batch:

  >>> loss = lambda w, x: jnp.sum((x @ w) ** 2)
  >>> g = partition.xmap(jax.grad(loss), in_axes=([...], ['batch', ...]),
  ...                    out_axes=partition.Mean('batch'),
  ...                    axis_resources={'batch': partition.SerialLoop(4)})
  >>> g(jnp.ones((3, 2)), jnp.ones((8, 3))).shape
  (3, 2)
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from partition import _mesh
from partition._errors import (
  AxisNameError,
  LoopCollectiveError,
  MeshError,
  SpecError,
  format_message,
  fun_name,
)
from partition._plan import (
  Plan,
  build_plan,
  check_cooccurrence,
  check_divisible,
  infer_sizes,
  normalize_resources,
)
from partition._program import Tracer, merge_outputs, split_inputs
from partition._resources import named_loops
from partition._specs import (
  AxisSpec,
  canonical_in_axes,
  flatten_specs,
  parse_specs,
  placed,
  spec_names,
)


def xmap(fun: Callable, in_axes: Any, out_axes: Any, *,
         axis_sizes: Mapping[str, int] | None = None,
         axis_resources: Any = None,
         donate_argnums: int | Sequence[int] = (),
         mesh: jax.sharding.Mesh | None = None) -> XMapped:
  """Maps ``fun`` over named axes.

  Args:
    fun: the function to map; it sees its arguments with the named dims removed.
    in_axes: a pytree prefix of the argument tuple. Each leaf is ``{dim: 'name'}``, a list of
      names with ``None`` for unnamed dims (asserting the rank) optionally ending in ``...``,
      or ``{}`` / ``[...]`` / ``None`` for no named dims.
    out_axes: a pytree prefix of the outputs, with the same leaves as ``in_axes`` plus
      ``partition.Sum(*names, axes=...)`` / ``partition.Mean(...)`` to reduce over axes.
      An output that does not vary along a placed axis is broadcast; one that varies along
      an axis it does not place is an error.
    axis_sizes: sizes of axes (required for axes that no input carries; checked otherwise).
    axis_resources: ``{axis: resources}`` where resources are a mesh axis, a tuple of mesh
      axes, ``SerialLoop(n)``, a name bound by ``serial_loop(name, n)``, or a tuple mixing
      them (mesh axes first); or an ``AxisRules`` table resolving the axis names.
    donate_argnums: positional arguments whose buffers may be reused, as in ``jax.jit``.
    mesh: the device mesh; defaults to the one set by ``jax.set_mesh``.

  Returns:
    A callable with the signature of ``fun`` taking and returning positional arrays, with
    a ``.lower(*args)`` method returning ``jax.stages.Lowered``.

  Raises:
    SpecError, AxisNameError, AxisSizeError, ResourceError, MeshError, OutputAxesError:
      (``TypeError`` / ``ValueError`` subclasses) naming the offending leaf and the fix.
  """
  return XMapped(fun, in_axes, out_axes, axis_sizes=axis_sizes, axis_resources=axis_resources,
                 donate_argnums=donate_argnums, mesh=mesh)


class XMapped:
  """The result of :func:`xmap`: call it, or ``.lower(*args)`` it."""

  def __init__(self, fun, in_axes, out_axes, *, axis_sizes, axis_resources, donate_argnums,
               mesh):
    if not callable(fun):
      raise SpecError(f"xmap expects a callable as its first argument, got {fun!r}; "
                      "pass the function to map, e.g. xmap(jnp.sin, ['i', ...], ['i', ...]).")
    self._fun = fun
    self._name = fun_name(fun)
    if out_axes == ():
      raise SpecError(f"xmap({self._name}): out_axes=() means no outputs; xmapped functions "
                      "must return something.")
    self._in_axes = canonical_in_axes(in_axes)
    self._out_axes = out_axes
    self._axis_sizes = dict(axis_sizes or {})
    self._axis_resources = axis_resources
    self._donate = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
    self._mesh = mesh
    # Everything that depends on in_axes/out_axes alone is read once, here.
    self._in_names = _defined_names(self._in_axes, self._axis_sizes)
    self._out_specs = parse_specs(out_axes, "out_axes")
    self._out_names = {n for spec in self._out_specs for n in spec_names(spec)}
    self._cache: dict[Any, Any] = {}
    # updated=(): copying fun.__dict__ would clobber our state when fun is itself an XMapped.
    functools.update_wrapper(self, fun, updated=())

  def __repr__(self) -> str:
    return (f"xmap({self._name}, in_axes={self._in_axes!r}, out_axes={self._out_axes!r}, "
            f"axis_resources={self._axis_resources!r})")

  def __call__(self, *args):
    jitted, targets = self._prepare(args)
    return jitted(*_place(args, targets))

  def lower(self, *args) -> jax.stages.Lowered:
    """Lowers for the given arguments (arrays or ``jax.ShapeDtypeStruct``s)."""
    jitted, targets = self._prepare(args)
    return jitted.lower(*_place(args, targets))

  # ------------------------------------------------------------------ planning

  def _prepare(self, args):
    # Hot path: one C++ flatten and a dict lookup; specs are re-read only on a miss.
    leaves, treedef = jax.tree_util.tree_flatten(args)
    mesh = _mesh.current_mesh(self._mesh)
    key = (treedef, tuple(_shape_dtype(x) for x in leaves), mesh, _loops_key())
    hit = self._cache.get(key)
    if hit is None:
      leaves, specs, paths, _ = flatten_specs(self._in_axes, args, "in_axes", self._name)
      plan = self._plan(leaves, specs, paths, mesh)
      hit = self._cache[key] = self._compile(plan, treedef, specs)
    return hit

  def _plan(self, leaves, specs, paths, mesh) -> Plan:
    names = self._in_names
    undefined = sorted(self._out_names - set(names))
    if undefined:
      raise AxisNameError(format_message(
          f"xmap({self._name}): out_axes names axes {undefined} that are not defined.",
          context=[f"defined axes (from in_axes and axis_sizes): {names}"],
          fix="Every out_axes name must appear in in_axes or axis_sizes."))
    sizes, source = infer_sizes(leaves, specs, paths, self._axis_sizes, names, self._name)
    resources = normalize_resources(self._axis_resources, names, sizes, mesh, self._name)
    axes = check_divisible(resources, sizes, source, mesh, self._name)
    check_cooccurrence(specs, [f"argument{p}" for p in paths], axes, self._name)
    out_specs = self._out_specs
    check_cooccurrence(out_specs, [f"out_axes entry {s!r}" for s in out_specs], axes, self._name)
    order = _level_order(out_specs, leaves, specs, names)
    return build_plan({n: axes[n] for n in order}, mesh)

  def _compile(self, plan: Plan, in_treedef, specs):
    mesh = plan.mesh
    has_mesh = bool(plan.mesh_axes)  # _plan checked that a mesh exists then
    in_shardings = tuple(_sharding(plan, s, mesh) for s in specs) if has_mesh else None

    # On a mesh with Explicit axes the body runs with all of them Auto (see program); nested
    # xmaps then find them Auto already and need no region of their own.
    explicit = (sorted(_mesh.explicit_axes(mesh))
                if _mesh.explicit_axes(mesh) & plan.mesh_axes else [])

    def traced(leaves):
      _check_not_shadowing(plan, self._name)
      tracer = Tracer(plan, self._fun, self._name, in_treedef, self._out_axes)
      if explicit:  # inside the Auto region: re-apply the input placement as constraints
        leaves = [jax.lax.with_sharding_constraint(x, _pspec(plan, s))
                  for x, s in zip(leaves, specs)]
      split, labels = split_inputs(plan, leaves, specs)
      try:
        with _tracing(plan):
          outs = tracer.run(0, split, labels)
      except NameError as e:
        raise _loop_collective_error(e, plan, self._name) from None
      outs = merge_outputs(tracer, outs)
      out_specs = [_pspec(plan, placed(s)) for s in tracer.out_specs]
      if has_mesh:  # inside an Auto region, a bare spec refers to the context mesh
        outs = [jax.lax.with_sharding_constraint(x, spec if explicit else NamedSharding(mesh, spec))
                for x, spec in zip(outs, out_specs)]
      return outs, out_specs, tracer.out_treedef

    def program(*args):
      leaves = jax.tree_util.tree_leaves(args)
      now_explicit = _still_explicit(mesh, explicit)
      if not now_explicit:
        outs, _, treedef = traced(leaves)
      else:
        # Explicit mesh axes: run the body with those axes made Auto (like
        # jax.sharding.auto_axes, whose out_sharding we only know after tracing), so that
        # vmap(spmd_axis_name=) places intermediates and collectives lower as on Auto meshes;
        # then hand the outputs back with Explicit types.
        base = _context_or(mesh)
        auto = base.update_axis_types({a: jax.sharding.AxisType.Auto for a in now_explicit})
        with jax.sharding.use_abstract_mesh(auto):
          leaves = jax.sharding.reshard(leaves, [PartitionSpec()] * len(leaves))
          try:
            outs, out_specs, treedef = traced(leaves)
          except ValueError as e:
            if "should match the aval mesh" not in str(e):
              raise
            raise _explicit_closure_error(self._name, mesh) from e
        outs = [jax.sharding.reshard(x, NamedSharding(mesh, spec))
                for x, spec in zip(outs, out_specs)]
      return jax.tree_util.tree_unflatten(treedef, outs)

    program.__name__ = f"xmap_{getattr(self._fun, '__name__', 'fun')}"
    flat_in = None if in_shardings is None else jax.tree_util.tree_unflatten(
        in_treedef, list(in_shardings))
    jitted = jax.jit(program, in_shardings=flat_in, donate_argnums=self._donate)
    return jitted, in_shardings


def _shape_dtype(x):
  shape = getattr(x, "shape", None)
  return (tuple(shape), x.dtype) if shape is not None else (np.shape(x), type(x))


def _loops_key():
  return tuple(sorted(named_loops().items()))


def _defined_names(in_axes: Any, axis_sizes: Mapping[str, int]) -> list[str]:
  """Names in any in_axes spec (also ones standing for empty containers) and axis_sizes."""
  names: dict[str, None] = {}
  for spec in parse_specs(in_axes, "in_axes"):
    names.update(dict.fromkeys(spec.names))
  names.update(dict.fromkeys(axis_sizes))
  return list(names)


def _pspec(plan: Plan, spec: AxisSpec) -> PartitionSpec:
  """The planned PartitionSpec of a leaf: each named dim on its axis' mesh axes."""
  entries = {dim: plan.mesh_spec_entry(name) for name, dim in zip(spec.names, spec.dims)}
  rank = max(entries) + 1 if entries else 0
  return PartitionSpec(*(entries.get(d) for d in range(rank)))


def _sharding(plan: Plan, spec: AxisSpec, mesh) -> NamedSharding:
  return NamedSharding(mesh, _pspec(plan, spec))


def _explicit_closure_error(name: str, mesh) -> MeshError:
  return MeshError(format_message(
      f"xmap({name}): the function uses a value with Explicit sharding on "
      f"{_mesh.describe(mesh)} that is not one of its arguments (a closure over an array or "
      "tracer from outside).",
      context=["On meshes with Explicit axes, xmap runs its body with those axes Auto (as "
               "jax.sharding.auto_axes does), and JAX rejects mixing the two."],
      fix="Pass the value to the xmapped function as an argument (in_axes [...] if it has no "
          "named dims), or use an Auto mesh."))


def _level_order(out_specs, leaves, specs, names) -> list[str]:
  """Outermost first: axes in the order out_axes mentions them, then as they appear in the
  largest inputs. That is the major-to-minor layout a hand-written nest of vmaps follows,
  and XLA lays out the intermediates accordingly."""
  sizes = [int(np.prod(np.shape(x))) for x in leaves]
  ordered: dict[str, None] = {}
  for spec in out_specs:
    ordered.update(dict.fromkeys(spec_names(spec)))
  for i in sorted(range(len(leaves)), key=lambda i: -sizes[i]):
    ordered.update(dict.fromkeys(specs[i].names))  # names are in dim order
  ordered.update(dict.fromkeys(names))
  return list(ordered)


def _context_or(mesh) -> jax.sharding.AbstractMesh:
  """The abstract mesh in context while tracing (an enclosing xmap may have made some axes
  Auto already), else ``mesh``'s."""
  context = jax.sharding.get_abstract_mesh()
  if not context.empty:
    return context
  return mesh if isinstance(mesh, jax.sharding.AbstractMesh) else mesh.abstract_mesh


def _still_explicit(mesh, axes) -> list[str]:
  if not axes:
    return []
  base = _context_or(mesh)
  types = dict(zip(base.axis_names, base.axis_types))
  return [a for a in axes if types.get(a) == jax.sharding.AxisType.Explicit]


def _place(args, targets):
  """Moves committed concrete inputs whose sharding differs onto the planned sharding."""
  if targets is None:
    return args
  leaves, treedef = jax.tree_util.tree_flatten(args)
  moved = False
  for i, (x, target) in enumerate(zip(leaves, targets)):
    if _needs_move(x, target):
      leaves[i] = jax.device_put(x, target)
      moved = True
  return jax.tree_util.tree_unflatten(treedef, leaves) if moved else args


def _needs_move(x, target) -> bool:
  if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer) or not x.committed:
    return False
  sharding = x.sharding
  return sharding != target and not sharding.is_equivalent_to(target, x.ndim)


class _Enclosing(threading.local):
  def __init__(self):
    self.axes: tuple[str, ...] = ()


_enclosing = _Enclosing()


class _tracing:
  """Records the axes of the xmap being traced, for the shadowing check of nested xmaps
  (loop-mapped axes are bound under private names, so lax.axis_size cannot see them)."""

  def __init__(self, plan: Plan):
    self.axes = tuple(plan.axes)

  def __enter__(self):
    self.saved = _enclosing.axes
    _enclosing.axes = self.saved + self.axes

  def __exit__(self, *exc):
    _enclosing.axes = self.saved


def _check_not_shadowing(plan: Plan, name: str) -> None:
  bound = []
  for axis in plan.axes:
    if axis in _enclosing.axes:
      bound.append(axis)
      continue
    try:
      jax.lax.axis_size(axis)
    except NameError:
      continue
    bound.append(axis)
  if bound:
    raise AxisNameError(format_message(
        f"xmap({name}): axis names {bound} are already bound by an enclosing xmap/vmap.",
        context=["Collectives over them would be ambiguous (the inner name would shadow the "
                 "outer one)."],
        fix="Rename the inner axes."))


_UNBOUND = re.compile(r"unbound axis name: (.+?)(?:\. |\.?$)", re.M)


def _loop_collective_error(e: NameError, plan: Plan, name: str) -> Exception:
  match = _UNBOUND.search(str(e))
  axis = match.group(1) if match else None
  if axis not in plan.loop_axes:
    return e
  return LoopCollectiveError(format_message(
      f"xmap({name}): a collective (psum, axis_index, all_gather, ...) refers to axis "
      f"{axis!r}, which is mapped to a serial loop {plan.axes[axis].resources_repr()}.",
      context=["Loop iterations run one after another, so there is no axis to communicate "
               "over inside the function."],
      fix=f"Reduce over it in out_axes instead, e.g. out_axes=partition.Sum({axis!r}) or "
          f"partition.Mean({axis!r}); or map {axis!r} to mesh axes / no resources."))
