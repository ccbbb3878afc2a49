"""Recording what a Haiku init creates, and the creators/getters that declare and
constrain logical axes inside a transform."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp

from partition._base.errors import format_message
from partition._base.logical_axes import LogicalAxesError
from partition._base.mesh import explicit_axes
from partition._haiku.errors import _LOCAL, _PARAMS, _STATE, Axes, UnusedPatternWarning
from partition._haiku.validation import _as_axes
from partition._params.path_rules import PathRules, PathRulesError
from partition._rules.constrain import constrain, constrain_as
from partition._rules.context import current_rules, current_rules_mesh

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
  initializing = hk.running_init() or _is_placing()
  return mesh is not None and bool(explicit_axes(mesh)) and initializing


def _is_placing() -> bool:
  return getattr(_LOCAL, "placing", 0) > 0


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


def _constrain_var(value: jax.Array, axes: Axes, name: str, api: str) -> jax.Array:
  """Constrains a param / state value (short axes are a prefix, as in flax); inside
  ``hk.layer_stack``'s scan it is one layer's slice, so a table entry spelled for the stacked
  array keeps only its trailing axes. Rules that do not place it warn naming it (``name``, its
  Haiku path), except while ``init_sharded`` traces: its placement audit reports them."""
  ndim = jnp.ndim(value)
  if len(axes) > ndim:
    axes = axes[len(axes) - ndim:]
  return constrain_as(value, tuple(axes) + (None,) * (ndim - len(axes)), name=name, api=api,
                      stacklevel=4, warn=not _is_placing())


def _full_name(name: str) -> str:
  """``module/name`` of a param / state read in the current module."""
  module = hk.experimental.current_name()
  return f"{module}/{name}" if module and module != "~" else f"~/{name}"


# -- declaring axes inside a transform ---------------------------------------------------------


def _declared(kind: str, name: str, shape: Any, axes: Any, api: str) -> Axes:
  axes = _as_axes(axes, f"{api}({name!r})")
  if len(axes) != len(tuple(shape)):
    raise LogicalAxesError(
        f"{api}({name!r}): shape {tuple(shape)} has {len(tuple(shape))} dims but axes={axes} "
        f"names {len(axes)}. Give one logical name (or None) per dim (inside hk.layer_stack: "
        "per layer; the stacked dim is added for you).")
  return axes


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
