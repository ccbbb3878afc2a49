"""``python -m benchmarks.accelerator``: one training step on whatever device JAX sees.

Ours (a ``layers`` Transformer, ``attention='auto'``) against an independent reference written
here (a plain-JAX Llama whose attention is ``jax.nn.dot_product_attention``, cuDNN on NVIDIA
GPUs), both bf16 compute with fp32 params and AdamW, on one device:

* seconds per step (median after compile), tokens/s, compiled temp memory;
* MFU two ways: the PaLM formula, ``(6 N + 12 L H Q T)`` FLOPs per token (``N`` all
  parameters, the tied table included since it is the output projection; ``L`` layers, ``H``
  heads, ``Q`` head_dim, ``T`` sequence length), and XLA's own ``cost_analysis()`` FLOPs of the
  compiled step, each over the device's peak bf16 FLOP/s (``None`` where the peak is unknown,
  e.g. on CPU);
* the ``k = 4`` micro-batch overhead (``partition.value_and_grad(microbatches=4)`` over ``k=1``);
* batch 1 at long sequences (8192 and 32768 tokens on an accelerator; a length beyond the
  main rows' tokens per step with ``remat='full'``, see :func:`long_context_remat`);
* the attention kernel's compiled temp memory over the length (``'xla'`` against
  ``'blockwise'``, and the fused kernel where there is one): the memory curve; and the
  blockwise path's causal over non-causal FLOPs at 8 blocks (it skips the fully masked
  blocks: ``36 / 64`` of the pairs).

The model is sized to the device: the issue's 1.07 B-parameter config on a GPU/TPU with at least
80 GB, a smaller one below, a tiny one on CPU (a smoke test: it runs in the test suite). Results
go to ``benchmarks/results_accelerator.json`` (``--out``) with the device named, and a markdown
table is printed for the README.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import statistics
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import optax

import layers
import layers.linen
import partition

OUT = pathlib.Path(__file__).resolve().parent / "results_accelerator.json"
# Peak dense bf16 FLOP/s per chip, from the vendors' data sheets (matched on device_kind).
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L4": 121e12,
             "TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12,
             "TPU v5": 459e12, "TPU v6 lite": 918e12, "TPU v6e": 918e12}


@dataclasses.dataclass(frozen=True)
class Size:
  """A model and the shapes it is measured at."""

  name: str
  config: layers.TransformerConfig
  batch: int
  length: int
  long: tuple[int, ...]          # batch-1 sequence lengths
  curve: tuple[int, ...]         # attention memory curve lengths
  steps: int


def size_for(device: Any) -> Size:
  """The issue's 1.07 B model on a >= 80 GB accelerator, 4 layers below, tiny on CPU."""
  big = dict(vocab_size=32768, embed_dim=2048, mlp_dim=8192, num_heads=16, num_kv_heads=8,
             head_dim=128, num_layers=16, max_len=32768, dtype="bfloat16",
             param_dtype="float32", scan_layers=True, remat="none")
  if device.platform == "cpu":
    cfg = layers.TransformerConfig(vocab_size=256, embed_dim=64, mlp_dim=128, num_heads=4,
                                   num_kv_heads=2, head_dim=16, num_layers=2, max_len=1024,
                                   dtype="bfloat16", scan_layers=True)
    return Size("tiny (CPU smoke test)", cfg, 4, 128, (512,), (256, 512, 1024), 3)
  memory = (device.memory_stats() or {}).get("bytes_limit", 0)
  if memory >= 80e9:
    return Size("1.07B (issue 29)", layers.TransformerConfig(**big), 4, 2048, (8192, 32768),
                (1024, 2048, 4096, 8192, 16384), 10)
  return Size("1.07B widths, 4 layers", layers.TransformerConfig(**{**big, "num_layers": 4}),
              2, 2048, (8192,), (1024, 2048, 4096, 8192), 10)


def long_context_remat(cfg: layers.TransformerConfig, length: int, main_tokens: int) -> str:
  """The model's own remat up to the main rows' tokens per step (same activation memory),
  ``'full'`` beyond: with a fused kernel activations grow linearly in the tokens, and 4x the
  main rows' (27.6 GB at 8192 tokens on the H200, with cuDNN) no longer fits in JAX's
  default 75 % of the GPU's memory. MFU counts no recompute (PaLM's definition)."""
  return cfg.remat if length <= main_tokens else "full"


def peak_flops(device: Any) -> float | None:
  kind = device.device_kind
  return next((v for k, v in PEAK_BF16.items() if k.lower() in kind.lower()), None)


def palm_flops_per_token(cfg: layers.TransformerConfig, num_params: int, length: int) -> float:
  """``6 N + 12 L H Q T`` (PaLM, appendix B): the matmuls forward + backward, attention's
  ``QK^T`` and ``PV`` counted at full (non-causal) ``T``, as the paper does."""
  return 6 * num_params + 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * length


