"""Doctests in the packages get the same 8 virtual CPU devices as tests/ (see tests/conftest.py)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
