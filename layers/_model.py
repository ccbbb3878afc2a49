"""The Transformer, composed once: block, block stack and model over a parameter tree.

``layers.linen``, ``layers.nnx`` and ``layers.haiku`` declare the parameters of
``layers._params.transformer_params(config)`` (each the framework's own way, with their
logical axes), read them back as a nested dict of arrays and call :func:`transformer`; so the
model is written here once, and the three frameworks compute the same thing by construction.

:func:`apply_blocks` is the one place the block stack runs (scan over the stacked ``layers``
dim or a loop, rematerialised per ``config.remat``): a schedule that splits the stack (e.g.
pipeline stages over ``layers``) replaces exactly this function.

>>> import jax, jax.numpy as jnp, layers
>>> from layers._params import transformer_params
>>> cfg = layers.TransformerConfig(num_layers=2, scan_layers=True)
>>> specs = transformer_params(cfg)
>>> is_spec = lambda s: hasattr(s, 'init') and hasattr(s, 'axes')
>>> params = jax.tree.map(lambda s: s.init(jax.random.key(0), s.shape, jnp.float32), specs,
...                       is_leaf=is_spec)
>>> logits, aux = transformer(params, jnp.zeros((2, 5), jnp.int32), cfg)
>>> logits.shape, sorted(aux)
((2, 5, 64), ['dropped_tokens', 'load_balance_loss'])
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import partition
from layers import _core, _loss, _moe
from layers._attention import Mask, array_problems
from layers._config import ConfigError, TransformerConfig
from layers._params import (
  LayerArgumentError,
  block_params,
  check_mesh,
  check_tokens,
  gathered_in_compute_dtype,
  spec_axes,
)
from partition.internal import format_message

Array = jax.Array
Params = dict[str, Any]


def block(p: Params, x: Array, config: TransformerConfig, mask: Mask | Array | None,
          positions: Array | None, cache: Any = None) -> tuple[Any, ...]:
  """Pre-norm decoder block: ``x + attn(norm(x))``, then ``+ mlp(norm(x))`` (or MoE).

  Args:
    p: one block's params (``layers._params.block_params``): ``attn_norm``, ``attn``,
      ``mlp_norm`` and ``mlp`` or ``moe``.
    x: ``(batch, length, embed)``.
    config: the model's config (``config.attention`` picks the attention implementation);
    mask: a ``layers._attention.Mask`` (or a dense bool array, ``'xla'`` only);
    positions, cache: as for ``_core.attention``.

  Returns:
    ``(x, aux)``: the block output and ``{'load_balance_loss', 'dropped_tokens'}``; with a
    ``cache`` (decoding), ``(x, aux, updated cache)``.
  """
  c = config
  p = _core.fsdp_gather(p, _block_axes(c), x.shape[0], _block_dtypes(c))
  h = _core.rms_norm(x, p["attn_norm"]["scale"], eps=c.norm_eps)
  h = _core.attention(p["attn"], h, mask=mask, positions=positions, rope_theta=c.rope_theta,
                      rope_scaling=c.rope_scaling, norm_eps=c.norm_eps, dtype=c.dtype,
                      implementation=c.attention, block=c.attention_block, cache=cache)
  h, cache = h if cache is not None else (h, None)
  x = partition.constrain(x + h, _core.EMBED)
  h = _core.rms_norm(x, p["mlp_norm"]["scale"], eps=c.norm_eps)
  if c.num_experts:
    m = p["moe"]
    h, aux = _moe.moe(h, m["router"], m["wi"], m["wo"], k=c.experts_per_token,
                      capacity_factor=c.capacity_factor, dtype=c.dtype)
  else:
    h, aux = _core.mlp(p["mlp"], h, dtype=c.dtype), _core.no_aux()
  x = partition.constrain(x + h, _core.EMBED)
  return (x, aux) if cache is None else (x, aux, cache)


@functools.cache
def _block_axes(config: TransformerConfig) -> dict[str, Any]:
  """The logical axes of one block's params, as a tree of tuples (read, never modified:
  an unrolled stack asks once per block)."""
  return spec_axes(block_params(config))


@functools.cache
def _block_dtypes(config: TransformerConfig) -> dict[str, Any]:
  """The dtype the block computes with each of its params: ``config.dtype`` for those
  :func:`layers.gathered_in_compute_dtype` names (the rule the planner prices too), ``None``
  (as stored) for the norm scales and the router, which it reads in fp32."""
  def dtype(path, _):
    name = "/".join(str(k.key) for k in path)
    return config.dtype if gathered_in_compute_dtype(name, tied=False) else None
  return jax.tree_util.tree_map_with_path(dtype, _block_axes(config),
                                          is_leaf=lambda a: isinstance(a, tuple))


def apply_blocks(blocks: Params | Sequence[Params], x: Array, config: TransformerConfig,
                 mask: Mask | Array | None, positions: Array | None, cache: Any = None
                 ) -> tuple[Any, ...]:
  """Runs the block stack: THE seam of the model for layer schedules (e.g. pipelining).

  Args:
    blocks: with ``config.scan_layers``, one tree of stacked params (leading ``layers`` dim,
      run with ``jax.lax.scan``); else a sequence of per-layer trees (a Python loop).
    x: ``(batch, length, embed)`` embeddings; mask, positions: shared by every block.
    cache: decoding only (``layers._decode``): the layers' caches, stacked like ``blocks``
      (a list of per-layer caches when unrolled); the stack then runs in order on one
      schedule (no remat, no pipeline) and also returns the updated caches.

  Returns:
    ``(x, aux)`` with each aux entry stacked over layers (``(num_layers,)``); with a
    ``cache``, ``(x, aux, updated caches)``.
  """
  if cache is not None:
    def layer(h, p_c):
      h, a, c = block(p_c[0], h, config, mask, positions, p_c[1])
      return h, (a, c)
    if config.scan_layers:
      x, (aux, cache) = jax.lax.scan(layer, x, (blocks, cache))
      return x, aux, cache
    outs = []
    for p_c in zip(blocks, cache):
      x, out = layer(x, p_c)
      outs.append(out)
    return x, jax.tree.map(lambda *a: jnp.stack(a), *[a for a, _ in outs]), [c for _, c in outs]
  run = block
  if config.remat != "none":
    # Under scan, CSE cannot merge the recomputation with the forward pass anyway.
    run = jax.checkpoint(block, policy=config.policy, prevent_cse=not config.scan_layers,
                         static_argnums=(2,))
  if config.scan_layers and partition.stage_axis() is not None:
    return _pipelined(run, blocks, x, config, mask, positions)
  if config.scan_layers:
    return jax.lax.scan(lambda h, p: run(p, h, config, mask, positions), x, blocks)
  auxes = []
  for p in blocks:
    x, a = run(p, x, config, mask, positions)
    auxes.append(a)
  return x, jax.tree.map(lambda *a: jnp.stack(a), *auxes)


def _pipelined(run, blocks: Params, x: Array, config: TransformerConfig,
               mask: Mask | Array | None, positions: Array | None
               ) -> tuple[Array, dict[str, Array]]:
  """The stacked blocks as a pipeline over the mesh axis the rules give ``layers``
  (``partition.pipeline``, docs/pipeline.md); the per-example arrays of the mask and the
  positions travel with ``x`` (split into micro-batches), the others are shared."""
  if config.num_experts:
    raise ConfigError("layers: a pipelined block stack (the rules map 'layers' to a mesh "
                      "axis) does not collect MoE aux losses; use num_experts=0, or map "
                      "'layers' to None.")
  leaves, tree = jax.tree.flatten((mask, positions))
  per_example = [a.ndim > 0 and a.shape[0] != 1 for a in leaves]

  def layer(p, carry, *shared):
    rest, fixed = iter(carry[1:]), iter(shared)
    m, pos = jax.tree.unflatten(tree, [next(rest) if b else next(fixed) for b in per_example])
    return (run(p, carry[0], config, m, pos)[0], *carry[1:])

  carry = (x, *(a for a, b in zip(leaves, per_example) if b))
  shared = tuple(a for a, b in zip(leaves, per_example) if not b)
  out = partition.pipeline(layer, blocks, carry, consts=shared,
                           microbatches=config.pipeline_microbatches or None,  # 0: one per stage
                           repeats=config.pipeline_repeats)
  num_layers = jax.tree.leaves(blocks)[0].shape[0]
  aux = jax.tree.map(lambda a: jnp.zeros((num_layers, *a.shape), a.dtype), _core.no_aux())
  return out[0], aux


def _body(p: Params, x: Array, config: TransformerConfig, tokens: Array,
          valid: Array | None, segment_ids: Array | None = None
          ) -> tuple[Array, dict[str, Array]]:
  """Embeddings -> final-normed hidden states (everything between lookup and logits).

  The mask is a small structure (``_core.decoder_mask``: causal flag, padding, segment ids),
  never a ``(batch, heads, L, L)`` array: each attention implementation builds what it needs.
  RoPE positions are ``0..L-1`` also for packed rows: attention within a segment depends
  only on position differences, so restarting them per segment would not change it.
  """
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  mask = _core.decoder_mask(tokens, valid, segment_ids)
  x, aux = apply_blocks(p["blocks"], x, config, mask, positions)
  scale = _core.fsdp_gather(p["final_norm"]["scale"], ("embed",), tokens.shape[0])
  return _core.rms_norm(x, scale, eps=config.norm_eps), aux


def _tied_lm(config: TransformerConfig):
  """``(table, rest, tokens, valid, segment_ids) -> (logits, aux)`` with the tied table's
  gradient reduced across devices once.

  The table has two gradient terms, ``onehot(tokens)^T dx0`` (lookup) and ``dlogits^T h``
  (output projection). Where the tokens are sharded over mesh axes, plain autodiff reduces
  each over them by itself (two ``(vocab, embed)`` all-reduces / reduce-scatters); there the
  backward pass stacks both terms' operands on a new leading dim and contracts them in one
  ``einsum``, so XLA reduces the table's gradient once. That costs a dot with the one-hot
  ``(batch, length, vocab)`` array (``2 B L V E`` FLOPs, as much as the projection's
  forward). Where no reduction exists (one device, or tokens not sharded) the lookup's term
  is the scatter-add it is (what ``jnp.take``'s transpose does), added in fp32 onto the
  projection's fp32 gradient. Same values up to float32 rounding.
  """
  def forward(table, rest, tokens, valid, segment_ids, differentiated=True):
    # One gathered copy of an FSDP-sharded table serves the lookup, the output projection
    # and the backward pass (XLA would gather it once per use).
    stored = table
    table = _core.fsdp_gather(table, ("vocab", "embed"), tokens.shape[0], config.dtype)
    x0 = partition.constrain(_core.embed(tokens, table, dtype=config.dtype), _core.EMBED)
    body = lambda r, x: _body(r, x, config, tokens, valid, segment_ids)
    # Outside autodiff (init, eval) the body is just called: tracing it through jax.vjp
    # would cost a linearization that nothing uses.
    (h, aux), body_vjp = jax.vjp(body, rest, x0) if differentiated else (body(rest, x0), None)
    logits = partition.constrain(_core.attend(h, table, dtype=config.dtype), _core.LOGITS)
    # the parameter as stored (no copy: an input) gives the gradient its dtype
    return (logits, aux), (table, stored, tokens, h, body_vjp)

  def backward(residuals, cotangents):
    table, stored, tokens, h, body_vjp = residuals
    dlogits, daux = cotangents
    dtype = dlogits.dtype
    dh = partition.constrain(jnp.einsum("blv,ve->ble", dlogits, table.astype(dtype)),
                             _core.EMBED)
    drest, dx0 = body_vjp((dh.astype(h.dtype), daux))
    if any(_core.token_mesh_axes(*tokens.shape)):  # the tokens are sharded
      onehot = partition.constrain(jax.nn.one_hot(tokens, table.shape[0], dtype=dtype),
                                   _core.LOGITS)
      dtable = jnp.einsum("sblv,sble->ve",
                          _core.token_major(jnp.stack([onehot, dlogits]), dim=1),
                          _core.token_major(jnp.stack([dx0.astype(dtype), h.astype(dtype)]),
                                            dim=1))
    else:
      dtable = jnp.einsum("blv,ble->ve", dlogits, h.astype(dtype),
                          preferred_element_type=jnp.float32)
      dtable = dtable.at[tokens].add(dx0.astype(jnp.float32))
    return dtable.astype(stored.dtype), drest, None, None, None

  lm = jax.custom_vjp(lambda table, rest, tokens, valid, segment_ids: forward(
      table, rest, tokens, valid, segment_ids, differentiated=False)[0])
  lm.defvjp(forward, backward)
  return lm


def transformer(p: Params, tokens: Array, config: TransformerConfig,
                valid: Array | None = None, *, segment_ids: Array | None = None,
                targets: Array | None = None, where: str = "layers.Transformer"
                ) -> tuple[Any, dict[str, Array]]:
  """Decoder-only LM on a parameter tree (``layers._params.transformer_params``).

  With ``config.tie_embeddings`` the table's gradient is reduced across devices once (see
  ``_tied_lm``; reverse-mode only: ``jax.jvp`` of a tied model is not supported), except
  with ``targets`` and ``config.loss_chunk > 0`` (see :func:`_chunked_loss`).

  Args:
    p: ``embed``, ``blocks`` (see :func:`apply_blocks`), ``final_norm`` and, when
      ``config.tie_embeddings`` is False, ``lm_head``.
    tokens: ``(batch, length)`` int ids, ``length <= config.max_len``.
    valid: ``(batch, length)`` bool, True for real tokens (a padding mask); or ``(batch,)``
      ints, each row's count of real tokens (right padding: the form cuDNN takes); or None.
      A padded query's attention output is zero.
    segment_ids: ``(batch, length)`` ints, one id per packed sequence (tokens attend only
      within their segment), or None.
    targets: ``(batch, length)`` int ids of the next tokens, or None. Given, the model
      returns the per-token loss instead of the logits: ``(ce, correct)``, the fp32 softmax
      cross-entropy and bool ``argmax(logits) == targets``, unmasked (the caller weighs
      padding). With ``config.loss_chunk > 0`` it is computed ``loss_chunk`` tokens per row
      at a time and the full logits never exist (``layers._loss.chunked_cross_entropy``);
      with 0, from the full logits (``layers._loss.cross_entropy``).
    where: the caller's name for error messages.

  Returns:
    ``(logits (batch, length, vocab), aux)`` or, with ``targets``, ``((ce, correct), aux)``;
    aux merged over layers (``_core.merge_aux``).
  """
  c = config
  check_mesh(where)
  check_tokens(tokens, c.max_len, where)
  if targets is not None:
    _check_targets(targets, tokens.shape, where)
  _check_mask(valid, segment_ids, tokens.shape, where)
  table = p["embed"]["embedding"]
  rest = {k: v for k, v in p.items() if k != "embed"}
  if targets is not None and c.loss_chunk:
    loss, aux = _chunked_loss(p, tokens, targets, c, valid, segment_ids)
    return loss, _core.merge_aux(aux)
  if c.tie_embeddings:
    logits, aux = _tied_lm(c)(table, rest, tokens, valid, segment_ids)
  else:
    x = partition.constrain(_core.embed(tokens, table, dtype=c.dtype), _core.EMBED)
    h, aux = _body(rest, x, c, tokens, valid, segment_ids)
    kernel = _core.fsdp_gather(p["lm_head"]["kernel"], ("embed", "vocab"), tokens.shape[0],
                               c.dtype)
    logits = partition.constrain(_core.dense(h, kernel, dtype=c.dtype), _core.LOGITS)
  out = logits if targets is None else _loss.cross_entropy(logits, targets)
  return out, _core.merge_aux(aux)


def _chunked_loss(p: Params, tokens: Array, targets: Array, config: TransformerConfig,
                  valid: Array | None, segment_ids: Array | None
                  ) -> tuple[tuple[Array, Array], dict[str, Array]]:
  """``((ce, correct), aux)`` by ``layers._loss.chunked_cross_entropy``: no full logits.

  The output projection (the tied table or ``lm_head/kernel``) is FSDP-gathered once, for
  every chunk of both passes. Plain autodiff here, not ``_tied_lm``: a tied table's gradient
  is the lookup's scatter-add plus the projection's gradient, accumulated over the chunks by
  the loss's own VJP, so TWO reductions over the batch's mesh axes instead of ``_tied_lm``'s
  one (its one dot needs the one-hot ``(batch, length, vocab)`` array, which chunking avoids).
  """
  c, batch = config, tokens.shape[0]
  table = p["embed"]["embedding"]
  if c.tie_embeddings:
    table = weights = _core.fsdp_gather(table, ("vocab", "embed"), batch, c.dtype)
  else:
    weights = _core.fsdp_gather(p["lm_head"]["kernel"], ("embed", "vocab"), batch, c.dtype)
  x = partition.constrain(_core.embed(tokens, table, dtype=c.dtype), _core.EMBED)
  rest = {k: v for k, v in p.items() if k not in ("embed", "lm_head")}
  h, aux = _body(rest, x, c, tokens, valid, segment_ids)
  loss = _loss.chunked_cross_entropy(h, weights, targets, chunk=c.loss_chunk,
                                     tied=c.tie_embeddings, dtype=c.dtype)
  return loss, aux


def _check_mask(valid: Array | None, segment_ids: Array | None, shape: tuple[int, ...],
                where: str) -> None:
  """Raises ``LayerArgumentError`` unless ``valid`` and ``segment_ids`` fit the tokens."""
  problems = []
  if valid is not None:
    lengths = np.ndim(valid) == 1   # (batch,) counts of real tokens, else a (batch, length) mask
    problems += array_problems("valid", valid, shape[:1] if lengths else shape,
                               integer_only=lengths)
  if segment_ids is not None:
    problems += array_problems("segment_ids", segment_ids, shape, integer_only=True)
  if problems:
    raise LayerArgumentError(format_message(
        f"{where}: bad mask.", bullets=problems,
        fix=f"Pass valid={shape} bool (True for real tokens) or {shape[:1]} ints (each row's "
            f"count of real tokens, right padding), and segment_ids={shape} ints."))


def _check_targets(targets: Array, shape: tuple[int, ...], where: str) -> None:
  """Raises ``LayerArgumentError`` unless ``targets`` is int ids shaped like the tokens."""
  problems = []
  if tuple(getattr(targets, "shape", ())) != tuple(shape):
    problems.append(f"targets has shape {getattr(targets, 'shape', None)}; expected the "
                    f"tokens' {tuple(shape)}")
  if not jnp.issubdtype(getattr(targets, "dtype", float), jnp.integer):
    problems.append(f"targets has dtype {getattr(targets, 'dtype', type(targets))}; "
                    "expected integer token ids")
  if problems:
    raise LayerArgumentError(format_message(
        f"{where}: bad targets.", bullets=problems,
        fix="Pass targets=<int ids of the next tokens>, one per input token (batch, length)."))
