"""Flax linen adapter: sharded init, logical axes for stock modules, flax's own rules.

Import it explicitly (``import partition.flax``); ``import partition`` never imports flax.
Models annotated the linen way — ``nn.with_logical_partitioning`` on initializers,
``nn.with_logical_constraint`` on activations — work unchanged:

>>> import jax, jax.numpy as jnp, flax.linen as nn
>>> import partition, partition.flax
>>> mesh = jax.make_mesh((4, 2), ('data', 'tensor'))
>>> rules = partition.AxisRules([('batch', 'data'), ('mlp', 'tensor')])
>>> dense = nn.Dense(16, kernel_init=nn.with_logical_partitioning(
...     nn.initializers.lecun_normal(), ('embed', 'mlp')))
>>> variables = partition.flax.init_sharded(dense, jax.random.key(0), jnp.ones((8, 4)),
...                                         rules=rules, mesh=mesh)
>>> variables['params']['kernel'].value.sharding.spec
P(None, 'tensor')

Stock modules you cannot edit get axes from :func:`with_axes` or a path table
(``param_axes=partition.PathRules([...])``).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import PartitionSpec

from partition._base.extras import needs_extra

with needs_extra("flax", by="partition.flax"):
  from flax import linen as nn
  from flax.core import meta

from partition._base.deprecations import deprecated_getattr
from partition._base.errors import did_you_mean, format_message
from partition._base.logical_axes import LogicalAxesError
from partition._base.mesh import AnyMesh, explicit_axes
from partition._params import adapt as _adapt
from partition._params.path_rules import PathRules
from partition._rules.constrain import constrain
from partition._rules.context import axis_rules as _context_axis_rules
from partition._rules.explain import ExplainReport

Axes = tuple[str | None, ...]


def _check_module(module: Any, api: str) -> None:
  if isinstance(module, nn.Module):
    return
  if isinstance(module, type) and issubclass(module, nn.Module):
    fix = f"Pass an instance, e.g. {module.__name__}(...) with its fields, not the class."
  elif _is_nnx(module):
    fix = "This is an NNX module: use partition.nnx.init_sharded(lambda: Model(...))."
  elif callable(module):
    fix = ("Pass a linen Module instance (e.g. nn.Dense(8)); for a Haiku function use "
           "partition.haiku.init_sharded(hk.transform(f), ...).")
  else:
    fix = "Pass a linen Module instance, e.g. nn.Dense(8)."
  raise _adapt.AdapterInputError(f"{api}: module must be a flax.linen Module instance, got "
                                f"{_adapt.describe_value(module)}. {fix}")


def _is_nnx(x: Any) -> bool:
  nnx = sys.modules.get("flax.nnx")
  return nnx is not None and (isinstance(x, nnx.Module) or (
      isinstance(x, type) and issubclass(x, nnx.Module)))


def _abstract(api: str, module: nn.Module, rngs: Any, args: tuple, init_kwargs: dict,
              rules, mesh, param_axes) -> tuple[Any, Any, Any]:
  _check_module(module, api)
  _adapt.check_rngs(rngs, api)
  init = _context_axes_auto(functools.partial(module.init, **init_kwargs), PartitionSpec())
  with _adapt.axis_rules(rules, mesh):
    shapes = jax.eval_shape(init, rngs, *args)
  axes, path_match = _adapt.match_axes(shapes, param_axes)
  return shapes, axes, path_match


def abstract_init(module: nn.Module, rngs: Any, *args: Any, rules: Any = None,
                  mesh: AnyMesh | None = None, param_axes: PathRules | Any = None,
                  **init_kwargs: Any) -> Any:
  """The variables ``module.init`` would create, as sharded ``ShapeDtypeStruct``s.

  Nothing is allocated (``jax.eval_shape``). Linen boxes are kept, so the result has the
  structure of the real variables: use it as a checkpoint-restore target or for memory
  reports. Arguments are those of :func:`init_sharded`; an abstract mesh is accepted.
  """
  api = "partition.flax.abstract_init"
  rules, mesh = _adapt.need_rules_mesh(rules, mesh, api, concrete=False)
  shapes, axes, _ = _abstract(api, module, rngs, args, init_kwargs, rules, mesh, param_axes)
  return _adapt.sharded_abstract(shapes, axes, rules, mesh)


def init_sharded(module: nn.Module, rngs: Any, *args: Any, rules: Any = None,
                 mesh: AnyMesh | None = None, param_axes: PathRules | Any = None,
                 strict: bool = False, **init_kwargs: Any) -> Any:
  """``module.init(rngs, *args, **init_kwargs)`` with every variable created sharded.

  The variables are first traced with ``jax.eval_shape`` (no allocation), their logical
  axes read (linen boxes — ``nn.with_logical_partitioning`` names, ``nn.with_partitioning``
  mesh axes —, T5X ``param_with_axes`` metadata, then ``param_axes`` for the rest; a short
  tuple is a prefix, as in flax) and resolved through ``rules`` on ``mesh``; then
  ``jax.jit(module.init, out_shardings=...)`` creates each one directly in its shards. The
  model runs under the rules, so ``partition.constrain`` and ``nn.with_logical_constraint``
  inside it take effect.

  Args:
    module: a linen module instance.
    rngs: a PRNG key or a dict of keys, as for ``module.init``.
    *args: the init inputs.
    rules: an ``AxisRules`` (or pairs / a file path); default: ``partition.axis_rules``.
    mesh: a ``jax.sharding.Mesh``; default: the ``axis_rules`` mesh, then ``jax.set_mesh``.
    param_axes: optional ``PathRules`` (or its pairs) giving axes to unannotated params;
      ``PathRules(..., override=True)`` replaces the axes the model declares.
    strict: raise one ``partition.PlacementError`` listing every logical name without a
      rule, parameter no pattern matched, unused pattern, unknown mesh axis and dim no rule
      divides. Otherwise one ``partition.ReplicatedWarning`` lists the large parameters
      left fully replicated on a multi-device mesh.
    **init_kwargs: passed to ``module.init`` (``method=``, ``mutable=``, call kwargs).

  Returns:
    The variables (linen boxes kept) whose leaves are ``jax.Array``s with the resolved
    ``NamedSharding``.
  """
  api = "partition.flax.init_sharded"
  rules, mesh = _adapt.need_rules_mesh(rules, mesh, api)
  shapes, axes, path_match = _abstract(api, module, rngs, args, init_kwargs, rules, mesh,
                                       param_axes)
  shardings = _adapt.place(shapes, axes, rules, mesh, strict=strict, api=api,
                           path_match=path_match)
  init = _context_axes_auto(functools.partial(module.init, **init_kwargs), shardings)
  return _adapt.jit_init(init, shardings, rules, mesh, rngs, *args)


def _context_axes_auto(init: Any, out_sharding: Any) -> Any:
  """``init`` traced with the context mesh's Explicit axes made Auto.

  Linen's boxes (``nn.with_logical_partitioning``) and ``nn.with_logical_constraint`` call
  ``with_sharding_constraint``, which on Explicit axes is an assertion, not a placement;
  init needs no constraint (``out_shardings`` place every variable), so under
  ``jax.set_mesh`` of an Explicit mesh it runs in ``jax.sharding.auto_axes`` and hands
  its outputs back with Explicit types.
  """
  context = jax.sharding.get_abstract_mesh()
  explicit = tuple(a for a in context.axis_names if a in explicit_axes(context))
  if not explicit:
    return init
  return jax.sharding.auto_axes(init, axes=explicit, out_sharding=out_sharding)


def explain(module: nn.Module, rngs: Any, *args: Any, rules: Any = None,
            mesh: AnyMesh | None = None, param_axes: PathRules | Any = None,
            **init_kwargs: Any) -> ExplainReport:
  """``partition.explain`` for ``module``'s variables: spec and bytes per device per leaf."""
  api = "partition.flax.explain"
  rules, mesh = _adapt.need_rules_mesh(rules, mesh, api, concrete=False)
  shapes, axes, _ = _abstract(api, module, rngs, args, init_kwargs, rules, mesh, param_axes)
  return _adapt.explain_tree(shapes, axes, rules, mesh)


