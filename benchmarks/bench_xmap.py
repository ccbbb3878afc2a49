"""xmap against hand-written ``jit(vmap)`` / ``lax.scan`` / ``lax.map`` baselines.

Run ``python benchmarks/bench_xmap.py`` (``--quick`` for a short run, ``--markdown`` for a
markdown table). Everything runs in one process on 8 virtual CPU devices; every pair of
programs uses the same shardings, dtypes and shapes, and results are checked equal before
anything is timed.

Measured, side by side, as ratios ``xmap / baseline``:

* steady state: median wall time of a call (``block_until_ready``) over many repeats after
  warm-up; xmap and baseline calls are interleaved (order alternating each round) so drift
  and noise hit both alike;
* trace + compile: ``lower(*args).compile()`` on fresh function objects after
  ``jax.clear_caches()``, interleaved likewise;
* memory: compiled temp memory (``memory_analysis().temp_size_in_bytes``) of
  ``SerialLoop(k)`` against ``lax.map(f, xs, batch_size=N // k)`` (the floor for chunked
  execution) and against plain vectorisation ``jit(vmap(f))``, on a function whose
  per-example intermediate ``sin(outer(x, x))`` XLA cannot fuse away.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)  # before any JAX computation

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import partition  # noqa: E402
from partition import Mean, SerialLoop, xmap  # noqa: E402

STEADY_TARGET = 1.03
ACCUM_STEADY_TARGET = 1.05  # issue 7: value_and_grad vs a hand-written accumulation step
COMPILE_TARGET = 1.25
FLOOR_TARGET = 1.05
VECTOR_TARGET = 1.3  # divided by k
TEMP_MEMORY_ROWS = ("fsdp_tp_accum",)


# --------------------------------------------------------------------------- helpers


def _log(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


def _mesh(shape, names):
  return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


def _mlp_params(rng, d, h, o):
  return {
      "w1": jnp.asarray(rng.normal(size=(d, h)) / np.sqrt(d), jnp.float32),
      "b1": jnp.asarray(rng.normal(size=(h,)) * 0.1, jnp.float32),
      "w2": jnp.asarray(rng.normal(size=(h, o)) / np.sqrt(h), jnp.float32),
  }


def _example_loss(p, x, y):
  """Squared error of a 2-layer MLP on ONE example (x: [D], y: [O])."""
  h = jnp.tanh(x @ p["w1"] + p["b1"])
  return jnp.sum((h @ p["w2"] - y) ** 2)


def _assert_close(a, b, what):
  for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=2e-4, atol=2e-5,
                               err_msg=f"{what}: xmap and baseline disagree")


@dataclasses.dataclass
class Workload:
  """``make()`` returns fresh ``(xmap_program, baseline_program)``; both are callables
  with ``.lower``. ``args`` are placed on the shardings both programs expect."""

  name: str
  description: str
  make: Callable[[], tuple[Any, Any]]
  args: tuple
  mesh: Any


# ------------------------------------------------------------------------- workloads


def mlp_data_parallel(quick: bool) -> Workload:
  """value_and_grad of the mean loss of an MLP; batch sharded over an (8,) mesh."""
  n, d, h, o = (256, 128, 256, 16) if quick else (1024, 256, 512, 32)
  mesh = _mesh((8,), ("data",))
  rng = np.random.default_rng(0)
  rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  params = jax.device_put(_mlp_params(rng, d, h, o), rep)
  x = jax.device_put(jnp.asarray(rng.normal(size=(n, d)), jnp.float32), rows)
  y = jax.device_put(jnp.asarray(rng.normal(size=(n, o)), jnp.float32), rows)

  def make():
    loss = xmap(lambda p, x, y: _example_loss(p, x, y), ([...], ["batch", ...], ["batch", ...]),
                Mean("batch"), axis_resources={"batch": "data"}, mesh=mesh)
    ours = jax.jit(jax.value_and_grad(loss))

    def base_loss(p, x, y):
      per_example = jax.vmap(lambda p, x, y: _example_loss(p, x, y), (None, 0, 0),
                             spmd_axis_name="data")
      return per_example(p, x, y).mean()

    base = jax.jit(jax.value_and_grad(base_loss), in_shardings=(rep, rows, rows),
                   out_shardings=rep)
    return ours, base

  return Workload("mlp_dp", f"MLP value_and_grad, batch {n} on mesh (8,) 'data'",
                  make, (params, x, y), mesh)


def mlp_tensor_parallel(quick: bool) -> Workload:
  """Megatron-style MLP on a (4, 2) mesh: batch on 'data', hidden units on 'model', the
  second layer a psum over 'hidden'; value_and_grad of the mean loss."""
  n, d, h, o = (128, 128, 256, 16) if quick else (512, 256, 512, 32)
  mesh = _mesh((4, 2), ("data", "model"))
  rng = np.random.default_rng(1)
  p = _mlp_params(rng, d, h, o)
  shard = {"w1": NamedSharding(mesh, P(None, "model")), "b1": NamedSharding(mesh, P("model")),
           "w2": NamedSharding(mesh, P("model", None))}
  rows = NamedSharding(mesh, P("data"))
  rep = NamedSharding(mesh, P())
  params = jax.device_put(p, shard)
  x = jax.device_put(jnp.asarray(rng.normal(size=(n, d)), jnp.float32), rows)
  y = jax.device_put(jnp.asarray(rng.normal(size=(n, o)), jnp.float32), rows)

  def unit(p, x, y):  # one example, one hidden unit: w1 [D], b1 [], w2 [O]
    hid = jnp.tanh(x @ p["w1"] + p["b1"])
    out = lax.psum(hid * p["w2"], "hidden")
    return jnp.sum((out - y) ** 2)

  def make():
    p_axes = {"w1": {1: "hidden"}, "b1": {0: "hidden"}, "w2": {0: "hidden"}}
    loss = xmap(unit, (p_axes, ["batch", ...], ["batch", ...]), Mean("batch"),
                axis_resources={"batch": "data", "hidden": "model"}, mesh=mesh)
    ours = jax.jit(jax.value_and_grad(loss))

    def base_loss(p, x, y):
      over_hidden = jax.vmap(unit, ({"w1": 1, "b1": 0, "w2": 0}, None, None), out_axes=None,
                             axis_name="hidden", spmd_axis_name="model")
      over_batch = jax.vmap(over_hidden, (None, 0, 0), axis_name="batch",
                            spmd_axis_name="data")
      return over_batch(p, x, y).mean()

    base = jax.jit(jax.value_and_grad(base_loss), in_shardings=(shard, rows, rows),
                   out_shardings=(rep, shard))
    return ours, base

  return Workload("mlp_tp", f"MLP value_and_grad, batch {n} on 'data', hidden {h} on "
                  "'model', mesh (4,2)", make, (params, x, y), mesh)


def per_example_grads_loop(quick: bool, k: int = 4) -> Workload:
  """Mean of per-example value_and_grad, batch on ('data', SerialLoop(k)); the baseline is
  the same accumulation written by hand: vmap over devices, lax.scan over k chunks."""
  n, d, h, o = (256, 128, 256, 16) if quick else (512, 256, 512, 32)
  m = 8
  mesh = _mesh((m,), ("data",))
  rng = np.random.default_rng(2)
  rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  params = jax.device_put(_mlp_params(rng, d, h, o), rep)
  x = jax.device_put(jnp.asarray(rng.normal(size=(n, d)), jnp.float32), rows)
  y = jax.device_put(jnp.asarray(rng.normal(size=(n, o)), jnp.float32), rows)
  c = n // (m * k)

  def make():
    vg = jax.value_and_grad(lambda p, x, y: _example_loss(p, x, y))
    ours = xmap(vg, ([...], ["batch", ...], ["batch", ...]), Mean("batch"),
                axis_resources={"batch": ("data", SerialLoop(k))}, mesh=mesh)

    def base_fn(p, x, y):
      xr = x.reshape(m, k, c, *x.shape[1:])  # mesh-major: each device keeps its rows
      yr = y.reshape(m, k, c, *y.shape[1:])

      def per_device(xd, yd):  # [k, c, ...]
        def step(acc, xy):
          vals = jax.vmap(vg, (None, 0, 0))(p, *xy)
          return jax.tree_util.tree_map(lambda a, v: a + v.sum(0), acc, vals), None

        zero = (jnp.zeros((), jnp.float32), jax.tree_util.tree_map(jnp.zeros_like, p))
        acc, _ = lax.scan(step, zero, (xd, yd))
        return acc

      acc = jax.vmap(per_device, spmd_axis_name="data")(xr, yr)
      return jax.tree_util.tree_map(lambda a: a.sum(0) / n, acc)

    base = jax.jit(base_fn, in_shardings=(rep, rows, rows), out_shardings=rep)
    return ours, base

  return Workload("pex_loop", f"per-example value_and_grad, Mean over batch {n} on "
                  f"('data', SerialLoop({k})), mesh (8,)", make, (params, x, y), mesh)


def fsdp_tp_accumulation(quick: bool, k: int = 4) -> Workload:
  """``partition.value_and_grad`` with an FSDP+TP table and k micro-batches on a (2, 2, 2)
  mesh; the baseline is the same step by hand: jit with the params' shardings, a strided
  micro-batch split, and a lax.scan accumulating gradients constrained to those shardings."""
  n, d, h, o = (128, 128, 256, 128) if quick else (256, 256, 512, 256)
  mesh = _mesh((2, 2, 2), ("data", "fsdp", "tensor"))
  rules = partition.AxisRules([("batch", ("data", "fsdp")), ("embed", "fsdp"),
                               ("mlp", "tensor")])
  axes = {"w1": ("embed", "mlp"), "b1": ("mlp",), "w2": ("mlp", "embed")}
  rng = np.random.default_rng(3)
  p = _mlp_params(rng, d, h, o)
  specs = {name: rules.spec(a, p[name].shape, mesh) for name, a in axes.items()}
  shard = {name: NamedSharding(mesh, spec) for name, spec in specs.items()}
  rows = NamedSharding(mesh, P(("data", "fsdp")))
  rep = NamedSharding(mesh, P())
  params = jax.device_put(p, shard)
  batch = {"x": jax.device_put(jnp.asarray(rng.normal(size=(n, d)), jnp.float32), rows),
           "y": jax.device_put(jnp.asarray(rng.normal(size=(n, o)), jnp.float32), rows)}

  def loss(p, b):
    return jnp.mean((jnp.tanh(b["x"] @ p["w1"] + p["b1"]) @ p["w2"] - b["y"]) ** 2)

  def make():
    ours = jax.jit(partition.value_and_grad(
        loss, batch_axes=("batch", "embed"), param_axes=axes, rules=rules, mesh=mesh,
        microbatches=k))
    m = 4  # devices along the batch: data x fsdp

    def base_fn(p, b):
      def micro(x):  # micro-batch j = rows j, j+k, ... of each device's block
        x = x.reshape(m, n // (m * k), k, *x.shape[1:])
        return jnp.moveaxis(x, 2, 0).reshape(k, n // k, *x.shape[3:])

      def step(acc, mb):
        mb = lax.with_sharding_constraint(mb, {"x": rows, "y": rows})
        value, grads = jax.value_and_grad(loss)(p, mb)
        grads = lax.with_sharding_constraint(grads, shard)
        return jax.tree_util.tree_map(jnp.add, acc, (value, grads)), None

      zero = (jnp.zeros((), jnp.float32),
              lax.with_sharding_constraint(jax.tree_util.tree_map(jnp.zeros_like, p), shard))
      (value, grads), _ = lax.scan(step, zero, jax.tree_util.tree_map(micro, b))
      return value / k, jax.tree_util.tree_map(lambda g: g / k, grads)

    base = jax.jit(base_fn, in_shardings=(shard, {"x": rows, "y": rows}),
                   out_shardings=(rep, shard))
    return ours, base

  return Workload("fsdp_tp_accum", f"partition.value_and_grad, FSDP+TP, batch {n} in {k} "
                  "micro-batches, mesh (2,2,2)", make, (params, batch), mesh)


# --------------------------------------------------------------------------- measuring


def _time_call(f, args) -> float:
  t = time.perf_counter()
  jax.block_until_ready(f(*args))
  return time.perf_counter() - t


def steady_state(w: Workload, repeats: int, warmup: int) -> tuple[float, float]:
  ours, base = w.make()
  with jax.set_mesh(w.mesh):
    _assert_close(ours(*w.args), base(*w.args), w.name)
    for _ in range(warmup):
      _time_call(ours, w.args)
      _time_call(base, w.args)
    t_ours, t_base = [], []
    gc.disable()
    try:
      for i in range(repeats):
        pair = [(ours, t_ours), (base, t_base)]
        for f, out in (pair if i % 2 == 0 else pair[::-1]):
          out.append(_time_call(f, w.args))
    finally:
      gc.enable()
  return statistics.median(t_ours), statistics.median(t_base)


def compile_time(w: Workload, repeats: int) -> tuple[float, float]:
  def once(which: int) -> float:
    jax.clear_caches()
    gc.collect()
    t = time.perf_counter()
    with jax.set_mesh(w.mesh):
      program = w.make()[which]  # fresh function objects: nothing cached
      program.lower(*w.args).compile()
    return time.perf_counter() - t

  once(0), once(1)  # warm the Python-side imports and XLA's one-time setup
  t_ours, t_base = [], []
  for i in range(repeats):
    order = (0, 1) if i % 2 == 0 else (1, 0)
    for which in order:
      (t_ours if which == 0 else t_base).append(once(which))
  return statistics.median(t_ours), statistics.median(t_base)


def _temp_bytes(lowered) -> int:
  return lowered.compile().memory_analysis().temp_size_in_bytes


def memory(ks, n: int, d: int) -> list[dict]:
  def f(x):  # per example: a [d, d] intermediate XLA cannot fuse into the reduction
    return jnp.sin(jnp.outer(x, x)).sum()

  xs = jax.ShapeDtypeStruct((n, d), jnp.float32)
  vector = _temp_bytes(jax.jit(jax.vmap(f)).lower(xs))
  rows = []
  for k in ks:
    ours = _temp_bytes(xmap(f, ["b", ...], ["b", ...],
                            axis_resources={"b": SerialLoop(k)}).lower(xs))
    floor = _temp_bytes(jax.jit(lambda xs, k=k: lax.map(f, xs, batch_size=n // k)).lower(xs))
    rows.append(dict(k=k, ours=ours, floor=floor, vector=vector))
  return rows


# ---------------------------------------------------------------------------- report


def _status(ratio: float, target: float) -> str:
  return "PASS" if ratio <= target else "MISS"


def _ms(t: float) -> str:
  return f"{t * 1e3:.2f} ms"


def _mib(b: int) -> str:
  return f"{b / 2**20:.2f} MiB"


def build_rows(args) -> list[list[str]]:
  quick = args.quick
  workloads = [mlp_data_parallel(quick), mlp_tensor_parallel(quick),
               per_example_grads_loop(quick), fsdp_tp_accumulation(quick)]
  repeats, warmup, c_repeats = (30, 3, 5) if quick else (100, 5, 9)
  rows = []
  for i, w in enumerate(workloads, 1):
    _log(f"[{i}/{len(workloads) + 1}] {w.name}: {w.description}")
    _log("    steady state ...")
    ours, base = steady_state(w, repeats, warmup)
    r = ours / base
    target = ACCUM_STEADY_TARGET if w.name in TEMP_MEMORY_ROWS else STEADY_TARGET
    rows.append([w.name, "steady-state time", _ms(ours), _ms(base), f"{r:.3f}",
                 f"<= {target}", _status(r, target)])
    _log("    trace + compile ...")
    ours, base = compile_time(w, c_repeats)
    r = ours / base
    rows.append([w.name, "trace+compile time", _ms(ours), _ms(base), f"{r:.3f}",
                 f"<= {COMPILE_TARGET}", _status(r, COMPILE_TARGET)])
    if w.name in TEMP_MEMORY_ROWS:
      ours_fn, base_fn = w.make()
      ours, base = (_temp_bytes(f.lower(*w.args)) for f in (ours_fn, base_fn))
      r = ours / base
      rows.append([w.name, "temp memory", _mib(ours), _mib(base), f"{r:.3f}",
                   f"<= {FLOOR_TARGET}", _status(r, FLOOR_TARGET)])
  _log(f"[{len(workloads) + 1}/{len(workloads) + 1}] memory: sin(outer(x, x)) per example")
  n, d = (64, 128) if quick else (64, 256)
  for m in memory((2, 4), n, d):
    k = m["k"]
    r = m["ours"] / m["floor"]
    rows.append([f"mem N={n} D={d}", f"temp SerialLoop({k}) / lax.map(batch_size={n // k})",
                 _mib(m["ours"]), _mib(m["floor"]), f"{r:.3f}", f"<= {FLOOR_TARGET}",
                 _status(r, FLOOR_TARGET)])
    r = m["ours"] / m["vector"]
    target = VECTOR_TARGET / k
    rows.append([f"mem N={n} D={d}", f"temp SerialLoop({k}) / jit(vmap(f))",
                 _mib(m["ours"]), _mib(m["vector"]), f"{r:.3f}", f"<= {target:.3f}",
                 _status(r, target)])
  return rows


HEADER = ["workload", "metric", "xmap", "baseline", "ratio", "target", "status"]


def print_markdown(rows) -> None:
  print("| " + " | ".join(HEADER) + " |")
  print("|" + "|".join("---" for _ in HEADER) + "|")
  for row in rows:
    print("| " + " | ".join(row) + " |")


def print_table(rows, title: str) -> None:
  try:
    from rich.console import Console
    from rich.table import Table
  except ImportError:  # plain formatting
    widths = [max(len(x) for x in col) for col in zip(HEADER, *rows)]
    print(title)
    for row in [HEADER, *rows]:
      print("  ".join(x.ljust(w) for x, w in zip(row, widths)))
    return
  table = Table(title=title)
  for h in HEADER:
    table.add_column(h, justify="right" if h in ("xmap", "baseline", "ratio") else "left")
  for row in rows:
    style = "green" if row[-1] == "PASS" else "bold red"
    table.add_row(*row[:-1], f"[{style}]{row[-1]}[/{style}]")
  Console(width=160).print(table)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="smaller shapes, fewer repeats")
  parser.add_argument("--markdown", action="store_true", help="print a markdown table")
  args = parser.parse_args(argv)
  start = time.perf_counter()
  rows = build_rows(args)
  title = (f"xmap / baseline (jax {jax.__version__}, named-partition, "
           f"{jax.device_count()} {jax.default_backend()} devices on {os.cpu_count()} cores"
           f"{', --quick' if args.quick else ''}; {time.perf_counter() - start:.0f} s)")
  if args.markdown:
    print(title + "\n")
    print_markdown(rows)
  else:
    print_table(rows, title)
  misses = sum(row[-1] == "MISS" for row in rows)
  _log(f"{len(rows) - misses} PASS, {misses} MISS")
  return 0


if __name__ == "__main__":
  sys.exit(main())
