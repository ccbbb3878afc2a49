"""Section 2: temp memory of ``SerialLoop(k)`` for k = 1..32.

The per-example function is ``sin(outer(x, x)).sum()``: its ``[D, D]`` intermediate cannot
be fused into the reduction, so the temp memory of a program is the size of the
intermediates alive at once. Chunked execution in ``k`` sequential chunks keeps ``N/k`` of
them alive; the floor for that is ``lax.map(f, xs, batch_size=N // k)`` (JAX's own chunked
map), and plain vectorisation ``jit(vmap(f))`` keeps all ``N``. Targets: ``SerialLoop(k)``
<= 1.05 x the floor, and <= 1.3 / k of plain vectorisation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from benchmarks.common import MEMORY_TARGET, Row, Section, log, memory
from partition import SerialLoop, xmap

NAME = "serial_loop_memory"
TITLE = "2. SerialLoop(k) temp memory vs lax.map(batch_size=N/k) and 1/k of jit(vmap)"
KS = (1, 2, 4, 8, 16, 32)
VECTOR_TARGET = 1.3  # divided by k


def f(x):
  """One example: a ``[D, D]`` intermediate XLA cannot fuse away."""
  return jnp.sin(jnp.outer(x, x)).sum()


def _temp(program, xs) -> int:
  return memory(program.lower(xs).compile())["temp"]


def run(quick: bool) -> Section:
  section = Section(NAME, TITLE)
  n, d = (32, 64) if quick else (64, 256)
  xs = jax.ShapeDtypeStruct((n, d), jnp.float32)
  data = jax.random.normal(jax.random.key(0), (n, d), jnp.float32)
  vector = _temp(jax.jit(jax.vmap(f)), xs)
  reference = jax.jit(jax.vmap(f))(data)
  log(f"  N={n} D={d}: k = {KS}")
  ours_bytes, floor_bytes = [], []
  for k in KS:
    loop = xmap(f, ["b", ...], ["b", ...], axis_resources={"b": SerialLoop(k)})
    floor = jax.jit(lambda xs, k=k: lax.map(f, xs, batch_size=n // k))
    section.check(f"SerialLoop({k})", loop(data), reference, rtol=1e-5, atol=1e-4)
    ours, base = _temp(loop, xs), _temp(floor, xs)
    ours_bytes.append(ours)
    floor_bytes.append(base)
    workload = f"N={n} D={d} k={k}"
    section.rows.append(Row(NAME, workload, f"temp / lax.map(batch_size={n // k})", ours,
                            base, "bytes", MEMORY_TARGET, ours_label="SerialLoop(k)",
                            baseline_label="lax.map"))
    target = VECTOR_TARGET / k
    note = ""
    if ours / vector > target and ours <= MEMORY_TARGET * base:
      note = (f"at the lax.map floor: with {n // k} example(s) per chunk, buffers that do not "
              f"shrink with k ({(ours - vector / k) / 1024:.1f} KiB: loop input/output slices) "
              "dominate")
    section.rows.append(Row(NAME, workload, "temp / jit(vmap(f))", ours, vector, "bytes",
                            round(target, 4), note, ours_label="SerialLoop(k)",
                            baseline_label="jit(vmap)"))
  section.series["memory_vs_k"] = {"k": list(KS), "serial_loop": ours_bytes,
                                   "lax_map": floor_bytes,
                                   "vmap_over_k": [vector / k for k in KS], "n": n, "d": d}
  return section
