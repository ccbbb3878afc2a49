"""Rules files: hardened YAML/TOML/JSON loaders and atomic, round-trip-checked dumpers.

A file is read whole (at most 1 MiB), parsed with keys given twice reported (PyYAML and
``json`` would keep the last silently), checked for depth and size (YAML alias bombs), then
validated against the schema (``schema.py``). Every problem is reported with the file, the
entry and a fix; all problems of a file are collected before raising. A write goes to a
temporary file that replaces the destination only once complete, and only if the text reads
back as the same table.
"""

from __future__ import annotations

import json
import json.decoder
import json.scanner
import os
import re
import tomllib
from collections.abc import Mapping
from typing import Any

import yaml

from partition._base import io as _io
from partition._base.errors import format_message, short
from partition._rules.errors import RulesConfigError, RulesConfigTypeError
from partition._rules.schema import ENTRY_FIX, key_parts, parse_document, parse_selected, select

FORMATS = {".yaml": "yaml", ".yml": "yaml", ".toml": "toml", ".json": "json"}
MAX_FILE_BYTES = _io.MAX_READ_BYTES
MAX_DEPTH = 64  # rules need 4 levels; peers' configs (MaxText, T5X) fewer than 10
MAX_NODES = 200_000  # counts aliased YAML nodes once per use: stops "billion laughs"


# -- reading files ----------------------------------------------------------------------------


def format_of(path: str, fmt: Any, error: type[Exception] = RulesConfigError) -> str:
  """The format named by ``fmt`` or, if ``None``, by the extension of ``path``."""
  if fmt is not None:
    fmt = fmt.lower() if isinstance(fmt, str) else fmt  # format='YAML' is unambiguous
    if fmt not in FORMATS.values():
      raise error(f"Unknown rules format {short(fmt)} for {path!r}; use one of 'yaml', "
                  "'toml', 'json'.")
    return fmt
  ext = os.path.splitext(path)[1].lower()
  if ext not in FORMATS:
    raise error(format_message(
        f"Cannot tell the format of rules file {path!r} from its extension {ext!r}.",
        fix=f"Name it with one of {', '.join(FORMATS)} or pass format='yaml'|'toml'|'json'."))
  return FORMATS[ext]


def _toml_line(err: BaseException, data: bytes) -> list[str]:
  """The source line a TOML error points at (tomllib names the line, not the key)."""
  m = re.search(r"at line (\d+)", str(err))
  lines = data.decode("utf-8", "replace").splitlines()
  if not m or not 1 <= int(m.group(1)) <= len(lines):
    return []
  hint = " (a key given twice?)" if "overwrite" in str(err) else ""
  return [f"line {m.group(1)}: {short(lines[int(m.group(1)) - 1].strip())[1:-1]}{hint}"]


def _syntax_error(path: str, fmt: str, err: BaseException, data: bytes = b"") -> RulesConfigError:
  detail = str(err).strip().replace("\n", " ")
  detail = detail if len(detail) <= 300 else detail[:297] + "..."
  mark = getattr(err, "problem_mark", None)
  if mark is not None:
    detail = f"line {mark.line + 1}, column {mark.column + 1}: {getattr(err, 'problem', '')}"
  elif isinstance(err, json.JSONDecodeError):
    detail = f"line {err.lineno}, column {err.colno}: {err.msg}"
  elif isinstance(err, RecursionError):
    detail = f"nested more deeply than Python can parse (the limit here is {MAX_DEPTH})"
  more = _toml_line(err, data) if fmt == "toml" else []
  return RulesConfigError(format_message(
      f"Rules file {path!r} is not valid {fmt.upper()}.", bullets=[detail, *more],
      fix=f"Fix the {fmt.upper()} syntax at that position. {ENTRY_FIX}"))


