"""Optimizer state sharded like its parameters.

``jax.jit(tx.init)(params)`` leaves every optax moment to XLA's propagation and its scalar
``count`` on one device (``SingleDeviceSharding``). :func:`optimizer_init` instead resolves the
parameters' logical axes through the rules, maps each parameter sharding onto the state with
``optax.tree_map_params`` (every moment of a parameter gets that parameter's sharding; other
fields such as ``count`` are replicated on the mesh) and creates the state with
``jax.jit(tx.init, out_shardings=...)``, so no full-size moment ever lands on one device.
:func:`optimizer_axes` gives the state's logical-axes tree (moments keep their parameter's
axes, other fields ``None``), e.g. for checkpoint-restore targets.

>>> import jax, jax.numpy as jnp, optax, partition
>>> mesh = jax.make_mesh((4, 2), ('fsdp', 'tensor'))
>>> rules = partition.AxisRules([('embed', 'fsdp'), ('mlp', 'tensor')])
>>> params = {'w': partition.WithAxes(jnp.zeros((8, 4)), ('embed', 'mlp'))}
>>> state = partition.optimizer_init(optax.adam(1e-3), params, rules=rules, mesh=mesh)
>>> state[0].mu['w'].sharding.spec, state[0].count.sharding.spec
(P('fsdp', 'tensor'), P())
>>> partition.optimizer_axes(optax.adam(1e-3), params)[0].mu
{'w': ('embed', 'mlp')}
"""

from __future__ import annotations

import sys
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from partition._base.errors import PartitionError, format_message
from partition._base.logical_axes import logical_axes, unbox
from partition._base.mesh import AnyMesh
from partition._params import adapt as _adapt
from partition._params.path_rules import PathRules, as_path_rules, is_path_table


class OptimizerStateError(PartitionError, TypeError):
  """``optimizer_init`` got something that is not an optax transformation or params tree."""


def _masked_node(x: Any) -> bool:
  optax = sys.modules.get("optax")
  return optax is not None and isinstance(x, optax.MaskedNode)


def _check_tx(tx: Any, api: str) -> None:
  if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
    raise OptimizerStateError(format_message(
        f"{api}: tx must be an optax GradientTransformation, got {type(tx).__name__}.",
        fix="Pass e.g. optax.adamw(1e-3) (an object with .init and .update), not a function "
            "or a class."))


def resolve_param_axes(params: Any, param_axes: Any) -> Any:
  """The parameters' logical-axes tree: declared, a path table, or given directly.

  A path table is a :class:`PathRules` or, as in the adapters' ``param_axes=``, a list of
  ``(regex, axes)`` pairs (unless the params themselves are a list, whose axes it would be).

  >>> import jax.numpy as jnp
  >>> params = {'dense': {'kernel': jnp.zeros((4, 8))}}
  >>> resolve_param_axes(params, [(r'kernel$', ('embed', 'mlp'))])
  {'dense': {'kernel': ('embed', 'mlp')}}
  """
  if param_axes is None:
    return logical_axes(params)
  if isinstance(param_axes, PathRules) or (
      is_path_table(param_axes) and not isinstance(params, (list, tuple))):
    return as_path_rules(param_axes).axes(params)
  return param_axes


def _map_params(tx: Any, state: Any, per_param: Any, non_params: Any) -> Any:
  """``per_param``'s leaf for each copy of a parameter in ``state``; ``non_params`` else."""
  import optax

  def f(value, item):
    return value if _masked_node(value) else item

  return optax.tree_map_params(tx, f, state, per_param,
                               transform_non_params=lambda _: non_params,
                               is_leaf=_masked_node)


