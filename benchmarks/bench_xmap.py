"""Kept for ``python benchmarks/bench_xmap.py [--quick]``: sections 1-3 of ``python -m benchmarks``.

The workloads moved to ``benchmarks/xmap_vs_vmap.py``, ``serial_loop_memory.py`` and
``accumulation.py``; this script runs those sections (outputs go to a temporary folder
unless ``--out DIR``).
"""

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, not -m

from benchmarks.common import setup_devices  # noqa: E402

setup_devices()

from benchmarks.run import main  # noqa: E402

if __name__ == "__main__":
  args = [a for a in sys.argv[1:] if a != "--markdown"]  # the table is always printed now
  if "--out" not in args:  # leave the full run's benchmarks/results.json alone
    args += ["--out", tempfile.mkdtemp(prefix="bench_xmap_")]
  sys.exit(main(["--only", "xmap_vs_vmap,serial_loop_memory,accumulation", *args]))
