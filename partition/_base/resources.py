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
import operator
import threading
from collections.abc import Iterator

from partition._base.errors import ResourceError, format_message, short

# A loop runs one chunk per iteration inside one program; more than a million sequential
# micro-batches is a typo (and would trace a scan of that length), not a plan.
MAX_LOOP_LENGTH = 1 << 20


def loop_length_problem(length: object) -> str | None:
  """Why ``length`` is not a valid loop length (a positive int <= MAX_LOOP_LENGTH), or None."""
  if isinstance(length, bool) or not _is_int(length):
    return (f"a loop length is a positive int, got {type(length).__name__} "
            f"{short(length)}")
  if not 1 <= operator.index(length) <= MAX_LOOP_LENGTH:
    return (f"a loop length must be a positive int, at most {MAX_LOOP_LENGTH}; got "
            f"{operator.index(length)}")
  return None


def _is_int(x: object) -> bool:
  try:
    operator.index(x)  # int and numpy integers; not float, str or bool-like junk
  except TypeError:
    return False
  return True


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
    if loop_length_problem(self.length):
      raise ResourceError(
          f"SerialLoop(length) takes a positive int, got {short(self.length)} (at most "
          f"{MAX_LOOP_LENGTH} iterations). Use e.g. SerialLoop(4) for four sequential "
          "micro-batches.")
    object.__setattr__(self, "length", operator.index(self.length))  # numpy int -> int

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
  problems = []
  if not isinstance(name, str) or not name.strip():
    problems.append(f"name: a loop name is a non-empty str, got {type(name).__name__} "
                    f"{short(name)}")
  length_problem = loop_length_problem(length)
  if length_problem:
    problems.append(f"length: {length_problem}")
  if problems:
    raise ResourceError(format_message(
        f"serial_loop(name, length) got {short(name)}, {short(length)}:", bullets=problems,
        fix="Write e.g. `with partition.serial_loop('micro', 4):` and name 'micro' in "
            "axis_resources or in the rules."))
  length = operator.index(length)
  old = _loop_env.loops
  _loop_env.loops = {**old, name: length}
  try:
    yield
  finally:
    _loop_env.loops = old


def named_loops() -> dict[str, int]:
  """The named loops bound by enclosing ``serial_loop`` contexts (this thread)."""
  return dict(_loop_env.loops)
