"""Flax NNX adapter: sharded construction, logical axes for stock modules.

Import it explicitly (``import partition.nnx``). NNX keeps a parameter's logical axes in the
Variable's ``out_sharding`` metadata (``nnx.with_partitioning``, ``kernel_metadata=``);
the deprecated ``sharding`` / ``sharding_names`` spellings are read too. NNX shards eagerly
by default, resolving names through flax's own rules; :func:`init_sharded` turns eager
sharding off, resolves through ``AxisRules`` instead and creates the state with
``jax.jit(out_shardings=...)``:

>>> import jax, jax.numpy as jnp
>>> from flax import nnx
>>> import partition, partition.nnx
>>> mesh = jax.make_mesh((4, 2), ('data', 'tensor'))
>>> rules = partition.AxisRules([('embed', 'data'), ('mlp', 'tensor')])
>>> model = partition.nnx.init_sharded(
...     lambda: nnx.Linear(4, 8, rngs=nnx.Rngs(0),
...                        kernel_metadata={'out_sharding': ('embed', 'mlp')}),
...     rules=rules, mesh=mesh)
>>> model.kernel[...].sharding.spec
P('data', 'tensor')
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

import jax

from partition._base.extras import needs_extra

with needs_extra("flax", by="partition.nnx"):
  from flax import errors as flax_errors
  from flax import nnx

from partition._base.deprecations import deprecated_getattr
from partition._base.errors import did_you_mean
from partition._base.logical_axes import LogicalAxesError
from partition._base.mesh import AnyMesh
from partition._params import adapt as _adapt
from partition._params.path_rules import PathRules
from partition._rules.constrain import constrain
from partition._rules.context import current_rules, current_rules_mesh
from partition._rules.explain import ExplainReport

Axes = tuple[str | None, ...]


def _build(init_fn: Callable[..., nnx.Module], args: tuple, kwargs: dict) -> nnx.Module:
  with nnx.use_eager_sharding(False):
    try:
      return init_fn(*args, **kwargs)
    except flax_errors.TraceContextError as e:
      # init_fn runs under nnx.eval_shape and jax.jit: state made outside it (most often an
      # nnx.Rngs) cannot be advanced from inside, and flax only names the trace level.
      raise _adapt.AdapterInputError(
          f"partition.nnx: init_fn ({_adapt.describe_value(init_fn)}) uses NNX state created "
          "outside it "
          f"({e.__class__.__name__}: {str(e).split(' (https')[0]}). init_fn is traced "
          "(nnx.eval_shape, then jax.jit), so create the nnx.Rngs inside it: "
          "lambda: Model(..., rngs=nnx.Rngs(0)).") from e


def _check_init_fn(init_fn: Any, api: str) -> None:
  if isinstance(init_fn, nnx.Module):
    raise _adapt.AdapterInputError(
        f"{api}: init_fn must build the module, got an already built "
        f"{type(init_fn).__name__} instance. Pass a function that builds it, e.g. "
        f"lambda: {type(init_fn).__name__}(..., rngs=nnx.Rngs(0)), so that its Variables "
        "are created directly in their shards.")
  linen = sys.modules.get("flax.linen")
  if linen is not None and (isinstance(init_fn, linen.Module) or (
      isinstance(init_fn, type) and issubclass(init_fn, linen.Module))):
    raise _adapt.AdapterInputError(
        f"{api}: got the linen module {_adapt.describe_value(init_fn)}. Use "
        "partition.flax.init_sharded(module, rng, *inputs) for linen modules.")
  if not callable(init_fn):
    raise _adapt.AdapterInputError(
        f"{api}: init_fn must be a function (or NNX Module class) that builds the module, "
        f"got {_adapt.describe_value(init_fn)}. Pass e.g. lambda: nnx.Linear(4, 8, "
        "rngs=nnx.Rngs(0)).")


def _returned(value: Any) -> str:
  if hasattr(value, "shape") and hasattr(value, "dtype"):  # eval_shape's view of an array
    return f"an array (dtype {value.dtype}, shape {tuple(value.shape)})"
  return _adapt.describe_value(value)


def _abstract(api, init_fn, args, kwargs, rules, mesh, param_axes):
  """``(graphdef, state, axes, PathMatch, rules)``; rules gain NNX's mesh-axis pass-through."""
  _check_init_fn(init_fn, api)
  with _adapt.axis_rules(rules, mesh):
    model = nnx.eval_shape(lambda: _build(init_fn, args, kwargs))
  if not isinstance(model, nnx.Module):
    raise _adapt.AdapterInputError(
        f"{api}: init_fn must return an NNX Module, but {_adapt.describe_value(init_fn)} "
        f"returned {_returned(model)}. Return the module it builds, e.g. "
        "lambda: nnx.Linear(4, 8, rngs=nnx.Rngs(0)).")
  graphdef, state = nnx.split(model)
  axes, path_match = _adapt.match_axes(state, param_axes)
  return graphdef, state, axes, path_match, _adapt.passthrough_rules(rules, mesh)


