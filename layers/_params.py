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
from typing import Any, NamedTuple

import jax

from partition import PartitionError
from partition.internal import format_message

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


def attention_params(embed_dim: int, num_heads: int, num_kv_heads: int, head_dim: int,
                     use_bias: bool = False, qk_norm: bool = False
                     ) -> dict[str, dict[str, ParamSpec]]:
  """``qkv``: one fused kernel ``(embed, kv_heads, q_per_kv + 2, head_dim)`` (axes
  ``('embed', 'kv_heads', None, 'head_dim')``; see ``_core.attention``) and, with
  ``use_bias``, ``bias (kv_heads, q_per_kv + 2, head_dim)``; ``out (heads, head_dim, embed)``;
  with ``qk_norm``, ``query_norm`` and ``key_norm`` scales ``(head_dim,)`` (ones).

  >>> attention_params(16, 4, 2, 8)['qkv']['kernel'].shape
  (16, 2, 4, 8)
  >>> attention_params(16, 4, 2, 8, qk_norm=True)['key_norm']['scale'].axes
  ('head_dim',)
  """
  per_kv = num_heads // num_kv_heads
  out = {"qkv": dense_params((embed_dim,), (num_kv_heads, per_kv + 2, head_dim), ("embed",),
                             ("kv_heads", None, "head_dim"), use_bias, where="Attention"),
         "out": dense_params((num_heads, head_dim), embed_dim, ("heads", "head_dim"),
                             ("embed",), where="Attention")}
  if qk_norm:
    for name in ("query_norm", "key_norm"):
      out[name] = {"scale": ParamSpec((head_dim,), ("head_dim",), init.ones)}
  return out


def mlp_params(embed_dim: int, mlp_dim: int) -> dict[str, dict[str, ParamSpec]]:
  """``wi``: the fused gate and up kernels ``(embed, 2, mlp)``; ``wo (mlp, embed)``."""
  return {"wi": dense_params((embed_dim,), (2, mlp_dim), ("embed",), (None, "mlp")),
          "wo": dense_params((mlp_dim,), embed_dim, ("mlp",), ("embed",))}


def moe_params(embed_dim: int, mlp_dim: int, num_experts: int) -> dict[str, ParamSpec]:
  """``router (embed, expert)``; experts ``wi (expert, embed, 2, mlp)`` (gate and up fused),
  ``wo (expert, mlp, embed)``."""
  e, m, n = embed_dim, mlp_dim, num_experts
  return {
      "router": ParamSpec((e, n), ("embed", "expert"), _fan_in(1, 2)),
      "wi": ParamSpec((n, e, 2, m), ("expert", "embed", None, "mlp"), _fan_in(1, 4, (0,))),
      "wo": ParamSpec((n, m, e), ("expert", "mlp", "embed"), _fan_in(1, 3, (0,))),
  }


def block_params(cfg: Any) -> dict[str, Any]:
  """One pre-norm block of a ``TransformerConfig``: ``attn_norm``, ``attn``, ``mlp_norm``
  and ``mlp`` (or ``moe``)."""
  out = {"attn_norm": norm_params(cfg.embed_dim),
         "attn": attention_params(cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                  cfg.qkv_bias, cfg.qk_norm),
         "mlp_norm": norm_params(cfg.embed_dim)}
  if cfg.num_experts:
    out["moe"] = moe_params(cfg.embed_dim, cfg.mlp_dim, cfg.num_experts)
  else:
    out["mlp"] = mlp_params(cfg.embed_dim, cfg.mlp_dim)
  return out


def _stacked(spec: ParamSpec, layers: int) -> ParamSpec:
  """``spec`` with a leading ``layers`` dim, each layer initialised as ``spec`` would be."""
  def init_stack(key, shape, dtype):
    return jax.vmap(lambda k: spec.init(k, shape[1:], dtype))(jax.random.split(key, shape[0]))
  return ParamSpec((layers, *spec.shape), ("layers", *spec.axes), init_stack)


# Params the blocks compute with in the model's dtype (the projections' kernels and biases,
# the experts' weights); the norm scales and the router are read in fp32.
COMPUTE_DTYPE_PARAMS = ("kernel", "bias", "wi", "wo")


