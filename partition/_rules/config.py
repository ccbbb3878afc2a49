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

import json
import json.decoder
import json.scanner
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from partition._base import io as _io
from partition._base.errors import PartitionError, did_you_mean, format_message, short
from partition._base.resources import MAX_LOOP_LENGTH, SerialLoop, loop_length_problem

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
MAX_FILE_BYTES = _io.MAX_READ_BYTES
MAX_DEPTH = 64  # rules need 4 levels; peers' configs (MaxText, T5X) fewer than 10
MAX_NODES = 200_000  # counts aliased YAML nodes once per use: stops "billion laughs"

class RulesError(PartitionError, ValueError):
  """A rule table (built in Python or read from a file) is malformed."""


class RulesTypeError(RulesError, TypeError):
  """A rule table was built from a Python object of the wrong type."""


class RulesConfigError(RulesError):
  """A rules file cannot be read: bad syntax, unknown key, wrong type or order."""


class RulesConfigTypeError(RulesConfigError, RulesTypeError):
  """A rules-file argument has the wrong type (a path that is not a path, a bad key)."""


# -- one entry ------------------------------------------------------------------------------


def _loop(item: Mapping, problems: list[str]) -> SerialLoop | None:
  keys = list(item)
  if keys != ["serial_loop"]:
    bad = [k for k in keys if k != "serial_loop"]
    hint = did_you_mean(str(bad[0]), ["serial_loop"]) if bad else ""
    problems.append(f"a loop is written {{serial_loop: N}}, got keys {short(keys)}{hint}")
    return None
  problem = loop_length_problem(item["serial_loop"])
  if problem:
    problems.append(f"serial_loop: {problem}")
    return None
  return SerialLoop(item["serial_loop"])


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
    elif isinstance(item, str) and item.strip():
      out.append(item)
    else:
      problems.append(f"mesh axes are names (non-empty str), null or {{serial_loop: N}}; "
                      f"got {type(item).__name__} {short(item)}")
  loops = [i for i, r in enumerate(out) if isinstance(r, SerialLoop)]
  if loops and loops[0] != len(out) - 1:
    problems.append("a serial loop must come last, after the mesh axes "
                    "(loops run inside the mesh split), and at most one per entry")
  axes = [r for r in out if isinstance(r, str)]
  dups = sorted({a for a in axes if axes.count(a) > 1})
  if dups:
    problems.append(f"mesh axis {dups[0]!r} is repeated in one entry")
  return (tuple(out) or None), problems


def parse_entries(raw: Any, label: str = "rules") -> tuple[list[tuple[str, Value]], list[str]]:
  """Validates a rules list (or mapping); returns ``(pairs, problems)``.

  ``label`` names the list in messages (``rules[3]``, ``logical_axis_rules[3]``).
  """
  if isinstance(raw, Mapping):
    raw = list(raw.items())
  elif isinstance(raw, (str, bytes)) or not isinstance(raw, Sequence):
    return [], [f"{label!r} must be a list of [logical_name, mesh_axes] pairs, "
                f"got {type(raw).__name__} {short(raw)}"]
  pairs: list[tuple[str, Value]] = []
  problems: list[str] = []
  for i, entry in enumerate(raw):
    where = f"{label}[{i}] {short(entry)}"
    if isinstance(entry, (str, bytes)) or not isinstance(entry, Sequence) or len(entry) != 2:
      problems.append(f"{where}: expected a pair [logical_name, mesh_axes]")
      continue
    name, value = entry
    if not isinstance(name, str) or not name.strip():
      problems.append(f"{where}: the logical name must be a non-empty str, got {short(name)}")
      continue
    canon, bad = parse_value(value)
    problems += [f"{where}: {b}" for b in bad]
    if not bad:
      pairs.append((name, canon))
  return pairs, problems


# -- a whole document -----------------------------------------------------------------------


def _looks_like_rules(value: Any) -> bool:
  """A non-empty list of ``[str, anything]`` pairs: how peers' configs spell a rule table."""
  return (isinstance(value, list) and bool(value) and all(
      isinstance(e, (list, tuple)) and len(e) == 2 and isinstance(e[0], str) for e in value))


def rules_keys(doc: Any, prefix: str = "", depth: int = 3) -> list[str]:
  """Dotted keys of ``doc`` (down to ``depth`` levels) whose value looks like a rules list."""
  if not isinstance(doc, Mapping) or depth == 0:
    return []
  found = []
  for k, v in doc.items():
    if not isinstance(k, str):
      continue
    if _looks_like_rules(v):
      found.append(prefix + k)
    found += rules_keys(v, f"{prefix}{k}.", depth - 1)
  # Prefer keys that say "rules" (MaxText also has data_sharding: [[...]] lists).
  return sorted(found, key=lambda k: ("rule" not in k.lower(), len(k)))


