"""Decoding: a sharded KV cache, prefill, one-token decode steps and sampling, as one core.

The block code is the training code: ``_model.apply_blocks(..., cache=)`` threads each layer's
:class:`KVCache` down to ``_core.attention_core``, where the rotated keys and values join the
cache (:meth:`KVCache.update`) and the queries attend what it holds. The three frameworks only
read their params into the parameter tree of ``layers._model.transformer`` and call
:func:`generate` (``layers.linen.generate``, ``layers.nnx.generate``,
``layers.haiku.generate``).

**Layout.** Prompts are *right*-padded to a common length ``P``; row ``b`` holds
``lengths[b]`` real tokens at positions ``0 .. lengths[b] - 1``. Prefill is the ordinary
causal forward pass over the padded block (padding only follows a row's tokens, so no real
query sees it) that also writes every key and value into cache slots ``0 .. P - 1``. A decode
step feeds each row's newest token at its own position ``pos[b]`` (per-row positions),
writes its key and value into slot ``pos[b]`` (overwriting the padding there) and attends
slots ``0 .. pos[b]``. So each row computes exactly what it would alone.

**Sharding.** The cache's logical axes are :data:`CACHE_AXES` (``('batch', 'cache_length',
'kv_heads', 'head_dim')``, with a leading ``'layers'`` when the blocks are scanned): the
presets' rules place it like the activations (batch over ``data``/``fsdp``, kv heads over
``tensor``; ``cache_length`` is replicated: :func:`decode_rules` adds the null rule that
says so to rules without one). :func:`init_cache` creates it in its shards (a jitted zeros
with ``out_shardings``), never whole on one device; every update is constrained to the same
axes, and the decode loop donates it.

>>> import jax, jax.numpy as jnp, layers
>>> from layers._params import ParamSpec, transformer_params
>>> cfg = layers.TransformerConfig(num_layers=2, vocab_size=32)
>>> params = jax.tree.map(lambda s: s.init(jax.random.key(0), s.shape, jnp.float32),
...                       transformer_params(cfg), is_leaf=lambda s: isinstance(s, ParamSpec))
>>> out = generate(params, cfg, [[3, 4, 5], [6]], Sampling(max_new_tokens=4))
>>> out.tokens.shape, out.lengths.tolist()
((2, 4), [4, 4])
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import partition
from layers import _core, _model
from layers._config import TransformerConfig
from layers._params import ParamSpec, check_tokens, spec_axes, transformer_params
from partition import PartitionError
from partition.internal import format_message

Array = jax.Array
Params = dict[str, Any]

#: Logical axes of one layer's cached keys (and values).
CACHE_AXES = ("batch", "cache_length", "kv_heads", "head_dim")


class GenerateError(PartitionError, ValueError):
  """A decoding argument is invalid (sampling settings, prompts, stop tokens)."""


# -- the cache -------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  """Keys and values of one layer, ``(batch, cache_length, kv_heads, head_dim)`` each (a
  leading ``layers`` dim when the model's blocks are scanned).

  ``prefill`` (static) says how :meth:`update` treats new keys: ``True``, every row starts
  at position 0 (a prompt block: written to slots ``0 .. T - 1`` and attended as they
  are, under the caller's causal mask); ``False``, row ``b``'s new keys go to the slots of
  their positions and the queries attend slots ``0 .. position``.
  """

  k: Array
  v: Array
  prefill: bool = dataclasses.field(default=False, metadata={"static": True})

  def update(self, k: Array, v: Array, positions: Array, mask: Any, implementation: str
             ) -> tuple[Array, Array, Any, KVCache, str]:
    """``(keys, values, mask, new cache, implementation)`` to attend after adding rotated
    ``k, v`` ``(batch, T, kv_heads, head_dim)`` at ``positions (batch, T)``.

    A prefill attends its own keys under the caller's mask (a ``Mask``: the fused kernels
    apply); a decode step attends the whole cache under a dense ``(batch, 1, T, length)``
    mask on the XLA path (a few queries against a cache: no kernel to fuse)."""
    k, v = k.astype(self.k.dtype), v.astype(self.v.dtype)
    if self.prefill:
      put = lambda c, x: jax.lax.dynamic_update_slice_in_dim(c, x, 0, axis=1)
      ck, cv = _constrained(put(self.k, k)), _constrained(put(self.v, v))
      return k, v, mask, KVCache(ck, cv, True), implementation
    rows = jnp.arange(k.shape[0])[:, None]
    ck = _constrained(self.k.at[rows, positions].set(k, mode="drop"))
    cv = _constrained(self.v.at[rows, positions].set(v, mode="drop"))
    slots = jnp.arange(ck.shape[1])
    mask = slots[None, None, None, :] <= positions[:, None, :, None]   # (b, 1, T, length)
    return ck, cv, mask, KVCache(ck, cv, False), "xla"


def _constrained(x: Array, axes: tuple = CACHE_AXES) -> Array:
  return partition.constrain(x, axes, rules=decode_rules(partition.current_rules()))


def decode_rules(rules: Any) -> Any:
  """``rules`` with ``('cache_length', None)`` appended when they have no rule for it.

  The cache's length dim is replicated on purpose (each decode step writes one slot per row
  and attends all of them); rules that say nothing about ``cache_length`` (the presets)
  mean that, so decoding states it instead of warning that the name has no rule. Rules
  that do give ``cache_length`` a rule are kept as they are.

  >>> import partition
  >>> decode_rules(partition.AxisRules([('batch', 'data')]))
  AxisRules([('batch', 'data'), ('cache_length', None)])
  """
  if rules is None:
    return None
  rules = _as_rules(rules)
  return rules if "cache_length" in rules.names else rules + [("cache_length", None)]


def cache_axes(config: TransformerConfig) -> KVCache | list[KVCache]:
  """The logical axes of the model's cache: one :class:`KVCache` of axes tuples (stacked,
  ``'layers'`` first) when ``config.scan_layers``, else one per layer."""
  if config.scan_layers:
    stacked = ("layers", *CACHE_AXES)
    return KVCache(stacked, stacked)
  return [KVCache(CACHE_AXES, CACHE_AXES) for _ in range(config.num_layers)]


def cache_shapes(config: TransformerConfig, batch: int, length: int, dtype: Any = None
                 ) -> KVCache | list[KVCache]:
  """``jax.ShapeDtypeStruct`` s of the cache (dtype default: ``config.dtype``)."""
  dtype = jnp.dtype(config.dtype if dtype is None else dtype)
  shape = (batch, length, config.num_kv_heads, config.head_dim)
  if config.scan_layers:
    one = jax.ShapeDtypeStruct((config.num_layers, *shape), dtype)
    return KVCache(one, one)
  return [KVCache(jax.ShapeDtypeStruct(shape, dtype), jax.ShapeDtypeStruct(shape, dtype))
          for _ in range(config.num_layers)]


def _is_axes(x: Any) -> bool:
  return isinstance(x, tuple)


def cache_shardings(config: TransformerConfig, batch: int, length: int, *, rules: Any = None,
                    mesh: jax.sharding.Mesh | None = None, dtype: Any = None) -> Any:
  """The cache's ``NamedSharding`` s under ``rules`` / ``mesh`` (default: the
  ``partition.axis_rules`` context), or ``None`` without a mesh."""
  rules = decode_rules(partition.current_rules() if rules is None else rules)
  mesh = partition.current_rules_mesh() if mesh is None else mesh
  if mesh is None or rules is None:
    return None
  shapes = cache_shapes(config, batch, length, dtype)
  return rules.tree_shardings(cache_axes(config), mesh, shapes)


def _as_rules(rules: Any) -> partition.AxisRules:
  return rules if isinstance(rules, partition.AxisRules) else partition.AxisRules(rules)


def init_cache(config: TransformerConfig, batch: int, length: int, *, rules: Any = None,
               mesh: jax.sharding.Mesh | None = None, dtype: Any = None
               ) -> KVCache | list[KVCache]:
  """A zero cache for ``batch`` rows of up to ``length`` tokens, created in its shards.

  >>> import layers
  >>> c = init_cache(layers.TransformerConfig(scan_layers=True), batch=2, length=16)
  >>> c.k.shape
  (2, 2, 16, 2, 8)
  """
  # the context is read here, not in the cached maker: a maker is one rules/mesh's layout
  rules = decode_rules(partition.current_rules() if rules is None else rules)
  mesh = partition.current_rules_mesh() if mesh is None else mesh
  return _cache_maker(config, batch, length, rules, mesh, dtype)()


@functools.lru_cache(maxsize=32)
def _cache_maker(config, batch, length, rules, mesh, dtype):
  """The jitted zeros of one cache layout, built once (each generate call makes a cache)."""
  shapes = cache_shapes(config, batch, length, dtype)
  shardings = cache_shardings(config, batch, length, rules=rules, mesh=mesh, dtype=dtype)
  zeros = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
  return jax.jit(zeros, out_shardings=shardings)


def cache_bytes_per_device(config: TransformerConfig, batch: int, length: int, *,
                           rules: Any, mesh: jax.sharding.Mesh, dtype: Any = None) -> int:
  """Bytes of the cache on each device, on paper: every array's size divided by the mesh
  sizes its resolved ``PartitionSpec`` splits it over."""
  shapes = jax.tree.leaves(cache_shapes(config, batch, length, dtype))
  specs = decode_rules(rules).tree_specs(cache_axes(config),
                                         cache_shapes(config, batch, length, dtype), mesh)
  specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
  total = 0
  for s, spec in zip(shapes, specs):
    split = math.prod(mesh.shape[a] for e in spec for a in partition.internal.entry_mesh_axes(e))
    total += math.prod(s.shape) * s.dtype.itemsize // split
  return total


def _with_mode(cache: Any, prefill: bool) -> Any:
  return jax.tree.map(lambda c: dataclasses.replace(c, prefill=prefill), cache,
                      is_leaf=lambda c: isinstance(c, KVCache))


# -- the model with a cache ------------------------------------------------------------------


def _hidden(params: Params, tokens: Array, config: TransformerConfig, cache: Any,
            positions: Array, mask: Array | None) -> tuple[Array, Any]:
  """Final-normed hidden states ``(batch, T, embed)`` of ``tokens`` and the updated cache."""
  c = config
  table = params["embed"]["embedding"]
  x = partition.constrain(_core.embed(tokens, table, dtype=c.dtype), _core.EMBED)
  x, _, cache = _model.apply_blocks(params["blocks"], x, c, mask, positions, cache)
  # A scan stacks the per-layer caches unconstrained along 'layers': pin the whole cache.
  is_cache = lambda x: isinstance(x, KVCache)
  cache = jax.tree.map(lambda x, a: KVCache(_constrained(x.k, a.k),
                                            _constrained(x.v, a.v), x.prefill),
                       cache, cache_axes(c), is_leaf=is_cache)
  scale = _core.fsdp_gather(params["final_norm"]["scale"], ("embed",), tokens.shape[0])
  return _core.rms_norm(x, scale, eps=c.norm_eps), cache


def _logits(params: Params, h: Array, config: TransformerConfig) -> Array:
  """``h (batch, T, embed)`` -> logits ``(batch, T, vocab)``, tied or not."""
  c = config
  if c.tie_embeddings:
    table = _core.fsdp_gather(params["embed"]["embedding"], ("vocab", "embed"), h.shape[0],
                              c.dtype)
    logits = _core.attend(h, table, dtype=c.dtype)
  else:
    logits = _core.dense(h, params["lm_head"]["kernel"], dtype=c.dtype)
  return partition.constrain(logits, _core.LOGITS)


def prefill(params: Params, tokens: Array, cache: Any, config: TransformerConfig
            ) -> tuple[Array, Any]:
  """Runs right-padded prompts ``tokens (batch, P)`` from position 0 into an empty ``cache``.

  Returns:
    ``(logits (batch, P, vocab), cache)``; row ``b``'s next-token logits are at
    ``lengths[b] - 1`` (later positions are padding and mean nothing).
  """
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  h, cache = _hidden(params, tokens, config, _with_mode(cache, True), positions,
                     _core.decoder_mask(tokens))
  return _logits(params, h, config), _with_mode(cache, False)


def decode_step(params: Params, tokens: Array, positions: Array, cache: Any,
                config: TransformerConfig) -> tuple[Array, Any]:
  """Feeds ``tokens (batch, T)`` (usually ``T = 1``) at per-row ``positions (batch, T)``.

  Each row attends its cached slots ``0 .. position``; slots past it are never read.

  Returns:
    ``(logits (batch, T, vocab), cache)``.
  """
  h, cache = _hidden(params, tokens, config, _with_mode(cache, False), positions, None)
  return _logits(params, h, config), cache


# -- sampling --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How tokens are chosen.

  Attributes:
    max_new_tokens: tokens to generate per row (at most; a row also stops at a stop token
      or when it reaches the cache length).
    temperature: 0 = greedy (argmax); else logits are divided by it and sampled.
    top_k: keep only the ``top_k`` most likely tokens (0 = all).
    top_p: nucleus: keep the most likely tokens whose probabilities sum to ``top_p``
      (the smallest such set; 1.0 = all), in ``(0, 1]``.
    seed: the ``jax.random`` seed of the draws.
    stop_tokens: ids that end a row (the stop token is part of its output).

  Raises:
    GenerateError: naming every invalid field.
  """

  max_new_tokens: int = 32
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0
  stop_tokens: tuple[int, ...] = ()

  def __post_init__(self):
    stops = self.stop_tokens   # one int is one stop token, as an HF eos_token_id may be
    if _is_int(stops):
      stops = (stops,)
    elif isinstance(stops, (Sequence, np.ndarray)) and not isinstance(stops, str):
      stops = tuple(stops)
    object.__setattr__(self, "stop_tokens", stops)   # anything else: problems() names it
    problems = Sampling.problems(**{f.name: getattr(self, f.name)
                                    for f in dataclasses.fields(self)})
    if problems:
      raise GenerateError(format_message(
          f"Sampling: {len(problems)} invalid setting(s).", bullets=[p for _, p in problems],
          fix="Fix the settings listed above, e.g. Sampling(temperature=0.8, top_p=0.9)."))

  @staticmethod
  def problems(max_new_tokens: Any = 32, temperature: Any = 0.0, top_k: Any = 0,
               top_p: Any = 1.0, seed: Any = 0, stop_tokens: Sequence[Any] = ()
               ) -> list[tuple[tuple[str, ...], str]]:
    """``(fields, message)`` per invalid setting, the fields it is about first (so that a
    command line can name its own flags); ``[]`` when ``Sampling(...)`` would accept them.

    >>> Sampling.problems(temperature=-1.0)
    [(('temperature',), 'temperature=-1.0 must be a finite number >= 0 (0 = greedy)')]
    """
    problems = []
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
      problems.append((("max_new_tokens",), f"max_new_tokens={max_new_tokens!r} must be an "
                                            "int >= 1"))
    if not _is_number(temperature) or not 0 <= temperature < math.inf:
      problems.append((("temperature",), f"temperature={temperature!r} must be a finite "
                                         "number >= 0 (0 = greedy)"))
    if not _is_int(top_k) or top_k < 0:
      problems.append((("top_k",), f"top_k={top_k!r} must be an int >= 0 (0 = no top-k cut)"))
    if not _is_number(top_p) or not 0 < top_p <= 1:
      problems.append((("top_p",), f"top_p={top_p!r} must be in (0, 1] (1.0 = no nucleus "
                                   "cut)"))
    cuts = tuple(name for name, cut in (
        ("top_k", _is_int(top_k) and top_k > 0),
        ("top_p", _is_number(top_p) and 0 < top_p < 1)) if cut)
    if _is_number(temperature) and temperature == 0 and cuts:
      problems.append((cuts + ("temperature",), f"top_k={top_k!r} / top_p={top_p!r} cut the "
                       "distribution sampled from, but temperature=0 is greedy (argmax): set "
                       "a temperature > 0 to sample, or leave top_k=0 and top_p=1.0"))
    if not _is_int(seed):
      problems.append((("seed",), f"seed={seed!r} must be an int"))
    if not isinstance(stop_tokens, tuple):
      problems.append((("stop_tokens",), f"stop_tokens={stop_tokens!r} must be token ids: an "
                       "int or a sequence of ints, e.g. stop_tokens=(2,)"))
      stop_tokens = ()
    bad = [t for t in stop_tokens if not _is_int(t) or t < 0]
    if bad:
      problems.append((("stop_tokens",), f"stop_tokens has {bad}: token ids are ints >= 0"))
    return problems

  def check_vocab(self, vocab_size: int) -> None:
    """Raises ``GenerateError`` for a stop token the model's vocabulary does not have."""
    bad = [t for t in self.stop_tokens if t >= vocab_size]
    if bad:
      raise GenerateError(f"stop token(s) {bad} are not in the model's vocabulary "
                          f"(vocab_size={vocab_size}, ids 0..{vocab_size - 1}). Pass ids "
                          "the model can emit.")


