"""Checking the arguments of the Haiku entry points (one error listing every problem)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from partition._base.errors import format_message
from partition._base.logical_axes import LogicalAxesTypeError
from partition._haiku.errors import Axes
from partition._params import adapt as _adapt
from partition._params.adapt import AdapterInputError
from partition._params.path_rules import PathRules

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
    raise LogicalAxesTypeError(format_message(f"{api}: {problem}.",
                                       fix="Give one logical name (or None) per dim, e.g. "
                                           "axes=('embed', 'mlp') or axes=('embed',)."))
  return tuple(axes)


def _table(table: Any, api: str, arg: str = "param_axes") -> PathRules | None:
  """``table`` as a :class:`PathRules`; a clear error naming ``arg`` otherwise."""
  if table is None or isinstance(table, PathRules):
    return table
  if isinstance(table, (str, bytes)) or not isinstance(table, (Mapping, Sequence)):
    raise AdapterInputError(format_message(
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
    raise LogicalAxesTypeError(format_message(f"{api}: {arg} has invalid logical axes:",
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
  name = getattr(transformed, "__name__", kind)
  if callable(transformed) and name in ("init_fn", "apply_fn") and getattr(
      transformed, "__module__", "").startswith("haiku."):
    method = name[:-len("_fn")]
    return (f"transformed is the {method} function of a Haiku transform (f.{method}), not the "
            f"transform: pass f itself (f = hk.transform(...)), not f.{method}")
  if callable(transformed):
    return (f"transformed is a plain callable ({name}), not a Haiku transform: pass "
            f"hk.transform({name}) (or hk.transform_with_state({name}) if it uses state)")
  return (f"transformed must be an hk.transform / hk.transform_with_state result, got {kind} "
          f"{transformed!r:.60}")


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
    return rng, None if _adapt.is_prng_key(rng) else f"rng {rng} is not a PRNG key; {fix}"
  if isinstance(rng, (jax.Array, np.ndarray)):
    if _adapt.is_prng_key(rng):
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
  """Checks every argument of one call; raises one :class:`AdapterInputError` listing all."""
  problems = [_check_transformed(transformed)]
  rng, rng_problem = _check_rng(rng, concrete)
  static, static_problems = _static_nums(static_argnums, len(args))
  problems += [rng_problem, *static_problems]
  if stack_axis is not None and (not isinstance(stack_axis, str) or not stack_axis):
    problems.append(f"stack_axis must be a logical name (a non-empty str) or None, got "
                    f"{stack_axis!r}")
  problems = [p for p in problems if p]
  if problems:
    raise AdapterInputError(format_message(f"{api}: invalid arguments:", bullets=problems,
                                         fix=f"Call it as {api}(hk.transform(fn), "
                                             "jax.random.key(0), *inputs, rules=..., mesh=...)."))
  return rng, static
