"""Shared machinery of the framework adapters (``partition.flax``, ``.nnx``, ``.haiku``).

Sharded initialisation is the same three steps everywhere:

1. ``jax.eval_shape`` the framework's init: shapes and logical axes, nothing allocated;
2. resolve the axes through the rules on the mesh: one ``NamedSharding`` per parameter;
3. ``jax.jit(init, out_shardings=...)``: XLA creates each parameter directly in its
   shards, so no device ever holds a full copy of a sharded weight.

Between 2 and 3 :func:`place` runs ``partition._params.audit.audit_placement``: ``strict=True``
turns every unplaced name / path / dim into one error, otherwise one warning lists large
parameters left fully replicated.

"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import Mesh

from partition._base.errors import MeshError, PartitionError, format_message, short
from partition._base.logical_axes import (
  LogicalAxesError,
  LogicalAxesTypeError,
  abstract,
  check_names,
  logical_axes,
  unbox,
)
from partition._base.mesh import AnyMesh
from partition._params.audit import audit_placement
from partition._params.path_rules import PathMatch, as_path_rules
from partition._rules.constrain import NoRulesError
from partition._rules.context import axis_rules, current_rules, current_rules_mesh
from partition._rules.explain import explain as _explain
from partition._rules.table import AxisRules


class AdapterInputError(PartitionError, TypeError, ValueError):
  """An adapter entry point (``partition.flax``, ``.nnx``, ``.haiku``) got an argument it
  cannot use: the wrong kind of object (a class for an instance, a function, an int key) or
  a bad value (``strict=2``, a key that is not a PRNG key, ``static_argnums`` out of range)."""


def describe_value(x: Any) -> str:
  """``x`` in a few words for an error message: kind and a short repr."""
  if isinstance(x, type):
    return f"the class {x.__module__}.{x.__qualname__}"
  if callable(x) and hasattr(x, "__qualname__"):
    return f"the function {x.__qualname__}"
  return f"{type(x).__name__} {short(x)}"


def check_axes_table(params: Any, output: Any, what: str) -> tuple[dict[str, Any], Any]:
  """``with_axes(params=, output=)`` validated (a str is never split into letters); ``what``
  names the table's keys in messages ('param' for linen, 'Variable' for NNX)."""
  if params is not None and not isinstance(params, Mapping):
    raise LogicalAxesTypeError(
        f"with_axes(params=...) takes a mapping {{{what} name: logical axes}}, got "
        f"{describe_value(params)}. Write e.g. params={{'kernel': ('embed', 'mlp')}}.")
  table = {}
  for k, v in (params or {}).items():
    if not isinstance(k, str):
      raise LogicalAxesTypeError(
          f"with_axes(params=...): keys are {what} names (str), got {k!r}. Write e.g. "
          "params={'kernel': ('embed', 'mlp')}.")
    table[k] = check_names(v, f"with_axes(params={{{k!r}: ...}})")
  out = None if output is None else check_names(output, "with_axes(output=...)")
  return table, out


def is_prng_key(x: Any) -> bool:
  """One PRNG key: a typed key of shape ``()`` or a raw ``uint32[2]`` key.

  >>> import jax, jax.numpy as jnp
  >>> is_prng_key(jax.random.key(0)), is_prng_key(jax.random.PRNGKey(0)), is_prng_key(3)
  (True, True, False)
  >>> is_prng_key(jnp.zeros(2, jnp.uint32)), is_prng_key(jax.random.split(jax.random.key(0)))
  (True, False)
  """
  dtype, shape = getattr(x, "dtype", None), tuple(getattr(x, "shape", (None,)))
  if dtype is None:
    return False
  if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    return shape == ()
  return dtype == "uint32" and shape == (2,)


def check_rngs(rngs: Any, api: str) -> None:
  """A PRNG key or a ``{name: key}`` dict, as ``module.init`` takes; else a clear error."""
  if isinstance(rngs, Mapping):
    bad = [f"{k!r}: {describe_value(v)}" for k, v in rngs.items()
           if not isinstance(k, str) or not is_prng_key(v)]
    if not bad:
      return
    what = "a dict with entries that are not 'name': key pairs (" + "; ".join(bad) + ")"
  elif is_prng_key(rngs):
    return
  else:
    what = describe_value(rngs)
  raise AdapterInputError(
      f"{api}: rngs must be a PRNG key or a dict of them, got {what}. Pass "
      "jax.random.key(0), or {'params': jax.random.key(0), 'dropout': jax.random.key(1)}.")


