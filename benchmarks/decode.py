"""Section 10: decoding (``layers._decode``) vs a hand-written ``jit`` decode loop.

The model is the ``layers`` Transformer (scanned blocks, GQA, untied) on one device; the
baseline is the same model written by hand in plain ``jax.numpy`` (fused QKV kernel, RoPE,
grouped attention over a ``(layers, batch, length, kv_heads, head_dim)`` cache, SwiGLU), its
decode step jitted with the cache donated, called from a Python loop. Both read the same
params, and their prefill logits, decode-step logits and greedy tokens are checked equal.

Rows (targets: ``<= 1.05 x`` the hand-written program):

* **prefill time** of a batch of prompts (ours: ``Programs.prefill``, the model's own causal
  forward pass writing the cache).
* **decode step time**, teacher-forced: ours ``jit(decode_step)`` (donated cache) vs the
  hand-written step, each in a Python loop of ``steps`` calls; seconds per step.
* **greedy decode, whole loop**: ours ``Programs.loop`` (one ``lax.while_loop``: sampling,
  stop tokens, per-row positions) vs the hand-written step + argmax in a Python loop;
  seconds per generated token (tokens/s is its inverse, printed in the workload).
* **cache bytes per device** on the ``fsdp_tp`` preset's ``(2, 2, 2)`` mesh: the bytes the
  first device holds after ``init_cache`` vs the analytic size (each array divided by the
  mesh sizes its spec splits it over, worked out here from the rules by hand).

On an accelerator (``JAX_PLATFORMS=cuda python -m benchmarks.run --only decode``) the same
rows are measured on its first device.
"""

from __future__ import annotations

import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import layers
import layers.linen
from benchmarks.common import BYTES_TARGET, Check, Row, Section, auto_mesh, log
from layers import _decode

NAME = "decode"
TITLE = "10. decoding (layers._decode) vs a hand-written jit decode loop"
DECODE_TARGET = 1.05


def config(quick: bool) -> layers.TransformerConfig:
  if quick:
    return layers.TransformerConfig(vocab_size=64, embed_dim=32, mlp_dim=64, num_heads=4,
                                    num_kv_heads=2, head_dim=8, num_layers=2, max_len=64,
                                    scan_layers=True, tie_embeddings=False)
  return layers.TransformerConfig(vocab_size=2048, embed_dim=256, mlp_dim=1024, num_heads=8,
                                  num_kv_heads=4, head_dim=32, num_layers=4, max_len=256,
                                  scan_layers=True, tie_embeddings=False)


# -- the hand-written model ------------------------------------------------------------------


def _rms(x, scale, eps):
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _rope(x, pos, theta):
  half = x.shape[-1] // 2
  freq = theta ** (-jnp.arange(half, dtype=jnp.float32) * 2 / x.shape[-1])
  ang = pos.astype(jnp.float32)[:, :, None, None, None] * freq      # (b, t, 1, 1, half)
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * jnp.cos(ang) - x2 * jnp.sin(ang),
                          x2 * jnp.cos(ang) + x1 * jnp.sin(ang)], axis=-1)


def hand_forward(params, tokens, pos, ck, cv, cfg, prefill):
  """Plain-jnp forward of ``tokens (b, t)`` at ``pos (b, t)``: ``(logits, ck, cv)``."""
  g = cfg.num_heads // cfg.num_kv_heads
  b, t = tokens.shape
  x = params["embed"]["embedding"][tokens]
  slots = jnp.arange(ck.shape[2])

  def layer(x, p_c):
    p, k_cache, v_cache = p_c
    h = _rms(x, p["attn_norm"]["scale"], cfg.norm_eps)
    qkv = jnp.einsum("bte,ekgd->btkgd", h, p["attn"]["qkv"]["kernel"])
    q = _rope(qkv[..., :g, :], pos, cfg.rope_theta)
    k = _rope(qkv[..., g:g + 1, :], pos, cfg.rope_theta)[..., 0, :]
    v = qkv[..., g + 1, :]
    if prefill:
      k_cache = jax.lax.dynamic_update_slice_in_dim(k_cache, k, 0, axis=1)
      v_cache = jax.lax.dynamic_update_slice_in_dim(v_cache, v, 0, axis=1)
      keys, values, mask = k, v, jnp.tril(jnp.ones((t, t), bool))[None, None, None]
    else:
      rows = jnp.arange(b)[:, None]
      k_cache = k_cache.at[rows, pos].set(k)
      v_cache = v_cache.at[rows, pos].set(v)
      keys, values = k_cache, v_cache
      mask = (slots[None, :] <= pos[:, :, None])[:, None, None]        # (b, 1, 1, t, S)
    s = jnp.einsum("btkgd,bskd->bkgts", q, keys) / math.sqrt(cfg.head_dim)
    w = jax.nn.softmax(jnp.where(mask, s, jnp.finfo(s.dtype).min), axis=-1)
    o = jnp.einsum("bkgts,bskd->btkgd", w, values).reshape(b, t, cfg.num_heads, -1)
    x = x + jnp.einsum("bthd,hde->bte", o, p["attn"]["out"]["kernel"])
    h = _rms(x, p["mlp_norm"]["scale"], cfg.norm_eps)
    gu = jnp.einsum("bte,egm->btgm", h, p["mlp"]["wi"]["kernel"])
    x = x + jnp.einsum("btm,me->bte", jax.nn.silu(gu[..., 0, :]) * gu[..., 1, :],
                       p["mlp"]["wo"]["kernel"])
    return x, (k_cache, v_cache)

  x, (ck, cv) = jax.lax.scan(layer, x, (params["blocks"], ck, cv))
  h = _rms(x, params["final_norm"]["scale"], cfg.norm_eps)
  return h @ params["lm_head"]["kernel"], ck, cv


