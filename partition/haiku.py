"""Haiku adapter: logical axes for Haiku params, sharded init, apply-time constraints.

Import it explicitly (``import partition.haiku``). Haiku has no sharding API; this module
adds one without changing how Haiku models are written:

* inside your own modules, :func:`get_parameter` is ``hk.get_parameter`` plus ``axes=``;
* for stock modules (``hk.Linear``, ``hk.nets.MLP``) a path table,
  ``partition.PathRules([(r'linear_0/w$', ('embed', 'mlp')), ...])``, matched against the
  param names Haiku builds (``mlp/~/linear_0/w``) — pass it as ``param_axes=``;
* :func:`init_sharded` creates the params directly in their shardings.

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
import threading
from collections.abc import Iterator
from typing import Any

import haiku as hk
import jax

from partition import _adapt
from partition._constrain import constrain
from partition._context import current_rules, current_rules_mesh
from partition._explain import ExplainReport
from partition._logical_axes import Annotated, LogicalAxesError
from partition._mesh import AnyMesh
from partition._path_rules import PathRules, as_path_rules, path_str

Axes = tuple[str | None, ...]

_LOCAL = threading.local()


def _recorders() -> list[dict[str, Axes]]:
  if not hasattr(_LOCAL, "stack"):
    _LOCAL.stack = []
  return _LOCAL.stack


@contextlib.contextmanager
def _recording() -> Iterator[dict[str, Axes]]:
  """Collects ``{param name: axes}`` declared while tracing an init."""
  found: dict[str, Axes] = {}
  _recorders().append(found)
  try:
    yield found
  finally:
    _recorders().pop()


def _record(context: hk.GetterContext, axes: Axes) -> None:
  name = (context.lifted_prefix_name or "") + context.full_name
  for found in _recorders():
    found[name] = axes


def _active() -> bool:
  return current_rules_mesh() is not None and current_rules() is not None


def get_parameter(name: str, shape: Any, dtype: Any = None, init: Any = None, *,
                  axes: Axes) -> jax.Array:
  """``hk.get_parameter`` that declares the parameter's logical axes.

  The axes are recorded when the params are created (seen by :func:`init_sharded`,
  :func:`eval_axes`, :func:`annotate`); under ``partition.axis_rules`` with a mesh, the
  returned value is also constrained to its sharding (a no-op without a mesh).

  Args:
    name, shape, dtype, init: as for ``hk.get_parameter``.
    axes: one logical name (or ``None``) per dim of ``shape``.

  Raises:
    LogicalAxesError: if ``axes`` does not have one entry per dim.

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
  axes = tuple(axes)
  if len(axes) != len(tuple(shape)):
    raise LogicalAxesError(
        f"partition.haiku.get_parameter({name!r}): shape {tuple(shape)} has "
        f"{len(tuple(shape))} dims but axes={axes} names {len(axes)}. Give one logical "
        "name (or None) per dim.")

  def creator(next_creator, shape, dtype, init, context):
    _record(context, axes)
    return next_creator(shape, dtype, init)

  with hk.custom_creator(creator):
    value = hk.get_parameter(name, shape, dtype, init)
  return constrain(value, axes) if _active() else value


@contextlib.contextmanager
def param_axes_from(param_axes: PathRules | Any, *, constrain_params: bool = True
                    ) -> Iterator[PathRules]:
  """Annotates params created inside the block through a path table (use in a transform).

  A custom creator records each new param's axes from the table (matched against
  ``context.full_name``); with ``constrain_params``, a custom getter constrains each param
  with axes to its sharding whenever a mesh and rules are in scope (at apply time too).

  Example:
    >>> import haiku as hk, jax, jax.numpy as jnp
    >>> import partition.haiku
    >>> def f(x):
    ...   with partition.haiku.param_axes_from([(r'/w$', ('embed', 'mlp'))]):
    ...     return hk.Linear(3)(x)
    >>> partition.haiku.eval_axes(hk.transform(f), jax.random.key(0), jnp.ones((1, 2)))
    {'linear': {'b': None, 'w': ('embed', 'mlp')}}
  """
  table = as_path_rules(param_axes)

  def lookup(context) -> Axes | None:
    hit = table.lookup((context.lifted_prefix_name or "") + context.full_name)
    return None if hit is None else hit[1]

  def creator(next_creator, shape, dtype, init, context):
    axes = lookup(context)
    if axes is not None:
      if len(axes) != len(tuple(shape)):
        raise LogicalAxesError(
            f"param_axes_from: {context.full_name} has shape {tuple(shape)} but the table "
            f"gives {axes}. Give the pattern one name per dim or make it more specific.")
      _record(context, axes)
    return next_creator(shape, dtype, init)

  def getter(next_getter, value, context):
    axes = lookup(context)
    if axes is not None and _active():
      value = constrain(value, axes)
    return next_getter(value)

  with contextlib.ExitStack() as stack:
    stack.enter_context(hk.custom_creator(creator))
    if constrain_params:
      stack.enter_context(hk.custom_getter(getter))
    yield table


# -- abstract and sharded init -----------------------------------------------------------------


def _trace_init(transformed: Any, rng: Any, args: tuple, kwargs: dict) -> Any:
  """``eval_shape`` of the init through a fresh function: JAX caches traces by function,
  and a cached trace would not run the creators that record axes."""
  return jax.eval_shape(lambda r, *a: transformed.init(r, *a, **kwargs), rng, *args)


