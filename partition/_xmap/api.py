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

import collections
import contextlib
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from partition._base import mesh as _mesh
from partition._base.errors import (
  AxisNameError,
  AxisSizeError,
  MeshError,
  SpecError,
  format_message,
  fun_name,
  short,
)
from partition._base.resources import named_loops
from partition._rules.context import axis_rules, current_rules
from partition._rules.scope import rules_mesh
from partition._rules.table import AxisRules
from partition._xmap import placement as _placement
from partition._xmap.collectives import check_no_joint_ppermute
from partition._xmap.layout import (
  MapLayout,
  build_layout,
  check_cooccurrence,
  check_divisible,
  infer_sizes,
  normalize_resources,
)
from partition._xmap.messages import explicit_closure_error, in_xmap_terms
from partition._xmap.nesting import check_not_shadowing, enclosing, tracing
from partition._xmap.program import (
  BodyTracer,
  merge_outputs,
  per_example_structs,
  split_inputs,
)
from partition._xmap.specs import (
  AxisSpec,
  Logical,
  canonical_in_axes,
  flatten_specs,
  is_spec_leaf,
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
      them (mesh axes first); or an ``AxisRules`` table resolving the axis names. Left
      out, the axes resolve by the ``partition.axis_rules`` table in context (as ``Logical``
      dims do), else they are vectorised only.
    donate_argnums: positional arguments whose buffers may be reused, as in ``jax.jit``.
    mesh: the device mesh; defaults to the one set by ``jax.set_mesh``, else an enclosing
      xmap's, else the one given to ``partition.axis_rules``.

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
    self._axis_sizes = _check_axis_sizes(axis_sizes, self._name)
    self._axis_resources = axis_resources
    self._donate = _check_donate(donate_argnums, self._name)
    self._mesh = _mesh.current_mesh(mesh, f"xmap({self._name})") if mesh is not None else None
    # Everything that depends on in_axes/out_axes alone is read once, here.
    in_specs = parse_specs(self._in_axes, "in_axes")
    self._in_names = _defined_names(in_specs, self._axis_sizes)
    self._out_specs = parse_specs(out_axes, "out_axes")
    self._out_names = {n for spec in self._out_specs for n in spec_names(spec)}
    self._uses_logical = any(isinstance(placed(s).sharding, Logical)
                             for s in in_specs + self._out_specs)
    # Equal xmaps (same function, specs and resources) share compiled programs, so a fresh
    # xmap(...) per step of a training loop does not re-trace.
    self._cache = _shared_cache(
        (fun, _specs_key(self._in_axes, in_specs), _specs_key(out_axes, self._out_specs),
         tuple(sorted(self._axis_sizes.items())), _resources_key(axis_resources),
         self._donate, mesh))
    # updated=(): copying fun.__dict__ would clobber our state when fun is itself an XMapped.
    functools.update_wrapper(self, fun, updated=())

  def __repr__(self) -> str:
    return (f"xmap({self._name}, in_axes={self._in_axes!r}, out_axes={self._out_axes!r}, "
            f"axis_resources={self._axis_resources!r})")

  def __call__(self, *args, **kwargs):
    if kwargs:
      raise SpecError(f"xmap({self._name}) takes positional arguments only (in_axes describes "
                      f"them by position), got keywords {sorted(kwargs)}; pass them in order.")
    jitted, targets = self._prepare(args)
    with self._devices_context(targets):
      return jitted(*_place(args, targets))

  def lower(self, *args) -> jax.stages.Lowered:
    """Lowers for the given arguments (arrays or ``jax.ShapeDtypeStruct``s)."""
    jitted, targets = self._prepare(args)
    with self._devices_context(targets):
      return jitted.lower(*_place(args, targets))

  def _devices_context(self, input_shardings):
    """``jit`` learns the devices from its inputs' shardings; without array inputs, a
    ``mesh=`` given to xmap is made the context mesh so that the program runs on it (JAX
    otherwise compiles for one device and fails on an Explicit mesh's typed outputs)."""
    if (input_shardings == () and isinstance(self._mesh, jax.sharding.Mesh)
        and jax.sharding.get_abstract_mesh().empty):
      return jax.set_mesh(self._mesh)
    return contextlib.nullcontext()

  # ------------------------------------------------------------------ planning

  def _prepare(self, args):
    # Hot path: one C++ flatten and a dict lookup; specs are re-read only on a miss.
    try:
      leaves, treedef = jax.tree_util.tree_flatten(args)
    except ValueError as e:  # dict keys of mixed types cannot be sorted
      raise SpecError(format_message(
          f"xmap({self._name}): the arguments are not a valid pytree: {e}",
          fix="Use dict keys of one type (e.g. all str) in the arguments.")) from e
    # The axis_rules mesh comes last: it is what partition.constrain would use here.
    mesh = _mesh.current_mesh(self._mesh) or enclosing.mesh or rules_mesh()
    if isinstance(self._mesh, jax.sharding.AbstractMesh) and (
        jax.sharding.get_abstract_mesh().empty):
      raise MeshError(format_message(
          f"xmap({self._name}): mesh= is an AbstractMesh, which has no devices to run on.",
          context=[f"mesh=: {_mesh.describe(self._mesh)}"],
          fix="Pass a concrete mesh (jax.make_mesh(shape, names)), or call the xmap under "
              "`with jax.set_mesh(mesh):` with a concrete mesh of the same shape."))
    rules = self._rules()
    key = (treedef, tuple(_leaf_key(x) for x in leaves), mesh, _loops_key(), rules)
    hit = self._cache.get(key)
    if hit is None:
      _check_call(args, len(args), self._donate, self._name)
      _check_context_mesh(self._mesh, self._name)
      leaves, specs, paths, _ = flatten_specs(self._in_axes, args, "in_axes", self._name)
      layout = self._layout(leaves, specs, paths, mesh, rules)
      hit = self._cache[key] = self._compile(layout, treedef, leaves, specs, paths, rules)
    return hit

  def _table_in_scope(self, mesh):
    """An ``axis_resources`` rules table is the body's rules too, where no
    ``partition.axis_rules`` context gives others: its ``partition.constrain`` and
    ``nn.with_logical_constraint`` resolve by the table the xmap was given."""
    table = self._axis_resources
    if not isinstance(table, AxisRules) or current_rules() is not None:
      return contextlib.nullcontext()
    return axis_rules(table, mesh)

  def _rules(self):
    """The rules that resolve ``Logical`` leaves and, without ``axis_resources``, the named
    axes: axis_resources if it is a table, else the ``partition.axis_rules`` context (looked
    up when some leaf is ``Logical`` or no axis_resources were given)."""
    if hasattr(self._axis_resources, "xmap_resources"):
      return self._axis_resources
    if not self._uses_logical and self._axis_resources is not None:
      return None
    return current_rules()

  def _layout(self, leaves, specs, paths, mesh, rules) -> MapLayout:
    names = self._in_names
    undefined = sorted(self._out_names - set(names))
    if undefined:
      raise AxisNameError(format_message(
          f"xmap({self._name}): out_axes names axes {undefined} that are not defined.",
          context=[f"defined axes (from in_axes and axis_sizes): {names}"],
          fix="Every out_axes name must appear in in_axes or axis_sizes."))
    sizes, source = infer_sizes(leaves, specs, paths, self._axis_sizes, names, self._name)
    # Named axes resolve by the rules in context too, as Logical dims do: a name with a rule
    # is placed by it, as everywhere else under `partition.axis_rules`.
    given = self._axis_resources if self._axis_resources is not None else rules
    resources = normalize_resources(given, names, sizes, mesh, self._name)
    axes = check_divisible(resources, sizes, source, mesh, self._name)
    check_cooccurrence(specs, [f"argument{p}" for p in paths], axes, self._name)
    out_specs = self._out_specs
    check_cooccurrence(out_specs, [f"out_axes entry {s!r}" for s in out_specs], axes, self._name)
    order = _level_order(out_specs, leaves, specs, names)
    return build_layout({n: axes[n] for n in order}, mesh)

  def _compile(self, layout: MapLayout, in_treedef, leaves, specs, paths, rules):
    """The jitted program of one layout, and the input shardings callers are moved onto."""
    self._check_stated_shardings_have_a_mesh(layout, specs)
    inputs = _InputPlacement.of(layout, leaves, specs, paths, rules, self._out_specs, self._name)
    trace = functools.partial(self._trace_body, layout, inputs, in_treedef, specs, rules)
    program = _program(layout, trace, inputs.has_mesh, self._name)
    program.__name__ = f"xmap_{getattr(self._fun, '__name__', 'fun')}"
    flat_in = None if inputs.shardings is None else jax.tree_util.tree_unflatten(
        in_treedef, list(inputs.shardings))
    jitted = jax.jit(program, in_shardings=flat_in, donate_argnums=self._donate)
    return jitted, inputs.shardings

  def _check_stated_shardings_have_a_mesh(self, layout: MapLayout, specs) -> None:
    stating = [s for s in list(specs) + [placed(o) for o in self._out_specs]
               if s.sharding is not None]
    if stating and layout.mesh is None:
      raise MeshError(format_message(
          f"xmap({self._name}): {stating[0].user_repr} states a sharding, but there is no mesh.",
          fix="Pass mesh=jax.make_mesh(...) to xmap, or call it under "
              "`with jax.set_mesh(mesh):`."))

  def _trace_body(self, layout: MapLayout, inputs: _InputPlacement, in_treedef, specs, rules,
                  leaves, in_region: bool, typed=None):
    """Traces the user's function over the layout's levels: ``(outputs, their full specs,
    their treedef)``; outputs constrained to their placement unless ``in_region`` (an
    Explicit-axes region re-places them itself)."""
    name, mesh, has_mesh = self._name, layout.mesh, inputs.has_mesh
    check_not_shadowing(layout, name)
    constrain = _constrainer(mesh)

    def state_outputs(spec, shape, path):
      return _placement.stated_entries(layout, spec, shape, rules, f"out_axes for output{path}",
                                       name) if has_mesh else None

    tracer = BodyTracer(layout, self._fun, name, in_treedef, self._out_axes, state_outputs,
                        constrain if has_mesh else None)
    if has_mesh:
      typed = typed or [None] * len(leaves)
      leaves = [_constrain_input(layout, x, s, st, t, constrain)
                for x, s, st, t in zip(leaves, specs, inputs.stated, typed)]
    split, labels = split_inputs(layout, leaves, specs)
    with self._table_in_scope(mesh), in_xmap_terms(layout, name, self._in_names), \
        tracing(layout):
      check_no_joint_ppermute(
          lambda *xs: self._fun(*jax.tree_util.tree_unflatten(in_treedef, list(xs))),
          per_example_structs(split, labels), _bound_axes(layout), name)
      outs = tracer.run(0, split, labels)
    outs = merge_outputs(tracer, outs)
    out_specs = [_placement.full_spec(layout, placed(s), x.ndim, st)
                 for s, st, x in zip(tracer.out_specs, tracer.out_stated, outs)]
    if has_mesh and not in_region:
      outs = [x if _placement.is_trivial(sp) else constrain(x, sp)
              for x, sp in zip(outs, out_specs)]
    return outs, out_specs, tracer.out_treedef


class _InputPlacement(NamedTuple):
  """Where the inputs go: per leaf, the positional entries its spec states (``stated``) and
  the sharding callers' arrays are moved onto (``shardings``); ``None``s off-mesh."""

  has_mesh: bool
  stated: list
  shardings: tuple | None

  @classmethod
  def of(cls, layout: MapLayout, leaves, specs, paths, rules, out_specs, name
         ) -> _InputPlacement:
    stating = any(s.sharding is not None for s in list(specs) + [placed(o) for o in out_specs])
    if not (layout.mesh_axes or stating):
      return cls(False, [None] * len(specs), None)
    stated = [_placement.stated_entries(layout, s, _positional_shape(x, s), rules,
                                        f"in_axes for argument{p}", name)
              for x, s, p in zip(leaves, specs, paths)]
    return cls(True, stated, tuple(_in_sharding(layout, x, s, st)
                                   for x, s, st in zip(leaves, specs, stated)))


def _program(layout: MapLayout, trace: Callable, has_mesh: bool, name: str) -> Callable:
  """The function ``jax.jit`` compiles: the traced body, run with the mesh's Explicit axes
  made Auto when there are any (see program.py)."""
  mesh = layout.mesh
  # Nested xmaps find the axes Auto already and need no region of their own.
  explicit = sorted(_mesh.explicit_axes(mesh)) if has_mesh and _mesh.explicit_axes(mesh) else []

  def program(*args):
    leaves = jax.tree_util.tree_leaves(args)
    now_explicit = _still_explicit(mesh, explicit)
    if now_explicit:
      outs, treedef = _with_explicit_axes_auto(mesh, now_explicit, trace, leaves, name)
    else:
      with _mesh.in_context(mesh if has_mesh else None):
        outs, _, treedef = trace(leaves, in_region=False)
    return jax.tree_util.tree_unflatten(treedef, outs)

  return program


def _with_explicit_axes_auto(mesh, explicit: list[str], trace: Callable, leaves, name: str):
  """Runs the body with the Explicit mesh axes made Auto (like ``jax.sharding.auto_axes``,
  whose out_sharding we only know after tracing), so that ``vmap(spmd_axis_name=)`` places
  intermediates and collectives lower as on Auto meshes; then hands the outputs back with
  Explicit types. ``reshard`` to ``P()`` only drops the types: ``_constrain_input``
  re-states the placement, and XLA moves no data."""
  auto = _context_or(mesh).update_axis_types({a: jax.sharding.AxisType.Auto for a in explicit})
  typed = [jax.typeof(x).sharding.spec for x in leaves]
  with jax.sharding.use_abstract_mesh(auto):
    leaves = jax.sharding.reshard(leaves, [PartitionSpec()] * len(leaves))
    try:
      outs, out_specs, treedef = trace(leaves, in_region=True, typed=typed)
    except ValueError as e:
      if "should match the aval mesh" not in str(e):
        raise
      raise explicit_closure_error(name, mesh) from e
  outs = [jax.sharding.reshard(x, NamedSharding(mesh, _placement.concrete(spec)))
          for x, spec in zip(outs, out_specs)]
  return outs, treedef


_SHARED_CACHES: collections.OrderedDict[Any, dict] = collections.OrderedDict()
_SHARED_CACHE_SIZE = 256


def _bound_axes(layout: MapLayout) -> list[tuple[str, int]]:
  """The named axes a collective in the body can name, with their sizes: this xmap's
  vectorised axes and the enclosing ones still bound under their names (loop axes are
  bound under private names)."""
  own = [(level.bound_name, level.size) for level in layout.levels
         if level.kind == "vmap" and level.labels[0][1] == "all"]
  outer = []
  for axis in enclosing.axes:
    if axis in layout.axes:
      continue
    try:
      outer.append((axis, jax.lax.axis_size(axis)))
    except NameError:
      pass
  return outer + own


def _shared_cache(key) -> dict:
  try:
    cache = _SHARED_CACHES.pop(key)
  except TypeError:  # something unhashable in the configuration: no sharing
    return {}
  except KeyError:
    cache = {}
  _SHARED_CACHES[key] = cache
  while len(_SHARED_CACHES) > _SHARED_CACHE_SIZE:
    _SHARED_CACHES.popitem(last=False)
  return cache


def _specs_key(raw: Any, parsed: Sequence[Any]) -> Any:
  return jax.tree_util.tree_structure(raw, is_leaf=is_spec_leaf), tuple(parsed)


def _resources_key(resources: Any) -> Any:
  if not isinstance(resources, Mapping):
    return resources
  return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in resources.items())


