"""Micro-batched gradients reduced once per step (``value_and_grad(grad_reduction=...)``).

With ``k`` micro-batches of a batch sharded over mesh axes ``B`` (``m`` devices), the
per-micro-batch schedule keeps the gradient carry in the parameters' shardings, so XLA
reduces every gradient over ``B`` in every iteration: ``k`` times the bytes of one
reduction. Here the batch is cut into ``[k, m, n/(m k)]`` (micro-batch ``j`` holds rows
``j, j+k, ...`` of each device's block, as in the per-micro-batch schedule) and each
micro-batch runs as ``jax.vmap(jax.value_and_grad(loss), spmd_axis_name=B)`` over the ``m``
device shards: each device differentiates the loss of its own rows, with no communication,
and adds the result to a carry ``[m, *param.shape]`` whose ``m`` dim lies on ``B``. After the
loop one sum over ``m`` reduces each gradient: an all-reduce for a parameter replicated over
``B``, a reduce-scatter for one sharded over ``B`` (FSDP).

Per device the carry is one full-size gradient. For a parameter replicated over ``B`` that
is the parameter's own size, so reducing once is free; for one sharded over ``B`` it is
``N`` times the sharded carry, which is why ``grad_reduction='auto'`` keeps such parameters
on the per-micro-batch schedule (their shard of the gradient summed over ``m`` inside the
loop: a reduce-scatter per micro-batch) and only ``'once'`` trades their memory for traffic.

Inside the vmap the model sees one device's rows. The rules there name ``B`` under
placeholders the mesh lacks, so every rule resolves exactly as before (an axis the mesh
lacks still counts as used) and only ``B`` drops out of the specs: vmap's
``spmd_axis_name`` puts the shard dim on ``B`` instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from partition._base.mesh import entry_mesh_axes, to_spec_entry
from partition._rules.context import axis_rules
from partition._rules.table import AxisRules

SCHEDULES = ("auto", "per_microbatch", "once")
_PLACEHOLDER = "{}@device_shard"


def uses_axes(spec: PartitionSpec | None, axes: Sequence[str]) -> bool:
  """Does ``spec`` shard some dim over one of the mesh ``axes``?"""
  return spec is not None and any(a in axes for e in spec for a in entry_mesh_axes(e))


def reduce_once_step(loss_fn: Callable, has_aux: bool, params: Any, batch: Any,
                     rest: Sequence[Any], *, rules: AxisRules, mesh: Any, batch_axes: Any,
                     dims: Any, k: int, m: int, mesh_axes: tuple[str, ...], param_specs: Any,
                     once: Callable[[PartitionSpec | None], bool],
                     rng_positions: Sequence[int]) -> tuple[Any, Any]:
  """``(value, grads)`` of the mean loss over ``k`` micro-batches, gradients for which
  ``once(spec)`` is true reduced over ``mesh_axes`` after the loop, the others per
  micro-batch (see the module docstring)."""

  def constrain(x, spec):
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

  def split(x, dim, axes):  # [.., n, ..] -> [k, .., m, n/(m k), ..], m on mesh_axes
    shape = np.shape(x)
    x = jnp.reshape(x, shape[:dim] + (m, shape[dim] // (m * k), k) + shape[dim + 1:])
    e = _entries(rules.spec(tuple(axes), shape, mesh), len(shape))
    spec = PartitionSpec(None, *e[:dim], e[dim], None, *e[dim + 1:])
    return constrain(jnp.moveaxis(x, dim + 2, 0), spec)

  micro = jax.tree.map(split, batch, dims, batch_axes, is_leaf=lambda x: x is None)
  inner = placeholder_rules(rules, mesh_axes)

  def shard_loss(params, shard_batch, *shard_rest):
    with axis_rules(inner, mesh):
      return jax.value_and_grad(loss_fn, has_aux=has_aux)(params, shard_batch, *shard_rest)

  rest_axes = tuple(0 if i in rng_positions else None for i in range(len(rest)))
  per_shard = jax.vmap(shard_loss, in_axes=(None, dims, *rest_axes),
                       spmd_axis_name=mesh_axes)
  shard_spec = mesh_axes if len(mesh_axes) > 1 else mesh_axes[0]

  def carried(grads):  # once: [m, ...] on mesh_axes; per micro-batch: summed, as the param
    return _map_specs(lambda g, spec: (
        constrain(g, PartitionSpec(shard_spec, *_without(spec, mesh_axes, g.ndim - 1)))
        if once(spec) else _constrain_opt(constrain, g.sum(0), spec)), param_specs, grads)

  def keys_for(j):
    out = list(rest)
    for i in rng_positions:
      key_j = jax.random.fold_in(rest[i], j)
      out[i] = jax.vmap(lambda s, key=key_j: jax.random.fold_in(key, s))(jnp.arange(m))
    return out

  def body(carry, xs):
    j, mb = xs
    value, grads = per_shard(params, mb, *keys_for(j))
    return jax.tree.map(jnp.add, carry, (value, carried(grads))), None

  shapes = jax.eval_shape(lambda: per_shard(params, jax.tree.map(lambda x: x[0], micro),
                                              *keys_for(0)))
  zero = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
  zero = (zero[0], carried(zero[1]))
  (value, grads), _ = jax.lax.scan(body, zero, (jnp.arange(k), micro))
  value = jax.tree.map(lambda v: jnp.mean(v, axis=0) / k, value)
  grads = _map_specs(lambda g, spec: _constrain_opt(
      constrain, (_sum_shards(g, spec, mesh_axes, mesh, constrain) if once(spec) else g)
      / (k * m), spec), param_specs, grads)
  return value, grads


def _sum_shards(g, spec, mesh_axes, mesh, constrain):
  """Sums the device-shard dim of ``g`` (``[m, ...]``, ``m`` over ``mesh_axes``): over the
  batch axes the parameter is sharded on first (a reduce-scatter onto its shards), then over
  the others (an all-reduce of the shard), the ZeRO order; one sum when that is all."""
  sharded = [a for a in mesh_axes if uses_axes(spec, (a,))]
  if not sharded or len(sharded) == len(mesh_axes):
    return g.sum(0)
  ndim = g.ndim - 1
  split = jnp.reshape(g, tuple(mesh.shape[a] for a in mesh_axes) + g.shape[1:])
  split = constrain(split, PartitionSpec(*mesh_axes, *_without(spec, mesh_axes, ndim)))
  rest = [a for a in mesh_axes if a not in sharded]
  part = split.sum(tuple(i for i, a in enumerate(mesh_axes) if a in sharded))
  part = constrain(part, PartitionSpec(*rest, *_entries(spec, ndim)))
  return part.sum(tuple(range(len(rest))))


def _map_specs(f, param_specs, grads):
  """``f(leaf, spec)`` over ``grads``, one spec per parameter subtree (boxes included)."""
  if param_specs is None:
    return jax.tree.map(lambda g: f(g, None), grads)
  return jax.tree.map(lambda spec, sub: jax.tree.map(lambda g: f(g, spec), sub),
                      param_specs, grads, is_leaf=lambda s: s is None
                      or isinstance(s, PartitionSpec))


def _constrain_opt(constrain, x, spec):
  return x if spec is None else constrain(x, spec)


def _entries(spec: PartitionSpec | None, ndim: int) -> list:
  e = list(spec or ())
  return e + [None] * (ndim - len(e))


def _without(spec: PartitionSpec | None, axes: Sequence[str], ndim: int) -> list:
  """``spec``'s entries with the mesh ``axes`` removed (those dims then held whole)."""
  out = []
  for e in _entries(spec, ndim):
    out.append(to_spec_entry(a for a in entry_mesh_axes(e) if a not in axes))
  return out


def placeholder_rules(rules: AxisRules, axes: Sequence[str]) -> AxisRules:
  """``rules`` with the mesh ``axes`` renamed to placeholders the mesh lacks."""
  def rename(value):
    if value is None or isinstance(value, str):
      return _PLACEHOLDER.format(value) if value in axes else value
    return tuple(rename(v) if isinstance(v, str) else v for v in value)
  return AxisRules([(name, rename(value)) for name, value in rules.pairs])

