"""``python -m partition``: print the environment and self-check xmap on an 8-device mesh.

On a machine without accelerators JAX is given 8 virtual CPU devices (override with
``--devices N``), so the check runs anywhere.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m partition", description=__doc__)
  parser.add_argument("--devices", type=int, default=8,
                      help="virtual CPU devices to create when no accelerator is present")
  args = parser.parse_args(argv)

  import jax

  if jax.config.jax_platforms in (None, "", "cpu"):
    jax.config.update("jax_num_cpu_devices", args.devices)

  from partition._selfcheck import environment_report, run_selfcheck

  print(environment_report())
  ok = run_selfcheck(num_devices=args.devices)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
