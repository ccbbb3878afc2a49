"""Reading and writing rule tables: YAML, TOML and JSON with one schema.

A rules file holds one top-level key, ``rules``, whose value is a list of
``[logical_name, mesh_axes]`` pairs in priority order (or, when no logical name repeats, a
mapping ``{logical_name: mesh_axes}``)::

  rules:
    - [batch, [data, fsdp]]
    - [embed, fsdp]
    - [kv, null]                     # claim the dim, replicated
    - [microbatch, {serial_loop: 4}] # xmap only: run the axis as a 4-step loop
    - [batch, [data, {serial_loop: 4}]]

``mesh_axes`` is ``null`` (TOML has no null: write ``[]``), a mesh axis name, a list of mesh
axis names, or a list that ends in one ``{serial_loop: N}``. An optional ``description``
string is allowed next to ``rules``. Every problem is reported with the file, the entry and
a fix; all problems of a file are collected before raising.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from partition._errors import PartitionError, format_message
from partition._resources import SerialLoop

try:  # Python >= 3.11
  import tomllib
except ModuleNotFoundError:  # pragma: no cover
  import tomli as tomllib  # type: ignore[no-redef]

Resource = str | SerialLoop
Value = tuple[Resource, ...] | None

FORMATS = {".yaml": "yaml", ".yml": "yaml", ".toml": "toml", ".json": "json"}
TOP_KEYS = ("rules", "description")
ENTRY_FIX = ("Write each entry as [logical_name, mesh_axes], e.g. [mlp, tensor], "
             "[batch, [data, fsdp]], [kv, null] or [batch, [data, {serial_loop: 4}]].")


class RulesError(PartitionError, ValueError):
  """A rule table (built in Python or read from a file) is malformed."""


class RulesTypeError(RulesError, TypeError):
  """A rule table was built from a Python object of the wrong type."""


class ConfigError(RulesError):
  """A rules file cannot be read: bad syntax, unknown key, wrong type or order."""


def did_you_mean(word: str, options: Sequence[str]) -> str:
  close = difflib.get_close_matches(word, list(options), n=1)
  return f" (did you mean {close[0]!r}?)" if close else ""


def _loop(item: Mapping, problems: list[str]) -> SerialLoop | None:
  keys = list(item)
  if keys != ["serial_loop"]:
    bad = [k for k in keys if k != "serial_loop"]
    hint = did_you_mean(str(bad[0]), ["serial_loop"]) if bad else ""
    problems.append(f"a loop is written {{serial_loop: N}}, got keys {keys}{hint}")
    return None
  n = item["serial_loop"]
  if isinstance(n, bool) or not isinstance(n, int) or n < 1:
    problems.append(f"serial_loop takes a positive int, got {n!r}")
    return None
  return SerialLoop(n)


def parse_value(value: Any) -> tuple[Value, list[str]]:
  """Canonical mesh_axes of one entry: ``None`` or a tuple of resources; plus problems."""
  if value is None:
    return None, []
  items = list(value) if isinstance(value, (list, tuple)) else [value]
  problems: list[str] = []
  out: list[Resource] = []
  for item in items:
    if isinstance(item, SerialLoop):
      out.append(item)
    elif isinstance(item, Mapping):
      loop = _loop(item, problems)
      if loop is not None:
        out.append(loop)
    elif isinstance(item, str) and item:
      out.append(item)
    else:
      problems.append(f"mesh axes are names (str), null or {{serial_loop: N}}; "
                      f"got {type(item).__name__} {item!r}")
  loops = [i for i, r in enumerate(out) if isinstance(r, SerialLoop)]
  if loops and loops[0] != len(out) - 1:
    problems.append("a serial loop must come last, after the mesh axes "
                    "(loops run inside the mesh split), and at most one per entry")
  axes = [r for r in out if isinstance(r, str)]
  dups = sorted({a for a in axes if axes.count(a) > 1})
  if dups:
    problems.append(f"mesh axis {dups[0]!r} is repeated in one entry")
  return (tuple(out) or None), problems


def parse_entries(raw: Any) -> tuple[list[tuple[str, Value]], list[str]]:
  """Validates the value of ``rules``; returns ``(pairs, problems)``."""
  if isinstance(raw, Mapping):
    raw = list(raw.items())
  elif isinstance(raw, (str, bytes)) or not isinstance(raw, Sequence):
    return [], [f"'rules' must be a list of [logical_name, mesh_axes] pairs, "
                f"got {type(raw).__name__}"]
  pairs: list[tuple[str, Value]] = []
  problems: list[str] = []
  for i, entry in enumerate(raw):
    where = f"rules[{i}] {entry!r}"
    if isinstance(entry, (str, bytes)) or not isinstance(entry, Sequence) or len(entry) != 2:
      problems.append(f"{where}: expected a pair [logical_name, mesh_axes]")
      continue
    name, value = entry
    if not isinstance(name, str) or not name:
      problems.append(f"{where}: the logical name must be a non-empty str, got {name!r}")
      continue
    canon, bad = parse_value(value)
    problems += [f"{where}: {b}" for b in bad]
    if not bad:
      pairs.append((name, canon))
  return pairs, problems


def parse_document(doc: Any) -> tuple[list[tuple[str, Value]], list[str]]:
  """Validates a whole document ``{'rules': [...], 'description': str}``."""
  if not isinstance(doc, Mapping):
    return [], [f"the top level must be a mapping with key 'rules', got {type(doc).__name__}"]
  problems = [f"unknown key {k!r}{did_you_mean(str(k), TOP_KEYS)}; allowed keys: "
              f"{', '.join(TOP_KEYS)}" for k in doc if k not in TOP_KEYS]
  if "description" in doc and not isinstance(doc["description"], str):
    problems.append("'description' must be a str")
  if "rules" not in doc:
    return [], problems + ["missing key 'rules'"]
  pairs, more = parse_entries(doc["rules"])
  return pairs, problems + more


def _format_of(path: str, fmt: str | None) -> str:
  if fmt is not None:
    if fmt not in FORMATS.values():
      raise ConfigError(f"Unknown rules format {fmt!r}; use one of 'yaml', 'toml', 'json'.")
    return fmt
  ext = os.path.splitext(path)[1].lower()
  if ext not in FORMATS:
    raise ConfigError(format_message(
        f"Cannot tell the format of rules file {path!r} from its extension {ext!r}.",
        fix=f"Name it with one of {', '.join(FORMATS)} or pass format='yaml'|'toml'|'json'."))
  return FORMATS[ext]


def _syntax_error(path: str, fmt: str, err: Exception) -> ConfigError:
  detail = str(err).strip().replace("\n", " ")
  mark = getattr(err, "problem_mark", None)
  if mark is not None:
    detail = f"line {mark.line + 1}, column {mark.column + 1}: {getattr(err, 'problem', '')}"
  elif isinstance(err, json.JSONDecodeError):
    detail = f"line {err.lineno}, column {err.colno}: {err.msg}"
  return ConfigError(format_message(
      f"Rules file {path!r} is not valid {fmt.upper()}.", bullets=[detail],
      fix=f"Fix the {fmt.upper()} syntax at that position. {ENTRY_FIX}"))


def load(path: str | os.PathLike, *, format: str | None = None) -> dict[str, Any]:
  """Reads and validates a rules file; returns ``{'rules': [(name, value), ...], ...}``."""
  path = os.fspath(path)
  fmt = _format_of(path, format)
  try:
    with open(path, "rb") as f:
      data = f.read()
  except OSError as e:
    raise ConfigError(f"Cannot read rules file {path!r}: {e.strerror} "
                      f"(working directory {os.getcwd()!r}). Check the path.") from None
  try:
    if fmt == "yaml":
      doc = yaml.safe_load(data)
    elif fmt == "toml":
      doc = tomllib.loads(data.decode())
    else:
      doc = json.loads(data)
  except (yaml.YAMLError, tomllib.TOMLDecodeError, json.JSONDecodeError,
          UnicodeDecodeError) as e:
    raise _syntax_error(path, fmt, e) from None
  pairs, problems = parse_document(doc)
  if problems:
    raise ConfigError(format_message(
        f"Invalid axis rules in {path!r} ({len(problems)} problem(s)):",
        bullets=problems, fix=ENTRY_FIX))
  return {**doc, "rules": pairs}


def _toml_value(v: Any) -> str:
  if isinstance(v, str):
    return json.dumps(v)
  if isinstance(v, int):
    return str(v)
  if isinstance(v, Mapping):
    return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
  if v is None:
    return "[]"
  return "[" + ", ".join(_toml_value(x) for x in v) + "]"


def dumps(doc: Mapping[str, Any], fmt: str) -> str:
  """Serialises a ``to_dict()`` document as YAML, TOML or JSON text."""
  if fmt == "json":
    return json.dumps(doc, indent=2) + "\n"
  if fmt == "yaml":
    head = {k: v for k, v in doc.items() if k != "rules"}
    text = yaml.safe_dump(head, sort_keys=False) if head else ""
    rows = [f"  - {json.dumps(entry)}" for entry in doc["rules"]]  # JSON is flow-style YAML
    return text + "rules:\n" + "\n".join(rows) + ("\n" if rows else " []\n")
  lines = [f"description = {_toml_value(doc['description'])}"] if "description" in doc else []
  lines.append("rules = [")
  lines += [f"  {_toml_value(entry)}," for entry in doc["rules"]]
  return "\n".join(lines) + "\n]\n"


def dump(doc: Mapping[str, Any], path: str | os.PathLike, *, format: str | None = None) -> None:
  path = os.fspath(path)
  with open(path, "w") as f:
    f.write(dumps(doc, _format_of(path, format)))


_LOOP_TOKEN = re.compile(r"^(?:serial_loop|loop)[:=](\d+)$|^SerialLoop\((\d+)\)$")


def parse_override(text: str) -> tuple[str, Value]:
  """Parses a CLI override ``name=axes``: ``mlp=tensor``, ``batch=data,fsdp``,
  ``kv=null`` (or ``kv=``), ``batch=data,serial_loop:4``."""
  name, sep, rhs = text.partition("=")
  name, rhs = name.strip(), rhs.strip()
  if not sep or not name:
    raise RulesError(f"Rule override {text!r} is not of the form name=mesh_axes. "
                     "Write e.g. 'mlp=tensor', 'batch=data,fsdp' or 'kv=null'.")
  if rhs.lower() in ("", "null", "none", "~"):
    return name, None
  items: list[Any] = []
  for token in (t.strip() for t in rhs.split(",")):
    m = _LOOP_TOKEN.match(token)
    items.append({"serial_loop": int(m.group(1) or m.group(2))} if m else token)
  value, problems = parse_value(items)
  if problems:
    raise RulesError(format_message(f"Rule override {text!r} is invalid:", bullets=problems,
                                    fix="Write e.g. 'batch=data,fsdp,serial_loop:4'."))
  return name, value
