"""Tracing a Haiku init with ``jax.eval_shape``: which inputs are traced, which static."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import haiku as hk
import jax
import numpy as np

from partition._base.errors import format_message
from partition._base.logical_axes import LogicalAxesError
from partition._haiku.errors import _PARAMS, _STATE, StaticArgError
from partition._haiku.recording import _placing, _recording
from partition._haiku.stacked import _axes_tree, _Matching, _stack_leads
from partition._haiku.validation import _table, _validate
from partition._params import adapt as _adapt
from partition._params.path_rules import PathRulesError

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
