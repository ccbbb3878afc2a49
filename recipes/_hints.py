"""The CLI's typo hint, as a sentence after the message (``... Did you mean 'steps'?``).

partition's own hint (``partition.did_you_mean``) is a parenthesis inside the sentence; the
recipes' messages end with a separate sentence instead.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(word: str, options: Iterable[str]) -> str:
  """`` Did you mean 'x'?`` for the closest option, or ``''``.

  >>> did_you_mean('stpes', ['steps', 'seed'])
  " Did you mean 'steps'?"
  """
  close = difflib.get_close_matches(word, [o for o in options if isinstance(o, str)], n=1)
  return f" Did you mean {close[0]!r}?" if close else ""