class _YamlLoader(yaml.SafeLoader):
  """PyYAML's safe loader, recording keys given twice in one mapping (PyYAML keeps the last)."""

  def __init__(self, stream):
    super().__init__(stream)
    self.duplicates: list[str] = []

  def construct_mapping(self, node, deep=False):
    if isinstance(node, yaml.MappingNode):
      seen: dict[Any, int] = {}
      for key_node, _ in node.value:
        # Merge keys (<<) legitimately repeat and are overridden; complex keys cannot clash.
        if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(
            key_node, yaml.ScalarNode):
          continue
        key = self.construct_object(key_node)
        line = key_node.start_mark.line + 1
        if key in seen:
          self.duplicates.append(f"key {short(key)} is given twice (line {seen[key]} and "
                                 f"line {line}); the second would silently replace the first")
        else:
          seen[key] = line
    return super().construct_mapping(node, deep)


def _yaml_load(data: bytes) -> tuple[Any, list[str]]:
  loader = _YamlLoader(data)
  try:
    return loader.get_single_data(), loader.duplicates
  finally:
    loader.dispose()


def _json_load(data: bytes) -> tuple[Any, list[str]]:
  """``json.loads`` that reports keys given twice in one object, with their line."""
  text = data.decode(json.detect_encoding(data))
  duplicates: list[str] = []
  decoder = json.JSONDecoder()

  def parse_object(s_and_end, strict, scan_once, object_hook, object_pairs_hook, memo=None):
    s, start = s_and_end
    repeated: list[str] = []

    def pairs_hook(pairs):
      keys = [k for k, _ in pairs]
      repeated.extend(k for i, k in enumerate(keys) if k in keys[:i])
      return dict(pairs)

    obj, end = json.decoder.JSONObject(s_and_end, strict, scan_once, object_hook,
                                       pairs_hook, memo)
    for k in repeated:
      spots = [m.start() for m in re.finditer(re.escape(json.dumps(k)) + r"\s*:", s[start:end])]
      lines = [s.count("\n", 0, start + p) + 1 for p in spots[:2]]
      where = f" (lines {lines[0]} and {lines[1]})" if len(lines) == 2 else ""
      duplicates.append(f"key {short(k)} is given twice in one object{where}; the second "
                        "would silently replace the first")
    return obj, end

  # The pure-Python scanner is the one that calls parse_object (the C one does not).
  decoder.parse_object = parse_object
  decoder.scan_once = json.scanner.py_make_scanner(decoder)
  return decoder.decode(text), duplicates


def _toml_load(data: bytes) -> tuple[Any, list[str]]:
  return tomllib.loads(data.decode("utf-8")), []  # TOML itself rejects repeated keys


_PARSERS = {"yaml": _yaml_load, "json": _json_load, "toml": _toml_load}


def _depth_problem(doc: Any) -> str | None:
  """Why ``doc`` is too deep or too large to process safely (iterative: no recursion)."""
  stack, nodes = [(doc, 1)], 0
  while stack:
    node, depth = stack.pop()
    nodes += 1
    if depth > MAX_DEPTH:
      return (f"it is nested more than {MAX_DEPTH} levels deep (or refers to itself "
              "through a YAML alias)")
    if nodes > MAX_NODES:
      return f"it has more than {MAX_NODES} values (YAML aliases count once per use)"
    if isinstance(node, Mapping):
      stack += [(v, depth + 1) for v in node.values()]
    elif isinstance(node, (list, tuple, set)):
      stack += [(v, depth + 1) for v in node]
  return None


def parse_text(data: bytes, fmt: str, source: str) -> Any:
  """Parses the bytes of a YAML/TOML/JSON file; syntax, depth and duplicate keys checked."""
  try:
    doc, duplicates = _PARSERS[fmt](data)
  except (yaml.YAMLError, tomllib.TOMLDecodeError, ValueError, TypeError, OverflowError,
          RecursionError) as e:
    # ValueError covers JSONDecodeError, UnicodeDecodeError, YAML's invalid dates and
    # Python's limit on int digits; RecursionError, deeply nested brackets.
    raise _syntax_error(source, fmt, e, data) from None
  problems = duplicates + [p for p in [_depth_problem(doc)] if p]
  if problems:
    raise RulesConfigError(format_message(
        f"Rules file {source!r} cannot be used ({len(problems)} problem(s)):",
        bullets=problems, fix="Give each key once (merge the two values) and keep the "
                              "nesting to what the schema needs."))
  return doc


