"""``TransformerConfig``: the one description of a model that all three frameworks build.

>>> import layers
>>> cfg = layers.TransformerConfig(vocab_size=64, embed_dim=16, num_heads=4, num_kv_heads=2,
...                                head_dim=4, num_layers=2)
>>> cfg.num_heads // cfg.num_kv_heads       # query heads per kv head (GQA)
2
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from partition import PartitionError
from partition.internal import did_you_mean, format_message

# Remat policy names -> ``jax.checkpoint`` policies. ``'none'`` means no remat at all;
# ``'full'`` recomputes everything in the backward pass (policy ``None``).
REMAT_POLICIES: dict[str, Any] = {
    "none": None,
    "full": None,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
}


class ConfigError(PartitionError, ValueError):
  """A ``TransformerConfig`` field has an invalid value."""


def remat_policy(name: str) -> Any:
  """The ``jax.checkpoint`` policy for a remat name (``None`` = save nothing)."""
  return REMAT_POLICIES[name]


ROPE_SCALINGS = ("linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """A scaling of the rotary frequencies (hashable: part of a ``TransformerConfig``).

  ``kind='linear'`` divides every inverse frequency by ``factor`` (position interpolation);
  ``kind='llama3'`` (Llama 3.1+) divides the low frequencies, whose wavelength exceeds
  ``original_max_len / low_freq_factor``, by ``factor``, keeps the high ones (wavelength
  below ``original_max_len / high_freq_factor``) and interpolates smoothly between. Both as
  ``transformers``' ``rope_type`` of the same name (``layers._core.rope_frequencies``).

  >>> RopeScaling('llama3', 8.0, original_max_len=8192)
  RopeScaling(kind='llama3', factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, \
original_max_len=8192)
  """

  kind: str
  factor: float
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_len: int = 8192

  def problems(self) -> list[str]:
    """What is invalid, as ``rope_scaling.<field>=...`` sentences (empty when valid)."""
    out = []
    if self.kind not in ROPE_SCALINGS:
      out.append(f"rope_scaling.kind={self.kind!r} must be one of {list(ROPE_SCALINGS)}")
    for name in ("factor", "low_freq_factor", "high_freq_factor"):
      v = getattr(self, name)
      if isinstance(v, bool) or not (isinstance(v, (int, float)) and v > 0):
        out.append(f"rope_scaling.{name}={v!r} must be a positive number")
    if (self.kind == "llama3" and not out
        and not self.low_freq_factor < self.high_freq_factor):
      out.append(f"rope_scaling: low_freq_factor={self.low_freq_factor} must be below "
                 f"high_freq_factor={self.high_freq_factor} (llama3 interpolates between)")
    v = self.original_max_len
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
      out.append(f"rope_scaling.original_max_len={v!r} must be a positive int")
    return out


def _rope_scaling(value: Any, problems: list[str]) -> Any:
  """``None``, a :class:`RopeScaling`, or a mapping of its fields (YAML, a saved config's
  ``dataclasses.asdict``) made one."""
  if value is None or isinstance(value, RopeScaling):
    scaling = value
  elif isinstance(value, Mapping):
    unknown = sorted(set(value) - {f.name for f in dataclasses.fields(RopeScaling)})
    if unknown or "kind" not in value or "factor" not in value:
      problems.append(f"rope_scaling={dict(value)!r} needs kind and factor (and optionally "
                      "low_freq_factor, high_freq_factor, original_max_len)"
                      + (f"; unknown {unknown}" if unknown else ""))
      return value
    scaling = RopeScaling(**value)
  else:
    problems.append(f"rope_scaling={value!r} must be None, a layers.RopeScaling or a "
                    "mapping such as {kind: llama3, factor: 8.0}")
    return value
  if scaling is not None:
    problems.extend(scaling.problems())
  return scaling


def _positive(cfg: TransformerConfig) -> list[str]:
  names = ("vocab_size", "embed_dim", "mlp_dim", "num_heads", "num_kv_heads", "head_dim",
           "num_layers", "max_len", "pipeline_repeats")
  return [f"{n}={getattr(cfg, n)!r} must be a positive int" for n in names
          if not isinstance(getattr(cfg, n), int) or getattr(cfg, n) < 1]


def _relations(cfg: TransformerConfig) -> list[str]:
  problems = []
  if (isinstance(cfg.num_heads, int) and isinstance(cfg.num_kv_heads, int)
      and cfg.num_kv_heads > 0 and cfg.num_heads % cfg.num_kv_heads):
    problems.append(f"num_heads={cfg.num_heads} is not a multiple of num_kv_heads="
                    f"{cfg.num_kv_heads}: each kv head serves a whole group of query heads "
                    "(use a divisor of num_heads)")
  if not isinstance(cfg.pipeline_microbatches, int) or cfg.pipeline_microbatches < 0:
    problems.append(f"pipeline_microbatches={cfg.pipeline_microbatches!r} must be an int >= 0 "
                    "(0 = one micro-batch per pipeline stage)")
  chunk = cfg.loss_chunk
  if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
    problems.append(f"loss_chunk={cfg.loss_chunk!r} must be an int >= 0 (tokens per row per "
                    "step of the chunked cross-entropy, e.g. 256; 0 = full logits)")
  if not isinstance(cfg.num_experts, int) or cfg.num_experts < 0:
    problems.append(f"num_experts={cfg.num_experts!r} must be an int >= 0 (0 = dense MLP)")
  elif cfg.num_experts and not 1 <= cfg.experts_per_token <= cfg.num_experts:
    problems.append(f"experts_per_token={cfg.experts_per_token!r} must be between 1 and "
                    f"num_experts={cfg.num_experts}")
  if isinstance(cfg.head_dim, int) and cfg.head_dim % 2:
    problems.append(f"head_dim={cfg.head_dim} must be even (rotary embeddings rotate pairs)")
  for name in ("tie_embeddings", "qkv_bias", "qk_norm", "scan_layers"):
    if not isinstance(getattr(cfg, name), bool):
      problems.append(f"{name}={getattr(cfg, name)!r} must be True or False")
  if isinstance(cfg.rope_theta, bool) or not (isinstance(cfg.rope_theta, (int, float))
                                              and cfg.rope_theta > 0):
    problems.append(f"rope_theta={cfg.rope_theta!r} must be a positive number (the rotary "
                    "base, e.g. 10000.0 or Llama 3's 500000.0)")
  if isinstance(cfg.norm_eps, bool) or not (isinstance(cfg.norm_eps, (int, float))
                                            and cfg.norm_eps >= 0):
    problems.append(f"norm_eps={cfg.norm_eps!r} must be a number >= 0 (e.g. 1e-6 or 1e-5)")
  if isinstance(cfg.capacity_factor, bool) or not (
      isinstance(cfg.capacity_factor, (int, float)) and cfg.capacity_factor > 0):
    problems.append(f"capacity_factor={cfg.capacity_factor!r} must be a positive number (MoE "
                    "slots per expert relative to a balanced load; num_experts / "
                    "experts_per_token never drops a token)")
  problems.extend(_attention_problems(cfg))
  if cfg.remat not in REMAT_POLICIES:
    problems.append(f"remat={cfg.remat!r} is not a remat policy; use one of "
                    f"{sorted(REMAT_POLICIES)}")
  return problems


ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "cudnn", "pallas", "blockwise")


def _attention_problems(cfg: TransformerConfig) -> list[str]:
  problems = []
  if cfg.attention not in ATTENTION_IMPLEMENTATIONS:
    hint = did_you_mean(str(cfg.attention), ATTENTION_IMPLEMENTATIONS)
    problems.append(f"attention={cfg.attention!r} is not an attention implementation; use one "
                    f"of {list(ATTENTION_IMPLEMENTATIONS)}{hint}")
  block = cfg.attention_block
  if isinstance(block, bool) or not isinstance(block, int) or block < 1:
    problems.append(f"attention_block={block!r} must be a positive int (the K/V block width "
                    "of the blockwise path and the Pallas kernel, e.g. 512)")
  return problems


def _dtype(value: Any, field: str, problems: list[str]) -> Any:
  try:
    dtype = jnp.dtype(value)
  except TypeError:
    problems.append(f"{field}={value!r} is not a dtype (use e.g. 'float32' or 'bfloat16')")
    return value
  if not jnp.issubdtype(dtype, jnp.floating):   # numpy's check misses bfloat16
    problems.append(f"{field}={value!r} must be a floating dtype")
  return dtype


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """A decoder-only transformer LM, as built by ``layers.{linen,nnx,haiku}.Transformer``.

  Blocks are pre-norm (RMSNorm) with grouped-query attention using rotary position
  embeddings, and a SwiGLU MLP (or, with ``num_experts > 0``, a top-k mixture of
  SwiGLU experts). The output projection is tied to the embedding table unless
  ``tie_embeddings=False``.

  Attributes:
    vocab_size: number of token ids (logical axis ``vocab``).
    embed_dim: model width (``embed``).
    mlp_dim: hidden width of the MLP and of each expert (``mlp``).
    num_heads: query heads (``heads``).
    num_kv_heads: key/value heads (``kv_heads``); ``num_heads`` must be a multiple.
    head_dim: width of one head (``head_dim``), even (RoPE).
    num_layers: number of blocks (``layers`` when scanned).
    num_experts: experts per MoE layer (``expert``); 0 = dense MLP.
    experts_per_token: the router's top-k (softmax over all experts in fp32, the top-k
      probabilities renormalised to sum to one: Mixtral's router).
    capacity_factor: MoE slots per expert and sequence relative to a balanced load
      (``layers._moe.capacity``); ``num_experts / experts_per_token`` (or more) gives every
      expert room for every token, so nothing is dropped (``from_hf`` sets it for Mixtral).
    max_len: longest sequence the model is meant for (positions are ``0..length-1``).
    dtype: computation dtype; param_dtype: parameter dtype (names or numpy dtypes).
    scan_layers: stack the blocks' params with a leading ``layers`` axis and scan.
    remat: rematerialisation policy of each block, one of ``REMAT_POLICIES``.
    tie_embeddings: logits are ``x @ embed/embedding.T``; ``False`` adds an output
      projection ``lm_head/kernel (embed, vocab)`` (Llama 2+, Mistral, Qwen2 >= 7B).
    rope_theta: the rotary base (period ``2 pi theta`` for the slowest pair of dims).
    rope_scaling: ``None`` or a :class:`RopeScaling` of the rotary frequencies (Llama 3.1's
      ``llama3``, ``linear``); a mapping of its fields is accepted and converted.
    norm_eps: epsilon of every RMSNorm (HF ``rms_norm_eps``).
    qkv_bias: add biases to the query, key and value projections (Qwen2).
    qk_norm: RMSNorm each query and key head over ``head_dim`` (own scales ``attn/query_norm``
      and ``attn/key_norm``, ``norm_eps``) after the projection, before RoPE (Qwen3).
    pipeline_microbatches: when the rules map ``layers`` to a mesh axis (a pipeline over
      stages, ``partition.pipeline``), the micro-batches ``m`` that flow through the stages;
      0 = one per stage. The idle share is ``(p - 1) / (r m + p - 1)``: more micro-batches,
      a smaller bubble.
    pipeline_repeats: chunks of consecutive blocks per stage, ``r``: 1 is GPipe, ``r > 1``
      the circular schedule (``num_layers`` a multiple of stages x ``r``).
    attention: the attention implementation (``layers._attention``): ``'auto'`` (the fused
      kernel of the backend when its constraints hold, cuDNN on GPUs, Pallas splash attention
      on TPUs; else ``'blockwise'`` for long sequences; else ``'xla'``), ``'xla'`` (einsum +
      softmax, the reference), ``'cudnn'``, ``'pallas'`` or ``'blockwise'`` (memory-efficient
      online softmax in pure JAX, any backend). An explicit choice that cannot run raises.
    attention_block: the K/V block width of ``'blockwise'`` (and the Pallas kernel's block).
    loss_chunk: with ``targets`` given to the Transformer (it then returns the per-token loss,
      not logits), compute the cross-entropy at most this many tokens of each row at a time
      (``layers._loss.chunked_cross_entropy``): the fp32 ``(batch, length, vocab)`` logits
      never exist, in the forward or the backward pass. 0 = from the full logits.

  Raises:
    ConfigError: listing every invalid field and how to fix it.
  """

  vocab_size: int = 64
  embed_dim: int = 32
  mlp_dim: int = 64
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 8
  num_layers: int = 2
  num_experts: int = 0
  experts_per_token: int = 2
  capacity_factor: float = 1.25
  max_len: int = 128
  dtype: Any = "float32"
  param_dtype: Any = "float32"
  scan_layers: bool = False
  remat: str = "none"
  tie_embeddings: bool = True
  rope_theta: float = 10_000.0
  rope_scaling: RopeScaling | None = None
  norm_eps: float = 1e-6
  qkv_bias: bool = False
  qk_norm: bool = False
  pipeline_microbatches: int = 0
  pipeline_repeats: int = 1
  attention: str = "auto"
  attention_block: int = 512
  loss_chunk: int = 0

  def __new__(cls, *args: Any, **kwargs: Any):
    # dataclass's __init__ says only "unexpected keyword argument": name the field meant
    fields = [f.name for f in dataclasses.fields(cls)]
    if unknown := [k for k in kwargs if k not in fields]:
      raise ConfigError(format_message(
          f"TransformerConfig: {len(unknown)} unknown field(s).",
          bullets=[f"{k!r}{did_you_mean(k, fields)}" for k in unknown],
          fix=f"The fields are {', '.join(fields)}."))
    return super().__new__(cls)

  def __post_init__(self):
    problems = _positive(self) + _relations(self)
    object.__setattr__(self, "rope_scaling", _rope_scaling(self.rope_scaling, problems))
    for field in ("dtype", "param_dtype"):
      object.__setattr__(self, field, _dtype(getattr(self, field), field, problems))
    if problems:
      raise ConfigError(format_message(
          f"TransformerConfig: {len(problems)} invalid field(s).", bullets=problems,
          fix="Fix the fields listed above (dataclasses.replace(config, field=value))."))

  @property
  def policy(self) -> Any:
    """The ``jax.checkpoint`` policy for ``remat`` (meaningless when ``remat='none'``)."""
    return remat_policy(self.remat)
