"""Flax NNX layers with logical axes (``out_sharding`` metadata) over ``layers._core``.

Each ``nnx.Param`` carries ``out_sharding=<logical axes>``; ``partition.nnx.init_sharded``
resolves them through a rules table. Modules only declare their parameters (the tables of
``layers/_params.py``) and call the framework-free math (``layers._core``; the Transformer:
``layers._model``). A scanned model declares every block parameter once with a leading
``layers`` dim; ``layers._model.apply_blocks`` scans over it.

>>> import jax, jax.numpy as jnp, partition
>>> from flax import nnx
>>> import layers, layers.nnx
>>> cfg = layers.TransformerConfig(vocab_size=64, embed_dim=16, mlp_dim=32, num_heads=2,
...                                num_kv_heads=1, head_dim=8, num_layers=2, scan_layers=True)
>>> model = layers.nnx.Transformer(cfg, rngs=nnx.Rngs(0))
>>> model.blocks.attn.qkv.kernel.get_metadata()['out_sharding']
('layers', 'embed', 'kv_heads', None, 'head_dim')
>>> model(jnp.zeros((2, 8), jnp.int32)).shape
(2, 8, 64)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from partition.internal import needs_extra

with needs_extra("flax", by="layers.nnx"):
  from flax import nnx

import partition
from layers import _core, _decode, _model, _moe
from layers._config import TransformerConfig
from layers._params import (
    ParamSpec,
    attention_params,
    block_params,
    dense_params,
    embed_params,
    mlp_params,
    moe_params,
    norm_params,
    transformer_params,
)

Array = jax.Array


def _param(spec: ParamSpec, dtype: Any, rngs: nnx.Rngs) -> nnx.Param:
  # No eager sharding: it would resolve the names through flax's rules (and fail without a
  # mesh). Placement comes from partition.nnx.init_sharded and an AxisRules table.
  return nnx.Param(spec.init(rngs.params(), spec.shape, dtype), out_sharding=spec.axes,
                   eager_sharding=False)


def _shape(features: int | tuple[int, ...]) -> tuple[int, ...]:
  return (features,) if isinstance(features, int) else tuple(features)


class Params(nnx.Module):
  """A nested dict of ``ParamSpec`` as attributes: ``nnx.Param``s, sub-dicts as ``Params``,
  lists (unrolled blocks) as ``nnx.List``; :meth:`values` reads the arrays back."""

  def __init__(self, specs: dict[str, Any], param_dtype: Any, rngs: nnx.Rngs):
    self._names = tuple(specs)
    for name, s in specs.items():
      if isinstance(s, ParamSpec):
        setattr(self, name, _param(s, param_dtype, rngs))
      elif isinstance(s, list):
        setattr(self, name, nnx.List([Params(b, param_dtype, rngs) for b in s]))
      else:
        setattr(self, name, Params(s, param_dtype, rngs))

  def values(self) -> dict[str, Any]:
    def value(x):
      if isinstance(x, nnx.Param):
        return x[...]
      return [b.values() for b in x] if isinstance(x, nnx.List) else x.values()
    return {name: value(getattr(self, name)) for name in self._names}


class Dense(Params):
  """Dense over the last ``len(in_axes)`` dims: ``(..., *in_features) -> (..., *features)``.

  Params: ``kernel (*in_features, *features)`` with axes ``in_axes + out_axes``; ``bias
  (*features)`` with ``out_axes`` when ``use_bias``.
  """

  def __init__(self, in_features: int | tuple[int, ...], features: int | tuple[int, ...],
               in_axes: tuple = ("embed",), out_axes: tuple = ("mlp",), *,
               use_bias: bool = False, dtype: Any = None, param_dtype: Any = jnp.float32,
               rngs: nnx.Rngs):
    super().__init__(dense_params(_shape(in_features), features, in_axes, out_axes, use_bias,
                                  where="layers.nnx.Dense"), param_dtype, rngs)
    self.contract, self.dtype = len(_shape(in_features)), dtype

  def __call__(self, x: Array) -> Array:
    p = self.values()
    return _core.dense(x, p["kernel"], p.get("bias"), contract=self.contract, dtype=self.dtype)


class Embed(Params):
  """Token embedding ``embedding (vocab, embed)``; ``attend`` is the tied output layer."""

  def __init__(self, num_embeddings: int, features: int, *, dtype: Any = None,
               param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
    super().__init__(embed_params(num_embeddings, features), param_dtype, rngs)
    self.dtype = dtype

  def __call__(self, tokens: Array) -> Array:
    x = _core.embed(tokens, self.embedding[...], dtype=self.dtype)
    return partition.constrain(x, _core.EMBED) if x.ndim == 3 else x

  def attend(self, x: Array) -> Array:
    """``(batch, length, embed) -> (batch, length, vocab)`` logits, constrained."""
    logits = _core.attend(x, self.embedding[...], dtype=self.dtype)
    return partition.constrain(logits, _core.LOGITS) if logits.ndim == 3 else logits


class RMSNorm(Params):
  """RMS normalisation of the last dim; ``scale (embed,)``."""

  def __init__(self, num_features: int, *, epsilon: float = 1e-6,
               param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
    super().__init__(norm_params(num_features), param_dtype, rngs)
    self.epsilon = epsilon

  def __call__(self, x: Array) -> Array:
    return _core.rms_norm(x, self.scale[...], eps=self.epsilon)


class LayerNorm(Params):
  """Layer normalisation of the last dim; ``scale``, ``bias (embed,)``."""

  def __init__(self, num_features: int, *, epsilon: float = 1e-6,
               param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
    super().__init__(norm_params(num_features, use_bias=True), param_dtype, rngs)
    self.epsilon = epsilon

  def __call__(self, x: Array) -> Array:
    return _core.layer_norm(x, self.scale[...], self.bias[...], eps=self.epsilon)


class Attention(Params):
  """Grouped-query self-attention with rotary embeddings (params as ``layers.linen``)."""

  def __init__(self, embed_dim: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
               use_rope: bool = True, use_bias: bool = False, rope_theta: float = 10_000.0,
               dtype: Any = None, param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
    super().__init__(attention_params(embed_dim, num_heads, num_kv_heads, head_dim, use_bias),
                     param_dtype, rngs)
    self.use_rope, self.rope_theta, self.dtype = use_rope, rope_theta, dtype

  def __call__(self, x: Array, mask: Array | None = None,
               positions: Array | None = None) -> Array:
    return _core.attention(self.values(), x, mask=mask, positions=positions,
                           use_rope=self.use_rope, rope_theta=self.rope_theta,
                           dtype=self.dtype)


class MLP(Params):
  """Gated MLP: ``wi (embed, 2, mlp)`` (gate, up) and ``wo (mlp, embed)`` kernels."""

  def __init__(self, embed_dim: int, mlp_dim: int, *, activation: str = "silu",
               dtype: Any = None, param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
    super().__init__(mlp_params(embed_dim, mlp_dim), param_dtype, rngs)
    self.activation, self.dtype = activation, dtype

  def __call__(self, x: Array) -> Array:
    return _core.mlp(self.values(), x, activation=self.activation, dtype=self.dtype)


class MoE(Params):
  """Top-k mixture of gated-MLP experts; ``__call__`` returns ``(y, aux)``."""

  def __init__(self, embed_dim: int, num_experts: int, experts_per_token: int, mlp_dim: int,
               *, capacity_factor: float = 1.25, activation: str = "silu", dtype: Any = None,
               param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
    super().__init__(moe_params(embed_dim, mlp_dim, num_experts), param_dtype, rngs)
    self.k, self.capacity_factor = experts_per_token, capacity_factor
    self.activation, self.dtype = activation, dtype

  def __call__(self, x: Array) -> tuple[Array, dict[str, Array]]:
    return _moe.moe(x, self.router[...], self.wi[...], self.wo[...], k=self.k,
                    capacity_factor=self.capacity_factor, activation=self.activation,
                    dtype=self.dtype)


class Block(Params):
  """Pre-norm decoder block (``layers._model.block``); ``(x, mask, positions) -> (x, aux)``."""

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    super().__init__(block_params(config), config.param_dtype, rngs)
    self.config = config

  def __call__(self, x: Array, mask: Array | None, positions: Array | None
               ) -> tuple[Array, dict[str, Array]]:
    return _model.block(self.values(), x, self.config, mask, positions)


class Transformer(Params):
  """Decoder-only LM: ``tokens (batch, length)`` ints -> ``logits (batch, length, vocab)``.

  Attributes: ``embed``, ``blocks`` (stacked params with a leading ``layers`` dim when
  ``config.scan_layers``, else an ``nnx.List`` of per-block params), ``final_norm`` and,
  untied, ``lm_head``. Call: ``model(tokens, valid=None, segment_ids=None, targets=None,
  return_aux=False)`` (see ``layers.linen.Transformer``).
  """

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    super().__init__(transformer_params(config), config.param_dtype, rngs)
    self.config = config

  def __call__(self, tokens: Array, valid: Array | None = None, *,
               segment_ids: Array | None = None, targets: Array | None = None,
               return_aux: bool = False) -> Any:
    out, aux = _model.transformer(self.values(), tokens, self.config, valid,
                                  segment_ids=segment_ids, targets=targets,
                                  where="layers.nnx.Transformer")
    return (out, aux) if return_aux else out


def decode_params(model: Any, config: TransformerConfig) -> dict[str, Any]:
  """The parameter tree ``layers._decode`` reads, from a :class:`Transformer` or its pure
  dict of params (``nnx.to_pure_dict``: unrolled blocks keyed ``0, 1, ...``)."""
  if isinstance(model, Transformer):
    return model.values()
  params = dict(model)
  if not config.scan_layers:
    blocks = params["blocks"]   # int keys, or str keys after a checkpoint round trip
    params["blocks"] = [blocks[i] if i in blocks else blocks[str(i)]
                        for i in range(config.num_layers)]
  return params


def generate(model: Transformer, prompts: Any, sampling: _decode.Sampling | None = None,
             **kwargs: Any) -> _decode.Generation:
  """Continues ``prompts`` (lists of token ids) with an NNX :class:`Transformer`: the one
  decoding core, ``layers._decode.generate`` (``kwargs``: its ``rules``, ``mesh``,
  ``pad_id``; params not yet on the mesh are put there as the rules shard them).

  >>> import layers, layers.nnx
  >>> model = layers.nnx.Transformer(layers.TransformerConfig(vocab_size=32, num_layers=1),
  ...                                rngs=nnx.Rngs(0))
  >>> layers.nnx.generate(model, [[1, 2, 3]], layers.Sampling(max_new_tokens=3)).tokens.shape
  (1, 3)
  """
  if not isinstance(model, Transformer):
    raise _decode.GenerateError(
        f"layers.nnx.generate: model is a {type(model).__name__}, not a layers.nnx.Transformer."
        " Call it as layers.nnx.generate(model, prompts, sampling).")
  return _decode.generate(model.values(), model.config, prompts, sampling,
                          where="layers.nnx.generate", **kwargs)
