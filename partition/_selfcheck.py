"""The environment report and self-check behind ``python -m partition``."""

from __future__ import annotations

import importlib.metadata
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

_PACKAGES = ("named-partition", "jax", "jaxlib", "flax", "optax", "dm-haiku", "numpy")


def environment_report() -> str:
  lines = ["named-partition environment"]
  for pkg in _PACKAGES:
    try:
      version = importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
      version = "not installed"
    lines.append(f"  {pkg:<16} {version}")
  devices = jax.devices()
  lines.append(f"  backend          {jax.default_backend()}")
  lines.append(f"  devices          {len(devices)} x {devices[0].device_kind}")
  lines.append(f"  processes        {jax.process_count()}")
  return "\n".join(lines)


def matmul_precision_note() -> str:
  """What a float32 matmul computes at JAX's default precision on this backend."""
  configured = jax.config.jax_default_matmul_precision
  if configured:
    return f"jax_default_matmul_precision={configured!r}"
  return {"cpu": "float32", "gpu": "TF32 on NVIDIA GPUs since Ampere (10-bit mantissa)",
          "tpu": "one bfloat16 pass (8-bit mantissa)"}.get(jax.default_backend(), "backend default")


def programs(mesh: jax.sharding.Mesh):
  """The self-check's two xmaps on ``mesh``: ``forward(w, x)`` (``tanh(x @ w.T)`` over
  ``(batch on data, feature on model)``) and ``mean(w, x)`` (its mean over the batch,
  accumulated over ``('data', SerialLoop(4))``).

  The dot is computed at ``precision='highest'`` (true float32 on every backend): at JAX's
  default a GPU multiplies float32 in TF32 and a TPU in bfloat16, whose errors (about
  ``1e-3`` relative) are the backend's, not xmap's, and would fail a comparison with numpy
  at ``1e-5``.
  """
  import partition

  def layer(w_row, x_row):  # one output feature of one example
    return jnp.tanh(jnp.dot(w_row, x_row, precision=jax.lax.Precision.HIGHEST))

  forward = partition.xmap(layer, (["feature", ...], ["batch", ...]), ["batch", "feature"],
                           axis_resources={"batch": "data", "feature": "model"}, mesh=mesh)
  mean = partition.xmap(layer, (["feature", ...], ["batch", ...]),
                        partition.Mean("batch", axes=["feature"]),
                        axis_resources={"batch": ("data", partition.SerialLoop(4))}, mesh=mesh)
  return forward, mean


def run_selfcheck(num_devices: int = 8) -> bool:
  """Runs an xmap'd MLP-style computation sharded over a 2-D mesh plus serial micro-batches,
  compares it with numpy and prints what it did. Returns whether every check passed.

  It holds on every backend and device count: the matmul runs in true float32 (see
  :func:`programs`), and float32 against float64 numpy differs by ``~1e-6`` here (16-term
  dots of unit normals, then ``tanh``), well inside the ``atol=1e-5`` it is checked at.
  """
  n = len(jax.devices())
  shape = (n // 2, 2) if n % 2 == 0 and n > 1 else (n, 1)
  mesh = jax.make_mesh(shape, ("data", "model"))
  rng = np.random.default_rng(0)
  batch, d_in, d_out = 8 * n, 16, 8
  x = rng.normal(size=(batch, d_in)).astype(np.float32)
  w = rng.normal(size=(d_out, d_in)).astype(np.float32)

  checks = []
  start = time.perf_counter()
  forward, mean = programs(mesh)
  y = forward(w, x)
  want = np.tanh(x.astype(np.float64) @ w.T.astype(np.float64))
  checks.append(("forward over mesh (data, model)", np.allclose(y, want, atol=1e-5),
                 f"output sharding {y.sharding.spec}"))
  checks.append(("output placed as asked", y.sharding.spec == PartitionSpec("data", "model"),
                 f"{len(y.sharding.device_set)} devices"))
  m = mean(w, x)
  checks.append(("Mean over ('data', SerialLoop(4))", np.allclose(m, want.mean(0), atol=1e-5),
                 "accumulated in 4 sequential micro-batches per device"))
  elapsed = time.perf_counter() - start

  print(f"\nself-check on {dict(mesh.shape)} mesh ({n} x {jax.devices()[0].device_kind}, "
        f"{elapsed:.2f}s)")
  print("  float32 matmuls at precision='highest' (JAX's default here: "
        f"{matmul_precision_note()}); compared with float64 numpy at atol=1e-5")
  for name, ok, detail in checks:
    print(f"  [{'ok' if ok else 'FAIL'}] {name}: {detail}")
  passed = all(ok for _, ok, _ in checks)
  print("all checks passed" if passed else "SELF-CHECK FAILED")
  return passed
