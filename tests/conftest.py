"""Test setup: 8 virtual CPU devices before any JAX computation."""

import os

# Must happen before JAX initialises its backends.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