def load(path: Any, *, format: str | None = None, key: Any = None) -> dict[str, Any]:
  """Reads and validates a rules file; returns ``{'rules': [(name, value), ...], ...}``.

  Args:
    path: a ``str``, ``bytes`` or ``os.PathLike`` file path.
    format: ``'yaml'``, ``'toml'`` or ``'json'``; default: from the extension.
    key: where the rules list lives in a larger config: a dotted key
      (``'logical_axis_rules'``, ``'partitioning.rules'``) or a list of keys. Other keys
      of the file are then ignored.
  """
  text_path = _io.fspath(path, "the rules file path", RulesConfigTypeError)
  fmt = format_of(text_path, format)
  if key is not None:
    key_parts(key)  # a bad key is a type error before any I/O
  data = _io.read_bytes(text_path, max_bytes=MAX_FILE_BYTES, what="rules file",
                        error=RulesConfigError)
  doc = parse_text(data, fmt, text_path)
  if key is None:
    pairs, problems = parse_document(doc)
    label = ""
  else:
    value, label = select(doc, key, f"Rules file {text_path!r}")
    pairs, problems = parse_selected(value, label, doc)
  if problems:
    raise RulesConfigError(format_message(
        f"Invalid axis rules in {text_path!r}" + (f" under key {label!r}" if label else "")
        + f" ({len(problems)} problem(s)):", bullets=problems, fix=ENTRY_FIX))
  if key is None:
    return {**doc, "rules": pairs}
  return {"rules": pairs}


# -- writing files ----------------------------------------------------------------------------


_SURROGATES = re.compile(r"\\u(d[89ab][0-9a-f]{2})\\u(d[c-f][0-9a-f]{2})")


def _quote(text: str) -> str:
  """A double-quoted string that YAML, TOML and JSON all read back as ``text``.

  JSON's escapes, except that characters outside the BMP stay literal (TOML and PyYAML reject
  JSON's surrogate pairs) and DEL is escaped (TOML and YAML require it).
  """
  out = _SURROGATES.sub(lambda m: chr(0x10000 + ((int(m.group(1), 16) - 0xD800) << 10)
                                      + int(m.group(2), 16) - 0xDC00), json.dumps(text))
  return out.replace("\x7f", "\\u007f")


def _flow(v: Any) -> str:
  """A rules entry in flow style (JSON syntax, which is also YAML), strings via _quote."""
  if isinstance(v, str):
    return _quote(v)
  if isinstance(v, Mapping):
    return "{" + ", ".join(f"{_quote(str(k))}: {_flow(x)}" for k, x in v.items()) + "}"
  if isinstance(v, (list, tuple)):
    return "[" + ", ".join(_flow(x) for x in v) + "]"
  return json.dumps(v)


def _toml_value(v: Any) -> str:
  if isinstance(v, str):
    return _quote(v)
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
    rows = [f"  - {_flow(entry)}" for entry in doc["rules"]]  # JSON is flow-style YAML
    return text + "rules:\n" + "\n".join(rows) + ("\n" if rows else " []\n")
  lines = [f"description = {_toml_value(doc['description'])}"] if "description" in doc else []
  lines.append("rules = [")
  lines += [f"  {_toml_value(entry)}," for entry in doc["rules"]]
  return "\n".join(lines) + "\n]\n"


def dump(doc: Mapping[str, Any], path: Any, *, format: str | None = None) -> None:
  """Writes ``doc`` atomically: format and destination are checked before any write."""
  text_path = _io.fspath(path, "the rules file path", RulesConfigTypeError)
  fmt = format_of(text_path, format)
  _io.check_destination(text_path, RulesConfigError)
  text = dumps(doc, fmt)
  # What we write must read back as the same table (names with odd characters included).
  back, problems = parse_document(parse_text(text.encode(), fmt, text_path))
  expected, _ = parse_document(doc)
  if problems or back != expected:
    raise RulesConfigError(f"Cannot write {text_path!r} as {fmt.upper()}: the table would not "
                      "read back unchanged. Use another format (json keeps any name).")
  _io.atomic_write(text_path, text, error=RulesConfigError)
