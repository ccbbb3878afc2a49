"""named-partition: shard JAX programs by name."""

# --- xmap core (issue 2) ---
from partition._resources import SerialLoop as SerialLoop
from partition._resources import serial_loop as serial_loop
from partition._errors import PartitionError as PartitionError
from partition._specs import Mean as Mean
from partition._specs import Sum as Sum
from partition._xmap import xmap as xmap

# --- rules engine (issue 3) ---

# --- framework adapters (issue 4) ---