# -- measurements ----------------------------------------------------------------------------


def _loop_seconds(make_state, run_loop, repeats):
  """Median seconds of ``run_loop(state)`` over ``repeats`` fresh states (state untimed)."""
  times = []
  for _ in range(repeats):
    state = make_state()
    jax.block_until_ready(state)
    t = time.perf_counter()
    jax.block_until_ready(run_loop(state))
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def _interleaved(pairs, repeats):
  """``[(make_state, run_loop), ...]`` timed alternately; median of each."""
  out = [[] for _ in pairs]
  for i in range(repeats):
    order = range(len(pairs)) if i % 2 == 0 else reversed(range(len(pairs)))
    for j in order:
      out[j].append(_loop_seconds(*pairs[j], 1))
  return [statistics.median(t) for t in out]


def run(quick: bool) -> Section:
  section = Section(NAME, TITLE)
  cfg = config(quick)
  batch, prompt, steps = (2, 8, 8) if quick else (8, 64, 64)
  repeats = 3 if quick else 7
  model = layers.linen.Transformer(cfg)
  variables = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
  params = layers.linen.decode_params(variables, cfg)
  tokens = jax.random.randint(jax.random.key(1), (batch, prompt + steps), 2, cfg.vocab_size)
  length = prompt + steps
  lengths = jnp.full((batch,), prompt, jnp.int32)
  n = sum(x.size for x in jax.tree.leaves(params))
  workload = (f"Transformer {n / 1e6:.2f}M params, batch {batch}, prompt {prompt}, "
              f"{steps} new tokens, 1 {jax.devices()[0].platform} device")
  log(f"  {workload}")

  programs = _decode.Programs(cfg, layers.Sampling(max_new_tokens=steps), batch=batch,
                              prompt_length=prompt, cache_length=length, rules=None,
                              mesh=None)
  ours_step = jax.jit(lambda p, t, pos, c: _decode.decode_step(p, t, pos, c, cfg),
                      donate_argnums=(3,))
  ours_prefill = jax.jit(lambda p, t, c: _decode.prefill(p, t, c, cfg), donate_argnums=(2,))

  def fresh_cache():
    return layers.init_cache(cfg, batch, length)

  def fresh_hand():
    c = fresh_cache()
    return c.k, c.v

  hand_prefill = jax.jit(lambda p, t, k, v: hand_forward(
      p, t, jnp.broadcast_to(jnp.arange(t.shape[1]), t.shape), k, v, cfg, True),
      donate_argnums=(2, 3))
  hand_step = jax.jit(lambda p, t, pos, k, v: hand_forward(p, t, pos, k, v, cfg, False),
                      donate_argnums=(3, 4))

  def hand_greedy_step(p, tok, pos, k, v):
    logits, k, v = hand_forward(p, tok, pos, k, v, cfg, False)
    return jnp.argmax(logits[:, -1], -1).astype(jnp.int32)[:, None], k, v

  hand_greedy = jax.jit(hand_greedy_step, donate_argnums=(3, 4))

  # -- agreement: prefill logits, teacher-forced step logits, greedy tokens
  first = tokens[:, :prompt]
  ours_logits, cache = ours_prefill(params, first, fresh_cache())
  hand_logits, hk, hv = hand_prefill(params, first, *fresh_hand())
  section.check(f"{workload}: prefill", ours_logits, hand_logits, rtol=1e-4, atol=1e-4)
  ours_steps, hand_steps = [], []
  for i in range(prompt, length):
    pos = jnp.full((batch, 1), i, jnp.int32)
    logits, cache = ours_step(params, tokens[:, i:i + 1], pos, cache)
    ours_steps.append(logits)
    logits, hk, hv = hand_step(params, tokens[:, i:i + 1], pos, hk, hv)
    hand_steps.append(logits)
  section.check(f"{workload}: decode step", ours_steps, hand_steps, rtol=1e-4, atol=1e-4)

  def hand_generate(state):
    k, v = state
    logits, k, v = hand_prefill(params, first, k, v)
    tok = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)[:, None]
    out = [tok]
    for i in range(prompt, prompt + steps - 1):
      tok, k, v = hand_greedy(params, tok, jnp.full((batch, 1), i, jnp.int32), k, v)
      out.append(tok)
    return jnp.concatenate(out, axis=1)

  ours_generated = programs(params, np.asarray(first), np.asarray(lengths))
  section.check(f"{workload}: greedy decode, whole loop", ours_generated.tokens,
                hand_generate(fresh_hand()), rtol=0, atol=0)

  # -- prefill time
  t_ours, t_hand = _interleaved([
      (fresh_cache, lambda c: ours_prefill(params, first, c)),
      (fresh_hand, lambda s: hand_prefill(params, first, *s))], repeats)
  section.rows.append(Row(NAME, f"{workload}: prefill", "prefill time", t_ours, t_hand, "s",
                          DECODE_TARGET, baseline_label="hand-written jit"))

  # -- decode step time (teacher forcing, Python loop over the jitted donated step)
  def prefilled():
    return ours_prefill(params, first, fresh_cache())[1]

  def hand_prefilled():
    return hand_prefill(params, first, *fresh_hand())[1:]

  def ours_loop(c):
    for i in range(prompt, length):
      logits, c = ours_step(params, tokens[:, i:i + 1], jnp.full((batch, 1), i, jnp.int32), c)
    return logits

  def hand_loop(s):
    k, v = s
    for i in range(prompt, length):
      logits, k, v = hand_step(params, tokens[:, i:i + 1], jnp.full((batch, 1), i, jnp.int32),
                               k, v)
    return logits

  t_ours, t_hand = _interleaved([(prefilled, ours_loop), (hand_prefilled, hand_loop)], repeats)
  section.rows.append(Row(NAME, f"{workload}: decode step", "decode step time",
                          t_ours / steps, t_hand / steps, "s", DECODE_TARGET,
                          baseline_label="hand-written jit"))

  # -- the whole greedy loop: ours one while_loop, the baseline a Python loop
  logits0 = jnp.take_along_axis(ours_prefill(params, first, fresh_cache())[0],
                                (lengths - 1)[:, None, None], axis=1)[:, 0]

  def ours_whole(c):
    return programs.loop(params, c, logits0, lengths)[0]

  def hand_whole(s):
    k, v = s
    tok = jnp.argmax(logits0, -1).astype(jnp.int32)[:, None]
    out = [tok]
    for i in range(prompt, prompt + steps - 1):
      tok, k, v = hand_greedy(params, tok, jnp.full((batch, 1), i, jnp.int32), k, v)
      out.append(tok)
    return jnp.concatenate(out, axis=1)

  t_ours, t_hand = _interleaved([(prefilled, ours_whole), (hand_prefilled, hand_whole)],
                                repeats)
  per = batch * steps
  section.rows.append(Row(
      NAME, f"{workload}: greedy decode, whole loop", "seconds per generated token",
      t_ours / per, t_hand / per, "s", DECODE_TARGET,
      note=f"{per / t_ours:,.0f} vs {per / t_hand:,.0f} tokens/s",
      baseline_label="hand-written jit loop"))

  row, check = _cache_bytes(cfg, batch, length)
  section.rows.append(row)
  section.checks.append(check)
  return section


