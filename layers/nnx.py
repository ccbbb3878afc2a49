"""Flax NNX layers with logical axes (``out_sharding`` metadata) over ``layers._core``.

Each ``nnx.Param`` carries ``out_sharding=<logical axes>``; ``partition.nnx.init_sharded``
resolves them through a rules table. Scanned stacks are built with ``nnx.vmap`` (which
prepends ``'layers'`` to every ``out_sharding`` through ``transform_metadata``) and run
with ``nnx.scan``.

>>> import jax, jax.numpy as jnp, partition
>>> from flax import nnx
>>> import layers, layers.nnx
>>> cfg = layers.TransformerConfig(vocab_size=64, embed_dim=16, mlp_dim=32, num_heads=2,
...                                num_kv_heads=1, head_dim=8, num_layers=2, scan_layers=True)
>>> model = layers.nnx.Transformer(cfg, rngs=nnx.Rngs(0))
>>> model.blocks.attn.query.kernel.get_metadata()['out_sharding']
('layers', 'embed', 'heads', 'head_dim')
>>> model(jnp.zeros((2, 8), jnp.int32)).shape
(2, 8, 64)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

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


def _param(spec: ParamSpec, dtype: Any, rngs: nnx.Rngs) -> nnx.Param:
  # No eager sharding: it would resolve the names through flax's rules (and fail without a
  # mesh). Placement comes from partition.nnx.init_sharded and an AxisRules table.
  return nnx.Param(spec.init(rngs.params(), spec.shape, dtype), out_sharding=spec.axes,
                   eager_sharding=False)


def _shape(features: int | tuple[int, ...]) -> tuple[int, ...]:
  return (features,) if isinstance(features, int) else tuple(features)


class Dense(nnx.Module):
  """Dense over the last ``len(in_axes)`` dims: ``(..., *in_features) -> (..., *features)``.

  Params: ``kernel (*in_features, *features)`` with axes ``in_axes + out_axes``; ``bias
  (*features)`` with ``out_axes`` when ``use_bias`` (else ``bias`` is ``None``).
  """

  def __init__(self, in_features: int | tuple[int, ...], features: int | tuple[int, ...],
               in_axes: tuple = ("embed",), out_axes: tuple = ("mlp",), *,
               use_bias: bool = False, dtype: Any = None, param_dtype: Any = jnp.float32,
               rngs: nnx.Rngs):
    specs = dense_params(_shape(in_features), features, in_axes, out_axes, use_bias,
                         where="layers.nnx.Dense")
    self.contract, self.dtype = len(_shape(in_features)), dtype
    self.kernel = _param(specs["kernel"], param_dtype, rngs)
    self.bias = _param(specs["bias"], param_dtype, rngs) if use_bias else None

  def __call__(self, x: Array) -> Array:
    bias = None if self.bias is None else self.bias[...]
    return _core.dense(x, self.kernel[...], bias, contract=self.contract, dtype=self.dtype)


class Embed(nnx.Module):
  """Token embedding ``embedding (vocab, embed)``; ``attend`` is the tied output layer."""

  def __init__(self, num_embeddings: int, features: int, *, dtype: Any = None,
               param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
    self.dtype = dtype
    self.embedding = _param(embed_params(num_embeddings, features)["embedding"], param_dtype,
                            rngs)

  def __call__(self, tokens: Array) -> Array:
    x = _core.embed(tokens, self.embedding[...], dtype=self.dtype)
    return partition.constrain(x, _core.EMBED) if x.ndim == 3 else x

  def attend(self, x: Array) -> Array:
    """``(batch, length, embed) -> (batch, length, vocab)`` logits, constrained."""
    logits = _core.attend(x, self.embedding[...], dtype=self.dtype)
    return partition.constrain(logits, _core.LOGITS) if logits.ndim == 3 else logits


class RMSNorm(nnx.Module):
  """RMS normalisation of the last dim; ``scale (embed,)``."""

  def __init__(self, num_features: int, *, epsilon: float = 1e-6,
               param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
    self.epsilon = epsilon
    self.scale = _param(norm_params(num_features)["scale"], param_dtype, rngs)

  def __call__(self, x: Array) -> Array:
    return _core.rms_norm(x, self.scale[...], eps=self.epsilon)


class LayerNorm(nnx.Module):
  """Layer normalisation of the last dim; ``scale``, ``bias (embed,)``."""

  def __init__(self, num_features: int, *, epsilon: float = 1e-6,
               param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
    specs = norm_params(num_features, use_bias=True)
    self.epsilon = epsilon
    self.scale = _param(specs["scale"], param_dtype, rngs)
    self.bias = _param(specs["bias"], param_dtype, rngs)

  def __call__(self, x: Array) -> Array:
    return _core.layer_norm(x, self.scale[...], self.bias[...], eps=self.epsilon)


class Attention(nnx.Module):
  """Grouped-query self-attention with rotary embeddings (params as ``layers.linen``)."""

  def __init__(self, embed_dim: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
               use_rope: bool = True, dtype: Any = None, param_dtype: Any = jnp.float32,
               rngs: nnx.Rngs):
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    heads = lambda n, axis: Dense(embed_dim, (n, head_dim), ("embed",), (axis, "head_dim"),
                                  **kw)
    self.use_rope = use_rope
    self.query = heads(num_heads, "heads")
    self.key = heads(num_kv_heads, "kv_heads")
    self.value = heads(num_kv_heads, "kv_heads")
    self.out = Dense((num_heads, head_dim), embed_dim, ("heads", "head_dim"), ("embed",),
                     **kw)

  def __call__(self, x: Array, mask: Array | None = None,
               positions: Array | None = None) -> Array:
    out = _core.attention_core(self.query(x), self.key(x), self.value(x), mask=mask,
                               positions=positions, use_rope=self.use_rope)
    return partition.constrain(self.out(out), _core.EMBED)


class MLP(nnx.Module):
  """Gated MLP: ``wi_gate``, ``wi_up (embed, mlp)``, ``wo (mlp, embed)`` kernels."""

  def __init__(self, embed_dim: int, mlp_dim: int, *, activation: str = "silu",
               dtype: Any = None, param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.activation = activation
    self.wi_gate = Dense(embed_dim, mlp_dim, ("embed",), ("mlp",), **kw)
    self.wi_up = Dense(embed_dim, mlp_dim, ("embed",), ("mlp",), **kw)
    self.wo = Dense(mlp_dim, embed_dim, ("mlp",), ("embed",), **kw)

  def __call__(self, x: Array) -> Array:
    h = _core.glu(self.wi_gate(x), self.wi_up(x), activation=self.activation)
    return partition.constrain(self.wo(h), _core.EMBED)


class MoE(nnx.Module):
  """Top-k mixture of gated-MLP experts; ``__call__`` returns ``(y, aux)``."""

  def __init__(self, embed_dim: int, num_experts: int, experts_per_token: int, mlp_dim: int,
               *, capacity_factor: float = 1.25, activation: str = "silu", dtype: Any = None,
               param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
    self.k, self.capacity_factor = experts_per_token, capacity_factor
    self.activation, self.dtype = activation, dtype
    specs = moe_params(embed_dim, mlp_dim, num_experts)
    self.router = _param(specs["router"], param_dtype, rngs)
    self.wi_gate = _param(specs["wi_gate"], param_dtype, rngs)
    self.wi_up = _param(specs["wi_up"], param_dtype, rngs)
    self.wo = _param(specs["wo"], param_dtype, rngs)

  def __call__(self, x: Array) -> tuple[Array, dict[str, Array]]:
    return _moe.moe(x, self.router[...], self.wi_gate[...], self.wi_up[...], self.wo[...],
                    k=self.k, capacity_factor=self.capacity_factor,
                    activation=self.activation, dtype=self.dtype)


class Block(nnx.Module):
  """Pre-norm decoder block; ``(x, mask, positions) -> (x, aux)``."""

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    c = config
    kw = dict(dtype=c.dtype, param_dtype=c.param_dtype, rngs=rngs)
    self.attn_norm = RMSNorm(c.embed_dim, param_dtype=c.param_dtype, rngs=rngs)
    self.attn = Attention(c.embed_dim, c.num_heads, c.num_kv_heads, c.head_dim, **kw)
    self.mlp_norm = RMSNorm(c.embed_dim, param_dtype=c.param_dtype, rngs=rngs)
    if c.num_experts:
      self.moe = MoE(c.embed_dim, c.num_experts, c.experts_per_token, c.mlp_dim, **kw)
    else:
      self.mlp = MLP(c.embed_dim, c.mlp_dim, **kw)

  def __call__(self, x: Array, mask: Array | None, positions: Array | None
               ) -> tuple[Array, dict[str, Array]]:
    x = partition.constrain(x + self.attn(self.attn_norm(x), mask, positions), _core.EMBED)
    h = self.mlp_norm(x)
    h, aux = self.moe(h) if hasattr(self, "moe") else (self.mlp(h), _core.no_aux())
    return partition.constrain(x + h, _core.EMBED), aux


def _stacked_blocks(config: TransformerConfig, rngs: nnx.Rngs) -> Block:
  """``num_layers`` blocks as one Block whose params have a leading ``layers`` axis."""
  @nnx.split_rngs(splits=config.num_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
  def make(rngs: nnx.Rngs) -> Block:
    return Block(config, rngs=rngs)
  return make(rngs)


def _run_block(config: TransformerConfig):
  def run(block, x, mask, positions):
    return block(x, mask, positions)
  if config.remat == "none":
    return run
  return nnx.remat(run, policy=config.policy, prevent_cse=not config.scan_layers)


class Transformer(nnx.Module):
  """Decoder-only LM: ``tokens (batch, length)`` ints -> ``logits (batch, length, vocab)``.

  Attributes: ``embed``, ``blocks`` (one stacked ``Block`` when ``config.scan_layers``,
  else an ``nnx.List`` of blocks) and ``final_norm``; the output layer is tied to
  ``embed``. Call: ``model(tokens, valid=None, return_aux=False)`` (see
  ``layers.linen.Transformer``).
  """

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    c = self.config = config
    self.embed = Embed(c.vocab_size, c.embed_dim, dtype=c.dtype, param_dtype=c.param_dtype,
                       rngs=rngs)
    if c.scan_layers:
      self.blocks = _stacked_blocks(c, rngs)
    else:
      self.blocks = nnx.List([Block(c, rngs=rngs) for _ in range(c.num_layers)])
    self.final_norm = RMSNorm(c.embed_dim, param_dtype=c.param_dtype, rngs=rngs)

  def _stack(self, x: Array, mask: Array, positions: Array) -> tuple[Array, Any]:
    run = _run_block(self.config)
    if self.config.scan_layers:
      scan = nnx.scan(run, in_axes=(0, nnx.Carry, None, None), out_axes=(nnx.Carry, 0),
                      transform_metadata={nnx.PARTITION_NAME: "layers"})
      return scan(self.blocks, x, mask, positions)
    auxes = []
    for block in self.blocks:
      x, a = run(block, x, mask, positions)
      auxes.append(a)
    return x, jax.tree.map(lambda *a: jnp.stack(a), *auxes)

  def __call__(self, tokens: Array, valid: Array | None = None, *,
               return_aux: bool = False) -> Any:
    check_tokens(tokens, self.config.max_len, "layers.nnx.Transformer")
    x = self.embed(tokens)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    x, aux = self._stack(x, _core.decoder_mask(tokens, valid), positions)
    logits = self.embed.attend(self.final_norm(x))
    return (logits, _core.merge_aux(aux)) if return_aux else logits