def _check_axis_sizes(axis_sizes: Any, name: str) -> dict[str, int]:
  if axis_sizes is None:
    return {}
  if not isinstance(axis_sizes, Mapping):
    raise AxisSizeError(f"xmap({name}): axis_sizes must be a dict {{axis name: size}}, got "
                        f"{axis_sizes!r}; e.g. axis_sizes={{'batch': 8}}.")
  problems = []
  for axis, size in axis_sizes.items():
    if not isinstance(axis, str):
      problems.append(f"key {axis!r} is not an axis name (str)")
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 0:
      problems.append(f"axis_sizes[{axis!r}] must be a non-negative int, got {size!r}")
    elif size >= 2**31:
      problems.append(f"axis_sizes[{axis!r}] = {size} does not fit JAX's int32 dims")
  if problems:
    raise AxisSizeError(format_message(f"xmap({name}): invalid axis_sizes.", bullets=problems,
                                       fix="Give sizes as {'axis name': int}, e.g. {'i': 4}."))
  return dict(axis_sizes)


def _check_donate(donate_argnums: Any, name: str) -> tuple[int, ...]:
  nums = (donate_argnums,) if isinstance(donate_argnums, (int, np.integer)) else donate_argnums
  try:
    nums = tuple(nums)
  except TypeError:
    nums = (nums,)
  bad = [n for n in nums if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0]
  if bad:
    raise SpecError(f"xmap({name}): donate_argnums must be non-negative ints (positions of "
                    f"arguments), got {donate_argnums!r}; e.g. donate_argnums=(0,).")
  return tuple(int(n) for n in nums)