# -- the independent reference: a plain-JAX Llama ---------------------------------------------


def reference_init(cfg: layers.TransformerConfig, key: jax.Array) -> dict[str, Any]:
  """Llama params (fp32): embedding (tied), per layer q/k/v/o, gate/up/down, two norms."""
  e, h, kv, d, m = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
  n = cfg.num_layers
  ks = iter(jax.random.split(key, 8))
  w = lambda shape, fan_in: jax.random.normal(next(ks), shape, jnp.float32) / math.sqrt(fan_in)
  return {"embed": w((cfg.vocab_size, e), 1.0) * 0.02,
          "layers": {"wq": w((n, e, h * d), e), "wk": w((n, e, kv * d), e),
                     "wv": w((n, e, kv * d), e), "wo": w((n, h * d, e), h * d),
                     "wg": w((n, e, m), e), "wu": w((n, e, m), e), "wd": w((n, m, e), m),
                     "n1": jnp.ones((n, e)), "n2": jnp.ones((n, e))},
          "final": jnp.ones((e,))}


def reference_loss(params, tokens, cfg: layers.TransformerConfig, implementation):
  """Next-token cross-entropy (fp32 logits) of the reference Llama (bf16 compute)."""
  dt = jnp.bfloat16
  b, t = tokens.shape
  h, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

  def norm(x, s):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 ** 2, -1, keepdims=True) + cfg.norm_eps)
            * s).astype(dt)

  inv = cfg.rope_theta ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)
  ang = jnp.arange(t, dtype=jnp.float32)[:, None] * inv[None]
  cos, sin = jnp.cos(ang)[None, :, None], jnp.sin(ang)[None, :, None]

  def rot(x):
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, -1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(dt)

  def layer(x, p):
    y = norm(x, p["n1"])
    q = rot((y @ p["wq"].astype(dt)).reshape(b, t, h, d))
    k = rot((y @ p["wk"].astype(dt)).reshape(b, t, kv, d))
    v = (y @ p["wv"].astype(dt)).reshape(b, t, kv, d)
    a = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
    x = x + a.reshape(b, t, h * d) @ p["wo"].astype(dt)
    y = norm(x, p["n2"])
    g = jax.nn.silu(y @ p["wg"].astype(dt)) * (y @ p["wu"].astype(dt))
    return x + g @ p["wd"].astype(dt), None

  x = params["embed"].astype(dt)[tokens]
  x, _ = jax.lax.scan(layer, x, params["layers"])
  logits = (norm(x, params["final"]) @ params["embed"].astype(dt).T).astype(jnp.float32)
  logp = jax.nn.log_softmax(logits[:, :-1])
  return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))


# -- steps -----------------------------------------------------------------------------------


def _ours(cfg: layers.TransformerConfig, batch: int, length: int, microbatches: int = 1):
  model = layers.linen.Transformer(cfg)
  example = jnp.zeros((batch, length), jnp.int32)
  params = partition.unbox(model.init(jax.random.key(0), example))

  def loss(params, data):
    logits = model.apply(params, data["tokens"]).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits[:, :-1])
    return -jnp.mean(jnp.take_along_axis(logp, data["tokens"][:, 1:, None], -1))

  grad = partition.value_and_grad(loss, batch_axes={"tokens": ("batch", "length")},
                                  param_axes=jax.tree.map(lambda _: None, params),
                                  microbatches=microbatches)
  return params, lambda p, tokens: grad(p, {"tokens": tokens})


def _reference(cfg: layers.TransformerConfig, implementation):
  params = reference_init(cfg, jax.random.key(0))
  grad = jax.value_and_grad(lambda p, t: reference_loss(p, t, cfg, implementation))
  return params, grad


def _train_step(grad_fn, optimizer):
  def step(params, opt_state, tokens):
    loss, grads = grad_fn(params, tokens)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
  return jax.jit(step, donate_argnums=(0, 1))


def measure(name: str, params, grad_fn, tokens, steps: int, peak: float | None,
            palm_per_token: float) -> dict[str, Any]:
  """Compile, then time ``steps`` steps (median); memory and FLOPs from the compiled step."""
  optimizer = optax.adamw(1e-4)
  opt_state = optimizer.init(params)
  step = _train_step(grad_fn, optimizer)
  row: dict[str, Any] = {"name": name, "batch": int(tokens.shape[0]),
                         "length": int(tokens.shape[1])}
  try:
    t0 = time.perf_counter()
    compiled = step.lower(params, opt_state, tokens).compile()
    row["compile_s"] = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    row["temp_bytes"] = int(getattr(mem, "temp_size_in_bytes", 0)) if mem else None
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    row["xla_flops"] = float(cost.get("flops", 0.0)) if cost else None
    times = []
    for _ in range(steps + 1):
      t0 = time.perf_counter()
      params, opt_state, loss = compiled(params, opt_state, tokens)
      loss.block_until_ready()
      times.append(time.perf_counter() - t0)
    row["step_s"] = statistics.median(times[1:])
    row["loss"] = float(loss)
  except Exception as e:  # noqa: BLE001  (an out-of-memory at long lengths is a result)
    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return row
  n_tokens = tokens.size
  row["tokens_per_s"] = n_tokens / row["step_s"]
  row["mfu_palm"] = None if peak is None else palm_per_token * n_tokens / row["step_s"] / peak
  row["mfu_xla"] = (None if peak is None or not row["xla_flops"]
                    else row["xla_flops"] / row["step_s"] / peak)
  return row