# -- giving stock modules logical axes --------------------------------------------------------


def _boxed_init(init_fn, axes: Axes, where: str):
  @functools.wraps(init_fn)
  def init(*args, **kwargs):
    value = init_fn(*args, **kwargs)
    if isinstance(value, meta.AxisMetadata):  # the decorator's axes win
      value = value.unbox(apply_constraint=False)
    _adapt.check_axes_rank(getattr(value, "shape", None), axes, f"with_axes: {where}")
    return nn.LogicallyPartitioned(value, axes)
  return init


def _check_names(cls: type, table: Mapping[str, Axes], params: Mapping[str, Any]) -> None:
  """Every name of ``table`` must be a param the module creates itself, not a sub-module."""
  created = [n for n, v in params.items() if not isinstance(v, Mapping)]
  submodules = [n for n, v in params.items() if isinstance(v, Mapping)]
  problems = []
  for n in table:
    if n in submodules:
      problems.append(
          f"{n!r} is a sub-module of {cls.__name__}, not a param it creates: wrap the "
          f"sub-module's class with with_axes, or give its params axes by path, e.g. "
          f"param_axes=partition.PathRules([(r'{n}/kernel$', (...))])")
    elif n not in created:
      problems.append(f"{n!r}{did_you_mean(n, created)} is not a param of {cls.__name__}")
  if problems:
    raise LogicalAxesError(format_message(
        f"with_axes({cls.__name__}): params= names {len(problems)} entry(ies) that "
        f"{cls.__name__} does not create itself:", bullets=problems,
        fix=f"Use the params it creates: {created}."))


