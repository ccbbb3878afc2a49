"""Haiku layers with logical axes (``partition.haiku.get_parameter``) over ``layers._core``.

Use them inside ``hk.transform``; ``partition.haiku.init_sharded`` reads the declared axes
and creates every parameter in its sharding. Scanned stacks use ``hk.layer_stack``.

>>> import haiku as hk, jax, jax.numpy as jnp, partition.haiku
>>> import layers, layers.haiku
>>> cfg = layers.TransformerConfig(vocab_size=64, embed_dim=16, mlp_dim=32, num_heads=2,
...                                num_kv_heads=1, head_dim=8, num_layers=2)
>>> f = hk.transform(lambda t: layers.haiku.Transformer(cfg)(t))
>>> tokens = jnp.zeros((2, 8), jnp.int32)
>>> axes = partition.haiku.eval_axes(f, jax.random.key(0), tokens)
>>> axes['transformer/blocks_0/attn/query']['kernel']
('embed', 'heads', 'head_dim')
>>> f.apply(f.init(jax.random.key(0), tokens), None, tokens).shape
(2, 8, 64)
"""

from __future__ import annotations

from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp

import partition
import partition.haiku
from layers import _core, _moe
from layers._config import TransformerConfig
from layers._params import (
    ParamSpec,
    check_tokens,
    dense_params,
    embed_params,
    moe_params,
    norm_params,
)

Array = jax.Array


def _param(name: str, spec: ParamSpec, dtype: Any) -> Array:
  init = lambda shape, dt: spec.init(hk.next_rng_key(), shape, dt)
  return partition.haiku.get_parameter(name, spec.shape, dtype, init, axes=spec.axes)


def _params(specs: dict[str, ParamSpec], dtype: Any) -> dict[str, Array]:
  return {name: _param(name, spec, dtype) for name, spec in specs.items()}


class Dense(hk.Module):
  """Dense over the last ``len(in_axes)`` dims: ``(..., *in) -> (..., *features)``.

  Params: ``kernel (*in, *features)`` with axes ``in_axes + out_axes``; ``bias
  (*features)`` with ``out_axes`` when ``use_bias``.
  """

  def __init__(self, features: int | tuple[int, ...], in_axes: tuple = ("embed",),
               out_axes: tuple = ("mlp",), *, use_bias: bool = False, dtype: Any = None,
               param_dtype: Any = jnp.float32, name: str | None = None):
    super().__init__(name=name)
    self.features, self.in_axes, self.out_axes = features, tuple(in_axes), tuple(out_axes)
    self.use_bias, self.dtype, self.param_dtype = use_bias, dtype, param_dtype

  def __call__(self, x: Array) -> Array:
    n = len(self.in_axes)
    specs = dense_params(x.shape[x.ndim - n:], self.features, self.in_axes, self.out_axes,
                         self.use_bias, where=f"layers.haiku.Dense({self.module_name})")
    p = _params(specs, self.param_dtype)
    return _core.dense(x, p["kernel"], p.get("bias"), contract=n, dtype=self.dtype)


class Embed(hk.Module):
  """Token embedding ``embedding (vocab, embed)``; ``attend`` is the tied output layer."""

  def __init__(self, num_embeddings: int, features: int, *, dtype: Any = None,
               param_dtype: Any = jnp.float32, name: str | None = None):
    super().__init__(name=name)
    self.spec = embed_params(num_embeddings, features)["embedding"]
    self.dtype, self.param_dtype = dtype, param_dtype

  def _table(self) -> Array:
    return _param("embedding", self.spec, self.param_dtype)

  def __call__(self, tokens: Array) -> Array:
    x = _core.embed(tokens, self._table(), dtype=self.dtype)
    return partition.constrain(x, _core.EMBED) if x.ndim == 3 else x

  def attend(self, x: Array) -> Array:
    """``(batch, length, embed) -> (batch, length, vocab)`` logits, constrained."""
    logits = _core.attend(x, self._table(), dtype=self.dtype)
    return partition.constrain(logits, _core.LOGITS) if logits.ndim == 3 else logits