def _check_context_mesh(mesh, name: str) -> None:
  """``mesh=`` must agree with a ``jax.set_mesh`` mesh in context (JAX otherwise fails with
  a bare AssertionError or "incompatible devices"). Inside an enclosing xmap the context is
  that xmap's own Auto region, which is expected to differ in axis types."""
  if mesh is None or enclosing.axes:
    return
  context = jax.sharding.get_abstract_mesh()
  if context.empty:
    return
  mine = mesh if isinstance(mesh, jax.sharding.AbstractMesh) else mesh.abstract_mesh
  if (dict(mine.shape), tuple(mine.axis_types)) != (dict(context.shape),
                                                    tuple(context.axis_types)):
    raise MeshError(format_message(
        f"xmap({name}): mesh= and the mesh in context (jax.set_mesh) differ.",
        context=[f"mesh=: {_mesh.describe(mine)}", f"context: {_mesh.describe(context)}"],
        fix="Pass the same mesh to both (same axes, sizes and AxisTypes), or drop mesh= to "
            "use the context mesh."))


def _check_call(args, n_args: int, donate, name) -> None:
  """Checks what jax.jit would reject with less context: donated positions must exist and
  leaves must be arrays (each bad leaf named by its keypath, e.g. ``argument[1]['k']``)."""
  out_of_range = [d for d in donate if d >= n_args]
  if out_of_range:
    raise SpecError(f"xmap({name}): donate_argnums {out_of_range} is out of range for a call "
                    f"with {n_args} positional arguments; count arguments from 0.")
  bad = [f"argument{jax.tree_util.keystr(path)} is {type(x).__name__} {short(x)}"
         for path, x in jax.tree_util.tree_flatten_with_path(args)[0]
         if not (hasattr(x, "shape") and hasattr(x, "dtype")) and not isinstance(
             x, (int, float, complex, bool, np.number, np.bool_))]
  if bad:
    raise SpecError(format_message(
        f"xmap({name}): arguments must be arrays (or pytrees of arrays); "
        f"{len(bad)} leaf(s) are not:",
        bullets=bad,
        fix="Convert them with jnp.asarray, or close over non-array values in the function."))


