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
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from partition._base.deprecations import deprecated_getattr
from partition._base.extras import needs_extra

with needs_extra("haiku", by="partition.haiku"):
  import haiku as hk

from partition._base.logical_axes import LogicalAxesTypeError, WithAxes, abstract
from partition._base.mesh import AnyMesh
from partition._haiku.errors import _PARAMS, _STATE, STACK_AXIS, Axes
from partition._haiku.errors import StaticArgError as StaticArgError
from partition._haiku.errors import UnusedPatternWarning as UnusedPatternWarning
from partition._haiku.recording import (
  _active,
  _constrain_output,
  _constrain_var,
  _declared,
  _explicit_init,
  _full_name,
  _note,
  _placing,
  _report_unused,
)
from partition._haiku.tracing import _prepare, _Traced
from partition._haiku.validation import _as_axes, _table
from partition._params import adapt as _adapt
from partition._params.adapt import AdapterInputError
from partition._params.path_rules import PathRules
from partition._rules.explain import ExplainReport


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
  return _constrain_var(value, axes, _full_name(name), "partition.haiku.get_parameter") \
      if _active() else value


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
  api = "partition.haiku.get_state"
  axes = _declared(_STATE, name, shape, axes, api) if shape is not None else _as_axes(
      axes, f"{api}({name!r})")

  def creator(next_creator, shape, dtype, init, context):
    _note(_STATE, context, shape, axes)
    return next_creator(shape, dtype, init)

  def getter(next_getter, value, context):
    # Without a shape, the state is read as hk.set_state left it: its rank is known only now.
    _declared(_STATE, name, jnp.shape(value), axes, api)
    _note(_STATE, context, jnp.shape(value), axes)
    return next_getter(value)

  with hk.custom_creator(creator, params=False, state=True), (
      hk.custom_getter(getter, params=False, state=True) if shape is None
      else contextlib.nullcontext()):
    value = hk.get_state(name, shape, dtype, init)
  return _constrain_var(value, axes, _full_name(name), api) if _active() else value


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
      value = _constrain_var(value, axes, context.full_name, "partition.haiku.param_axes_from")
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
  """Abstract params (and state) with each annotated leaf in a :class:`partition.WithAxes`.

  ``partition.logical_axes`` reads the result; ``partition.unbox`` strips the boxes.
  """
  t = _prepare("partition.haiku.annotate", transformed, rng, args, kwargs,
               param_axes=param_axes, stack_axis=stack_axis, static_argnums=static_argnums)
  return jax.tree.map(lambda leaf, a: leaf if a is None else WithAxes(leaf, a), t.out, t.axes)


def _placed(api: str, transformed: Any, rng: Any, args: tuple, kwargs: dict, *, rules: Any,
            mesh: Any, param_axes: Any, stack_axis: Any, static_argnums: Any, strict: bool,
            concrete: bool) -> tuple[_Traced, Any, Any, Any]:
  rules, mesh = _adapt.need_rules_mesh(rules, mesh, api, concrete=concrete)
  t = _prepare(api, transformed, rng, args, kwargs, param_axes=param_axes,
               stack_axis=stack_axis, static_argnums=static_argnums, rules=rules, mesh=mesh,
               concrete=concrete)
  shardings = _adapt.place(t.out, t.axes, rules, mesh, strict=strict, api=api,
                           path_match=t.matching.path_match(t.named(t.axes)), named=t.named,
                           depth=1)
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
    AdapterInputError: ``transformed`` is not a Haiku transform, ``rng`` is not a key, bad
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



__getattr__ = deprecated_getattr("partition.haiku", {
    "HaikuInputError": ("partition.AdapterInputError (one class for the three adapters)",
                        lambda: AdapterInputError),
    "AxesTypeError": ("partition.LogicalAxesError (the same class as every adapter's: "
                      "partition._base.logical_axes.LogicalAxesTypeError)",
                      lambda: LogicalAxesTypeError)})