def _unknown_key_problems(doc: Mapping, unknown: list) -> list[str]:
  candidates = [k for k in rules_keys(doc) if k != "rules"]
  near_miss = any(did_you_mean(str(k), TOP_KEYS) for k in unknown)  # 'rulez': a typo
  if "rules" not in doc and candidates and not (near_miss and len(unknown) <= 3):
    return [f"there is no top-level 'rules' key, but {candidates[0]!r} holds a rules list "
            f"(the other {len(doc) - 1} top-level key(s) are not rules): did you mean "
            f"key={candidates[0]!r}? e.g. AxisRules.from_file(path, key={candidates[0]!r})"]
  if len(unknown) > 3:
    shown = ", ".join(short(k) for k in unknown[:3])
    return [f"{len(unknown)} unknown keys ({shown}, ...): a rules file holds only "
            f"{' and '.join(map(repr, TOP_KEYS))}. For rules inside a larger config pass "
            "key='<dotted.key.of.the.rules.list>'"]
  return [f"unknown key {short(k)}{did_you_mean(str(k), TOP_KEYS)}; allowed keys: "
          f"{', '.join(TOP_KEYS)}" for k in unknown]


def parse_document(doc: Any) -> tuple[list[tuple[str, Value]], list[str]]:
  """Validates a whole document ``{'rules': [...], 'description': str}``."""
  if not isinstance(doc, Mapping):
    return [], [f"the top level must be a mapping with key 'rules', got "
                f"{type(doc).__name__} {short(doc)}"]
  unknown = [k for k in doc if k not in TOP_KEYS]
  problems = _unknown_key_problems(doc, unknown) if unknown else []
  if "description" in doc and not isinstance(doc["description"], str):
    problems.append(f"'description' must be a str, got {short(doc['description'])}")
  if "rules" not in doc:
    hinted = any("did you mean key=" in p or " unknown keys (" in p for p in problems)
    return [], problems + ([] if hinted else ["missing key 'rules'"])
  pairs, more = parse_entries(doc["rules"])
  return pairs, problems + more


def key_parts(key: Any, error: type[Exception] = RulesConfigTypeError) -> tuple[str, ...]:
  """``key=`` as parts: ``'a.b'`` -> ``('a', 'b')``; a list/tuple of str is taken as is."""
  if isinstance(key, str) and key.strip():
    return tuple(key.split("."))
  if isinstance(key, (list, tuple)) and key and all(isinstance(k, str) and k for k in key):
    return tuple(key)
  raise error(f"key= must be a non-empty str (dotted for nesting, e.g. "
              f"'model.logical_axis_rules') or a list of str, got {type(key).__name__} "
              f"{short(key)}.")


def select(doc: Any, key: Any, source: str) -> tuple[Any, str]:
  """The value under ``key`` (dotted or a list of parts) in ``doc``, and its label.

  A dotted key is looked up whole first, so a key that itself contains a dot still works.
  """
  parts = key_parts(key)
  node, path = doc, []
  i = 0
  while i < len(parts):
    if not isinstance(node, Mapping):
      where = ".".join(path) or "the top level"
      raise RulesConfigError(format_message(
          f"{source}: cannot look up key={'.'.join(parts)!r}: {where!r} is a "
          f"{type(node).__name__}, not a mapping.",
          fix="Give the dotted path of the rules list, e.g. key='logical_axis_rules'."))
    for j in range(len(parts), i, -1):  # longest match first: keys may contain dots
      if ".".join(parts[i:j]) in node:
        path.append(".".join(parts[i:j]))
        node, i = node[path[-1]], j
        break
    else:
      raise RulesConfigError(_missing_key_message(node, parts, i, path, source, doc))
  return node, ".".join(path)


def _missing_key_message(node: Mapping, parts, i, path, source, doc) -> str:
  names = [str(k) for k in node]
  candidates = rules_keys(doc)
  hint = f" Rules lists found under: {', '.join(map(repr, candidates[:3]))}." if (
      candidates) else ""
  return format_message(
      f"{source}: no key {parts[i]!r} in {'.'.join(path) or 'the top level'!r}"
      f"{did_you_mean(parts[i], names)}.",
      context=[f"keys there: {', '.join(map(repr, names[:8]))}"
               + (f", ... ({len(names)} in all)" if len(names) > 8 else "")],
      fix=f"Pass the dotted path of the rules list as key=.{hint}")


def parse_selected(value: Any, label: str, doc: Any = None
                   ) -> tuple[list[tuple[str, Value]], list[str]]:
  """Rules found under ``key=``: a list of pairs, a ``{name: axes}`` table, or a document."""
  if isinstance(value, Mapping) and "rules" in value and set(value) <= set(TOP_KEYS):
    return parse_document(value)
  if isinstance(value, list) and value and not any(
      isinstance(e, (list, tuple)) and len(e) == 2 for e in value):
    # Not a rules list at all (e.g. MaxText's mesh_axes): one line, not one per item.
    found = [k for k in rules_keys(doc) if k != label]
    hint = f"; did you mean key={found[0]!r}?" if found else ""
    return [], [f"{label!r} holds {short(value)}, not [logical_name, mesh_axes] pairs{hint}"]
  return parse_entries(value, label)


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


# -- command-line overrides -------------------------------------------------------------------

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