def _cache_bytes(cfg, batch, length) -> tuple[Row, Check]:
  """Bytes on the first device of the cache ``init_cache`` makes under ``fsdp_tp`` on a
  ``(2, 2, 2)`` mesh, against the size worked out by hand from the preset's rules."""
  from recipes.config import preset_rules
  mesh = auto_mesh((2, 2, 2), ("data", "fsdp", "tensor"))
  cache = layers.init_cache(cfg, batch * 4, length, rules=preset_rules("fsdp_tp"), mesh=mesh)
  device = mesh.devices.flat[0]
  held = sum(s.data.nbytes for x in (cache.k, cache.v) for s in x.addressable_shards
             if s.device == device)
  # batch over data x fsdp (4), kv_heads over tensor (2); layers, length, head_dim whole.
  kv_split = 2 if cfg.num_kv_heads % 2 == 0 else 1
  analytic = 2 * cfg.num_layers * (batch * 4 // 4) * length * (cfg.num_kv_heads // kv_split) \
      * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize
  workload = f"KV cache {batch * 4} x {length} tokens, fsdp_tp, mesh (2,2,2)"
  library = layers.cache_bytes_per_device(cfg, batch * 4, length,
                                           rules=preset_rules("fsdp_tp"), mesh=mesh)
  check = Check(NAME, workload, float(abs(library - analytic)), 0.0, 0.0, library == analytic)
  return (Row(NAME, workload, "cache bytes per device", held, analytic, "bytes", BYTES_TARGET,
              baseline_label="analytic"), check)