def abstract_init(init_fn: Callable[..., nnx.Module], *args: Any, rules: Any = None,
                  mesh: AnyMesh | None = None, param_axes: PathRules | Any = None,
                  **kwargs: Any) -> tuple[Any, nnx.State]:
  """``(graphdef, state)`` of the model ``init_fn`` builds, with sharded abstract values.

  Like ``nnx.get_abstract_model``, but the shardings come from ``rules``: each Variable
  holds a ``ShapeDtypeStruct`` with its ``NamedSharding``. Nothing is allocated. Use it as
  a checkpoint-restore target (``nnx.merge(graphdef, restored)``) or for memory reports.
  """
  api = "partition.nnx.abstract_init"
  rules, mesh = _adapt.need_rules_mesh(rules, mesh, api, concrete=False)
  graphdef, state, axes, _, rules = _abstract(api, init_fn, args, kwargs, rules, mesh,
                                              param_axes)
  return graphdef, _adapt.sharded_abstract(state, axes, rules, mesh)


def init_sharded(init_fn: Callable[..., nnx.Module], *args: Any, rules: Any = None,
                 mesh: AnyMesh | None = None, param_axes: PathRules | Any = None,
                 strict: bool = False, **kwargs: Any) -> nnx.Module:
  """Builds ``init_fn(*args, **kwargs)`` with every Variable created in its sharding.

  The NNX counterpart of ``partition.flax.init_sharded``: the model is first built with
  ``nnx.eval_shape`` (no allocation), its logical axes read (``out_sharding`` metadata,
  then ``param_axes`` for the rest; a short tuple is a prefix) and resolved through
  ``rules`` on ``mesh``; then its state is created under ``jax.jit(out_shardings=...)``
  and merged back into a module. As in flax NNX (``rules.get(name, name)``), an
  ``out_sharding`` name without a rule that is a mesh axis is that mesh axis (flax's
  sharding guides write mesh axes there directly).

  Args:
    init_fn: builds the module, e.g. ``lambda: MLP(rngs=nnx.Rngs(0))``. Create the
      ``nnx.Rngs`` inside it: it is called under ``jax.jit``.
    *args: passed to ``init_fn``.
    rules: an ``AxisRules`` (or pairs / a file path); default: ``partition.axis_rules``.
    mesh: a ``jax.sharding.Mesh``; default: the ``axis_rules`` mesh, then ``jax.set_mesh``.
    param_axes: optional ``PathRules`` for Variables without ``out_sharding`` (paths as in
      ``nnx.state``, e.g. ``layers/0/kernel``); ``override=True`` replaces declared axes.
    strict: raise one ``partition.PlacementError`` listing every name without a rule (nor
      mesh axis), unmatched path, unused pattern and indivisible dim; otherwise one
      ``partition.ReplicatedWarning`` lists large Variables left fully replicated.
    **kwargs: passed to ``init_fn``.

  Returns:
    The module; every Variable holds a ``jax.Array`` with the resolved ``NamedSharding``.
    On an Explicit mesh, call it under ``jax.set_mesh(mesh)``.
  """
  api = "partition.nnx.init_sharded"
  rules, mesh = _adapt.need_rules_mesh(rules, mesh, api)
  graphdef, state, axes, path_match, nnx_rules = _abstract(api, init_fn, args, kwargs, rules,
                                                           mesh, param_axes)
  shardings = _adapt.place(state, axes, nnx_rules, mesh, strict=strict, api=api,
                           path_match=path_match)
  new_state = _adapt.jit_init(lambda: nnx.state(_build(init_fn, args, kwargs)), shardings,
                              rules, mesh)
  return nnx.merge(graphdef, new_state)


def explain(init_fn: Callable[..., nnx.Module], *args: Any, rules: Any = None,
            mesh: AnyMesh | None = None, param_axes: PathRules | Any = None,
            **kwargs: Any) -> ExplainReport:
  """``partition.explain`` for the model's state: spec and bytes per device per Variable.

  PRNG keys and counters of ``nnx.Rngs`` are listed with their dtype (``key<fry>``).
  """
  api = "partition.nnx.explain"
  rules, mesh = _adapt.need_rules_mesh(rules, mesh, api, concrete=False)
  _, state, axes, _, rules = _abstract(api, init_fn, args, kwargs, rules, mesh, param_axes)
  return _adapt.explain_tree(state, axes, rules, mesh)