def _is_int(x: Any) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
  return isinstance(x, (int, float, np.number)) and not isinstance(x, bool)


def sample(logits: Array, key: Array, sampling: Sampling) -> Array:
  """One token id per row of ``logits (batch, vocab)``.

  >>> logits = jnp.log(jnp.array([[0.1, 0.6, 0.3]]))
  >>> sample(logits, jax.random.key(0), Sampling()).tolist()           # greedy
  [1]
  >>> sample(logits, jax.random.key(0), Sampling(temperature=1.0, top_k=1)).tolist()
  [1]
  """
  if sampling.temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits.astype(jnp.float32) / sampling.temperature
  if sampling.top_k and sampling.top_k < logits.shape[-1]:
    kth = jax.lax.top_k(logits, sampling.top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if sampling.top_p < 1:
    ordered = jnp.sort(logits, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(ordered, axis=-1)
    # Keep a token while the tokens before it hold less than top_p: the smallest set whose
    # mass reaches top_p (always at least the most likely token).
    kept = (jnp.cumsum(probs, axis=-1) - probs) < sampling.top_p
    cutoff = jnp.min(jnp.where(kept, ordered, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < cutoff, -jnp.inf, logits)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


# -- generation ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Generation:
  """What :func:`generate` returns.

  Attributes:
    tokens: ``(batch, max_new_tokens)`` numpy ints: each row's continuation, then
      ``pad_id``.
    lengths: ``(batch,)`` tokens generated per row (a stop token included).
    prompt_tokens: prompt tokens in the batch (padding excluded).
    prefill_seconds, decode_seconds: wall time of the prefill and of the decode loop (after
      compilation: each program is compiled before it is timed).
    decode_steps: decode steps run (the loop ends when every row has stopped).
  """

  tokens: np.ndarray
  lengths: np.ndarray
  prompt_tokens: int
  prefill_seconds: float
  decode_seconds: float
  decode_steps: int

  def continuations(self) -> list[list[int]]:
    """Each row's generated ids, without padding."""
    return [row[:n].tolist() for row, n in zip(self.tokens, self.lengths)]

  @property
  def prefill_tokens_per_s(self) -> float:
    return self.prompt_tokens / max(self.prefill_seconds, 1e-9)

  @property
  def decode_tokens_per_s(self) -> float:
    return int(self.lengths.sum()) / max(self.decode_seconds, 1e-9)


def pad_prompts(prompts: Sequence[Sequence[int]], *, pad_id: int = 0, where: str = "generate"
                ) -> tuple[np.ndarray, np.ndarray]:
  """Right-padded ``(tokens (batch, P) int32, lengths (batch,))`` of lists of ids.

  >>> pad_prompts([[5, 6, 7], [8]])[0].tolist()
  [[5, 6, 7], [8, 0, 0]]
  """
  rows = _prompt_rows(prompts, where)
  empty = [i for i, p in enumerate(rows) if not p]
  if not rows or empty:
    raise GenerateError(f"{where}: prompt(s) {empty or 'list'} empty: every row needs at "
                        "least one token to continue.")
  lengths = np.array([len(p) for p in rows], np.int32)
  tokens = np.full((len(rows), int(lengths.max())), pad_id, np.int32)
  for i, p in enumerate(rows):
    tokens[i, :len(p)] = p
  return tokens, lengths


PROMPTS_FIX = "Pass prompts as a list of lists of int token ids, e.g. [[1, 5, 9], [3]]."


def _prompt_rows(prompts: Any, where: str) -> list[list[int]]:
  """The rows of ``prompts``, each a list of int ids; text, floats or a flat list of ids
  (once read as one prompt per digit, or truncated) are errors."""
  if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (Sequence, np.ndarray,
                                                                    jax.Array)):
    raise GenerateError(format_message(
        f"{where}: prompts={prompts!r:.60} is a {type(prompts).__name__}, not a batch of "
        "token ids (text goes through a tokenizer first).", fix=PROMPTS_FIX))
  rows, problems = [], []
  for i, row in enumerate(prompts):
    if _is_int(row):
      raise GenerateError(format_message(
          f"{where}: prompts[{i}] is the int {row}: prompts is one list of ids, not a batch "
          "of them.", fix=f"Wrap it: {[[int(t) if _is_int(t) else t for t in prompts]]!r:.60} "
                          "for one prompt."))
    ids = list(np.asarray(row).ravel()) if isinstance(row, (np.ndarray, jax.Array)) else (
        None if isinstance(row, (str, bytes)) or not isinstance(row, Sequence) else list(row))
    if ids is None:
      problems.append(f"prompts[{i}] is a {type(row).__name__} ({row!r:.40}), not a list of "
                      "ids (text goes through a tokenizer first)")
    elif bad := [t for t in ids if not _is_int(t)]:
      problems.append(f"prompts[{i}] has ids that are not ints: {bad[:4]!r}")
    rows.append(ids or [])
  if problems:
    raise GenerateError(format_message(f"{where}: {len(problems)} prompt(s) are not token ids.",
                                       bullets=problems, fix=PROMPTS_FIX))
  return rows


@functools.lru_cache(maxsize=32)
def _param_shapes(config: TransformerConfig) -> dict[str, tuple[int, ...]]:
  """``{a/b/c path: shape}`` of the parameter tree :func:`generate` reads."""
  return {jax.tree_util.keystr(k, simple=True, separator="/"): tuple(s.shape) for k, s in
          jax.tree_util.tree_flatten_with_path(
              transformer_params(config), is_leaf=lambda s: isinstance(s, ParamSpec))[0]}


def check_params(params: Params, config: TransformerConfig, where: str = "generate") -> None:
  """``params`` is the tree of ``config``'s model: the same arrays, of the same shapes (a
  ``num_layers`` or ``vocab_size`` that differs from the weights' would decode wrong or in
  JAX's words)."""
  want = _param_shapes(config)
  have = {re.sub(r"^blocks_(\d+)/", r"blocks/\1/", jax.tree_util.keystr(
      k, simple=True, separator="/")): tuple(np.shape(x))
          for k, x in jax.tree_util.tree_flatten_with_path(params)[0]}
  problems = []
  layers_have = {int(m[1]) for k in have if (m := re.match(r"blocks/(\d+)/", k))}
  if not config.scan_layers and layers_have and len(layers_have) != config.num_layers:
    problems.append(f"blocks: the params hold {len(layers_have)} layer(s), the config has "
                    f"num_layers={config.num_layers}")
    want = {k: v for k, v in want.items() if not k.startswith("blocks/")}
    have = {k: v for k, v in have.items() if not k.startswith("blocks/")}
  problems += [f"{k}: missing (the config has it, shape {v})" for k, v in want.items()
               if k not in have]
  problems += [f"{k}: not in this config's model (shape {v})" for k, v in have.items()
               if k not in want]
  problems += [f"{k}: shape {have[k]}, but the config makes {v}" for k, v in want.items()
               if k in have and have[k] != v]
  if problems:
    shown = problems[:8] + ([f"... and {len(problems) - 8} more"] if len(problems) > 8 else [])
    raise GenerateError(format_message(
        f"{where}: the params are not the model of this config ({len(problems)} problem(s)).",
        bullets=shown,
        fix="Pass the config the params were made with (the training run's model.*); "
            "canonical weights (layers.from_hf, layers.to_canonical) go through "
            "layers.from_canonical(weights, like=<the model's own params>) first."))


def check_prompts(tokens: np.ndarray, lengths: np.ndarray, config: TransformerConfig,
                  where: str = "generate") -> None:
  """Prompt ids in the vocabulary and no longer than ``config.max_len``."""
  problems = []
  if int(lengths.max()) > config.max_len:
    long = [i for i, n in enumerate(lengths.tolist()) if n > config.max_len]
    problems.append(f"prompt(s) {long} have {int(lengths.max())} tokens > the model's "
                    f"max_len={config.max_len}")
  bad = sorted({int(t) for t, m in zip(tokens.ravel(), _valid(tokens, lengths).ravel())
                if m and not 0 <= t < config.vocab_size})
  if bad:
    problems.append(f"token ids {bad[:8]} are outside the vocabulary 0..{config.vocab_size - 1}")
  if problems:
    fixes = (["shorten the long prompts (or use a model with a larger max_len)"]
             if int(lengths.max()) > config.max_len else []) + (
        [f"pass ids from 0 to {config.vocab_size - 1} (those of the model's tokenizer)"]
        if bad else [])
    raise GenerateError(format_message(f"{where}: bad prompts.", bullets=problems,
                                       fix=" and ".join(fixes).capitalize() + "."))


def _valid(tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
  return np.arange(tokens.shape[1])[None, :] < lengths[:, None]


def _decode_loop(params: Params, cache: Any, logits: Array, lengths: Array, *,
                 config: TransformerConfig, sampling: Sampling, cache_length: int,
                 pad_id: int) -> tuple[Array, Array, Array, Any]:
  """``(tokens (b, max_new), counts (b,), steps, cache)``: sample, feed, repeat, in one
  ``lax.while_loop`` that ends when every row has stopped."""
  n, b = sampling.max_new_tokens, lengths.shape[0]
  key = jax.random.key(sampling.seed)
  stops = jnp.asarray(sampling.stop_tokens or (-1,), jnp.int32)

  def choose(i, logits, done):
    tok = sample(logits, jax.random.fold_in(key, i), sampling)
    tok = jnp.where(done, pad_id, tok)
    # The token at step i sits at position lengths + i; the row ends on a stop token or
    # when the next position would fall outside the cache.
    ends = jnp.isin(tok, stops) | (lengths + i + 1 >= cache_length)
    return tok, done | ends

  done0 = lengths >= cache_length
  tok, done = choose(0, logits, done0)
  out = jnp.full((b, n), pad_id, jnp.int32).at[:, 0].set(tok)
  count = (~done0).astype(jnp.int32)

  def cond(state):
    i, _, _, _, done, _ = state
    return (i < n) & ~jnp.all(done)

  def body(state):
    i, tok, cache, out, done, count = state
    pos = jnp.minimum(lengths + i - 1, cache_length - 1)[:, None]
    logits, cache = decode_step(params, tok[:, None], pos, cache, config)
    tok, now_done = choose(i, logits[:, 0], done)
    return (i + 1, tok, cache, out.at[:, i].set(tok), now_done,
            count + (~done).astype(jnp.int32))

  i, _, cache, out, _, count = jax.lax.while_loop(
      cond, body, (jnp.int32(1), tok, cache, out, done, count))
  return out, count, i - 1, cache


def generate(params: Params, config: TransformerConfig, prompts: Sequence[Sequence[int]],
             sampling: Sampling | None = None, *, rules: Any = None,
             mesh: jax.sharding.Mesh | None = None, pad_id: int = 0,
             where: str = "layers.generate") -> Generation:
  """Continues a batch of prompts: prefill, then a jitted decode loop that donates the cache.

  Args:
    params: the parameter tree of ``layers._model.transformer`` (the frameworks'
      ``generate`` functions read theirs into it).
    config: the model.
    prompts: lists of token ids, of any lengths (right-padded here).
    sampling: a :class:`Sampling` (default: greedy, 32 tokens).
    rules, mesh: place the params, the cache and the activations (default: the
      ``partition.axis_rules`` context; neither: one device). Params not yet on the mesh
      (numpy, uncommitted or on one device: ``model.init`` output, a loaded checkpoint)
      are placed as ``rules`` shard them, like training does; params already on the mesh's
      devices stay as they are. A mesh with ``Explicit`` axes decodes on the same devices
      with those axes ``Auto`` (the model's gathers have no Explicit form; the result is
      numpy), in or outside ``jax.set_mesh``.
    pad_id: the id written after a row stops (and into the padding of the prompts).

  Returns:
    A :class:`Generation`.

  Raises:
    GenerateError: a prompt longer than ``config.max_len``, ids outside the vocabulary, a
      stop token the vocabulary lacks, invalid sampling settings; ``mesh=`` without rules
      (or ``rules=`` without a mesh); params sharded over devices other than the mesh's.
  """
  sampling = Sampling() if sampling is None else sampling
  if not isinstance(sampling, Sampling):
    raise GenerateError(format_message(
        f"{where}: sampling is a {type(sampling).__name__}, not a layers.Sampling.",
        fix="Pass layers.Sampling(...)" + (f", e.g. layers.Sampling(**{sampling!r:.60})"
                                          if isinstance(sampling, dict) else "") + "."))
  if not _is_int(pad_id) or not 0 <= pad_id < config.vocab_size:
    raise GenerateError(format_message(
        f"{where}: pad_id={pad_id!r} is not a token id of the vocabulary "
        f"0..{config.vocab_size - 1} (its embedding would be NaN, and the padded rows with it).",
        fix="Pass an id the model has, e.g. pad_id=0."))
  sampling.check_vocab(config.vocab_size)
  check_params(params, config, where)
  tokens, lengths = pad_prompts(prompts, pad_id=pad_id, where=where)
  check_prompts(tokens, lengths, config, where)
  given_rules, given_mesh = rules is not None, mesh is not None
  rules = decode_rules(partition.current_rules() if rules is None else rules)
  mesh = partition.current_rules_mesh() if mesh is None else mesh
  if given_mesh and rules is None:
    raise GenerateError(format_message(
        f"{where}: mesh= was given without rules, so nothing would be placed on it.",
        fix="Pass rules= too (e.g. recipes.config.preset_rules('fsdp_tp')), or call it "
            "inside `with partition.axis_rules(rules, mesh):`."))
  if given_rules and mesh is None:
    raise GenerateError(format_message(
        f"{where}: rules= was given without a mesh, so they would place nothing.",
        fix="Pass mesh= too (e.g. jax.make_mesh((4, 2), ('data', 'tensor'))), or leave "
            "rules out to decode on one device."))
  mesh = auto_view(mesh)
  params = place_params(params, config, rules, mesh, where)
  batch, width = tokens.shape
  cache_length = min(config.max_len, width + sampling.max_new_tokens)
  run = _programs(config, sampling, batch, width, cache_length, rules, mesh, pad_id)
  return run(params, tokens, lengths)


def auto_view(mesh: Any) -> Any:
  """``mesh`` with its ``Explicit`` axes made ``Auto`` (the same devices, names and shape);
  ``mesh`` itself when it has none (or is ``None``).

  Decoding runs on this view: the model's embedding lookup and the cache's per-row writes
  are gathers and scatters that JAX's Explicit sharding asks an ``out_sharding`` of, which
  the shared block code does not give (the training code runs on Auto meshes too).
  """
  if not isinstance(mesh, jax.sharding.Mesh):
    return mesh
  auto, explicit = jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit
  if explicit not in mesh.axis_types:
    return mesh
  # a concrete Mesh has no update_axis_types (only AbstractMesh, which xmap's region uses)
  return jax.sharding.Mesh(mesh.devices, mesh.axis_names,
                           axis_types=tuple(auto if t == explicit else t
                                            for t in mesh.axis_types))


def param_axes(config: TransformerConfig) -> Params:
  """The logical axes of the parameter tree :func:`generate` reads, one tuple per array."""
  return spec_axes(transformer_params(config))


def place_params(params: Params, config: TransformerConfig, rules: Any, mesh: Any,
                 where: str = "generate") -> Params:
  """``params`` ready for the programs of one ``rules`` / ``mesh``.

  Without a mesh, numpy leaves become device arrays. On a mesh, every leaf not already on
  the mesh's devices (numpy, uncommitted, committed to one device) is put there as
  ``rules`` shard it (:func:`param_axes`); leaves on exactly the mesh's devices keep their
  sharding (re-stated on :func:`auto_view` of their mesh when it has Explicit axes).

  Raises:
    GenerateError: a leaf sharded over several devices that are not the mesh's.
    partition.RulesError: the tree is not the model's (keypaths named).
  """
  if rules is None or mesh is None:
    return jax.tree.map(lambda x: x if isinstance(x, jax.Array) else jnp.asarray(x), params)
  devices = frozenset(mesh.devices.flat)
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  elsewhere = [(jax.tree_util.keystr(path), x.sharding.device_set) for path, x in leaves
               if isinstance(x, jax.Array) and x.committed
               and len(x.sharding.device_set) > 1 and x.sharding.device_set != devices]
  if elsewhere:
    path, on = elsewhere[0]
    raise GenerateError(format_message(
        f"{where}: {len(elsewhere)} param(s) are sharded over other devices than mesh=.",
        bullets=[f"{path} is on devices {sorted(d.id for d in on)}",
                 f"mesh= has devices {sorted(d.id for d in devices)}"],
        fix="Pass the mesh the params were placed on as mesh=, or move them first: "
            "jax.device_put(params, jax.sharding.NamedSharding(mesh, P())) (or their "
            "rules' shardings)."))
  shardings = rules.tree_shardings(param_axes(config), mesh, params)

  def one(x, sharding):
    if isinstance(x, jax.Array) and x.committed and x.sharding.device_set == devices:
      own = x.sharding
      if isinstance(own, jax.sharding.NamedSharding) and auto_view(own.mesh) is not own.mesh:
        return jax.device_put(x, jax.sharding.NamedSharding(auto_view(own.mesh), own.spec))
      return x
    return jax.device_put(x, sharding)

  return jax.tree.map(one, params, shardings)


@functools.lru_cache(maxsize=32)
def _programs(config, sampling, batch, width, cache_length, rules, mesh, pad_id) -> Programs:
  """One :class:`Programs` per shape and setting, so calling :func:`generate` again (a
  chat loop, a batch of requests) reuses its compiled prefill and loop."""
  return Programs(config, sampling, batch=batch, prompt_length=width,
                  cache_length=cache_length, rules=rules, mesh=mesh, pad_id=pad_id)


class Programs:
  """The compiled pieces of :func:`generate` for one shape: ``prefill`` and ``loop``, each
  jitted under the rules, donating the cache; calling it runs and times both."""

  def __init__(self, config: TransformerConfig, sampling: Sampling, *, batch: int,
               prompt_length: int, cache_length: int, rules: Any, mesh: Any,
               pad_id: int = 0):
    self.config, self.sampling, self.pad_id = config, sampling, pad_id
    self.batch, self.prompt_length, self.cache_length = batch, prompt_length, cache_length
    mesh = auto_view(mesh)   # Explicit axes decode as Auto: see auto_view
    self.rules, self.mesh = rules, mesh
    self._executables: dict[Any, tuple] = {}
    placed = rules is not None and mesh is not None

    def under_rules(f):
      def wrapped(*args):
        if not placed:
          return f(*args)
        with partition.axis_rules(rules, mesh):
          return f(*args)
      return wrapped

    def first(params, tokens, lengths, cache):  # prefill, projecting only the last tokens
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
      h, cache = _hidden(params, tokens, config, _with_mode(cache, True), positions,
                         _core.decoder_mask(tokens))
      h = jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)
      return _logits(params, h, config)[:, 0], _with_mode(cache, False)

    self.prefill = jax.jit(under_rules(first), donate_argnums=(3,))
    self.loop = jax.jit(under_rules(lambda params, cache, logits, lengths: _decode_loop(
        params, cache, logits, lengths, config=config, sampling=sampling,
        cache_length=cache_length, pad_id=pad_id)), donate_argnums=(1,))

  def new_cache(self) -> Any:
    return init_cache(self.config, self.batch, self.cache_length, rules=self.rules,
                      mesh=self.mesh)

  def __call__(self, params: Params, tokens: np.ndarray, lengths: np.ndarray) -> Generation:
    if self.rules is None or self.mesh is None:
      return self._run(params, tokens, lengths)
    # Under this mesh even inside the caller's jax.set_mesh (an Explicit one included):
    # the programs are traced and run on the Auto view that they constrain on.
    with jax.set_mesh(self.mesh):
      return self._run(params, tokens, lengths)

  def _run(self, params: Params, tokens: np.ndarray, lengths: np.ndarray) -> Generation:
    check_tokens(tokens, self.config.max_len, "generate")
    tokens, lengths = self._placed(tokens), self._placed(lengths)
    # Compile both programs before timing either (the cache they compile against is
    # abstract: nothing is allocated for it).
    cache = self.new_cache()
    prefill, loop = self._compiled(params, tokens, lengths, cache)
    start = time.perf_counter()
    logits, cache = prefill(params, tokens, lengths, cache)
    jax.block_until_ready(logits)
    middle = time.perf_counter()
    out, count, steps, cache = loop(params, cache, logits, lengths)
    out, count, steps = jax.device_get((out, count, steps))
    end = time.perf_counter()
    return Generation(np.asarray(out), np.asarray(count), int(np.asarray(lengths).sum()),
                      middle - start, end - middle, int(steps))

  def _compiled(self, params: Params, tokens: Array, lengths: Array, cache: Any) -> tuple:
    """Both programs compiled for these inputs' shapes, dtypes and shardings, once."""
    abstract = lambda tree: jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
    leaves, treedef = jax.tree.flatten(abstract((params, tokens, lengths)))
    key = (treedef, tuple((x.shape, x.dtype, x.sharding) for x in leaves))
    if key not in self._executables:
      shapes = abstract(cache)
      prefill = self.prefill.lower(params, tokens, lengths, shapes).compile()
      logits = prefill.out_info[0]   # no second trace for the logits' shape
      logits = jax.ShapeDtypeStruct(logits.shape, logits.dtype,
                                    sharding=prefill.output_shardings[0])
      loop = self.loop.lower(params, shapes, logits, lengths).compile()
      self._executables[key] = prefill, loop
    return self._executables[key]

  def _placed(self, x: np.ndarray) -> Array:
    """``x`` (batch first) on the mesh, split over the batch's mesh axes like the cache."""
    if self.rules is None or self.mesh is None:
      return jnp.asarray(x)
    names = ("batch",) + (None,) * (x.ndim - 1)
    return jax.device_put(x, self.rules.sharding(names, self.mesh, x.shape))
