"""Haiku layers with logical axes (``partition.haiku.get_parameter``) over ``layers._core``.

Use them inside ``hk.transform``; ``partition.haiku.init_sharded`` reads the declared axes
and creates every parameter in its sharding. Modules only declare their parameters (the tables
of ``layers/_params.py``) and call the framework-free math (``layers._core``; the Transformer:
``layers._model``). A scanned model declares every block parameter once with a leading
``layers`` dim (``transformer/blocks/...``); ``layers._model.apply_blocks`` scans over it.

>>> import haiku as hk, jax, jax.numpy as jnp, partition.haiku
>>> import layers, layers.haiku
>>> cfg = layers.TransformerConfig(vocab_size=64, embed_dim=16, mlp_dim=32, num_heads=2,
...                                num_kv_heads=1, head_dim=8, num_layers=2)
>>> f = hk.transform(lambda t: layers.haiku.Transformer(cfg)(t))
>>> tokens = jnp.zeros((2, 8), jnp.int32)
>>> axes = partition.haiku.eval_axes(f, jax.random.key(0), tokens)
>>> axes['transformer/blocks_0/attn/qkv']['kernel']
('embed', 'kv_heads', None, 'head_dim')
>>> f.apply(f.init(jax.random.key(0), tokens), None, tokens).shape
(2, 8, 64)
"""

from __future__ import annotations

import contextlib
import re
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp

from partition.internal import needs_extra

with needs_extra("haiku", by="layers.haiku"):
  import haiku as hk

import partition
import partition.haiku
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
_LOCAL = threading.local()   # the warnings of the outermost _declare in progress
_WARNING_REGISTRY: dict = {}


def _param(name: str, spec: ParamSpec, dtype: Any) -> Array:
  init = lambda shape, dt: spec.init(hk.next_rng_key(), shape, dt)
  module = hk.experimental.current_name()
  where = f"{module}/{name}" if module and module != "~" else f"~/{name}"
  with _one_warning_per_cause(), warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    value = partition.haiku.get_parameter(name, spec.shape, dtype, init, axes=spec.axes)
    _LOCAL.caught.extend((where, w) for w in caught)
  return value


def _declare(specs: dict[str, Any], dtype: Any) -> dict[str, Any]:
  """Creates ``specs`` (a nested dict of ``ParamSpec``) in the current module, sub-dicts as
  child modules; returns the same nesting of arrays. The parameters' warnings come out once
  per cause (:func:`_one_warning_per_cause`)."""
  with _one_warning_per_cause():
    return {name: _param(name, s, dtype) if isinstance(s, ParamSpec)
            else _Scope(s, dtype, name=name)() for name, s in specs.items()}


@contextlib.contextmanager
def _one_warning_per_cause() -> Iterator[None]:
  """Collects the warnings of the parameters declared inside (nested ``_declare`` calls
  included) and re-issues one per distinct cause when the outermost one ends.

  ``partition.haiku.get_parameter`` names the parameter in its warning (``... logical axis
  'layers' has no rule, so transformer/blocks/mlp/wo/kernel dim 0 is replicated``), so
  Python's once-per-message filter would let every parameter of a model through. Two
  warnings have the same cause when their texts agree once the parameter's path and dim are
  taken out; the first is re-issued, counting the others, as ``init_sharded`` does.
  """
  if getattr(_LOCAL, "caught", None) is not None:   # an enclosing _declare collects
    yield
    return
  _LOCAL.caught = []
  try:
    yield
  finally:
    caught, _LOCAL.caught = _LOCAL.caught, None
  _reissue(caught)   # not when the declaration raised: its error is the news


def _reissue(caught: list[tuple[str, warnings.WarningMessage]]) -> None:
  groups: dict[tuple, list[warnings.WarningMessage]] = {}
  for where, w in caught:
    text = str(w.message)
    cause = re.sub(rf"{re.escape(where)}( dim \d+)?", "<param>", text) if where in text else text
    groups.setdefault((w.category, cause), []).append(w)
  for (category, _), same in groups.items():
    first, text = same[0], str(same[0].message)
    if len(same) > 1:
      head, sep, rest = text.partition("\n")
      head = head[:-1] if head.endswith(".") else head
      text = f"{head} (and {len(same) - 1} more parameter(s) for the same reason).{sep}{rest}"
    # this module's registry, so a retrace (micro-batches, jit) repeats nothing already shown
    warnings.warn_explicit(text, category, first.filename, first.lineno,
                           registry=_WARNING_REGISTRY)


class _Scope(hk.Module):
  """A named level of a parameter tree (``attn``, ``qkv``, ``blocks_0``, ...)."""

  def __init__(self, specs: dict[str, Any], param_dtype: Any, name: str):
    super().__init__(name=name)
    self.specs, self.param_dtype = specs, param_dtype

  def __call__(self) -> dict[str, Any]:
    return _declare(self.specs, self.param_dtype)


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
    p = _declare(specs, self.param_dtype)
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
    p = _declare(norm_params(x.shape[-1]), self.param_dtype)
    return _core.rms_norm(x, p["scale"], eps=self.epsilon)


class LayerNorm(hk.Module):
  """Layer normalisation of the last dim; ``scale``, ``bias (embed,)``."""

  def __init__(self, epsilon: float = 1e-6, *, param_dtype: Any = jnp.float32,
               name: str | None = None):
    super().__init__(name=name)
    self.epsilon, self.param_dtype = epsilon, param_dtype

  def __call__(self, x: Array) -> Array:
    p = _declare(norm_params(x.shape[-1], use_bias=True), self.param_dtype)
    return _core.layer_norm(x, p["scale"], p["bias"], eps=self.epsilon)


