"""Haiku adapter: logical axes for Haiku params and state, sharded init, output constraints.

Import it explicitly (``import partition.haiku``). Haiku has no sharding API; this module
adds one without changing how Haiku models are written:

* inside your own modules, :func:`get_parameter` / :func:`get_state` are ``hk.get_parameter``
  / ``hk.get_state`` plus ``axes=``;
* for stock modules (``hk.Linear``, ``hk.nets.ResNet``) a path table,
  ``partition.PathRules([(r'linear_0/w$', ('embed', 'mlp')), ...])``, matched against the
  names Haiku builds (``mlp/~/linear_0/w``) — pass it as ``param_axes=`` or apply it inside
  the transform with :func:`param_axes_from`; it annotates state (BatchNorm EMAs) too;
* :func:`constrain_outputs` constrains stock modules' outputs by module path;
* :func:`init_sharded` creates params and state directly in their shardings. Inside
  ``hk.layer_stack`` (and anything else that stacks per-layer params, e.g. ``hk.lift`` over a
  ``jax.vmap``'d init scanned with ``hk.scan``) axes are written per layer and the leading
  stacked dim gets the logical name ``stack_axis`` (default ``'layers'``).

>>> import haiku as hk, jax, jax.numpy as jnp
>>> import partition, partition.haiku
>>> f = hk.transform(lambda x: hk.Linear(8)(x))
>>> mesh = jax.make_mesh((4, 2), ('data', 'tensor'))
>>> rules = partition.AxisRules([('embed', 'data'), ('mlp', 'tensor')])
>>> params = partition.haiku.init_sharded(
...     f, jax.random.key(0), jnp.ones((2, 4)), rules=rules, mesh=mesh,
...     param_axes=[(r'/w$', ('embed', 'mlp')), (r'/b$', ('mlp',))])
>>> params['linear']['w'].sharding.spec
P('data', 'tensor')
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from partition import _adapt
from partition._audit import audit_placement
from partition._constrain import constrain
from partition._context import current_rules, current_rules_mesh
from partition._errors import PartitionError, format_message
from partition._explain import ExplainReport
from partition._logical_axes import (
  Annotated,
  LogicalAxesError,
  abstract,
  fit_rank,
  unbox,
)
from partition._mesh import AnyMesh, explicit_axes
from partition._path_rules import PathMatch, PathRules, PathRulesError, path_str

Axes = tuple[str | None, ...]

STACK_AXIS = "layers"
"""Default logical name of the leading dim that ``hk.layer_stack`` adds to per-layer params."""

_PARAMS, _STATE = "params", "state"
_LOCAL = threading.local()


class HaikuInputError(PartitionError, TypeError, ValueError):
  """An entry point of ``partition.haiku`` got an argument it cannot use (wrong type/value)."""


class AxesTypeError(LogicalAxesError, TypeError):
  """Logical axes given as something other than a sequence of names (e.g. a bare ``str``)."""


class StaticArgError(PartitionError, TypeError):
  """The model needs a concrete Python value from an input that the adapter traces."""


class UnusedPatternWarning(UserWarning):
  """A :func:`constrain_outputs` pattern matched no module call."""


# -- checking arguments ------------------------------------------------------------------------


def _axes_problem(axes: Any, what: str) -> str | None:
  """Why ``axes`` is not a tuple of logical names (``None`` if it is one)."""
  if isinstance(axes, str):
    return (f"{what} is the string {axes!r}, which would be read as the one-letter axes "
            f"{tuple(axes)}: write ({axes!r},) for one axis")
  if not isinstance(axes, (tuple, list)) or not all(a is None or isinstance(a, str)
                                                      for a in axes):
    return f"{what} must be a tuple of logical names (str or None), got {axes!r}"
  return None


def _as_axes(axes: Any, api: str) -> Axes:
  problem = _axes_problem(axes, "axes")
  if problem:
    raise AxesTypeError(format_message(f"{api}: {problem}.",
                                       fix="Give one logical name (or None) per dim, e.g. "
                                           "axes=('embed', 'mlp') or axes=('embed',)."))
  return tuple(axes)


def _table(table: Any, api: str, arg: str = "param_axes") -> PathRules | None:
  """``table`` as a :class:`PathRules`; a clear error naming ``arg`` otherwise."""
  if table is None or isinstance(table, PathRules):
    return table
  if isinstance(table, (str, bytes)) or not isinstance(table, (Mapping, Sequence)):
    raise HaikuInputError(format_message(
        f"{api}: {arg} must be a partition.PathRules, a list of (regex, logical_axes) pairs or "
        f"a {{regex: logical_axes}} mapping, got {type(table).__name__} {table!r:.60}.",
        fix=f"Pass {arg}=[(r'linear_0/w$', ('embed', 'mlp'))] or "
            f"{arg}=partition.PathRules([...])."))
  pairs = list(table.items()) if isinstance(table, Mapping) else list(table)
  problems = [_axes_problem(entry[1], f"entry #{i} {entry[0]!r}: the axes")
              for i, entry in enumerate(pairs)
              if isinstance(entry, (tuple, list)) and len(entry) == 2 and entry[1] is not None]
  problems = [p for p in problems if p]
  if problems:
    raise AxesTypeError(format_message(f"{api}: {arg} has invalid logical axes:",
                                       bullets=problems,
                                       fix="Give each pattern a tuple with one name (or None) "
                                           "per dim, or None to replicate."))
  return PathRules(pairs)


def _check_transformed(transformed: Any) -> str | None:
  if isinstance(transformed, (hk.Transformed, hk.TransformedWithState, hk.MultiTransformed,
                              hk.MultiTransformedWithState)):
    return None
  kind = type(transformed).__name__
  if isinstance(transformed, type) and issubclass(transformed, hk.Module):
    return (f"transformed is the Haiku module class {transformed.__name__}; modules are created "
            f"inside a function: pass hk.transform(lambda x: {transformed.__name__}(...)(x))")
  if "flax" in type(transformed).__module__:
    return (f"transformed is a Flax {kind}; use partition.flax.init_sharded or "
            "partition.nnx.init_sharded for Flax models")
  if callable(transformed):
    name = getattr(transformed, "__name__", kind)
    return (f"transformed is a plain callable ({name}), not a Haiku transform: pass "
            f"hk.transform({name}) (or hk.transform_with_state({name}) if it uses state)")
  return (f"transformed must be an hk.transform / hk.transform_with_state result, got {kind} "
          f"{transformed!r:.60}")


def _is_key(x: Any) -> bool:
  dtype, shape = getattr(x, "dtype", None), tuple(getattr(x, "shape", (None,)))
  if dtype is None:
    return False
  if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    return shape == ()
  return np.dtype(dtype) == np.uint32 and shape == (2,)


def _check_rng(rng: Any, concrete: bool) -> tuple[Any, str | None]:
  """The init key, converted like Haiku does; or a problem.

  Haiku's ``init`` takes an int seed (``hk.PRNGSequence(seed)`` makes
  ``jax.random.PRNGKey(seed)``); converting it here gives the same values as ``f.init``.
  """
  fix = "pass jax.random.key(0) (or an int seed, as for f.init)"
  if rng is None:
    return None, None
  if isinstance(rng, bool):
    return rng, f"rng is the bool {rng}; {fix}"
  if isinstance(rng, (int, np.integer)):
    return jax.random.PRNGKey(int(rng)), None
  if isinstance(rng, jax.ShapeDtypeStruct):
    if concrete:
      return rng, f"rng is an abstract ShapeDtypeStruct, but init needs a real key; {fix}"
    return rng, None if _is_key(rng) else f"rng {rng} is not a PRNG key; {fix}"
  if isinstance(rng, (jax.Array, np.ndarray)):
    if _is_key(rng):
      return rng, None
    if rng.shape == () and jnp.issubdtype(rng.dtype, jnp.integer):
      return jax.random.PRNGKey(rng), None
    return rng, (f"rng is an array of shape {rng.shape} and dtype {rng.dtype}, not a PRNG key "
                 f"(a key array of shape () or a uint32[2] raw key); {fix}")
  return rng, f"rng must be a PRNG key, got {type(rng).__name__} {rng!r:.40}; {fix}"


def _static_nums(static_argnums: Any, nargs: int) -> tuple[set[int], list[str]]:
  nums = (static_argnums,) if isinstance(static_argnums, int) else static_argnums
  if isinstance(nums, (str, bytes)) or not isinstance(nums, Sequence) or not all(
      isinstance(i, int) and not isinstance(i, bool) for i in nums):
    return set(), [f"static_argnums must be an int or a tuple of ints, got {static_argnums!r}"]
  bad = [i for i in nums if not -nargs <= i < nargs]
  if bad:
    return set(), [f"static_argnums={tuple(nums)} has {bad}, out of range for the {nargs} "
                   "input(s) after rng (static_argnums counts the inputs after rng from 0)"]
  return {i % nargs for i in nums}, []


def _validate(api: str, transformed: Any, rng: Any, args: tuple, static_argnums: Any,
              stack_axis: Any, concrete: bool) -> tuple[Any, set[int]]:
  """Checks every argument of one call; raises one :class:`HaikuInputError` listing all."""
  problems = [_check_transformed(transformed)]
  rng, rng_problem = _check_rng(rng, concrete)
  static, static_problems = _static_nums(static_argnums, len(args))
  problems += [rng_problem, *static_problems]
  if stack_axis is not None and (not isinstance(stack_axis, str) or not stack_axis):
    problems.append(f"stack_axis must be a logical name (a non-empty str) or None, got "
                    f"{stack_axis!r}")
  problems = [p for p in problems if p]
  if problems:
    raise HaikuInputError(format_message(f"{api}: invalid arguments:", bullets=problems,
                                         fix=f"Call it as {api}(hk.transform(fn), "
                                             "jax.random.key(0), *inputs, rules=..., mesh=...)."))
  return rng, static


# -- recording what the init creates -----------------------------------------------------------


@dataclasses.dataclass
class _Created:
  """What a creator saw for one param / state: its per-layer shape and declared axes."""

  shape: tuple[int, ...]
  prefix: str
  axes: Axes | None = None


def _recorders() -> list[dict[tuple[str, str], _Created]]:
  if not hasattr(_LOCAL, "stack"):
    _LOCAL.stack = []
  return _LOCAL.stack


def _note(kind: str, context: hk.GetterContext, shape: Any, axes: Axes | None = None) -> None:
  prefix = context.lifted_prefix_name or ""
  for found in _recorders():
    entry = found.setdefault((kind, prefix + context.full_name),
                             _Created(tuple(shape), prefix))
    if axes is not None:
      entry.axes = axes


def _shape_creator(kind: str) -> Callable:
  def creator(next_creator, shape, dtype, init, context):
    _note(kind, context, shape)
    return next_creator(shape, dtype, init)
  return creator


def _shapes_interceptor(next_fun, args, kwargs, context):
  # hk.custom_creator only works inside a transform, and the user's transform is already
  # built; an interceptor runs inside it (every param created in a module, including the
  # per-layer params that hk.layer_stack creates in its inner transform, is created under
  # some module call), so the per-layer shapes are recorded from here.
  del context
  with hk.custom_creator(_shape_creator(_PARAMS)), \
      hk.custom_creator(_shape_creator(_STATE), params=False, state=True):
    return next_fun(*args, **kwargs)


@contextlib.contextmanager
def _recording() -> Iterator[dict[tuple[str, str], _Created]]:
  """Collects ``{(kind, name): _Created}`` for everything created while tracing an init."""
  found: dict[tuple[str, str], _Created] = {}
  _recorders().append(found)
  try:
    with hk.intercept_methods(_shapes_interceptor):
      yield found
  finally:
    _recorders().pop()


def _explicit_init() -> bool:
  """Inside an init on a mesh with Explicit axes (then nothing is constrained).

  A reshard inside the init would put sharded types into stock module code (``hk.Embed``'s
  gather, ``hk.Linear``'s dot then need ``out_sharding=``), and ``init_sharded``'s
  ``out_shardings`` place the params anyway.
  """
  mesh = current_rules_mesh()
  # hk.running_init() is False in the apply that hk.layer_stack runs inside its init, hence
  # also the flag set while this module traces an init.
  initializing = hk.running_init() or getattr(_LOCAL, "placing", 0) > 0
  return mesh is not None and bool(explicit_axes(mesh)) and initializing


@contextlib.contextmanager
def _placing() -> Iterator[None]:
  """Marks code that traces an init for :func:`init_sharded` and friends."""
  _LOCAL.placing = getattr(_LOCAL, "placing", 0) + 1
  try:
    yield
  finally:
    _LOCAL.placing -= 1


def _active() -> bool:
  """Constrain params / state now? Needs a mesh and rules, and not an Explicit init."""
  if current_rules_mesh() is None or current_rules() is None:
    return False
  return not _explicit_init()


def _constrain_var(value: jax.Array, axes: Axes) -> jax.Array:
  """Constrains a param / state value (short axes are a prefix, as in flax); inside
  ``hk.layer_stack``'s scan it is one layer's slice, so a table entry spelled for the stacked
  array keeps only its trailing axes."""
  ndim = jnp.ndim(value)
  if len(axes) > ndim:
    axes = axes[len(axes) - ndim:]
  return constrain(value, tuple(axes) + (None,) * (ndim - len(axes)))


# -- declaring axes inside a transform ---------------------------------------------------------


def _declared(kind: str, name: str, shape: Any, axes: Any, api: str) -> Axes:
  axes = _as_axes(axes, f"{api}({name!r})")
  if len(axes) != len(tuple(shape)):
    raise LogicalAxesError(
        f"{api}({name!r}): shape {tuple(shape)} has {len(tuple(shape))} dims but axes={axes} "
        f"names {len(axes)}. Give one logical name (or None) per dim (inside hk.layer_stack: "
        "per layer; the stacked dim is added for you).")
  return axes


def get_parameter(name: str, shape: Any, dtype: Any = None, init: Any = None, *,
                  axes: Axes) -> jax.Array:
  """``hk.get_parameter`` that declares the parameter's logical axes.

  The axes are recorded when the params are created (seen by :func:`init_sharded`,
  :func:`eval_axes`, :func:`annotate`); under ``partition.axis_rules`` with a mesh, the
  returned value is also constrained to its sharding (a no-op without a mesh). Inside
  ``hk.layer_stack`` give the per-layer axes: the stacked dim gets ``stack_axis``.

  Args:
    name, shape, dtype, init: as for ``hk.get_parameter``.
    axes: one logical name (or ``None``) per dim of ``shape``, e.g. ``('embed', 'mlp')``;
      a single axis is ``('embed',)``, not ``'embed'``.

  Raises:
    LogicalAxesError: if ``axes`` does not have one entry per dim or is not a tuple.

  Example:
    >>> import haiku as hk, jax, jax.numpy as jnp
    >>> import partition.haiku
    >>> def f(x):
    ...   w = partition.haiku.get_parameter('w', (4, 8), init=jnp.zeros,
    ...                                     axes=('embed', 'mlp'))
    ...   return x @ w
    >>> partition.haiku.eval_axes(hk.transform(f), jax.random.key(0), jnp.ones((1, 4)))
    {'~': {'w': ('embed', 'mlp')}}
  """
  axes = _declared(_PARAMS, name, shape, axes, "partition.haiku.get_parameter")

  def creator(next_creator, shape, dtype, init, context):
    _note(_PARAMS, context, shape, axes)
    return next_creator(shape, dtype, init)

  with hk.custom_creator(creator):
    value = hk.get_parameter(name, shape, dtype, init)
  return _constrain_var(value, axes) if _active() else value


def get_state(name: str, shape: Any = None, dtype: Any = jnp.float32, init: Any = None, *,
              axes: Axes) -> jax.Array:
  """``hk.get_state`` that declares the state's logical axes (see :func:`get_parameter`).

  Example:
    >>> import haiku as hk, jax, jax.numpy as jnp
    >>> import partition.haiku
    >>> def f(x):
    ...   total = partition.haiku.get_state('total', (4,), init=jnp.zeros, axes=('embed',))
    ...   hk.set_state('total', total + x.sum(0))
    ...   return x
    >>> f = hk.transform_with_state(f)
    >>> partition.haiku.eval_axes(f, jax.random.key(0), jnp.ones((2, 4)))
    ({}, {'~': {'total': ('embed',)}})
  """
  axes = _declared(_STATE, name, shape, axes, "partition.haiku.get_state")

  def creator(next_creator, shape, dtype, init, context):
    _note(_STATE, context, shape, axes)
    return next_creator(shape, dtype, init)

  with hk.custom_creator(creator, params=False, state=True):
    value = hk.get_state(name, shape, dtype, init)
  return _constrain_var(value, axes) if _active() else value


@contextlib.contextmanager
def param_axes_from(param_axes: PathRules | Any, *, constrain_params: bool = True,
                    state: bool = True) -> Iterator[PathRules]:
  """Annotates params (and state) created inside the block through a path table.

  Use it inside the transformed function. A custom creator records each new param's axes
  from the table (matched against ``context.full_name``, e.g. ``mlp/~/linear_0/w``); with
  ``constrain_params``, a custom getter constrains each annotated param to its sharding
  whenever a mesh and rules are in scope (at apply time too). Inside ``hk.layer_stack`` the
  table gives per-layer axes.

  Args:
    param_axes: a :class:`partition.PathRules` or its pairs.
    constrain_params: also constrain annotated values when they are read.
    state: apply the table to ``hk.get_state`` too (e.g. BatchNorm's EMAs).

  Example:
    >>> import haiku as hk, jax, jax.numpy as jnp
    >>> import partition.haiku
    >>> def f(x):
    ...   with partition.haiku.param_axes_from([(r'/w$', ('embed', 'mlp'))]):
    ...     return hk.Linear(3)(x)
    >>> partition.haiku.eval_axes(hk.transform(f), jax.random.key(0), jnp.ones((1, 2)))
    {'linear': {'b': None, 'w': ('embed', 'mlp')}}
  """
  table = _table(param_axes, "partition.haiku.param_axes_from", "param_axes")

  def lookup(context) -> Axes | None:
    hit = table.lookup((context.lifted_prefix_name or "") + context.full_name)
    return None if hit is None else hit[1]

  def creator(kind):
    def create(next_creator, shape, dtype, init, context):
      axes = lookup(context)
      if axes is not None:
        _note(kind, context, shape, axes)
      return next_creator(shape, dtype, init)
    return create

  def getter(next_getter, value, context):
    axes = lookup(context)
    if axes is not None and _active():
      value = _constrain_var(value, axes)
    return next_getter(value)

  with contextlib.ExitStack() as stack:
    stack.enter_context(hk.custom_creator(creator(_PARAMS)))
    if state:
      stack.enter_context(hk.custom_creator(creator(_STATE), params=False, state=True))
    if constrain_params:
      stack.enter_context(hk.custom_getter(getter, params=True, state=state))
    yield table


@contextlib.contextmanager
def constrain_outputs(table: PathRules | Any, *, methods: Sequence[str] = ("__call__",),
                      strict: bool = False) -> Iterator[PathRules]:
  """Constrains the outputs of (stock) modules by module path.

  The Haiku counterpart of ``partition.flax.with_axes(..., output=)``: inside the
  transformed function (as a ``with`` block or a decorator), every call of a module method in
  ``methods`` whose module path (``module.module_name``, e.g. ``transformer/~/mlp/~/linear_0``)
  ``re.search``-matches a pattern has its output passed through ``partition.constrain`` with
  that pattern's logical axes (``None``: leave it). The first matching pattern wins. Values
  are unchanged; only the placement is pinned (not during an init on Explicit mesh axes, where
  ``init_sharded`` places the params). Inside ``hk.layer_stack`` module paths are
  relative to the stacked function (``linear``, not ``__layer_stack_no_per_layer/linear``).

  Args:
    table: a :class:`partition.PathRules` over module paths, its pairs, or a
      ``{regex: logical_axes}`` mapping.
    methods: the module methods whose outputs are constrained.
    strict: raise, instead of warning, when the block ends with a pattern that matched no
      module call.

  Raises:
    LogicalAxesError: an output's rank differs from its pattern's axes, or the output is not
      one array.

  Warns:
    UnusedPatternWarning: a pattern matched no module call (``strict=False``).

  Example:
    >>> import haiku as hk, jax, jax.numpy as jnp, partition, partition.haiku
    >>> @hk.transform
    ... @partition.haiku.constrain_outputs({r'mlp/~/linear_0$': ('batch', 'mlp')})
    ... def f(x):
    ...   return hk.nets.MLP([8, 4])(x)
    >>> mesh = jax.make_mesh((4, 2), ('data', 'tensor'),
    ...                      axis_types=(jax.sharding.AxisType.Auto,) * 2)
    >>> x = jnp.ones((8, 4))
    >>> params = f.init(jax.random.key(0), x)
    >>> with partition.axis_rules([('batch', 'data'), ('mlp', 'tensor')], mesh):
    ...   text = jax.jit(f.apply).lower(params, None, x).as_text()
    >>> 'sharding_constraint' in text
    True
  """
  api = "partition.haiku.constrain_outputs"
  table = _table(table, api, "table")
  if isinstance(methods, str):
    methods = (methods,)
  used: set[int] = set()

  def interceptor(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    name = getattr(context.module, "module_name", None)
    if context.method_name not in methods or name is None:
      return out
    hit = table.lookup(name)
    if hit is None:
      return out
    used.add(hit[0])
    if hit[1] is None or _explicit_init():
      return out
    return _constrain_output(out, hit[1], name, hit[0], table)

  with hk.intercept_methods(interceptor):
    yield table
  unused = [p for i, (p, _) in enumerate(table.pairs) if i not in used]
  if unused:
    _report_unused(api, unused, strict)


def _constrain_output(out: Any, axes: Axes, module: str, index: int, table: PathRules) -> Any:
  where = f"module {module} (pattern #{index} {table.pairs[index][0]!r})"
  if not hasattr(out, "shape"):
    raise LogicalAxesError(format_message(
        f"partition.haiku.constrain_outputs: {where} returned a "
        f"{type(out).__name__}, not one array, so axes {axes} do not apply.",
        fix="Anchor the pattern (e.g. r'/linear_0$') so it matches only modules that return "
            "one array, or constrain that output yourself with partition.constrain."))
  if len(axes) != out.ndim:
    raise LogicalAxesError(format_message(
        f"partition.haiku.constrain_outputs: {where} returned shape {tuple(out.shape)} "
        f"({out.ndim} dims) but the pattern gives {axes} ({len(axes)} names).",
        fix="Give the pattern one logical name (or None) per output dim, or anchor it so it "
            "skips modules with outputs of other ranks."))
  return constrain(out, axes)


def _report_unused(api: str, unused: list[str], strict: bool) -> None:
  bullets = [f"pattern {p!r} matched no module call" for p in unused]
  fix = ("Module paths look like 'transformer/~/mlp/~/linear_0' (print "
         "hk.experimental.tabulate, or the param names without the last part); fix the "
         "patterns or remove them.")
  head = f"{api}: {len(unused)} pattern(s) constrained nothing:"
  if strict:
    raise PathRulesError(format_message(head, bullets=bullets, fix=fix))
  warnings.warn(format_message(head, bullets=bullets, fix=fix), UnusedPatternWarning,
                stacklevel=4)


# -- tracing the init --------------------------------------------------------------------------


_TRACED = object()
_ARRAYS = (jax.Array, np.ndarray, jax.ShapeDtypeStruct)


@dataclasses.dataclass
class _Inputs:
  """The init inputs split into traced arrays and static Python values (as ``f.init`` sees).

  Only arrays are traced: Python flags (``is_training=True``), numbers and strings stay
  concrete, as they are for ``f.init``; ``static_argnums`` makes whole inputs static.
  """

  slots: list[tuple[Any, list]]
  traced: list[Any]
  labels: list[str]

  @classmethod
  def split(cls, args: tuple, static: set[int]) -> _Inputs:
    slots, traced, labels = [], [], []
    for i, arg in enumerate(args):
      if i in static:
        slots.append((None, [arg]))
        continue
      with_paths, treedef = jax.tree_util.tree_flatten_with_path(arg)
      marks = []
      for path, leaf in with_paths:
        if isinstance(leaf, _ARRAYS):
          marks.append(_TRACED)
          traced.append(leaf)
          labels.append(f"args[{i}]{jax.tree_util.keystr(path)} "
                        f"({getattr(leaf, 'dtype', '?')}{list(np.shape(leaf))})")
        else:
          marks.append(leaf)
      slots.append((treedef, marks))
    return cls(slots, traced, labels)

  def rebuild(self, values: Sequence[Any]) -> tuple:
    it = iter(values)
    out = []
    for treedef, marks in self.slots:
      if treedef is None:
        out.append(marks[0])
      else:
        out.append(jax.tree.unflatten(treedef, [next(it) if m is _TRACED else m
                                                for m in marks]))
    return tuple(out)


_CONCRETE_ERRORS = (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError,
                    jax.errors.TracerIntegerConversionError)


def _trace(api: str, init: Callable, rng: Any, inputs: _Inputs, rules: Any, mesh: Any
           ) -> tuple[Any, dict]:
  """``eval_shape`` of the init through a fresh function (JAX caches traces by function, and a
  cached trace would not run the creators that record axes)."""
  context = (_adapt.axis_rules(rules, mesh) if rules is not None
             else contextlib.nullcontext())
  try:
    with _recording() as created, context, _placing():
      out = jax.eval_shape(lambda r, *t: init(r, *t), rng, *inputs.traced)
  except _CONCRETE_ERRORS as e:
    raise StaticArgError(format_message(
        f"{api}: the model needs a concrete Python value (e.g. an `if is_training:` flag) "
        "from an input that is traced because it is an array:",
        bullets=inputs.labels or ["(no array inputs: the value comes from rng or kwargs)"],
        fix="Pass flags as Python values (True, not jnp.array(True)), mark the input static "
            "with static_argnums=(index after rng,), or pass it as a keyword argument "
            "(keyword arguments are static).")) from e
  return out, created


# -- axes of the created tree ------------------------------------------------------------------


@dataclasses.dataclass
class _Matching:
  """Path-table bookkeeping over params and state (for strict mode and errors)."""

  table: PathRules | None
  stack_axis: str | None
  leads: Mapping[str, int]
  matched: dict[str, int] = dataclasses.field(default_factory=dict)
  used: set[int] = dataclasses.field(default_factory=set)  # patterns that matched a path
  declared: list[str] = dataclasses.field(default_factory=list)
  unmatched: list[str] = dataclasses.field(default_factory=list)
  problems: list[str] = dataclasses.field(default_factory=list)  # declared axes misfit
  table_problems: list[str] = dataclasses.field(default_factory=list)  # table axes misfit

  def path_match(self, axes: Any) -> PathMatch | None:
    if self.table is None:
      return None
    used = self.used
    unused = tuple(p for i, (p, _) in enumerate(self.table.pairs) if i not in used)
    return PathMatch(axes, dict(self.matched), tuple(self.declared), tuple(self.unmatched),
                     unused)


def _stacked_dims(shape: tuple[int, ...], created: tuple[int, ...]) -> int:
  """How many leading dims a lift (``hk.layer_stack``) added to a param created per layer."""
  extra = len(shape) - len(created)
  return extra if extra > 0 and shape[extra:] == created else 0


def _leaf_axes(m: _Matching, kind: str, shown: str, name: str, leaf: Any,
               created: dict[tuple[str, str], _Created]) -> Axes | None:
  entry = created.get((kind, name))
  shape = tuple(leaf.shape)
  lead = (_stacked_dims(shape, entry.shape) if entry is not None
          else _lifted_lead(m.leads, name, len(shape)))
  hit = None if m.table is None else m.table.lookup(name)
  if hit is not None:
    m.used.add(hit[0])
  if entry is not None and entry.axes is not None and (hit is None or not m.table.override):
    axes, source = entry.axes, "the model declares"
    m.declared.append(shown)
  elif m.table is not None:
    if hit is None:
      m.unmatched.append(shown)
      return None
    m.matched[shown] = hit[0]
    axes, source = hit[1], f"pattern #{hit[0]} {m.table.pairs[hit[0]][0]!r} gives"
    if axes is None:
      return None
  else:
    return None
  per_layer = len(shape) - lead
  if lead and len(axes) <= per_layer:
    # Per-layer axes (a short tuple is a prefix, as in flax); the stacked dims go in front.
    return (m.stack_axis,) * lead + tuple(axes) + (None,) * (per_layer - len(axes))
  fitted, mismatch = fit_rank(axes, leaf)
  if mismatch is None and (not lead or len(axes) == len(shape)):
    return tuple(fitted)
  detail = ""
  if lead:
    detail = (f"; it is stacked by hk.layer_stack (or a lifted scan): {lead} leading dim(s) "
              f"over per-layer shape {shape[lead:]}, so give at most {per_layer} per-layer "
              f"names (the stacked dim gets {m.stack_axis!r}) or all {len(shape)}")
  problems = m.problems if source == "the model declares" else m.table_problems
  problems.append(f"{shown}: {source} {tuple(axes)} ({len(axes)} names) but it has shape "
                  f"{shape}{detail}")
  return None


def _lifted_lead(leads: Mapping[str, int], name: str, ndim: int) -> int:
  """Stacked dims of a value created without a creator (``hk.set_state`` of a new name, as
  BatchNorm's EMA ``average``): those of the other values under the same lifted prefix."""
  prefixes = [p for p in leads if name.startswith(p)]
  lead = leads[max(prefixes, key=len)] if prefixes else 0
  return lead if lead <= ndim else 0


def _stack_leads(out: Any, with_state: bool, created: dict) -> dict[str, int]:
  """``{lifted prefix: stacked dims}`` seen on the recorded values."""
  leads = {}
  trees = ((_PARAMS, out[0]), (_STATE, out[1])) if with_state else ((_PARAMS, out),)
  for kind, tree in trees:
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
      entry = created.get((kind, path_str(path)))
      if entry is not None and entry.prefix:
        lead = _stacked_dims(tuple(leaf.shape), entry.shape)
        if lead:
          leads[entry.prefix] = lead
  return leads


def _axes_tree(m: _Matching, kind: str, tree: Any, created: dict, prefix: str) -> Any:
  def one(path, leaf):
    name = path_str(path)
    return _leaf_axes(m, kind, prefix + name, name, leaf, created)
  return jax.tree_util.tree_map_with_path(one, tree)


def _with_state(transformed: Any) -> bool:
  return isinstance(transformed, (hk.TransformedWithState, hk.MultiTransformedWithState))


@dataclasses.dataclass
class _Traced:
  """One traced init: what it creates, the axes, and how to run it for real."""

  out: Any
  axes: Any
  matching: _Matching
  with_state: bool
  init: Callable
  call_args: tuple

  def named(self, tree: Any) -> Any:
    """``tree`` (shaped like ``out``) keyed ``params`` / ``state`` for reports."""
    return {"params": tree[0], "state": tree[1]} if self.with_state else tree


def _prepare(api: str, transformed: Any, rng: Any, args: tuple, kwargs: dict, *,
             param_axes: Any, stack_axis: Any, static_argnums: Any, rules: Any = None,
             mesh: Any = None, concrete: bool = False) -> _Traced:
  rng, static = _validate(api, transformed, rng, args, static_argnums, stack_axis, concrete)
  table = _table(param_axes, api)
  inputs = _Inputs.split(args, static)

  def init(r, *traced):
    return transformed.init(r, *inputs.rebuild(traced), **kwargs)

  out, created = _trace(api, init, rng, inputs, rules, mesh)
  with_state = _with_state(transformed)
  m = _Matching(table, stack_axis, _stack_leads(out, with_state, created))
  if with_state:
    axes = (_axes_tree(m, _PARAMS, out[0], created, "params/"),
            _axes_tree(m, _STATE, out[1], created, "state/"))
  else:
    axes = _axes_tree(m, _PARAMS, out, created, "")
  if m.problems:  # the model's own declarations, as partition.flax reports them
    raise LogicalAxesError(format_message(
        f"{api}: {len(m.problems)} parameter(s) declare logical axes of the wrong rank:",
        bullets=m.problems, fix="Give one logical name (or None) per dim."))
  if m.table_problems:  # the path table's: a PathRulesError, as in partition.flax / .nnx
    raise PathRulesError(format_message(
        f"{api}: {len(m.table_problems)} parameter(s) got logical axes of the wrong rank "
        "from param_axes:",
        bullets=m.table_problems,
        fix="Give those patterns at most one name (or None) per dim, or make them more "
            "specific (anchor with '$', e.g. r'/w$') so they skip parameters of other ranks."))
  return _Traced(out, axes, m, with_state, init, (rng, *inputs.traced))


# -- public entry points -----------------------------------------------------------------------


def eval_axes(transformed: Any, rng: Any, *args: Any, param_axes: PathRules | Any = None,
              stack_axis: str | None = STACK_AXIS, static_argnums: int | Sequence[int] = (),
              **kwargs: Any) -> Any:
  """The logical axes of what ``transformed.init`` creates (``None`` where unannotated).

  Axes come from :func:`get_parameter` / :func:`get_state` / :func:`param_axes_from` inside
  the model, then from ``param_axes`` (a path table) for the rest. Nothing is allocated.

  Returns:
    A tree shaped like the params, or ``(params_axes, state_axes)`` for
    ``hk.transform_with_state``.
  """
  return _prepare("partition.haiku.eval_axes", transformed, rng, args, kwargs,
                  param_axes=param_axes, stack_axis=stack_axis,
                  static_argnums=static_argnums).axes


def annotate(transformed: Any, rng: Any, *args: Any, param_axes: PathRules | Any = None,
             stack_axis: str | None = STACK_AXIS, static_argnums: int | Sequence[int] = (),
             **kwargs: Any) -> Any:
  """Abstract params (and state) with each annotated leaf in a :class:`partition.Annotated`.

  ``partition.logical_axes`` reads the result; ``partition.unbox`` strips the boxes.
  """
  t = _prepare("partition.haiku.annotate", transformed, rng, args, kwargs,
               param_axes=param_axes, stack_axis=stack_axis, static_argnums=static_argnums)
  return jax.tree.map(lambda leaf, a: leaf if a is None else Annotated(leaf, a), t.out, t.axes)


def _placed(api: str, transformed: Any, rng: Any, args: tuple, kwargs: dict, *, rules: Any,
            mesh: Any, param_axes: Any, stack_axis: Any, static_argnums: Any, strict: bool,
            concrete: bool) -> tuple[_Traced, Any, Any, Any]:
  rules, mesh = _adapt.need_rules_mesh(rules, mesh, api, concrete=concrete)
  t = _prepare(api, transformed, rng, args, kwargs, param_axes=param_axes,
               stack_axis=stack_axis, static_argnums=static_argnums, rules=rules, mesh=mesh,
               concrete=concrete)
  shardings = _adapt.shardings_for(t.out, t.axes, rules, mesh)
  named_axes = t.named(t.axes)
  audit_placement(unbox(t.named(t.out)), named_axes, t.named(shardings), rules, mesh,
                  strict=strict, api=api, path_match=t.matching.path_match(named_axes))
  return t, shardings, rules, mesh


def abstract_init(transformed: Any, rng: Any, *args: Any, rules: Any = None,
                  mesh: AnyMesh | None = None, param_axes: PathRules | Any = None,
                  stack_axis: str | None = STACK_AXIS, static_argnums: int | Sequence[int] = (),
                  strict: bool = False, **kwargs: Any) -> Any:
  """What ``transformed.init`` returns, as sharded ``ShapeDtypeStruct``s (no allocation).

  Takes the arguments of :func:`init_sharded`; ``mesh`` may be an ``AbstractMesh``.
  """
  t, shardings, _, _ = _placed("partition.haiku.abstract_init", transformed, rng, args, kwargs,
                               rules=rules, mesh=mesh, param_axes=param_axes,
                               stack_axis=stack_axis, static_argnums=static_argnums,
                               strict=strict, concrete=False)
  return abstract(t.out, shardings)


def init_sharded(transformed: Any, rng: Any, *args: Any, rules: Any = None,
                 mesh: AnyMesh | None = None, param_axes: PathRules | Any = None,
                 stack_axis: str | None = STACK_AXIS, static_argnums: int | Sequence[int] = (),
                 strict: bool = False, **kwargs: Any) -> Any:
  """``transformed.init(rng, *args, **kwargs)`` with every param and state created sharded.

  ``jax.eval_shape`` traces the init (recording axes declared with :func:`get_parameter`,
  :func:`get_state` or :func:`param_axes_from`), ``param_axes`` fills in the rest (params
  and state alike), the axes resolve through ``rules`` on ``mesh``, and
  ``jax.jit(transformed.init, out_shardings=...)`` creates everything in its shards. Values
  equal ``transformed.init(rng, *args, **kwargs)``'s.

  Only array inputs are traced: Python values (``is_training=True``, sizes, strings) stay
  static, as for ``f.init``; ``static_argnums`` makes array inputs static too.

  Args:
    transformed: an ``hk.transform`` / ``hk.transform_with_state`` result.
    rng: the init PRNG key (or an int seed, as ``f.init`` accepts).
    *args: the init inputs.
    rules: an ``AxisRules`` (or pairs / a file path); default: ``partition.axis_rules``.
    mesh: a ``jax.sharding.Mesh``; default: the ``axis_rules`` mesh, then ``jax.set_mesh``.
    param_axes: a ``PathRules`` (or its pairs) over names like ``mlp/~/linear_0/w``; also
      matched against state names (``batch_norm/~/mean_ema/average``).
    stack_axis: the logical name given to the leading dim(s) that ``hk.layer_stack`` adds
      to per-layer params and state (``None``: leave them unsharded).
    static_argnums: indices into ``args`` (0 = the first input after ``rng``) of inputs
      passed to the model as they are, not traced.
    strict: raise one error listing every logical name without a rule, unmatched path,
      unused pattern and indivisible dim; otherwise warn once when large parameters end up
      fully replicated. Never passed to the model.
    **kwargs: passed to ``transformed.init`` (static).

  Returns:
    The params (``(params, state)`` for ``transform_with_state``), every leaf a
    ``jax.Array`` with the resolved ``NamedSharding``.

  Raises:
    HaikuInputError: ``transformed`` is not a Haiku transform, ``rng`` is not a key, bad
      ``static_argnums`` / ``stack_axis``.
    StaticArgError: the model needs a concrete value from a traced array input.
    LogicalAxesError: declared or table axes do not fit a parameter's rank.
    PlacementError: ``strict=True`` and some parameter is not placed as asked.
  """
  api = "partition.haiku.init_sharded"
  t, shardings, rules, mesh = _placed(api, transformed, rng, args, kwargs, rules=rules,
                                      mesh=mesh, param_axes=param_axes,
                                      stack_axis=stack_axis, static_argnums=static_argnums,
                                      strict=strict, concrete=True)
  with _placing():
    return _adapt.jit_init(t.init, shardings, rules, mesh, *t.call_args)


def explain(transformed: Any, rng: Any, *args: Any, rules: Any = None,
            mesh: AnyMesh | None = None, param_axes: PathRules | Any = None,
            stack_axis: str | None = STACK_AXIS, static_argnums: int | Sequence[int] = (),
            **kwargs: Any) -> ExplainReport:
  """``partition.explain`` for the params (and state, keyed ``params/`` and ``state/``)."""
  api = "partition.haiku.explain"
  rules, mesh = _adapt.need_rules_mesh(rules, mesh, api, concrete=False)
  t = _prepare(api, transformed, rng, args, kwargs, param_axes=param_axes,
               stack_axis=stack_axis, static_argnums=static_argnums, rules=rules, mesh=mesh)
  return _adapt.explain_tree(t.named(t.out), t.named(t.axes), rules, mesh)