def optimizer_axes(tx: Any, params: Any, *, param_axes: Any = None) -> Any:
  """The logical axes of ``tx.init(params)``: each moment has its parameter's axes.

  Args:
    tx: an optax ``GradientTransformation`` (chains, ``optax.masked`` included).
    params: the parameters (boxed, ``WithAxes`` or plain arrays / ``ShapeDtypeStruct``s).
    param_axes: default ``partition.logical_axes(params)``; or a path table (a
      :class:`partition.PathRules` or a list of ``(regex, axes)`` pairs, as in the adapters);
      or the parameters' logical-axes tree itself.

  Returns:
    A tree with the state's structure: parameter-shaped fields hold logical-axes tuples
    (``None`` where unannotated), other fields (``count``) ``None``; ``EmptyState`` and
    ``MaskedNode`` stay as they are.
  """
  _check_tx(tx, "partition.optimizer_axes")
  plain = unbox(params)
  shapes = jax.eval_shape(tx.init, plain)
  return _map_params(tx, shapes, resolve_param_axes(params, param_axes), None)


def optimizer_init(tx: Any, params: Any, *, param_axes: Any = None, rules: Any = None,
                   mesh: AnyMesh | None = None) -> Any:
  """``tx.init(params)`` with every moment created in its parameter's sharding.

  Args:
    tx: an optax ``GradientTransformation`` (chains, ``optax.masked`` included).
    params: the parameters: linen variables' ``params`` (boxed or not), an ``nnx.State``,
      Haiku params, ``WithAxes`` boxes or plain arrays.
    param_axes: default ``partition.logical_axes(params)``; or a path table (a
      :class:`partition.PathRules` or a list of ``(regex, axes)`` pairs, as in the adapters);
      or the parameters' logical-axes tree itself.
    rules: an ``AxisRules`` (or pairs / a file path); default: ``partition.axis_rules``.
    mesh: a ``jax.sharding.Mesh``; default: the ``axis_rules`` mesh, then ``jax.set_mesh``.

  Returns:
    The optimizer state. Parameter-shaped fields have exactly the parameters' shardings
    (``rules`` resolved on ``mesh``, shape-aware); other fields such as ``count`` are
    replicated on the mesh (``NamedSharding(mesh, P())``).

  Raises:
    OptimizerStateError: if ``tx`` is not an optax transformation.
    NoRulesError / MeshError: without rules or a concrete mesh.
  """
  api = "partition.optimizer_init"
  _check_tx(tx, api)
  rules, mesh = _adapt.need_rules_mesh(rules, mesh, api)
  axes = resolve_param_axes(params, param_axes)
  plain = unbox(params)
  per_box = rules.tree_shardings(axes, mesh, shapes=plain)
  if not _has_nnx_variables(params):
    shapes = jax.eval_shape(tx.init, plain)
    replicated = NamedSharding(mesh, PartitionSpec())
    shardings = _map_params(tx, shapes, per_box, replicated)
    return jax.jit(tx.init, out_shardings=shardings)(plain)
  # An nnx.State: the state keeps the Variable wrappers (the structure tx.init(state) has),
  # since tx.update gets gradients of that structure; each parameter's sharding is spread
  # over its Variable's leaves.
  structure = jax.tree_util.tree_structure(per_box, is_leaf=_is_sharding)
  param_shardings = jax.tree_util.tree_unflatten(
      jax.tree_util.tree_structure(params),
      [sharding for sharding, box in zip(structure.flatten_up_to(per_box),
                                         structure.flatten_up_to(params))
       for _ in jax.tree_util.tree_leaves(box)])
  shapes = jax.eval_shape(tx.init, params)
  replicated = NamedSharding(mesh, PartitionSpec())
  shardings = _map_params(tx, shapes, param_shardings, replicated)
  return jax.jit(tx.init, out_shardings=shardings)(params)


def _has_nnx_variables(tree: Any) -> bool:
  nnx = sys.modules.get("flax.nnx")
  if nnx is None:
    return False
  return any(isinstance(x, nnx.Variable) for x in jax.tree_util.tree_leaves(
      tree, is_leaf=lambda x: isinstance(x, nnx.Variable)))


def _is_sharding(x: Any) -> bool:
  return x is None or isinstance(x, NamedSharding)