def attention_memory_curve(cfg: layers.TransformerConfig, lengths, implementations):
  """Compiled temp bytes of attention forward + backward alone (batch 1, the model's heads)."""
  out = []
  for length in lengths:
    q = jax.ShapeDtypeStruct((1, length, cfg.num_heads, cfg.head_dim), cfg.dtype)
    kv = jax.ShapeDtypeStruct((1, length, cfg.num_kv_heads, cfg.head_dim), cfg.dtype)
    row = {"length": length}
    for impl in implementations:
      f = lambda q, k, v, impl=impl: jnp.sum(layers.dot_product_attention(
          q, k, v, layers.Mask(), implementation=impl,
          block=cfg.attention_block).astype(jnp.float32))
      try:
        compiled = jax.jit(jax.grad(f, argnums=(0, 1, 2))).lower(q, kv, kv).compile()
        row[impl] = int(compiled.memory_analysis().temp_size_in_bytes)
      except Exception as e:  # noqa: BLE001
        row[impl] = f"{type(e).__name__}"
    out.append(row)
  return out


def blockwise_causal_flops(cfg: layers.TransformerConfig, blocks: int = 8) -> dict[str, Any]:
  """XLA's FLOPs of the blockwise attention's forward + backward, causal against non-causal,
  at ``blocks`` blocks per side (batch 1, the model's heads; scans unrolled, as XLA's cost
  analysis counts a loop body once). Expected: ``(n + 1) / (2 n)`` of the pairs run."""
  block = min(cfg.attention_block, 128)
  q = jax.ShapeDtypeStruct((1, blocks * block, cfg.num_heads, cfg.head_dim), cfg.dtype)
  kv = jax.ShapeDtypeStruct((1, blocks * block, cfg.num_kv_heads, cfg.head_dim), cfg.dtype)

  def flops(causal):
    f = lambda q, k, v, w: jnp.sum(w * layers.blockwise_attention(
        q, k, v, layers.Mask(causal=causal), block=block, unroll=True).astype(jnp.float32))
    cost = jax.jit(jax.grad(f, argnums=(0, 1, 2))).lower(q, kv, kv, q).compile().cost_analysis()
    return float((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"])

  causal, full = flops(True), flops(False)
  return {"blocks": blocks, "length": blocks * block, "causal_flops": causal,
          "full_flops": full, "ratio": causal / full,
          "pairs_ratio": (blocks + 1) / (2 * blocks)}


def run(size: Size | None = None, out: pathlib.Path | None = OUT) -> dict[str, Any]:
  """Every measurement on ``jax.devices()[0]``; written to ``out`` (None: not written)."""
  device = jax.devices()[0]
  size = size_for(device) if size is None else size
  cfg, peak = size.config, peak_flops(device)
  fused = {"gpu": "cudnn", "tpu": None}.get(device.platform)
  choice = layers.attention_choice(cfg, batch=size.batch, length=size.length)
  tokens = jax.random.randint(jax.random.key(1), (size.batch, size.length), 0, cfg.vocab_size)
  params, grad = _ours(cfg, size.batch, size.length)
  n = sum(x.size for x in jax.tree.leaves(params))
  per_token = palm_flops_per_token(cfg, n, size.length)
  log = lambda msg: print(msg, file=sys.stderr, flush=True)
  rows = []
  log(f"device: {device.device_kind} ({device.platform}); model {size.name}, {n / 1e9:.3f} B "
      f"params; attention {choice}")
  rows.append(measure(f"ours ({choice.implementation})", params, grad, tokens, size.steps,
                      peak, per_token))
  log(str(rows[-1]))
  rparams, rgrad = _reference(cfg, fused)
  rows.append(measure(f"reference ({fused or 'xla'})", rparams, rgrad, tokens, size.steps,
                      peak, palm_flops_per_token(cfg, sum(x.size for x in
                                                          jax.tree.leaves(rparams)),
                                                 size.length)))
  log(str(rows[-1]))
  params4, grad4 = _ours(cfg, size.batch, size.length, microbatches=4)
  rows.append(measure("ours, microbatches=4", params4, grad4, tokens, size.steps, peak,
                      per_token))
  log(str(rows[-1]))
  for length in size.long:
    lcfg = dataclasses.replace(cfg, max_len=max(cfg.max_len, length),
                               remat=long_context_remat(cfg, length, size.batch * size.length))
    ltokens = jax.random.randint(jax.random.key(2), (1, length), 0, cfg.vocab_size)
    lparams, lgrad = _ours(lcfg, 1, length)
    lchoice = layers.attention_choice(lcfg, batch=1, length=length)
    rows.append(measure(f"ours 1x{length} ({lchoice.implementation}, remat {lcfg.remat})",
                        lparams, lgrad, ltokens, max(2, size.steps // 2), peak,
                        palm_flops_per_token(lcfg, n, length)))
    log(str(rows[-1]))
  impls = ["xla", "blockwise"] + ([fused] if fused else [])
  curve = attention_memory_curve(cfg, size.curve, impls)
  log(f"attention temp memory curve: {curve}")
  causal_flops = blockwise_causal_flops(cfg)
  log(f"blockwise causal / non-causal FLOPs: {causal_flops}")
  ours, ref, micro = rows[0], rows[1], rows[2]
  summary = {
      "ours_over_reference_time": _ratio(ours, ref, "step_s"),
      "ours_over_reference_temp": _ratio(ours, ref, "temp_bytes"),
      "microbatches4_over_k1_time": _ratio(micro, ours, "step_s"),
  }
  result = {"device": {"kind": device.device_kind, "platform": device.platform,
                       "peak_bf16_flops": peak},
            "jax": jax.__version__, "model": size.name, "num_params": n,
            "config": {k: str(v) for k, v in dataclasses.asdict(cfg).items()},
            "batch": size.batch, "length": size.length, "attention": str(choice),
            "rows": rows, "summary": summary, "attention_memory_curve": curve,
            "blockwise_causal_flops": causal_flops}
  if out is not None:
    out.write_text(json.dumps(result, indent=2) + "\n")
  return result


def _ratio(a: dict, b: dict, key: str) -> float | None:
  if a.get(key) and b.get(key):
    return a[key] / b[key]
  return None


def markdown(result: dict[str, Any]) -> str:
  """The README table of one run."""
  gb = lambda b: "-" if not isinstance(b, int) else f"{b / 1e9:.2f} GB"
  pct = lambda x: "-" if x is None else f"{100 * x:.1f} %"
  lines = [f"Device: {result['device']['kind']} ({result['device']['platform']}), jax "
           f"{result['jax']}; model {result['model']} ({result['num_params'] / 1e9:.3f} B "
           f"params), attention {result['attention']}.", "",
           "| run | batch x length | s/step | tokens/s | MFU (PaLM) | MFU (XLA) | temp |",
           "|---|---|---|---|---|---|---|"]
  for r in result["rows"]:
    if "error" in r:
      lines.append(f"| {r['name']} | {r['batch']} x {r['length']} | {r['error']} | | | | |")
      continue
    lines.append(f"| {r['name']} | {r['batch']} x {r['length']} | {r['step_s']:.4f} | "
                 f"{r['tokens_per_s']:.0f} | {pct(r['mfu_palm'])} | {pct(r['mfu_xla'])} | "
                 f"{gb(r['temp_bytes'])} |")
  curve = result["attention_memory_curve"]
  impls = [k for k in curve[0] if k != "length"] if curve else []
  lines += ["", "Attention forward + backward, compiled temp memory (batch 1):", "",
            "| length | " + " | ".join(impls) + " |", "|---|" + "---|" * len(impls)]
  lines += ["| " + str(c["length"]) + " | " + " | ".join(gb(c[i]) for i in impls) + " |"
            for c in curve]
  cf = result.get("blockwise_causal_flops")
  if cf:
    lines += ["", f"Blockwise attention, causal / non-causal XLA FLOPs (forward + backward, "
                  f"{cf['blocks']} blocks of {cf['length'] // cf['blocks']}): "
                  f"{cf['ratio']:.3f} (pairs run: {cf['pairs_ratio']:.4f})."]
  s = result["summary"]
  f = lambda x: "-" if x is None else f"{x:.2f}"
  lines += ["", f"ours / reference: time {f(s['ours_over_reference_time'])}, temp "
                f"{f(s['ours_over_reference_temp'])}; microbatches=4 / k=1: "
                f"{f(s['microbatches4_over_k1_time'])}."]
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.accelerator",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--out", type=pathlib.Path, default=OUT,
                      help=f"the JSON results file (default {OUT})")
  args = parser.parse_args(argv)
  result = run(out=args.out)
  print(markdown(result))
  return 0


if __name__ == "__main__":
  sys.exit(main())
