"""Collectives JAX's vmap rules would get silently wrong in an xmap body.

``lax.ppermute`` over several named axes at once (``axis_name=('a', 'b')``) means one
permutation of the joint index under ``shard_map``; under nested ``jax.vmap`` each level
drops its own name and the outermost applies the whole permutation along its axis alone, a
wrong result without an error when the permutation's length happens to equal that axis'
size. xmap cannot see inside the vmaps, so where two or more named axes are bound it traces
the body once more on its own (``jax.make_jaxpr`` with the axes in ``axis_env``) and looks
for such a ``ppermute``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax

from partition._base.errors import AxisNameError, format_message


def check_no_joint_ppermute(call: Callable, structs: Sequence[jax.ShapeDtypeStruct],
                            axis_env: Sequence[tuple[str, int]], name: str) -> None:
  """Raises ``AxisNameError`` if ``call(*structs)`` runs a ``ppermute`` over several of the
  bound axes. Best effort: a body this extra trace cannot run is left to the real trace,
  which reports its own errors."""
  if len(axis_env) < 2:
    return
  try:
    with warnings.catch_warnings():  # the real trace gives the body's warnings, once
      warnings.simplefilter("ignore")
      closed = jax.make_jaxpr(call, axis_env=list(axis_env))(*structs)
  except Exception:  # noqa: BLE001 (the real trace raises it, in xmap's terms)
    return
  for eqn in _equations(closed.jaxpr):
    axes = eqn.params.get("axis_name") if eqn.primitive.name == "ppermute" else None
    if isinstance(axes, (tuple, list)) and len(axes) > 1:
      raise AxisNameError(format_message(
          f"xmap({name}): lax.ppermute over several named axes at once, "
          f"axis_name={tuple(axes)!r}, is not supported.",
          context=["Named axes are vectorised (jax.vmap), whose ppermute rule permutes along "
                   "one axis only: the result would be wrong, without an error."],
          fix="Call ppermute once per axis, with the permutation of that axis; or all_gather "
              "over one axis and index."))


def _equations(jaxpr: Any) -> Iterator[Any]:
  for eqn in jaxpr.eqns:
    yield eqn
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        inner = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr holds its Jaxpr
        if hasattr(inner, "eqns"):
          yield from _equations(inner)
