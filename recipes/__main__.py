"""``python -m recipes``: the entry points, and ``python -m recipes COMMAND ...`` to run one.

``python -m recipes`` lists ``train``, ``explain``, ``export`` and ``plan`` with one line each;
``python -m recipes explain --devices 64 ...`` is ``python -m recipes.explain --devices 64 ...``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

COMMANDS = ("train", "explain", "export", "plan")


def _summary(command: str) -> str:
  module = importlib.import_module(f"recipes.{command}")
  first = (module.__doc__ or "").strip().splitlines()[0]
  return first.split(" (``")[0].rstrip(".").replace("``", "") + "."


def usage() -> str:
  lines = ["usage: python -m recipes COMMAND [ARGS ...]", ""]
  lines += [f"  {c:<8} {_summary(c)}" for c in COMMANDS]
  lines += ["", "Each is also python -m recipes.COMMAND; add --help for its flags, e.g. "
                "python -m recipes.explain --help."]
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  """Prints the entry points, or runs ``COMMAND`` with the remaining arguments."""
  argv = list(sys.argv[1:] if argv is None else argv)
  if not argv or argv[0] in ("-h", "--help", "help"):
    print(usage())
    return 0
  command, rest = argv[0], argv[1:]
  if command not in COMMANDS:
    from partition.internal import did_you_mean
    print(f"error: unknown command {command!r}{did_you_mean(command, COMMANDS)}.\n\n"
          f"{usage()}", file=sys.stderr)
    return 2
  return importlib.import_module(f"recipes.{command}").main(rest)


if __name__ == "__main__":
  sys.exit(main())
