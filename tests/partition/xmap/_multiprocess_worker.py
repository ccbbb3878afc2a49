"""One process of the two-process xmap test (run by test_multiprocess.py, not by pytest).

Usage: python _multiprocess_worker.py PROCESS_ID PORT AXIS_TYPE OUT_JSON

Joins a 2-process JAX cluster on 127.0.0.1:PORT with 4 CPU devices per process, builds an
8-device mesh ('data',) spanning both processes, and runs

* ``normalized``: ``x / psum(sum(x**2), 'b')`` with 'b' on 'data' (an all-reduce across
  processes), out_axes ['b', ...];
* ``mean_loop``: ``Mean('b')`` of ``tanh(x @ w)`` with 'b' on ``('data', SerialLoop(2))``.

Inputs are built with ``jax.make_array_from_callback`` from a seeded global numpy array.
Each addressable shard of each result is written to OUT_JSON with its global index, so the
parent can reassemble the global arrays from both processes and compare with numpy.
"""

import json
import os
import sys

import numpy as np

B, D, E = 32, 8, 5


def global_inputs():
  rng = np.random.default_rng(1234)
  x = rng.normal(size=(B, D)).astype(np.float32)
  w = rng.normal(size=(D, E)).astype(np.float32)
  return x, w


def shards(arr):
  out = []
  for s in arr.addressable_shards:
    index = [[sl.start or 0, sl.stop if sl.stop is not None else dim]
             for sl, dim in zip(s.index, arr.shape)]
    out.append({"index": index, "data": np.asarray(s.data).tolist()})
  return {"shape": list(arr.shape), "shards": out}


def main():
  # Only when run as a child: importing this module (pytest --doctest-modules, the parent
  # test reading global_inputs) must not touch the importer's JAX configuration.
  os.environ["JAX_PLATFORMS"] = "cpu"
  import jax
  jax.config.update("jax_num_cpu_devices", 4)  # before initialize and any computation

  process_id, port, axis_type, out_path = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
                                           sys.argv[4])
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                             process_id=process_id, initialization_timeout=60)
  import jax.numpy as jnp
  from jax import lax
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  from partition import Mean, SerialLoop, xmap

  assert jax.process_count() == 2, jax.process_count()
  assert jax.device_count() == 8 and jax.local_device_count() == 4
  kind = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}[axis_type]
  mesh = jax.make_mesh((8,), ("data",), axis_types=(kind,))
  x_np, w_np = global_inputs()
  rows, rep = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
  x = jax.make_array_from_callback(x_np.shape, rows, lambda idx: x_np[idx])
  w = jax.make_array_from_callback(w_np.shape, rep, lambda idx: w_np[idx])

  normalized = xmap(lambda x: x / lax.psum(jnp.sum(x**2), "b"), ["b", ...], ["b", ...],
                    axis_resources={"b": "data"}, mesh=mesh)
  mean_loop = xmap(lambda w, x: jnp.tanh(x @ w), ([...], ["b", ...]), Mean("b"),
                   axis_resources={"b": ("data", SerialLoop(2))}, mesh=mesh)
  with jax.set_mesh(mesh):
    results = {"normalized": normalized(x), "mean_loop": mean_loop(w, x)}
    jax.block_until_ready(results)
    payload = {name: shards(v) for name, v in results.items()}
  payload["process_id"] = process_id
  with open(out_path, "w") as f:
    json.dump(payload, f)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
