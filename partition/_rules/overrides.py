"""The command-line override grammar: ``name=mesh_axes`` strings, as ``--rules`` gives them.

``mlp=tensor``, ``batch=data,fsdp``, ``kv=null`` (or ``kv=``), ``batch=data,serial_loop:4``.
:func:`collect_overrides` gathers every override of one ``AxisRules.override`` call (strings,
lists of strings, pairs, mappings, keywords) with all their problems, so one message lists
every bad token.

>>> parse_override('batch=data,serial_loop:4')
(('batch', ('data', SerialLoop(4))), [])
>>> parse_override('kv=null')
(('kv', None), [])
>>> parse_override('mlp=tensr!')[1]
["'mlp=tensr!': mesh axis 'tensr!' contains '!'"]
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from partition._base.errors import short
from partition._base.resources import MAX_LOOP_LENGTH
from partition._rules.schema import Value, parse_entries, parse_value

_NAME = re.compile(r"^[\w.\-/]+$")
_LOOP_TOKEN = re.compile(r"^(?:serial_loop|loop)[:=](.*)$|^SerialLoop\((.*)\)$")
_NULLS = ("", "null", "none", "~")
OVERRIDE_FIX = ("Write one override per string as name=mesh_axes, e.g. 'mlp=tensor', "
                "'batch=data,fsdp', 'kv=null' or 'batch=data,serial_loop:4'; names are "
                "letters, digits, '_', '-', '.' and '/'.")


def _override_token(token: str, problems: list[str]) -> Any:
  m = _LOOP_TOKEN.match(token)
  if m:
    digits = (m.group(1) if m.group(1) is not None else m.group(2)).strip()
    if not digits.isdigit() or not digits.isascii():
      problems.append(f"loop length {digits!r} in {token!r} is not a positive int")
      return None
    if not 1 <= int(digits) <= MAX_LOOP_LENGTH:
      problems.append(f"loop length {digits} in {token!r} is not from 1 to {MAX_LOOP_LENGTH}")
      return None
    return {"serial_loop": int(digits)}
  if token.lower() in _NULLS:
    problems.append(f"{token!r} in a list of mesh axes: null (replicated) stands alone, "
                    "as in 'kv=null'" if token else "an empty mesh axis name (two commas "
                    "in a row, or a trailing comma)")
    return None
  if not _NAME.match(token):
    bad = sorted({c for c in token if not _NAME.match(c)})
    hint = (" (one override sets one name; pass several overrides as separate strings)"
            if "=" in token else "")
    problems.append(f"mesh axis {token!r} contains {''.join(bad)!r}{hint}")
    return None
  return token


def parse_override(text: str) -> tuple[tuple[str, Value] | None, list[str]]:
  """Parses a CLI override ``name=axes``: ``mlp=tensor``, ``batch=data,fsdp``,
  ``kv=null`` (or ``kv=``), ``batch=data,serial_loop:4``. Returns ``(pair, problems)``."""
  name, sep, rhs = text.partition("=")
  name, rhs = name.strip(), rhs.strip()
  if not sep or not name:
    return None, [f"{text!r} is not of the form name=mesh_axes"]
  problems = []
  if not _NAME.match(name):
    problems.append(f"logical name {name!r} in {text!r} is not a name")
  if rhs.lower() in _NULLS:
    return (None if problems else (name, None)), problems
  local: list[str] = []
  items = [_override_token(t.strip(), local) for t in rhs.split(",")]
  problems += [f"{text!r}: {p}" for p in local]
  if problems:
    return None, problems
  value, more = parse_value(items)
  return (None, [f"{text!r}: {p}" for p in more]) if more else ((name, value), [])


def collect_overrides(overrides: tuple, entries: Mapping[str, Any]
                      ) -> tuple[dict[str, Value], list[str], bool]:
  """``({name: value}, problems, any type error)`` of all overrides of one call."""
  new: dict[str, Value] = {}
  problems: list[str] = []
  type_error = False

  def add(pairs):
    new.update(dict(pairs))

  for i, item in enumerate(overrides):
    if isinstance(item, str):
      pair, bad = parse_override(item)
      problems += bad
      add([pair] if pair else [])
    elif isinstance(item, (list, tuple)) and item and all(
        isinstance(t, str) and "=" in t for t in item):
      for text in item:  # a list of CLI strings, as argparse's nargs/append give them
        pair, bad = parse_override(text)
        problems += bad
        add([pair] if pair else [])
    elif isinstance(item, Mapping) or (
        isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str)):
      pairs = list(item.items()) if isinstance(item, Mapping) else [tuple(item)]
      eq = [n for n, _ in pairs if isinstance(n, str) and "=" in n]
      problems += [f"override #{i}: logical name {n!r} contains '=': pass 'name=axes' "
                   "strings on their own (or a list of them), not inside a pair" for n in eq]
      good, bad = parse_entries([p for p in pairs if p[0] not in eq], f"override #{i}")
      problems += bad
      add(good)
    else:
      type_error = True
      problems.append(f"override #{i} {short(item)}: expected a 'name=axes' str, a list of "
                      f"them, a (name, axes) pair or a mapping, got {type(item).__name__}")
  good, bad = parse_entries(list(entries.items()), "keyword")
  problems += bad
  add(good)
  return new, problems, type_error