def _params_part(out: Any) -> tuple[Any, bool]:
  """``init`` returns params, or ``(params, state)`` for ``transform_with_state``."""
  if isinstance(out, tuple) and len(out) == 2:
    return out[0], True
  return out, False


def _axes_for(params: Any, recorded: dict[str, Axes], param_axes: Any) -> Any:
  table = as_path_rules(param_axes)
  declared = jax.tree_util.tree_map_with_path(
      lambda p, leaf: Annotated(leaf, recorded[path_str(p)]) if path_str(p) in recorded
      else leaf, params)
  return table.axes(declared) if table is not None else _adapt.logical_axes(declared)


def _abstract(transformed, rng, args, kwargs, rules, mesh, param_axes):
  with _recording() as recorded, _adapt.rules_context(rules, mesh):
    out = _trace_init(transformed, rng, args, kwargs)
  params, with_state = _params_part(out)
  axes = _axes_for(params, recorded, param_axes)
  if with_state:
    axes = (axes, jax.tree.map(lambda _: None, out[1]))
  return out, axes


def eval_axes(transformed: Any, rng: Any, *args: Any, param_axes: PathRules | Any = None,
              **kwargs: Any) -> Any:
  """The logical axes of ``transformed``'s params (``None`` where unannotated).

  Axes come from :func:`get_parameter` / :func:`param_axes_from` inside the model, then
  from ``param_axes`` (a path table) for the rest. Nothing is allocated.
  """
  with _recording() as recorded:
    out = _trace_init(transformed, rng, args, kwargs)
  return _axes_for(_params_part(out)[0], recorded, param_axes)


def annotate(transformed: Any, rng: Any, *args: Any, param_axes: PathRules | Any = None,
             **kwargs: Any) -> Any:
  """Abstract params with each annotated leaf in a :class:`partition.Annotated` box.

  ``partition.logical_axes`` reads the result; ``partition.unbox`` strips the boxes.
  """
  with _recording() as recorded:
    out = _trace_init(transformed, rng, args, kwargs)
  params = _params_part(out)[0]
  axes = _axes_for(params, recorded, param_axes)
  return jax.tree.map(lambda leaf, a: leaf if a is None else Annotated(leaf, a), params,
                      axes)


def abstract_init(transformed: Any, rng: Any, *args: Any, rules: Any = None,
                  mesh: AnyMesh | None = None, param_axes: PathRules | Any = None,
                  **kwargs: Any) -> Any:
  """What ``transformed.init`` returns, as sharded ``ShapeDtypeStruct``s (no allocation)."""
  rules, mesh = _adapt.need_rules_mesh(rules, mesh, "partition.haiku.abstract_init",
                                       concrete=False)
  out, axes = _abstract(transformed, rng, args, kwargs, rules, mesh, param_axes)
  return _adapt.sharded_abstract(out, axes, rules, mesh)


def init_sharded(transformed: Any, rng: Any, *args: Any, rules: Any = None,
                 mesh: AnyMesh | None = None, param_axes: PathRules | Any = None,
                 **kwargs: Any) -> Any:
  """``transformed.init(rng, *args)`` with every param created in its sharding.

  ``jax.eval_shape`` traces the init (recording axes declared with :func:`get_parameter`
  or :func:`param_axes_from`), ``param_axes`` fills in the rest, the axes resolve through
  ``rules`` on ``mesh``, and ``jax.jit(transformed.init, out_shardings=...)`` creates the
  params directly in their shards.

  Args:
    transformed: an ``hk.transform`` / ``hk.transform_with_state`` result.
    rng: the init PRNG key.
    *args: the init inputs.
    rules: an ``AxisRules`` (or pairs / a file path); default: ``partition.axis_rules``.
    mesh: a ``jax.sharding.Mesh``; default: the ``axis_rules`` mesh, then ``jax.set_mesh``.
    param_axes: a ``PathRules`` (or its pairs) over param names like ``mlp/~/linear_0/w``.
    **kwargs: passed to ``transformed.init``.

  Returns:
    The params (``(params, state)`` for ``transform_with_state``, state replicated),
    every leaf a ``jax.Array`` with the resolved ``NamedSharding``.
  """
  rules, mesh = _adapt.need_rules_mesh(rules, mesh, "partition.haiku.init_sharded")
  out, axes = _abstract(transformed, rng, args, kwargs, rules, mesh, param_axes)
  shardings = _adapt.shardings_for(out, axes, rules, mesh)
  return _adapt.jit_init(lambda r, *a: transformed.init(r, *a, **kwargs), shardings, rules,
                         mesh, rng, *args)


def explain(transformed: Any, rng: Any, *args: Any, rules: Any = None,
            mesh: AnyMesh | None = None, param_axes: PathRules | Any = None,
            **kwargs: Any) -> ExplainReport:
  """``partition.explain`` for the params: spec and bytes per device per leaf."""
  rules, mesh = _adapt.need_rules_mesh(rules, mesh, "partition.haiku.explain",
                                       concrete=False)
  out, axes = _abstract(transformed, rng, args, kwargs, rules, mesh, param_axes)
  params, with_state = _params_part(out)
  return _adapt.explain_tree(params, axes[0] if with_state else axes, rules, mesh)
