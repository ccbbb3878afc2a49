"""Section: the cross-entropy over the vocabulary, chunked vs full logits.

Loss + gradient (w.r.t. the final hidden states and the tied ``(vocab, embed)`` table) of
the mean softmax cross-entropy of ``h (batch, length, embed)``: from the full fp32 logits
(optax's ``softmax_cross_entropy_with_integer_labels``, what ``TransformerConfig.loss_chunk
= 0`` computes) and by ``layers.chunked_cross_entropy`` (``loss_chunk`` tokens per row
per step, custom VJP). Measured on the compiled programs, never run: XLA's temp memory
(``memory_analysis``) against the full program's and against the analytic size of one fp32
copy of the logits, ``batch x length x vocab x 4`` bytes; and the flops: the matmuls' count
(the chunked backward recomputes each chunk's logits, one more ``h @ table``: 4/3 of the full
program's three) and XLA's ``cost_analysis`` (which counts a loop body once, so it reports
the chunked program's per-step flops, not its total). Target: the chunked temp memory is at
most 1/4 of the full program's (it holds the fp32 table-gradient accumulator, ``vocab x
embed``, and about two chunks of logits, ``batch x chunk x vocab``, each a small share of
the logits when ``embed`` and ``chunk`` are small against ``batch x length``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

import layers
from benchmarks.common import Row, Section, log, memory

NAME = "loss_memory"
TITLE = "Chunked cross-entropy vs full fp32 logits: temp memory and flops of loss + grad"
TARGET = 0.25


def _full(h, w, t):
  logits = jnp.einsum("ble,ve->blv", h, w).astype(jnp.float32)
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, t))


def _chunked(chunk):
  return lambda h, w, t: jnp.mean(
      layers.chunked_cross_entropy(h, w, t, chunk=chunk, tied=True)[0])


def _compiled(loss, h, w, t):
  return jax.jit(jax.value_and_grad(loss, (0, 1))).lower(h, w, t).compile()


def _flops(compiled) -> float:
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost.get("flops", 0.0))


def run(quick: bool) -> Section:
  section = Section(NAME, TITLE)
  batch, length, embed, chunk = (2, 128, 16, 8) if quick else (2, 256, 64, 16)
  vocabs = (4096, 8192) if quick else (8192, 32768, 131072)
  # Agreement, on a small case run for real: the loss and both gradients.
  keys = jax.random.split(jax.random.key(0), 3)
  h = jax.random.normal(keys[0], (batch, 24, embed))
  w = jax.random.normal(keys[1], (vocabs[0], embed)) / embed ** 0.5
  t = jax.random.randint(keys[2], (batch, 24), 0, vocabs[0])
  grad = lambda f: jax.jit(jax.value_and_grad(f, (0, 1)))(h, w, t)
  section.check(f"vocab={vocabs[0]} L=24 chunk=5", grad(_chunked(5)), grad(_full),
                rtol=1e-5, atol=1e-6)
  series = {"vocab": list(vocabs), "full": [], "chunked": [], "logits": []}
  for vocab in vocabs:
    shapes = (jax.ShapeDtypeStruct((batch, length, embed), jnp.float32),
              jax.ShapeDtypeStruct((vocab, embed), jnp.float32),
              jax.ShapeDtypeStruct((batch, length), jnp.int32))
    full, ours = _compiled(_full, *shapes), _compiled(_chunked(chunk), *shapes)
    full_temp, ours_temp = memory(full)["temp"], memory(ours)["temp"]
    logits = batch * length * vocab * 4
    matmul = 2 * batch * length * vocab * embed     # one (B L, E) x (E, V) product
    xla = f"XLA: {_flops(full):.3g} full, {_flops(ours):.3g} chunked with each loop body once"
    workload = f"B={batch} L={length} E={embed} V={vocab} chunk={chunk}"
    log(f"  {workload}: temp {ours_temp / 2**20:.2f} MiB chunked, {full_temp / 2**20:.2f} MiB "
        f"full, logits {logits / 2**20:.2f} MiB; matmul flops {4 * matmul:.3g} chunked, "
        f"{3 * matmul:.3g} full ({xla})")
    section.rows.append(Row(NAME, workload, "temp / full logits", ours_temp, full_temp,
                            "bytes", TARGET, f"matmul flops chunked / full = 4/3; {xla}",
                            ours_label="chunked", baseline_label="full logits"))
    section.rows.append(Row(NAME, workload, "temp / one fp32 copy of the logits", ours_temp,
                            logits, "bytes", None,
                            f"full program: {full_temp / logits:.2f} x the logits",
                            ours_label="chunked", baseline_label="B x L x V x 4"))
    for key, value in (("full", full_temp), ("chunked", ours_temp), ("logits", logits)):
      series[key].append(value)
  section.series["loss_memory"] = series
  return section
