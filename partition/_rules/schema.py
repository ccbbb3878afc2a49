"""The schema of a rule table, shared by files, ``from_dict`` and ``AxisRules(pairs)``.

A rules document holds one top-level key, ``rules``, whose value is a list of
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
string is allowed next to ``rules``. Rules inside a larger config (MaxText's
``logical_axis_rules``) are found by a dotted ``key=``. The parsers here return
``(pairs, problems)`` so that callers collect every problem before raising.

>>> parse_entries([['batch', ['data', {'serial_loop': 4}]], ['kv', None]])
([('batch', ('data', SerialLoop(4))), ('kv', None)], [])
>>> parse_entries([['mlp', ['tensor', 'tensor']]])[1]
["rules[0] ['mlp', ['tensor', 'tensor']]: mesh axis 'tensor' is repeated in one entry"]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from partition._base.errors import did_you_mean, format_message, short
from partition._base.resources import SerialLoop, loop_length_problem
from partition._rules.errors import RulesConfigError, RulesConfigTypeError

Resource = str | SerialLoop
Value = tuple[Resource, ...] | None

TOP_KEYS = ("rules", "description")
ENTRY_FIX = ("Write each entry as [logical_name, mesh_axes], e.g. [mlp, tensor], "
             "[batch, [data, fsdp]], [kv, null] or [batch, [data, {serial_loop: 4}]].")


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


def _padding_problem(what: str, name: str) -> str:
  """A name with spaces around it never matches (``'batch '`` is not ``batch``)."""
  if name != name.strip():
    return f"the {what} {name!r} has spaces around it: write {name.strip()!r}"
  return ""


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
      if problem := _padding_problem("mesh axis", item):
        problems.append(problem)
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
    if problem := _padding_problem("logical name", name):
      bad = [problem, *bad]
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
