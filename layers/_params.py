"""Parameter tables: name, shape, logical axes and initializer of every layer's params.

The three framework wrappers create exactly these parameters (so shapes, axes and
initializer *distributions* agree across frameworks) and differ only in how they declare
them: linen ``nn.with_logical_partitioning``, NNX ``out_sharding`` metadata, Haiku
``partition.haiku.get_parameter(..., axes=)``.

>>> spec = dense_params((16,), (4, 8), ('embed',), ('heads', 'head_dim'))['kernel']
>>> spec.shape, spec.axes
((16, 4, 8), ('embed', 'heads', 'head_dim'))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax

from partition import PartitionError
from partition import format_message

init = jax.nn.initializers


class ParamSpec(NamedTuple):
  """One parameter: ``shape``, logical ``axes`` (one per dim), ``init(key, shape, dtype)``."""

  shape: tuple[int, ...]
  axes: tuple[str | None, ...]
  init: Callable


class LayerArgumentError(PartitionError, ValueError):
  """A layer was given inconsistent arguments (axes that do not match its shapes)."""


def _fan_in(contract: int, ndim: int, batch: tuple[int, ...] = ()) -> Callable:
  inputs = tuple(range(len(batch), len(batch) + contract))
  outputs = tuple(range(len(batch) + contract, ndim))
  return init.lecun_normal(in_axis=inputs, out_axis=outputs, batch_axis=batch)


def _as_tuple(features: int | Sequence[int]) -> tuple[int, ...]:
  return (features,) if isinstance(features, int) else tuple(features)


def dense_params(in_shape: Sequence[int], features: int | Sequence[int],
                 in_axes: Sequence[str | None], out_axes: Sequence[str | None],
                 use_bias: bool = False, *, where: str = "Dense") -> dict[str, ParamSpec]:
  """``kernel (*in_shape, *features)`` and optionally ``bias (*features)``."""
  features, in_shape = _as_tuple(features), tuple(in_shape)
  problems = []
  if len(in_axes) != len(in_shape):
    problems.append(f"in_axes={tuple(in_axes)} names {len(in_axes)} dims but the input's "
                    f"contracted dims are {in_shape}")
  if len(out_axes) != len(features):
    problems.append(f"out_axes={tuple(out_axes)} names {len(out_axes)} dims but "
                    f"features={features}")
  if problems:
    raise LayerArgumentError(format_message(
        f"{where}: logical axes do not match the kernel.", bullets=problems,
        fix="Give one logical name (or None) per contracted input dim (in_axes) and per "
            "feature dim (out_axes)."))
  shape = in_shape + features
  out = {"kernel": ParamSpec(shape, (*in_axes, *out_axes), _fan_in(len(in_shape), len(shape)))}
  if use_bias:
    out["bias"] = ParamSpec(features, tuple(out_axes), init.zeros)
  return out


def embed_params(vocab_size: int, embed_dim: int) -> dict[str, ParamSpec]:
  """``embedding (vocab, embed)``, std ``1/sqrt(embed)`` so tied logits start O(1)."""
  return {"embedding": ParamSpec((vocab_size, embed_dim), ("vocab", "embed"),
                                 init.variance_scaling(1.0, "fan_in", "normal",
                                                       in_axis=1, out_axis=0))}


def norm_params(dim: int, use_bias: bool = False) -> dict[str, ParamSpec]:
  """``scale (embed,)`` (ones) and, for LayerNorm, ``bias (embed,)`` (zeros)."""
  out = {"scale": ParamSpec((dim,), ("embed",), init.ones)}
  if use_bias:
    out["bias"] = ParamSpec((dim,), ("embed",), init.zeros)
  return out


def moe_params(embed_dim: int, mlp_dim: int, num_experts: int) -> dict[str, ParamSpec]:
  """``router (embed, expert)``; experts ``wi_gate``/``wi_up (expert, embed, mlp)``,
  ``wo (expert, mlp, embed)``."""
  e, m, n = embed_dim, mlp_dim, num_experts
  return {
      "router": ParamSpec((e, n), ("embed", "expert"), _fan_in(1, 2)),
      "wi_gate": ParamSpec((n, e, m), ("expert", "embed", "mlp"), _fan_in(1, 3, (0,))),
      "wi_up": ParamSpec((n, e, m), ("expert", "embed", "mlp"), _fan_in(1, 3, (0,))),
      "wo": ParamSpec((n, m, e), ("expert", "mlp", "embed"), _fan_in(1, 3, (0,))),
  }


def check_tokens(tokens: jax.Array, max_len: int, where: str) -> None:
  """Raises ``LayerArgumentError`` unless ``tokens`` is ``(batch, length <= max_len)`` ints."""
  problems = []
  if getattr(tokens, "ndim", None) != 2:
    problems.append(f"tokens has shape {getattr(tokens, 'shape', None)}; expected "
                    "(batch, length)")
  elif tokens.shape[1] > max_len:
    problems.append(f"tokens has length {tokens.shape[1]} > config.max_len={max_len}")
  if not jax.numpy.issubdtype(getattr(tokens, "dtype", float), jax.numpy.integer):
    problems.append(f"tokens has dtype {getattr(tokens, 'dtype', type(tokens))}; expected "
                    "integer token ids")
  if problems:
    raise LayerArgumentError(format_message(
        f"{where}: bad tokens.", bullets=problems,
        fix="Pass int token ids of shape (batch, length) with length <= max_len (raise "
            "max_len in the TransformerConfig for longer sequences)."))