class RMSNorm(hk.Module):
  """RMS normalisation of the last dim; ``scale (embed,)``."""

  def __init__(self, epsilon: float = 1e-6, *, param_dtype: Any = jnp.float32,
               name: str | None = None):
    super().__init__(name=name)
    self.epsilon, self.param_dtype = epsilon, param_dtype

  def __call__(self, x: Array) -> Array:
    p = _params(norm_params(x.shape[-1]), self.param_dtype)
    return _core.rms_norm(x, p["scale"], eps=self.epsilon)


class LayerNorm(hk.Module):
  """Layer normalisation of the last dim; ``scale``, ``bias (embed,)``."""

  def __init__(self, epsilon: float = 1e-6, *, param_dtype: Any = jnp.float32,
               name: str | None = None):
    super().__init__(name=name)
    self.epsilon, self.param_dtype = epsilon, param_dtype

  def __call__(self, x: Array) -> Array:
    p = _params(norm_params(x.shape[-1], use_bias=True), self.param_dtype)
    return _core.layer_norm(x, p["scale"], p["bias"], eps=self.epsilon)


class Attention(hk.Module):
  """Grouped-query self-attention with rotary embeddings (params as ``layers.linen``)."""

  def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, *,
               use_rope: bool = True, dtype: Any = None, param_dtype: Any = jnp.float32,
               name: str | None = None):
    super().__init__(name=name)
    self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
    self.use_rope, self.kw = use_rope, dict(dtype=dtype, param_dtype=param_dtype)

  def __call__(self, x: Array, mask: Array | None = None,
               positions: Array | None = None) -> Array:
    heads = lambda n, axis, name: Dense((n, self.head_dim), ("embed",), (axis, "head_dim"),
                                        name=name, **self.kw)(x)
    q = heads(self.num_heads, "heads", "query")
    k = heads(self.num_kv_heads, "kv_heads", "key")
    v = heads(self.num_kv_heads, "kv_heads", "value")
    out = _core.attention_core(q, k, v, mask=mask, positions=positions,
                               use_rope=self.use_rope)
    out = Dense(x.shape[-1], ("heads", "head_dim"), ("embed",), name="out", **self.kw)(out)
    return partition.constrain(out, _core.EMBED)


class MLP(hk.Module):
  """Gated MLP: ``wi_gate``, ``wi_up (embed, mlp)``, ``wo (mlp, embed)`` kernels."""

  def __init__(self, mlp_dim: int, *, activation: str = "silu", dtype: Any = None,
               param_dtype: Any = jnp.float32, name: str | None = None):
    super().__init__(name=name)
    self.mlp_dim, self.activation = mlp_dim, activation
    self.kw = dict(dtype=dtype, param_dtype=param_dtype)

  def __call__(self, x: Array) -> Array:
    gate = Dense(self.mlp_dim, ("embed",), ("mlp",), name="wi_gate", **self.kw)(x)
    up = Dense(self.mlp_dim, ("embed",), ("mlp",), name="wi_up", **self.kw)(x)
    h = _core.glu(gate, up, activation=self.activation)
    out = Dense(x.shape[-1], ("mlp",), ("embed",), name="wo", **self.kw)(h)
    return partition.constrain(out, _core.EMBED)


class MoE(hk.Module):
  """Top-k mixture of gated-MLP experts; returns ``(y, aux)``."""

  def __init__(self, num_experts: int, experts_per_token: int, mlp_dim: int, *,
               capacity_factor: float = 1.25, activation: str = "silu", dtype: Any = None,
               param_dtype: Any = jnp.float32, name: str | None = None):
    super().__init__(name=name)
    self.num_experts, self.k, self.mlp_dim = num_experts, experts_per_token, mlp_dim
    self.capacity_factor, self.activation = capacity_factor, activation
    self.dtype, self.param_dtype = dtype, param_dtype

  def __call__(self, x: Array) -> tuple[Array, dict[str, Array]]:
    p = _params(moe_params(x.shape[-1], self.mlp_dim, self.num_experts), self.param_dtype)
    return _moe.moe(x, p["router"], p["wi_gate"], p["wi_up"], p["wo"], k=self.k,
                    capacity_factor=self.capacity_factor, activation=self.activation,
                    dtype=self.dtype)


