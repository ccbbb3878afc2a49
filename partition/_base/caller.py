"""Where a warning points: at the user's line, however deep in ``partition`` it is raised."""

from __future__ import annotations

import os
import sys

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def outside_stacklevel() -> int:
  """The ``stacklevel`` that makes a ``warnings.warn`` in the calling function name the first
  frame outside ``partition`` (the user's call), whichever public entry point led there:
  a fixed count is right for one call path only.

  >>> outside_stacklevel()  # called from outside partition: the caller itself
  1
  """
  frame, level = sys._getframe(1), 1
  while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
    frame, level = frame.f_back, level + 1
  return level
