"""Old public names kept for one release: using one warns and names its replacement.

A module lists its renamed names and sets ``__getattr__ = deprecated_getattr(...)``; Python
calls it only for names the module does not define, so the new names cost nothing.

>>> import types, warnings
>>> mod = types.ModuleType('demo')
>>> mod.new = 1
>>> mod.__getattr__ = deprecated_getattr('demo', {'old': ('demo.new', lambda: mod.new)})
>>> with warnings.catch_warnings(record=True) as caught:
...   warnings.simplefilter('always')
...   value = mod.old
>>> value, str(caught[0].message)
(1, 'demo.old is deprecated and will be removed in the next release: use demo.new.')
>>> mod.nothing
Traceback (most recent call last):
AttributeError: module 'demo' has no attribute 'nothing'
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any


def deprecated_getattr(module: str, renamed: Mapping[str, tuple[str, Callable[[], Any]]]
                       ) -> Callable[[str], Any]:
  """A module ``__getattr__`` serving ``renamed`` (``old name -> (new dotted name, getter)``)
  with a ``DeprecationWarning`` at the caller's line."""

  def __getattr__(name: str) -> Any:
    if name not in renamed:
      raise AttributeError(f"module {module!r} has no attribute {name!r}")
    new, get = renamed[name]
    warnings.warn(f"{module}.{name} is deprecated and will be removed in the next release: "
                  f"use {new}.", DeprecationWarning, stacklevel=2)
    return get()

  return __getattr__
