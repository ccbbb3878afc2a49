"""The Haiku adapter's constants and exception classes."""

from __future__ import annotations

import threading

from partition._base.errors import PartitionError
from partition._rules.fallbacks import PartitionWarning

Axes = tuple[str | None, ...]

STACK_AXIS = "layers"
"""Default logical name of the leading dim that ``hk.layer_stack`` adds to per-layer params."""

_PARAMS, _STATE = "params", "state"
_LOCAL = threading.local()


class StaticArgError(PartitionError, TypeError):
  """The model needs a concrete Python value from an input that the adapter traces."""


class UnusedPatternWarning(PartitionWarning):
  """A :func:`constrain_outputs` pattern matched no module call."""


# Users meet these as partition.haiku.* (its public face re-exports them).
for _cls in (StaticArgError, UnusedPatternWarning):
  _cls.__module__ = "partition.haiku"