class Attention(hk.Module):
  """Grouped-query self-attention with rotary embeddings (params as ``layers.linen``)."""

  def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, *,
               use_rope: bool = True, use_bias: bool = False, rope_theta: float = 10_000.0,
               dtype: Any = None, param_dtype: Any = jnp.float32, name: str | None = None):
    super().__init__(name=name)
    self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
    self.use_rope, self.use_bias, self.rope_theta = use_rope, use_bias, rope_theta
    self.dtype, self.param_dtype = dtype, param_dtype

  def __call__(self, x: Array, mask: Array | None = None,
               positions: Array | None = None) -> Array:
    specs = attention_params(x.shape[-1], self.num_heads, self.num_kv_heads, self.head_dim,
                             self.use_bias)
    return _core.attention(_declare(specs, self.param_dtype), x, mask=mask,
                           positions=positions, use_rope=self.use_rope,
                           rope_theta=self.rope_theta, dtype=self.dtype)


class MLP(hk.Module):
  """Gated MLP: ``wi (embed, 2, mlp)`` (gate, up) and ``wo (mlp, embed)`` kernels."""

  def __init__(self, mlp_dim: int, *, activation: str = "silu", dtype: Any = None,
               param_dtype: Any = jnp.float32, name: str | None = None):
    super().__init__(name=name)
    self.mlp_dim, self.activation = mlp_dim, activation
    self.dtype, self.param_dtype = dtype, param_dtype

  def __call__(self, x: Array) -> Array:
    p = _declare(mlp_params(x.shape[-1], self.mlp_dim), self.param_dtype)
    return _core.mlp(p, x, activation=self.activation, dtype=self.dtype)


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
    p = _declare(moe_params(x.shape[-1], self.mlp_dim, self.num_experts), self.param_dtype)
    return _moe.moe(x, p["router"], p["wi"], p["wo"], k=self.k,
                    capacity_factor=self.capacity_factor, activation=self.activation,
                    dtype=self.dtype)


class Block(hk.Module):
  """Pre-norm decoder block (``layers._model.block``); ``(x, mask, positions) -> (x, aux)``."""

  def __init__(self, config: TransformerConfig, name: str | None = None):
    super().__init__(name=name)
    self.config = config

  def __call__(self, x: Array, mask: Array | None, positions: Array | None
               ) -> tuple[Array, dict[str, Array]]:
    p = _declare(block_params(self.config), self.config.param_dtype)
    return _model.block(p, x, self.config, mask, positions)


class Transformer(hk.Module):
  """Decoder-only LM: ``tokens (batch, length)`` ints -> ``logits (batch, length, vocab)``.

  Params (default name ``transformer``): ``transformer/embed``, the blocks
  (``transformer/blocks/...`` with a leading ``layers`` dim when ``config.scan_layers``,
  else ``transformer/blocks_0/...``), ``transformer/final_norm`` and, untied,
  ``transformer/lm_head``. Call: ``(tokens, valid=None, segment_ids=None, targets=None,
  return_aux=False)`` as in ``layers.linen.Transformer``.
  """

  def __init__(self, config: TransformerConfig, name: str | None = "transformer"):
    super().__init__(name=name)
    self.config = config

  def __call__(self, tokens: Array, valid: Array | None = None, *,
               segment_ids: Array | None = None, targets: Array | None = None,
               return_aux: bool = False) -> Any:
    c = self.config
    check_mesh("layers.haiku.Transformer")   # before the parameters are declared (and constrained)
    p = _declare(named_blocks(transformer_params(c)), c.param_dtype)
    out, aux = _model.transformer(listed_blocks(p, c.num_layers), tokens, c, valid,
                                  segment_ids=segment_ids, targets=targets,
                                  where="layers.haiku.Transformer")
    return (out, aux) if return_aux else out


def decode_params(params: Any, config: TransformerConfig) -> dict[str, Any]:
  """The parameter tree ``layers._decode`` reads, from a :class:`Transformer`'s Haiku params
  (``{'transformer/blocks_0/attn/qkv': {'kernel': ...}, ...}``; any module name)."""
  tree: dict[str, Any] = {}
  for module, leaves in params.items():
    node = tree
    for part in module.split("/")[1:]:   # drop the Transformer's own name
      node = node.setdefault(part, {})
    node.update(leaves)
  return listed_blocks(tree, config.num_layers)


def generate(config: TransformerConfig, params: Any, prompts: Any,
             sampling: _decode.Sampling | None = None, **kwargs: Any) -> _decode.Generation:
  """Continues ``prompts`` (lists of token ids) with the params of a Haiku
  :class:`Transformer`: the one decoding core, ``layers._decode.generate`` (``kwargs``: its
  ``rules``, ``mesh``, ``pad_id``; params not yet on the mesh are put there as the rules
  shard them).

  >>> import layers, layers.haiku
  >>> cfg = layers.TransformerConfig(vocab_size=32, num_layers=1)
  >>> f = hk.transform(lambda t: layers.haiku.Transformer(cfg)(t))
  >>> params = f.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
  >>> layers.haiku.generate(cfg, params, [[1, 2, 3]], layers.Sampling(max_new_tokens=3)
  ...                       ).tokens.shape
  (1, 3)
  """
  return _decode.generate(decode_params(params, config), config, prompts, sampling,
                          where="layers.haiku.generate", **kwargs)
