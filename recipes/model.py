"""The ``layers`` Transformer in each framework behind one interface.

``build(config, rules, mesh)`` returns a :class:`Model` whose params are a plain nested dict of
``jax.Array``s created directly in their shardings (``partition.{flax,nnx,haiku}.init_sharded``),
with a matching dict of logical axes, and ``apply(params, tokens) -> logits`` (keyword
arguments go to the Transformer's call: ``apply(params, tokens, targets=targets)`` returns the
per-token loss ``(ce, correct)``, chunked by ``config.loss_chunk``). The training step, the
optimizer state and the checkpoints only ever see plain dicts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

import layers
import partition
from partition.internal import needs_extra


@dataclasses.dataclass(frozen=True)
class Model:
  framework: str
  config: layers.TransformerConfig
  params: Any                       # nested dict of jax.Array, sharded
  param_axes: Any                   # the same structure, logical-axes tuples
  apply: Callable[..., Any]         # (params, tokens, **call_kwargs) -> logits


def build(framework: str, config: layers.TransformerConfig, *, seed: int, example: Any,
          rules: partition.AxisRules, mesh: jax.sharding.Mesh, abstract: bool = False) -> Model:
  """Creates the model's params sharded on ``mesh`` (``example``: int tokens for shapes).

  With ``abstract=True`` nothing is allocated: the params are ``jax.ShapeDtypeStruct``s
  with their shardings (``partition.{flax,nnx,haiku}.abstract_init``), a target to fill
  with loaded weights (``layers.from_canonical(weights, like=model.params)``).
  """
  builder = {"linen": _linen, "nnx": _nnx, "haiku": _haiku}[framework]
  params, axes, apply = builder(config, seed, example, rules, mesh, abstract)
  return Model(framework, config, params, axes, apply)


def _linen(config, seed, example, rules, mesh, abstract):
  import partition.flax
  from layers import linen

  module = linen.Transformer(config)
  init = partition.flax.abstract_init if abstract else partition.flax.init_sharded
  boxed = init(module, jax.random.key(seed), example, rules=rules, mesh=mesh)["params"]
  return (partition.unbox(boxed), partition.logical_axes(boxed),
          lambda params, tokens, **kw: module.apply({"params": params}, tokens, **kw))


def _nnx(config, seed, example, rules, mesh, abstract):
  with needs_extra("flax", by="recipes.model"):
    from flax import nnx

  import partition.nnx
  from layers import nnx as layers_nnx

  create = lambda: layers_nnx.Transformer(config, rngs=nnx.Rngs(seed))
  if abstract:
    module = nnx.merge(*partition.nnx.abstract_init(create, rules=rules, mesh=mesh))
  else:
    module = partition.nnx.init_sharded(create, rules=rules, mesh=mesh)
  graphdef, state, rest = nnx.split(module, nnx.Param, ...)
  if abstract and jax.tree.leaves(rest):  # apply() would run on placeholders
    raise RuntimeError("the NNX Transformer holds non-parameter state, which an abstract "
                       "build cannot fill: build it with abstract=False")
  params = nnx.to_pure_dict(state)
  axes = _plain(partition.logical_axes(state))
  treedef = jax.tree_util.tree_structure(state)
  _check_same_order(state, params)

  def apply(params, tokens, **kw):
    merged = nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, jax.tree.leaves(params)),
                       rest)
    return merged(tokens, **kw)

  return params, axes, apply


def _haiku(config, seed, example, rules, mesh, abstract):
  with needs_extra("haiku", by="recipes.model"):
    import haiku as hk

  import partition.haiku
  from layers import haiku as layers_hk

  transformed = hk.transform(lambda tokens, **kw: layers_hk.Transformer(config)(tokens, **kw))
  key = jax.random.key(seed)
  init = partition.haiku.abstract_init if abstract else partition.haiku.init_sharded
  params = init(transformed, key, example, rules=rules, mesh=mesh)
  axes = partition.haiku.eval_axes(transformed, key, example)
  return (_plain(params), _plain(axes),
          lambda params, tokens, **kw: transformed.apply(params, None, tokens, **kw))


def _plain(tree: Any) -> Any:
  """Nested plain dicts (NNX ``State`` and Haiku's mappings become ``dict``)."""
  if isinstance(tree, Mapping):
    return {k: _plain(v) for k, v in tree.items()}
  return tree


def _check_same_order(state, pure) -> None:
  """NNX: apply() rebuilds the State from the pure dict's leaves; both must flatten in the
  same order (they do: both sort their keys), checked once here."""
  paths = lambda t: [tuple(str(getattr(k, "key", k)) for k in p)
                     for p, _ in jax.tree_util.tree_flatten_with_path(t)[0]]
  ours, theirs = paths(state), paths(pure)  # a Variable adds a trailing '.value' level
  if len(ours) != len(theirs) or any(a[:len(b)] != b for a, b in zip(ours, theirs)):
    raise RuntimeError("NNX state and its pure dict flatten in different orders: "
                       f"{ours[:3]} vs {theirs[:3]}")


def example_tokens(batch_size: int, seq_len: int) -> jax.Array:
  return jnp.zeros((batch_size, seq_len), jnp.int32)
