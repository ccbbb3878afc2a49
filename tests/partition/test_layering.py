"""The import graph matches what the docstrings say (issue 19, items 7 and 9).

Read with ``ast`` (nothing is imported): the library's modules import each other without a
circle at module level; the core never imports a framework (flax, haiku) or the packages
built on it (layers, recipes) at module level, only the adapter modules do; and ``layers/``,
``recipes/``, ``benchmarks/`` use only partition's public API (no ``partition._x`` module).
"""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "partition"
ADAPTERS = {"partition.flax", "partition.nnx", "partition.haiku"}  # and partition._haiku.*
FRAMEWORKS = ("flax", "haiku", "layers", "recipes", "benchmarks")


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.Module, module: str, *, top_level: bool) -> set[str]:
  """Modules imported by ``tree`` (``from partition import _x`` counts as
  ``partition._x``); only the module's own statements when ``top_level``."""
  nodes = tree.body if top_level else list(ast.walk(tree))
  stack, found = list(nodes), set()
  while stack:
    node = stack.pop()
    if top_level and isinstance(node, (ast.If, ast.Try, ast.With)):
      stack += [n for block in ("body", "orelse", "finalbody", "handlers")
                for n in getattr(node, block, [])]
    if isinstance(node, ast.ExceptHandler):
      stack += node.body
    if isinstance(node, ast.Import):
      found |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      found.add(node.module)
      found |= {f"{node.module}.{a.name}" for a in node.names}
    elif isinstance(node, ast.ImportFrom) and node.level:
      base = module.rsplit(".", node.level)[0]
      target = f"{base}.{node.module}" if node.module else base
      found.add(target)
      found |= {f"{target}.{a.name}" for a in node.names}
  return found


def _sources(folder: pathlib.Path):
  return sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


def _graph() -> dict[str, set[str]]:
  modules = {_module_name(p): p for p in _sources(PACKAGE)}
  graph = {}
  for name, path in modules.items():
    imported = _imports(ast.parse(path.read_text()), name, top_level=True)
    graph[name] = {m for m in imported if m in modules and m != name}
  return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
  state: dict[str, int] = {}  # 1 visiting, 2 done

  def visit(node, trail):
    state[node] = 1
    for nxt in sorted(graph[node]):
      if nxt == "partition":  # the package __init__: only reached from outside
        continue
      if state.get(nxt) == 1:
        return trail + [node, nxt]
      if nxt not in state:
        found = visit(nxt, trail + [node])
        if found:
          return found
    state[node] = 2
    return None

  for node in sorted(graph):
    if node not in state:
      found = visit(node, [])
      if found:
        return found
  return None


# The groups of partition/ (each a private subpackage with a README) and the groups each may
# import; a module directly in partition/ (the public faces, the self-check) may import any.
GROUPS = {
    "_base": set(),
    "_rules": {"_base"},
    "_xmap": {"_base", "_rules"},
    "_params": {"_base", "_rules"},
    "_training": {"_base", "_rules", "_xmap", "_params"},
    "_haiku": {"_base", "_rules", "_params"},  # the Haiku adapter's machinery
}


def _group(module: str) -> str | None:
  parts = module.split(".")
  return parts[1] if len(parts) > 2 else None


def test_the_graph_is_read():
  graph = _graph()
  assert "partition._xmap.api" in graph
  assert "partition._rules.table" in graph["partition._rules.context"]


def test_every_module_is_in_a_group_or_is_a_public_face():
  loose = sorted(m for m in _graph() if _group(m) is None and m.count(".") == 1
                 and m.split(".")[1].startswith("_") and m.split(".")[1] not in GROUPS
                 and m not in {"partition.__main__", "partition._selfcheck",
                              "partition._renamed"})
  assert loose == [], f"put {loose} in one of the groups {sorted(GROUPS)}"
  assert {_group(m) for m in _graph()} - {None} == set(GROUPS)


def test_each_group_has_a_readme_naming_its_modules_and_allowed_imports():
  for group, allowed in GROUPS.items():
    readme = (PACKAGE / group / "README.md").read_text()
    for path in _sources(PACKAGE / group):
      if path.name != "__init__.py":
        assert f"`{path.name}`" in readme, f"{group}/README.md does not mention {path.name}"
    if group != "_haiku":
      stated = set(re.findall(r"`(_[a-z]+)`", readme.split("May import:")[1]))
      assert stated == allowed, (group, stated, allowed)


def test_groups_import_only_downward():
  offenders = []
  for module, imported in _graph().items():
    group = _group(module)
    if group is None:
      continue
    for target in imported:
      other = _group(target)
      if other is not None and other != group and other not in GROUPS[group]:
        offenders.append(f"{module} imports {target} "
                         f"({group} may import {sorted(GROUPS[group])})")
  assert offenders == []


def test_the_group_arrows_have_no_circle():
  assert _cycle({g: set(allowed) for g, allowed in GROUPS.items()}) is None


def test_partition_modules_import_each_other_without_a_circle():
  assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()))


def test_cycle_finder_finds_a_circle():
  assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_core_imports_no_framework_at_module_level():
  offenders = []
  for path in _sources(PACKAGE):
    name = _module_name(path)
    if name in ADAPTERS or name.startswith("partition._haiku"):
      continue
    imported = _imports(ast.parse(path.read_text()), name, top_level=True)
    offenders += [f"{name} imports {m}" for m in sorted(imported)
                  if m.split(".")[0] in FRAMEWORKS
                  or m in ADAPTERS or m.startswith("partition._haiku")]
  assert offenders == []


@pytest.mark.parametrize("folder", ["layers", "recipes", "benchmarks"])
def test_packages_built_on_partition_use_only_its_public_api(folder):
  offenders = []
  for path in _sources(ROOT / folder):
    name = _module_name(path)
    imported = _imports(ast.parse(path.read_text()), name, top_level=False)
    offenders += [f"{path.relative_to(ROOT)} imports {m}" for m in sorted(imported)
                  if m.startswith("partition.") and m.split(".")[1].startswith("_")]
  assert offenders == []


def test_function_local_imports_of_partition_modules_are_the_listed_ones():
  """Function-local imports only where they break a cycle or keep the CLI start fast."""
  allowed = {("partition.__main__", "partition._selfcheck"),
             ("partition._selfcheck", "partition")}
  found = set()
  for path in _sources(PACKAGE):
    name = _module_name(path)
    tree = ast.parse(path.read_text())
    inner = _imports(tree, name, top_level=False) - _imports(tree, name, top_level=True)
    found |= {(name, m) for m in inner if m == "partition" or (
        m.startswith("partition.") and m.count(".") == 1)}
  assert found <= allowed, sorted(found - allowed)
