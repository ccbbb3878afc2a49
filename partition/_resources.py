"""Serial-loop resources: run a named axis in sequential micro-batches.

A mesh axis places the slices of a named axis on different devices; a *serial loop* places
them in different iterations of a ``lax.scan`` on the same devices, so intermediates of only
one chunk are alive at a time. ``SerialLoop(n)`` is an anonymous loop for one axis;
``serial_loop(name, n)`` binds a named loop that several axes can share (they iterate
jointly, so they must never appear together in one value).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator

from partition._errors import ResourceError


@dataclasses.dataclass(frozen=True)
class SerialLoop:
  """An anonymous serial loop of ``length`` iterations for one xmap axis.

  Example:
    >>> import jax.numpy as jnp
    >>> import partition
    >>> f = partition.xmap(lambda x: x * 2, in_axes=['i', ...], out_axes=['i', ...],
    ...                    axis_resources={'i': partition.SerialLoop(4)})
    >>> f(jnp.arange(8.0)).tolist()
    [0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0]
  """

  length: int

  def __post_init__(self):
    if isinstance(self.length, bool) or not isinstance(self.length, int) or self.length < 1:
      raise ResourceError(
          f"SerialLoop(length) takes a positive int, got {self.length!r}. "
          "Use e.g. SerialLoop(4) for four sequential micro-batches.")

  def __repr__(self) -> str:
    return f"SerialLoop({self.length})"


class _LoopEnv(threading.local):
  def __init__(self):
    self.loops: dict[str, int] = {}


_loop_env = _LoopEnv()


@contextlib.contextmanager
def serial_loop(name: str, length: int) -> Iterator[None]:
  """Binds a named serial loop resource ``name`` of ``length`` iterations in this scope.

  Any xmap axis whose ``axis_resources`` names ``name`` is processed in ``length``
  sequential chunks. Axes that share one named loop iterate over it jointly.

  Example:
    >>> import jax.numpy as jnp
    >>> import partition
    >>> with partition.serial_loop('l', 2):
    ...   y = partition.xmap(jnp.sin, in_axes=['i', ...], out_axes=['i', ...],
    ...                      axis_resources={'i': 'l'})(jnp.zeros(4))
    >>> y.shape
    (4,)
  """
  SerialLoop(length)  # validates the length
  if not isinstance(name, str):
    raise ResourceError(f"serial_loop(name, length) takes a str name, got {name!r}.")
  old = _loop_env.loops
  _loop_env.loops = {**old, name: length}
  try:
    yield
  finally:
    _loop_env.loops = old


def named_loops() -> dict[str, int]:
  """The named loops bound by enclosing ``serial_loop`` contexts (this thread)."""
  return dict(_loop_env.loops)
