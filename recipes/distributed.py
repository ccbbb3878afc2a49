"""Joining a multi-process run with ``jax.distributed``.

Set ``distributed.coordinator`` (``host:port`` of process 0), ``distributed.num_processes``
and ``distributed.process_id`` (flags or config), or nothing: ``jax.distributed.initialize()``
then detects SLURM, Open MPI and Kubernetes (JobSet / indexed jobs) from their environment.
Without any of these the run is single-process. See docs/multihost.md.
"""

from __future__ import annotations

import os

# Environment variables that mean "this process is one task of a cluster job" and that
# jax.distributed.initialize() reads on its own.
_CLUSTER_ENV = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "JOB_COMPLETION_INDEX",
                "JAX_COORDINATOR_ADDRESS")


def num_processes(d) -> int:
  if d.num_processes is not None:
    return d.num_processes
  for var in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
    if var in os.environ:
      return int(os.environ[var])
  return 1


def initialize(d) -> bool:
  """Calls ``jax.distributed.initialize`` when the config or the environment asks for a
  multi-process run; returns whether it did."""
  import jax
  explicit = d.coordinator is not None or (d.num_processes or 1) > 1
  detected = any(v in os.environ for v in _CLUSTER_ENV) and num_processes(d) > 1
  if not (explicit or detected):
    return False
  kwargs = {}
  if d.coordinator is not None:
    kwargs["coordinator_address"] = d.coordinator
  if d.num_processes is not None:
    kwargs["num_processes"] = d.num_processes
  if d.process_id is not None:
    kwargs["process_id"] = d.process_id
  if d.local_devices:
    jax.config.update("jax_num_cpu_devices", d.local_devices)
  jax.distributed.initialize(**kwargs)
  return True
