"""Shared machinery of the framework adapters (``partition.flax``, ``.nnx``, ``.haiku``).

Sharded initialisation is the same three steps everywhere:

1. ``jax.eval_shape`` the framework's init: shapes and logical axes, nothing allocated;
2. resolve the axes through the rules on the mesh: one ``NamedSharding`` per parameter;
3. ``jax.jit(init, out_shardings=...)``: XLA creates each parameter directly in its
   shards, so no device ever holds a full copy of a sharded weight.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh

from partition._constrain import NoRulesError
from partition._context import axis_rules, current_rules, current_rules_mesh
from partition._errors import MeshError, format_message
from partition._explain import explain as _explain
from partition._logical_axes import abstract, logical_axes, unbox
from partition._mesh import AnyMesh
from partition._path_rules import as_path_rules
from partition._resources import SerialLoop
from partition._rules import AxisRules


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


def flax_rules(rules: AxisRules, mesh: AnyMesh | None = None) -> tuple:
  """``rules`` as flax's ``LogicalRules`` (for ``nn.logical_axis_rules``).

  Loops are dropped; with a mesh, axes it lacks or of size 1 are dropped and a rule left
  without axes is skipped (as ``AxisRules`` does without a shape).
  """
  sizes = None if mesh is None else dict(mesh.shape)
  out = []
  for name, value in rules.pairs:
    if value is None:
      out.append((name, None))
      continue
    axes = [a for a in value if not isinstance(a, SerialLoop)]
    if sizes is not None:
      axes = [a for a in axes if sizes.get(a, 1) > 1]
    if axes:
      out.append((name, axes[0] if len(axes) == 1 else tuple(axes)))
  return tuple(out)


def rules_context(rules: AxisRules, mesh: AnyMesh | None):
  """``partition.axis_rules(rules, mesh)`` (which also sets flax's rules when flax is used)."""
  return axis_rules(rules, mesh)


def apply_path_rules(tree: Any, param_axes: Any) -> Any:
  """Logical axes of ``tree``: declared ones, filled in by the path table if given."""
  table = as_path_rules(param_axes)
  if table is None:
    return logical_axes(tree)
  return table.axes(tree)


def shardings_for(tree: Any, axes: Any, rules: AxisRules, mesh: AnyMesh) -> Any:
  """``NamedSharding`` per parameter of the (boxed) abstract ``tree``."""
  return rules.tree_shardings(axes, mesh, shapes=unbox(tree))


def sharded_abstract(tree: Any, axes: Any, rules: AxisRules, mesh: AnyMesh) -> Any:
  """``tree`` with every array replaced by a ``ShapeDtypeStruct`` carrying its sharding."""
  return abstract(tree, shardings_for(tree, axes, rules, mesh))


def explain_tree(tree: Any, axes: Any, rules: AxisRules, mesh: AnyMesh):
  """``partition.explain`` over a (boxed) abstract tree and its logical axes."""
  return _explain(unbox(tree), axes, rules, mesh)


def jit_init(init, shardings: Any, rules: AxisRules, mesh: AnyMesh, *args: Any) -> Any:
  """Runs ``init(*args)`` under ``jax.jit(out_shardings=shardings)`` in the rules context."""
  with rules_context(rules, mesh):
    return jax.jit(init, out_shardings=shardings)(*args)