def _shape_dtype(x):
  shape = getattr(x, "shape", None)
  return (tuple(shape), x.dtype) if shape is not None else (np.shape(x), type(x))


def _loops_key():
  return tuple(sorted(named_loops().items()))


def _defined_names(in_specs: Sequence[AxisSpec], axis_sizes: Mapping[str, int]) -> list[str]:
  """Names in any in_axes spec (also ones standing for empty containers) and axis_sizes."""
  names: dict[str, None] = {}
  for spec in in_specs:
    names.update(dict.fromkeys(spec.names))
  names.update(dict.fromkeys(axis_sizes))
  return list(names)


def _positional_shape(x, spec: AxisSpec) -> tuple[int, ...]:
  return tuple(n for d, n in enumerate(np.shape(x)) if d not in spec.dims)


def _leaf_key(x) -> tuple:
  """What of a leaf decides the compiled program: shape, dtype, and where it lives."""
  if isinstance(x, jax.core.Tracer):
    return (*_shape_dtype(x), "traced", jax.typeof(x).sharding.spec)
  placement = getattr(x, "sharding", None) if getattr(x, "committed", True) else None
  return (*_shape_dtype(x), placement)


def _in_sharding(layout: MapLayout, x, spec: AxisSpec, stated) -> NamedSharding | None:
  """``jit`` in_sharding of one leaf: the named dims' placement with the stated, inherited
  (committed) or replicated positional dims. A tracer keeps what it has: ``None`` on Auto
  meshes; on Explicit ones its typed sharding, stated so that jit sees the mesh's devices
  (under eager grad/vmap the values are otherwise uncommitted: "device assignment 1")."""
  if isinstance(x, jax.core.Tracer):
    if not (_mesh.explicit_axes(layout.mesh) and isinstance(layout.mesh, jax.sharding.Mesh)):
      return None
    typed = jax.typeof(x).sharding
    return NamedSharding(layout.mesh, typed.spec if not typed.mesh.empty else PartitionSpec())
  if isinstance(layout.mesh, jax.sharding.AbstractMesh):
    # Under an eager transformation (grad, vmap) of a jax.set_mesh block only the abstract
    # mesh is visible; a concrete argument then goes in as it is, and the constraints in
    # the program place it (as for a traced one).
    return None
  if stated is None and getattr(x, "committed", True):
    stated = _placement.inherited_entries(layout, spec, x)
  spec = _placement.full_spec(layout, spec, np.ndim(x), stated, default=None)
  return NamedSharding(layout.mesh, spec)