def gathered_in_compute_dtype(path: str, *, tied: bool = True) -> bool:
  """Whether the model casts the parameter at ``path`` (``'blocks/mlp/wi/kernel'``) to
  ``config.dtype`` before its FSDP all-gather (``layers._core.fsdp_gather``): the
  :data:`COMPUTE_DTYPE_PARAMS` and a tied table; an untied table is looked up, not gathered.

  >>> [gathered_in_compute_dtype(p) for p in ('blocks/attn/qkv/kernel', 'blocks/moe/router')]
  [True, False]
  """
  return path.rsplit("/", 1)[-1] in COMPUTE_DTYPE_PARAMS or (
      tied and path.endswith("embed/embedding"))


def spec_axes(specs: Any) -> Any:
  """The logical axes of a tree of :class:`ParamSpec`, one tuple per parameter."""
  return jax.tree.map(lambda s: s.axes, specs, is_leaf=lambda s: isinstance(s, ParamSpec))


def transformer_params(cfg: Any) -> dict[str, Any]:
  """The whole model: ``embed``, ``blocks``, ``final_norm`` and, untied, ``lm_head``.

  ``blocks`` is one tree of stacked params (leading ``layers`` dim) when ``cfg.scan_layers``,
  else a list of ``num_layers`` per-layer trees (the wrappers name them ``blocks_0``, ... or,
  in NNX, ``blocks/0``, ...).

  >>> import layers
  >>> specs = transformer_params(layers.TransformerConfig(scan_layers=True, num_layers=3))
  >>> specs['blocks']['attn']['qkv']['kernel'].axes
  ('layers', 'embed', 'kv_heads', None, 'head_dim')
  """
  block = block_params(cfg)
  if cfg.scan_layers:
    blocks = jax.tree.map(lambda s: _stacked(s, cfg.num_layers), block,
                          is_leaf=lambda s: isinstance(s, ParamSpec))
  else:
    blocks = [block] * cfg.num_layers
  out = {"embed": embed_params(cfg.vocab_size, cfg.embed_dim), "blocks": blocks,
         "final_norm": norm_params(cfg.embed_dim)}
  if not cfg.tie_embeddings:
    out["lm_head"] = dense_params((cfg.embed_dim,), cfg.vocab_size, ("embed",), ("vocab",))
  return out


def named_blocks(specs: dict[str, Any]) -> dict[str, Any]:
  """Unrolled ``blocks`` list -> ``blocks_0``, ``blocks_1``, ... entries (linen, Haiku)."""
  if not isinstance(specs.get("blocks"), list):
    return specs
  rest = {k: v for k, v in specs.items() if k != "blocks"}
  return {**rest, **{f"blocks_{i}": b for i, b in enumerate(specs["blocks"])}}


def listed_blocks(params: dict[str, Any], num_layers: int) -> dict[str, Any]:
  """Inverse of :func:`named_blocks` on the created arrays."""
  names = [f"blocks_{i}" for i in range(num_layers)]
  if "blocks" in params or not all(n in params for n in names):
    return params  # not this layout, or not this many layers: left for the caller's check
  rest = {k: v for k, v in params.items() if k not in names}
  return {**rest, "blocks": [params[n] for n in names]}


def check_mesh(where: str) -> None:
  """Raises ``LayerArgumentError`` when the mesh in context (``jax.set_mesh``) has
  ``Explicit`` axes: the layers constrain activations by logical name (sharding hints that
  Explicit axes turn into assertions) and look embeddings up with gathers that Explicit
  sharding wants an ``out_sharding`` for, so they run on ``Auto`` axes. (``generate``
  decodes an Explicit mesh's devices on its Auto view itself.)"""
  mesh = jax.sharding.get_abstract_mesh()
  explicit = [n for n, t in zip(mesh.axis_names, mesh.axis_types)
              if t == jax.sharding.AxisType.Explicit] if not mesh.empty else []
  if explicit:
    raise LayerArgumentError(format_message(
        f"{where}: the mesh in context has Explicit axes {explicit}; the layers run on Auto "
        "axes (their logical-axis constraints are hints that Explicit axes would turn into "
        "assertions).",
        fix="Build the mesh with Auto axes: jax.make_mesh(shape, names, "
            "axis_types=(jax.sharding.AxisType.Auto,) * len(names)) (JAX's default is "
            "Explicit)."))


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