def declare_axes(module: nnx.Module, param_axes: PathRules | Any, *, strict: bool = False
                 ) -> nnx.Module:
  """Sets ``out_sharding`` metadata on ``module``'s Variables from a path table, in place.

  Variables that already declare axes keep them. Returns ``module``.
  """
  table = param_axes if isinstance(param_axes, PathRules) else PathRules(param_axes)
  state = nnx.state(module)
  axes = table.axes(state, strict=strict)
  flat_axes = dict(jax.tree_util.tree_flatten_with_path(
      axes, is_leaf=lambda x: x is None or isinstance(x, tuple))[0])
  for path, var in jax.tree_util.tree_flatten_with_path(
      state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]:
    names = flat_axes.get(path)
    if names is not None and not var.get_metadata().get("out_sharding"):
      var.set_metadata("out_sharding", names)
  return module


def _set_axes(module: nnx.Module, cls: type, table: Mapping[str, Axes]) -> None:
  created = [k for k, v in vars(module).items() if isinstance(v, nnx.Variable)]
  for name, axes in table.items():
    var = getattr(module, name, None)
    if not isinstance(var, nnx.Variable):
      raise _unknown_variable(cls, name, created)
    shape = getattr(var.get_value(), "shape", ())
    _adapt.check_axes_rank(shape, axes, f"with_axes({cls.__name__}): Variable {name!r}")
    var.set_metadata("out_sharding", axes)
    if nnx.using_eager_sharding() and current_rules() is not None and (
        current_rules_mesh() is not None):
      var.set_value(constrain(var.get_value(), axes))


def _unknown_variable(cls: type, name: str, created: list[str]) -> LogicalAxesError:
  hint = did_you_mean(name, created)
  return LogicalAxesError(
      f"with_axes({cls.__name__}): params= names {name!r}{hint}, which is not a Variable "
      f"of {cls.__name__}; its Variables are {created}. Use those names.")


def with_axes(module_cls: type | None = None, /, *,
              params: Mapping[str, Axes] | None = None,
              output: Axes | None = None) -> Any:
  """A subclass of an NNX module class whose Variables carry logical axes.

  After the original ``__init__``, each named Variable gets ``out_sharding`` metadata
  (replacing what the module declared); if ``output`` is given, ``__call__``'s result is
  constrained with ``partition.constrain`` (a no-op without a mesh).

  Args:
    module_cls: the class (e.g. ``nnx.Linear``); omit it to use as a decorator.
    params: ``{Variable attribute name: logical axes}``.
    output: logical axes of the output, one name per dim.

  Raises:
    LogicalAxesError: at construction, for a wrong rank or a name that is not a Variable.

  Example:
    >>> from flax import nnx
    >>> import partition, partition.nnx
    >>> Linear = partition.nnx.with_axes(nnx.Linear, params={'kernel': ('embed', 'mlp')})
    >>> partition.logical_axes(Linear(2, 3, rngs=nnx.Rngs(0)))['kernel']
    ('embed', 'mlp')
  """
  table, out_axes = _adapt.check_axes_table(params, output, "Variable")

  def wrap(cls: type) -> type:
    if not (isinstance(cls, type) and issubclass(cls, nnx.Module)):
      linen = sys.modules.get("flax.linen")
      is_linen = linen is not None and isinstance(cls, type) and issubclass(cls, linen.Module)
      hint = ("For linen modules use partition.flax.with_axes." if is_linen else
              f"Pass the class, e.g. with_axes({type(cls).__name__}, ...)."
              if isinstance(cls, nnx.Module) else "Pass a class such as nnx.Linear.")
      raise _adapt.AdapterInputError(
          f"partition.nnx.with_axes takes an nnx.Module class, got "
          f"{_adapt.describe_value(cls)}. {hint}")

    class Wrapped(cls):
      def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _set_axes(self, cls, table)

      def __call__(self, *args, **kwargs):
        y = super().__call__(*args, **kwargs)
        return y if out_axes is None else constrain(y, out_axes)

    Wrapped.__name__, Wrapped.__qualname__ = cls.__name__, cls.__qualname__
    Wrapped.__module__ = cls.__module__
    Wrapped.__doc__ = (f"{cls.__name__} with logical axes params={table!r}, "
                       f"output={out_axes!r} (partition.nnx.with_axes).")
    return Wrapped

  return wrap if module_cls is None else wrap(module_cls)


__getattr__ = deprecated_getattr("partition.nnx", {
    "annotate": ("partition.nnx.declare_axes", lambda: declare_axes)})
