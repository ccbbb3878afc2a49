"""Flax linen layers with logical axes (``nn.with_logical_partitioning``) over ``layers._core``.

Each module only declares its parameters (the tables of ``layers/_params.py``, with their
logical axes; see docs/layers.md), so ``partition.flax.init_sharded`` places them from a rules
table, and calls the framework-free math (``layers._core``; the Transformer:
``layers._model``). A scanned model declares every block parameter once with a leading
``layers`` dim; ``layers._model.apply_blocks`` scans over it.

>>> import jax, jax.numpy as jnp, partition
>>> import layers, layers.linen
>>> cfg = layers.TransformerConfig(vocab_size=64, embed_dim=16, mlp_dim=32, num_heads=2,
...                                num_kv_heads=1, head_dim=8, num_layers=2, scan_layers=True)
>>> model = layers.linen.Transformer(cfg)
>>> tokens = jnp.zeros((2, 8), jnp.int32)
>>> variables = jax.eval_shape(model.init, jax.random.key(0), tokens)
>>> partition.logical_axes(variables)['params']['blocks']['attn']['qkv']['kernel']
('layers', 'embed', 'kv_heads', None, 'head_dim')
>>> model.apply(model.init(jax.random.key(0), tokens), tokens).shape
(2, 8, 64)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from partition.internal import needs_extra

with needs_extra("flax", by="layers.linen"):
  import flax.linen as nn

import partition
from layers import _core, _decode, _model, _moe
from layers._config import TransformerConfig
from layers._params import (
  ParamSpec,
  attention_params,
  block_params,
  check_mesh,
  dense_params,
  embed_params,
  listed_blocks,
  mlp_params,
  moe_params,
  named_blocks,
  norm_params,
  transformer_params,
)

Array = jax.Array


def _declare(module: nn.Module, specs: dict[str, Any], dtype: Any) -> dict[str, Any]:
  """Creates ``specs`` (a nested dict of ``ParamSpec``) in ``module``'s scope, sub-dicts as
  child scopes; returns the same nesting of arrays."""
  return {name: module.param(name, nn.with_logical_partitioning(s.init, s.axes), s.shape, dtype)
          if isinstance(s, ParamSpec) else _Scope(s, dtype, name=name)()
          for name, s in specs.items()}


class _Scope(nn.Module):
  """A named level of a parameter tree (``attn``, ``qkv``, ``blocks_0``, ...)."""

  specs: dict[str, Any]
  param_dtype: Any

  @nn.compact
  def __call__(self) -> dict[str, Any]:
    return _declare(self, self.specs, self.param_dtype)


class Dense(nn.Module):
  """Dense over the last ``len(in_axes)`` dims: ``(..., *in) -> (..., *features)``.

  Params: ``kernel (*in, *features)`` with axes ``in_axes + out_axes``; ``bias
  (*features)`` with ``out_axes`` when ``use_bias``.
  """

  features: int | tuple[int, ...]
  in_axes: tuple[str | None, ...] = ("embed",)
  out_axes: tuple[str | None, ...] = ("mlp",)
  use_bias: bool = False
  dtype: Any = None
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    n = len(self.in_axes)
    specs = dense_params(x.shape[x.ndim - n:], self.features, self.in_axes, self.out_axes,
                         self.use_bias, where=f"layers.linen.Dense({self.name})")
    p = _declare(self, specs, self.param_dtype)
    return _core.dense(x, p["kernel"], p.get("bias"), contract=n, dtype=self.dtype)


class Embed(nn.Module):
  """Token embedding ``embedding (vocab, embed)``; ``attend`` is the tied output layer.

  ``(batch, length)`` ints -> ``(batch, length, embed)``, constrained.
  """

  num_embeddings: int
  features: int
  dtype: Any = None
  param_dtype: Any = jnp.float32

  def setup(self):
    spec = embed_params(self.num_embeddings, self.features)["embedding"]
    self.embedding = self.param("embedding", nn.with_logical_partitioning(spec.init, spec.axes),
                                spec.shape, self.param_dtype)

  def __call__(self, tokens: Array) -> Array:
    x = _core.embed(tokens, self.embedding, dtype=self.dtype)
    return partition.constrain(x, _core.EMBED) if x.ndim == 3 else x

  def attend(self, x: Array) -> Array:
    """``(batch, length, embed) -> (batch, length, vocab)`` logits, constrained."""
    logits = _core.attend(x, self.embedding, dtype=self.dtype)
    return partition.constrain(logits, _core.LOGITS) if logits.ndim == 3 else logits


class RMSNorm(nn.Module):
  """RMS normalisation of the last dim; ``scale (embed,)``."""

  epsilon: float = 1e-6
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    p = _declare(self, norm_params(x.shape[-1]), self.param_dtype)
    return _core.rms_norm(x, p["scale"], eps=self.epsilon)


class LayerNorm(nn.Module):
  """Layer normalisation of the last dim; ``scale``, ``bias (embed,)``."""

  epsilon: float = 1e-6
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    p = _declare(self, norm_params(x.shape[-1], use_bias=True), self.param_dtype)
    return _core.layer_norm(x, p["scale"], p["bias"], eps=self.epsilon)


class Attention(nn.Module):
  """Grouped-query self-attention with rotary embeddings (``_core.attention``).

  Params: ``qkv/kernel (embed, kv_heads, heads // kv_heads + 2, head_dim)`` (queries, key
  and value of each kv group fused), with ``use_bias`` also ``qkv/bias``; ``out/kernel
  (heads, head_dim, embed)``. ``x (batch, length, embed) -> (batch, length, embed)``.
  """

  num_heads: int
  num_kv_heads: int
  head_dim: int
  use_rope: bool = True
  use_bias: bool = False
  rope_theta: float = 10_000.0
  dtype: Any = None
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array, mask: Array | None = None,
               positions: Array | None = None) -> Array:
    specs = attention_params(x.shape[-1], self.num_heads, self.num_kv_heads, self.head_dim,
                             self.use_bias)
    return _core.attention(_declare(self, specs, self.param_dtype), x, mask=mask,
                           positions=positions, use_rope=self.use_rope,
                           rope_theta=self.rope_theta, dtype=self.dtype)


class MLP(nn.Module):
  """Gated MLP: ``wi/kernel (embed, 2, mlp)`` (gate, up), ``wo/kernel (mlp, embed)``."""

  mlp_dim: int
  activation: str = "silu"
  dtype: Any = None
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    p = _declare(self, mlp_params(x.shape[-1], self.mlp_dim), self.param_dtype)
    return _core.mlp(p, x, activation=self.activation, dtype=self.dtype)


class MoE(nn.Module):
  """Top-k mixture of gated-MLP experts; returns ``(y, aux)`` (see ``layers._moe.moe``).

  Params: ``router (embed, expert)``, ``wi (expert, embed, 2, mlp)``,
  ``wo (expert, mlp, embed)``.
  """

  num_experts: int
  experts_per_token: int
  mlp_dim: int
  capacity_factor: float = 1.25
  activation: str = "silu"
  dtype: Any = None
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> tuple[Array, dict[str, Array]]:
    p = _declare(self, moe_params(x.shape[-1], self.mlp_dim, self.num_experts),
                 self.param_dtype)
    return _moe.moe(x, p["router"], p["wi"], p["wo"], k=self.experts_per_token,
                    capacity_factor=self.capacity_factor, activation=self.activation,
                    dtype=self.dtype)


class Block(nn.Module):
  """Pre-norm decoder block (``layers._model.block``): ``attn_norm``, ``attn``,
  ``mlp_norm``, ``mlp`` (or ``moe``); ``(x, mask, positions) -> (x, aux)``."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, x: Array, mask: Array | None, positions: Array | None
               ) -> tuple[Array, dict[str, Array]]:
    p = _declare(self, block_params(self.config), self.config.param_dtype)
    return _model.block(p, x, self.config, mask, positions)