class Block(hk.Module):
  """Pre-norm decoder block; ``(x, mask, positions) -> (x, aux)``."""

  def __init__(self, config: TransformerConfig, name: str | None = None):
    super().__init__(name=name)
    self.config = config

  def __call__(self, x: Array, mask: Array | None, positions: Array | None
               ) -> tuple[Array, dict[str, Array]]:
    c = self.config
    kw = dict(dtype=c.dtype, param_dtype=c.param_dtype)
    h = RMSNorm(param_dtype=c.param_dtype, name="attn_norm")(x)
    h = Attention(c.num_heads, c.num_kv_heads, c.head_dim, name="attn", **kw)(h, mask,
                                                                               positions)
    x = partition.constrain(x + h, _core.EMBED)
    h = RMSNorm(param_dtype=c.param_dtype, name="mlp_norm")(x)
    if c.num_experts:
      h, aux = MoE(c.num_experts, c.experts_per_token, c.mlp_dim, name="moe", **kw)(h)
    else:
      h, aux = MLP(c.mlp_dim, name="mlp", **kw)(h), _core.no_aux()
    return partition.constrain(x + h, _core.EMBED), aux


def _layer(config: TransformerConfig, mask: Array, positions: Array):
  def layer(x, name):
    return Block(config, name=name)(x, mask, positions)
  if config.remat == "none":
    return layer
  # Under scan, CSE cannot merge the recomputation with the forward pass anyway.
  return hk.remat(layer, policy=config.policy, prevent_cse=not config.scan_layers,
                  static_argnums=(1,))


def _stack(config: TransformerConfig, x: Array, mask: Array, positions: Array
           ) -> tuple[Array, Any]:
  """The blocks (a plain function, so Haiku adds no ``~method`` scope to their names)."""
  layer = _layer(config, mask, positions)
  if config.scan_layers:
    stack = hk.layer_stack(config.num_layers, with_per_layer_inputs=True, name="blocks")
    return stack(lambda x, _: layer(x, "block"))(x, jnp.arange(config.num_layers))
  auxes = []
  for i in range(config.num_layers):
    x, a = layer(x, f"blocks_{i}")
    auxes.append(a)
  return x, jax.tree.map(lambda *a: jnp.stack(a), *auxes)


class Transformer(hk.Module):
  """Decoder-only LM: ``tokens (batch, length)`` ints -> ``logits (batch, length, vocab)``.

  Params (default name ``transformer``): ``transformer/embed``, the blocks
  (``transformer/blocks/block/...`` stacked by ``hk.layer_stack`` when
  ``config.scan_layers``, else ``transformer/blocks_0/...``) and
  ``transformer/final_norm``. Call: ``(tokens, valid=None, return_aux=False)`` as in
  ``layers.linen.Transformer``.
  """

  def __init__(self, config: TransformerConfig, name: str | None = "transformer"):
    super().__init__(name=name)
    self.config = config

  def __call__(self, tokens: Array, valid: Array | None = None, *,
               return_aux: bool = False) -> Any:
    c = self.config
    check_tokens(tokens, c.max_len, "layers.haiku.Transformer")
    embed = Embed(c.vocab_size, c.embed_dim, dtype=c.dtype, param_dtype=c.param_dtype,
                  name="embed")
    x = embed(tokens)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    x, aux = _stack(c, x, _core.decoder_mask(tokens, valid), positions)
    logits = embed.attend(RMSNorm(param_dtype=c.param_dtype, name="final_norm")(x))
    return (logits, _core.merge_aux(aux)) if return_aux else logits