def with_axes(module_cls: type | None = None, /, *,
              params: Mapping[str, Axes] | None = None,
              output: Axes | None = None) -> Any:
  """A subclass of a linen module class whose params carry logical axes.

  The subclass keeps the class name (so auto-named submodules and checkpoints keep their
  paths), wraps each named param's initializer in ``nn.with_logical_partitioning``
  (replacing axes the module declared itself) and, if ``output`` is given, constrains
  ``__call__``'s result with ``partition.constrain`` (a no-op without a mesh).

  Args:
    module_cls: the class (e.g. ``nn.Dense``); omit it to use ``with_axes`` as a decorator.
    params: ``{param name: logical axes}`` for params the module creates itself.
    output: logical axes of the output, one name per dim.

  Returns:
    The subclass (or, without ``module_cls``, a decorator that builds it).

  Raises:
    LogicalAxesError: at init, if a param gets axes of the wrong rank or ``params`` names
      a param the module does not create (a sub-module's name included: wrap the
      sub-module's class instead, or use a path table).
    LogicalAxesTypeError: at once, for axes given as a ``str`` (write ``('embed',)``),
      non-str keys, or a ``module_cls`` that is not a linen Module class.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> import partition, partition.flax
    >>> Dense = partition.flax.with_axes(nn.Dense, params={'kernel': ('embed', 'mlp'),
    ...                                  'bias': ('mlp',)}, output=('batch', 'mlp'))
    >>> v = jax.eval_shape(Dense(8).init, jax.random.key(0), jnp.ones((2, 4)))
    >>> partition.logical_axes(v)
    {'params': {'bias': ('mlp',), 'kernel': ('embed', 'mlp')}}
  """
  table, out_axes = _adapt.check_axes_table(params, output, "param")

  def wrap(cls: type) -> type:
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
      hint = ("For NNX modules use partition.nnx.with_axes." if _is_nnx(cls) else
              f"Pass the class, e.g. with_axes({type(cls).__name__}, ...)."
              if isinstance(cls, nn.Module) else "Pass a class such as nn.Dense.")
      raise _adapt.AdapterInputError(
          f"partition.flax.with_axes takes a linen Module class, got "
          f"{_adapt.describe_value(cls)}. {hint}")

    class Wrapped(cls):
      def param(self, name, init_fn, *init_args, unbox=True, **init_kwargs):
        if name in table:
          where = "/".join((*self.scope.path, name)) if self.scope else name
          init_fn = _boxed_init(init_fn, table[name], f"param {where!r}")
        return super().param(name, init_fn, *init_args, unbox=unbox, **init_kwargs)

      def __call__(self, *args, **kwargs):
        y = super().__call__(*args, **kwargs)
        if table and self.is_initializing():
          _check_names(cls, table, self.variables.get("params", {}))
        return y if out_axes is None else constrain(y, out_axes)

    Wrapped.__name__, Wrapped.__qualname__ = cls.__name__, cls.__qualname__
    Wrapped.__doc__ = (f"{cls.__name__} with logical axes params={table!r}, "
                       f"output={out_axes!r} (partition.flax.with_axes).")
    Wrapped.__module__ = cls.__module__
    return Wrapped

  return wrap if module_cls is None else wrap(module_cls)


__getattr__ = deprecated_getattr("partition.flax", {
    "axis_rules": ("partition.axis_rules (it sets flax's nn.logical_axis_rules too)",
                   lambda: _context_axis_rules)})