def check_axes_rank(shape: Any, axes: tuple, where: str) -> None:
  """``with_axes`` in both flax APIs: at most one logical name per dim (a shorter tuple is a
  prefix, as in flax)."""
  if shape is not None and len(shape) < len(axes):
    raise LogicalAxesError(
        f"{where} has shape {tuple(shape)} but was given logical axes {axes} ({len(axes)} "
        "dims). Give at most one logical name (or None) per dim (a shorter tuple leaves the "
        "trailing dims replicated, as in flax).")


def need_rules_mesh(rules: Any, mesh: AnyMesh | None, api: str, *,
                    concrete: bool = True) -> tuple[AxisRules, AnyMesh]:
  """Explicit ``rules``/``mesh`` first, then the ``axis_rules`` / ``set_mesh`` context."""
  found_rules, found_mesh = current_rules(rules), current_rules_mesh(mesh)
  if found_rules is None:
    raise NoRulesError(format_message(
        f"{api} needs axis rules to turn logical axes into shardings.",
        fix="Pass rules=partition.AxisRules([...]) (or a rules file path), or call it inside "
            "`with partition.axis_rules(rules, mesh):`."))
  if found_mesh is None or (concrete and not isinstance(found_mesh, Mesh)):
    what = "no mesh" if found_mesh is None else "only an abstract mesh"
    raise MeshError(format_message(
        f"{api} needs a concrete device mesh to place the parameters, but found {what}.",
        fix="Pass mesh=jax.make_mesh(shape, axis_names), or call it inside "
            "`with partition.axis_rules(rules, mesh):` or `with jax.set_mesh(mesh):`."))
  return found_rules, found_mesh


def passthrough_rules(rules: AxisRules, mesh: AnyMesh) -> AxisRules:
  """``rules`` plus ``(axis, axis)`` for each mesh axis that is not a logical name.

  Flax NNX resolves ``out_sharding`` names with ``rules.get(name, name)``: a name without a
  rule that is a mesh axis *is* that mesh axis. Appending identity rules (lowest priority)
  gives the same placement while keeping the priority algorithm for named rules.
  """
  extra = [(a, a) for a in mesh.axis_names if a not in rules.names]
  return rules + extra if extra else rules


def match_axes(tree: Any, param_axes: Any) -> tuple[Any, PathMatch | None]:
  """``(axes tree, PathMatch or None)``: declared axes, then the path table (if any)."""
  table = as_path_rules(param_axes)
  if table is None:
    return logical_axes(tree), None
  report = table.match(tree)
  return report.axes, report


def shardings_for(tree: Any, axes: Any, rules: AxisRules, mesh: AnyMesh) -> Any:
  """``NamedSharding`` per parameter of the (boxed) abstract ``tree``."""
  return rules.tree_shardings(axes, mesh, shapes=unbox(tree))


def place(tree: Any, axes: Any, rules: AxisRules, mesh: AnyMesh, *, strict: bool, api: str,
          path_match: PathMatch | None = None, named: Any = None, depth: int = 0) -> Any:
  """:func:`shardings_for`, audited (one strict error, or the fallback warnings).

  ``named`` (optional) maps a tree of ``tree``'s structure to the one the audit reports on
  (Haiku's ``(params, state)`` become ``params/...`` and ``state/...``). The warnings name
  the line that called the public entry point, which calls this directly (``depth=0``) or
  through ``depth`` helpers of its own.
  """
  if not isinstance(strict, bool):
    raise AdapterInputError(f"{api}(strict=...) takes True or False, got {short(strict)}.")
  shardings = shardings_for(tree, axes, rules, mesh)
  rename = named or (lambda t: t)
  audit_placement(unbox(rename(tree)), rename(axes), rename(shardings), rules, mesh,
                  strict=strict, api=api, path_match=path_match, stacklevel=4 + depth)
  return shardings


def sharded_abstract(tree: Any, axes: Any, rules: AxisRules, mesh: AnyMesh) -> Any:
  """``tree`` with every array replaced by a ``ShapeDtypeStruct`` carrying its sharding."""
  return abstract(tree, shardings_for(tree, axes, rules, mesh))


def explain_tree(tree: Any, axes: Any, rules: AxisRules, mesh: AnyMesh):
  """``partition.explain`` over a (boxed) abstract tree and its logical axes."""
  return _explain(unbox(tree), axes, rules, mesh)


def jit_init(init, shardings: Any, rules: AxisRules, mesh: AnyMesh, *args: Any) -> Any:
  """Runs ``init(*args)`` under ``jax.jit(out_shardings=shardings)`` in the rules context."""
  with axis_rules(rules, mesh):
    return jax.jit(init, out_shardings=shardings)(*args)