def _constrainer(mesh):
  """Applies a PartitionSpec as a constraint (called while tracing): bare when a mesh is in
  context (``set_mesh``, or the Auto region of an enclosing xmap on an Explicit mesh, whose
  axis types are the ones that count), else on ``mesh``."""
  if not jax.sharding.get_abstract_mesh().empty or isinstance(mesh, jax.sharding.AbstractMesh):
    return lambda x, spec: jax.lax.with_sharding_constraint(x, spec)
  return lambda x, spec: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def _constrain_input(layout: MapLayout, x, spec: AxisSpec, stated, typed, constrain):
  """Re-states an input's placement inside the program: named dims on their mesh axes,
  positional dims as stated, as typed (Explicit meshes), or unconstrained."""
  if stated is None and typed is not None:
    stated = _placement.typed_entries(layout, spec, typed, np.ndim(x))
  full = _placement.full_spec(layout, spec, np.ndim(x), stated)
  return x if _placement.is_trivial(full) else constrain(x, full)


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
    if target is not None and _needs_move(x, target):
      leaves[i] = jax.device_put(x, target)
      moved = True
  return jax.tree_util.tree_unflatten(treedef, leaves) if moved else args


def _needs_move(x, target) -> bool:
  if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer) or not x.committed:
    return False
  sharding = x.sharding
  return sharding != target and not sharding.is_equivalent_to(target, x.ndim)


