"""``python -m benchmarks [--quick] [--only SECTION,...] [--out DIR]``."""

import sys

from benchmarks.common import setup_devices

setup_devices()  # before any JAX computation

from benchmarks.run import main  # noqa: E402

sys.exit(main())
