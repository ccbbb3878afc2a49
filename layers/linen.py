"""Flax linen layers with logical axes (``nn.with_logical_partitioning``) over ``layers._core``.

Every parameter is declared with its logical axes (see ``layers/_params.py`` and
docs/layers.md), so ``partition.flax.init_sharded`` places it from a rules table; activations
are constrained with ``partition.constrain`` inside the core at block boundaries.

>>> import jax, jax.numpy as jnp, partition
>>> import layers, layers.linen
>>> cfg = layers.TransformerConfig(vocab_size=64, embed_dim=16, mlp_dim=32, num_heads=2,
...                                num_kv_heads=1, head_dim=8, num_layers=2, scan_layers=True)
>>> model = layers.linen.Transformer(cfg)
>>> tokens = jnp.zeros((2, 8), jnp.int32)
>>> variables = jax.eval_shape(model.init, jax.random.key(0), tokens)
>>> partition.logical_axes(variables)['params']['blocks']['attn']['query']['kernel']
('layers', 'embed', 'heads', 'head_dim')
>>> model.apply(model.init(jax.random.key(0), tokens), tokens).shape
(2, 8, 64)
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

import partition
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


def _params(module: nn.Module, specs: dict[str, ParamSpec], dtype: Any) -> dict[str, Array]:
  return {name: module.param(name, nn.with_logical_partitioning(s.init, s.axes), s.shape,
                             dtype) for name, s in specs.items()}


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
    p = _params(self, specs, self.param_dtype)
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
    p = _params(self, norm_params(x.shape[-1]), self.param_dtype)
    return _core.rms_norm(x, p["scale"], eps=self.epsilon)


class LayerNorm(nn.Module):
  """Layer normalisation of the last dim; ``scale``, ``bias (embed,)``."""

  epsilon: float = 1e-6
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    p = _params(self, norm_params(x.shape[-1], use_bias=True), self.param_dtype)
    return _core.layer_norm(x, p["scale"], p["bias"], eps=self.epsilon)


class Attention(nn.Module):
  """Grouped-query self-attention with rotary embeddings.

  Params: ``query/kernel (embed, heads, head_dim)``, ``key/kernel`` and ``value/kernel
  (embed, kv_heads, head_dim)``, ``out/kernel (heads, head_dim, embed)``.
  ``x (batch, length, embed) -> (batch, length, embed)``.
  """

  num_heads: int
  num_kv_heads: int
  head_dim: int
  use_rope: bool = True
  dtype: Any = None
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array, mask: Array | None = None,
               positions: Array | None = None) -> Array:
    kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
    heads = lambda n, axis, name: Dense((n, self.head_dim), ("embed",), (axis, "head_dim"),
                                        name=name, **kw)(x)
    q = heads(self.num_heads, "heads", "query")
    k = heads(self.num_kv_heads, "kv_heads", "key")
    v = heads(self.num_kv_heads, "kv_heads", "value")
    out = _core.attention_core(q, k, v, mask=mask, positions=positions,
                               use_rope=self.use_rope)
    out = Dense(x.shape[-1], ("heads", "head_dim"), ("embed",), name="out", **kw)(out)
    return partition.constrain(out, _core.EMBED)


class MLP(nn.Module):
  """Gated MLP: ``wi_gate/kernel``, ``wi_up/kernel (embed, mlp)``, ``wo/kernel (mlp, embed)``."""

  mlp_dim: int
  activation: str = "silu"
  dtype: Any = None
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
    gate = Dense(self.mlp_dim, ("embed",), ("mlp",), name="wi_gate", **kw)(x)
    up = Dense(self.mlp_dim, ("embed",), ("mlp",), name="wi_up", **kw)(x)
    h = _core.glu(gate, up, activation=self.activation)
    out = Dense(x.shape[-1], ("mlp",), ("embed",), name="wo", **kw)(h)
    return partition.constrain(out, _core.EMBED)


class MoE(nn.Module):
  """Top-k mixture of gated-MLP experts; returns ``(y, aux)`` (see ``layers._moe.moe``).

  Params: ``router (embed, expert)``, ``wi_gate``/``wi_up (expert, embed, mlp)``,
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
    p = _params(self, moe_params(x.shape[-1], self.mlp_dim, self.num_experts),
                self.param_dtype)
    return _moe.moe(x, p["router"], p["wi_gate"], p["wi_up"], p["wo"],
                    k=self.experts_per_token, capacity_factor=self.capacity_factor,
                    activation=self.activation, dtype=self.dtype)


class Block(nn.Module):
  """Pre-norm decoder block: ``attn_norm``, ``attn``, ``mlp_norm``, ``mlp`` (or ``moe``).

  ``(x, mask, positions) -> (x, aux)`` with ``x (batch, length, embed)`` — the signature
  ``nn.scan`` wants (carry, per-layer output).
  """

  config: TransformerConfig

  @nn.compact
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


def _block_class(config: TransformerConfig) -> type[nn.Module]:
  if config.remat == "none":
    return Block
  # Under scan, CSE cannot merge the recomputation with the forward pass anyway.
  return nn.remat(Block, policy=config.policy, prevent_cse=not config.scan_layers)


class Transformer(nn.Module):
  """Decoder-only LM: ``tokens (batch, length)`` ints -> ``logits (batch, length, vocab)``.

  Params: ``embed/embedding``, the blocks (``blocks/...`` with a leading ``layers`` axis
  when ``config.scan_layers``, else ``blocks_0/...``, ``blocks_1/...``) and
  ``final_norm/scale``. The output layer is tied to the embedding.

  Call: ``model.apply(variables, tokens, valid=None, return_aux=False)``; ``valid``
  ``(batch, length)`` bool marks real tokens (padding mask); ``return_aux`` also returns
  ``{'load_balance_loss', 'dropped_tokens'}`` summed/averaged over layers.
  """

  config: TransformerConfig

  @nn.compact
  def __call__(self, tokens: Array, valid: Array | None = None, *,
               return_aux: bool = False) -> Any:
    c = self.config
    check_tokens(tokens, c.max_len, "layers.linen.Transformer")
    embed = Embed(c.vocab_size, c.embed_dim, dtype=c.dtype, param_dtype=c.param_dtype,
                  name="embed")
    x = embed(tokens)
    mask = _core.decoder_mask(tokens, valid)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    block = _block_class(c)
    if c.scan_layers:
      stack = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                      in_axes=(nn.broadcast, nn.broadcast), length=c.num_layers,
                      metadata_params={nn.PARTITION_NAME: "layers"})
      x, aux = stack(c, name="blocks")(x, mask, positions)
    else:
      auxes = []
      for i in range(c.num_layers):
        x, a = block(c, name=f"blocks_{i}")(x, mask, positions)
        auxes.append(a)
      aux = jax.tree.map(lambda *a: jnp.stack(a), *auxes)
    logits = embed.attend(RMSNorm(param_dtype=c.param_dtype, name="final_norm")(x))
    return (logits, _core.merge_aux(aux)) if return_aux else logits