class Transformer(nn.Module):
  """Decoder-only LM: ``tokens (batch, length)`` ints -> ``logits (batch, length, vocab)``.

  Params: ``embed/embedding``, the blocks (``blocks/...`` with a leading ``layers`` axis
  when ``config.scan_layers``, else ``blocks_0/...``, ``blocks_1/...``),
  ``final_norm/scale`` and, when ``config.tie_embeddings`` is False, ``lm_head/kernel``.

  Call: ``model.apply(variables, tokens, valid=None, segment_ids=None, targets=None,
  return_aux=False)``;
  ``valid`` ``(batch, length)`` bool marks real tokens (padding mask; or ``(batch,)`` ints,
  right-padded lengths); ``segment_ids`` ``(batch, length)`` ints separate packed sequences
  (``config.attention`` picks the attention implementation); ``targets`` ``(batch, length)``
  int ids return the per-token loss ``(ce, correct)`` instead of the logits (computed in
  chunks of ``config.loss_chunk`` tokens when it is > 0: no full logits, see
  ``layers._model.transformer``); ``return_aux`` also returns ``{'load_balance_loss',
  'dropped_tokens'}`` summed/averaged over layers.
  """

  config: TransformerConfig

  @nn.compact
  def __call__(self, tokens: Array, valid: Array | None = None, *,
               segment_ids: Array | None = None, targets: Array | None = None,
               return_aux: bool = False) -> Any:
    c = self.config
    check_mesh("layers.linen.Transformer")   # before the parameters are declared (and constrained)
    p = _declare(self, named_blocks(transformer_params(c)), c.param_dtype)
    out, aux = _model.transformer(listed_blocks(p, c.num_layers), tokens, c, valid,
                                  segment_ids=segment_ids, targets=targets,
                                  where="layers.linen.Transformer")
    return (out, aux) if return_aux else out


def decode_params(variables: Any, config: TransformerConfig) -> dict[str, Any]:
  """The parameter tree ``layers._decode`` reads, from a :class:`Transformer`'s variables
  (``{'params': ...}``, boxed or not) or its ``params`` alone."""
  params = partition.unbox(variables)
  params = params.get("params", params)
  return listed_blocks(dict(params), config.num_layers)


def generate(model: Transformer, variables: Any, prompts: Any,
             sampling: _decode.Sampling | None = None, **kwargs: Any) -> _decode.Generation:
  """Continues ``prompts`` (lists of token ids) with a linen :class:`Transformer`: the one
  decoding core, ``layers._decode.generate`` (``kwargs``: its ``rules``, ``mesh``,
  ``pad_id``; variables not yet on the mesh are put there as the rules shard them).

  >>> import layers, layers.linen
  >>> cfg = layers.TransformerConfig(vocab_size=32, num_layers=1)
  >>> model = layers.linen.Transformer(cfg)
  >>> variables = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
  >>> out = layers.linen.generate(model, variables, [[1, 2, 3]],
  ...                             layers.Sampling(max_new_tokens=3))
  >>> out.tokens.shape
  (1, 3)
  """
  return _decode.generate(decode_params(variables, model.config), model.config, prompts,
                          sampling, where="layers.linen.generate", **kwargs)
