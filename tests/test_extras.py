"""Optional dependencies (pip extras): ``import partition`` needs only the core dependencies,
each module of an extra names its extra when a package is missing, and ``pyproject.toml``
declares every package the code imports.

The missing packages are simulated in a fresh process with ``sys.modules[name] = None``, which
makes ``import name`` raise ``ModuleNotFoundError`` as if it were not installed.
"""

from __future__ import annotations

import ast
import json
import pathlib
import re
import subprocess
import sys
import textwrap
import tomllib

import pytest

from partition.internal import needs_extra

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# Import name -> distribution, where they differ.
DISTRIBUTIONS = {"haiku": "dm-haiku", "orbax": "orbax-checkpoint", "yaml": "PyYAML"}
# Imported only where they are optional on purpose.
OPTIONAL = {"tomli": "partition/_rules/files.py's fallback for Python < 3.11"}
FIRST_PARTY = {"partition", "layers", "recipes", "benchmarks"}


def _run(code: str, child_env) -> dict:
  """Runs ``code`` in a fresh Python (this checkout first on the path); its JSON output."""
  proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=child_env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _requirement_name(requirement: str) -> str:
  return re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower()


def _closure(extras: list[str]) -> set[str]:
  """The distributions the core plus ``extras`` install (self-references followed)."""
  names, todo, seen = set(), [*PYPROJECT["dependencies"]], set()
  todo += [r for e in extras for r in PYPROJECT["optional-dependencies"][e]]
  while todo:
    requirement = todo.pop()
    name = _requirement_name(requirement)
    if name == "named-partition":
      more = re.search(r"\[(.*)\]", requirement).group(1).split(",")
      todo += [r for e in more if e.strip() not in seen
               for r in PYPROJECT["optional-dependencies"][e.strip()]]
      seen |= {e.strip() for e in more}
    else:
      names.add(name)
  return names


# (the package made missing, the modules that need it, their extra)
CASES = [
    ("flax", ["partition.flax", "partition.nnx", "layers.linen", "layers.nnx"], "flax"),
    ("haiku", ["partition.haiku", "layers.haiku"], "haiku"),
    ("optax", ["recipes.train"], "recipes"),
    ("orbax", ["recipes.checkpoint"], "recipes"),
    ("grain", ["recipes.data"], "recipes"),
]


@pytest.mark.slow  # starts a process
@pytest.mark.parametrize("blocked, modules, extra", CASES, ids=[c[0] for c in CASES])
def test_a_module_without_its_extra_names_the_pip_command(blocked, modules, extra, child_env):
  found = _run(f"""
      import json, sys
      sys.modules[{blocked!r}] = None  # as if it were not installed
      found = {{}}
      for module in {modules!r}:
        try:
          __import__(module)
          found[module] = None
        except ImportError as err:
          found[module] = [type(err).__name__, str(err), err.name.split('.')[0]]
      print(json.dumps(found))
      """, child_env)
  package = DISTRIBUTIONS.get(blocked, blocked)
  for module in modules:
    assert found[module] == [
        "MissingExtraError",
        f"{module} needs {package}, which is not installed: "
        f"pip install 'named-partition[{extra}]'",
        blocked], module
  assert package.lower() in _closure([extra]), f"[{extra}] does not install {package}"


@pytest.mark.slow  # starts a process
def test_the_core_runs_an_xmap_without_the_frameworks(child_env):
  found = _run("""
      import json, sys
      BLOCKED = ('flax', 'haiku', 'optax', 'orbax', 'grain', 'matplotlib', 'safetensors',
                 'rich', 'tokenizers')
      for name in BLOCKED:
        sys.modules[name] = None
      import jax
      jax.config.update('jax_num_cpu_devices', 8)
      import jax.numpy as jnp
      import numpy as np
      import partition
      import layers
      mesh = jax.make_mesh((4, 2), ('data', 'model'))
      x = jnp.arange(32.0).reshape(8, 4)
      rules = partition.AxisRules([('batch', 'data')])
      center = partition.xmap(lambda v: v - jax.lax.pmean(v, 'batch'), ['batch', ...],
                              ['batch', ...], axis_resources=rules, mesh=mesh)
      y = center(x)
      print(json.dumps({
          'close': bool(np.allclose(y, np.asarray(x) - np.asarray(x).mean(0))),
          'spec': str(y.sharding.spec),
          'loaded': sorted(n for n in BLOCKED if sys.modules.get(n) is not None)}))
      """, child_env)
  assert found == {"close": True, "spec": "P('data', None)", "loaded": []}


def test_needs_extra_turns_a_missing_module_into_the_pip_command():
  with pytest.raises(ImportError) as caught:
    with needs_extra("haiku", by="layers.haiku"):
      import haiku_is_not_a_module  # noqa: F401
  assert str(caught.value) == ("layers.haiku needs haiku_is_not_a_module, which is not "
                               "installed: pip install 'named-partition[haiku]'")
  assert caught.value.name == "haiku_is_not_a_module"
  assert isinstance(caught.value.__cause__, ModuleNotFoundError)


def test_needs_extra_leaves_other_errors_alone():
  with pytest.raises(ValueError, match="not an import"):
    with needs_extra("flax", by="partition.flax"):
      raise ValueError("not an import")
  with pytest.raises(ModuleNotFoundError, match="no name"):  # nothing to name in a message
    with needs_extra("flax", by="partition.flax"):
      raise ModuleNotFoundError("no name")
  with needs_extra("flax", by="partition.flax"):
    import json  # noqa: F401  (present: nothing raised)


def _third_party_imports(folder: str, *, top_level: bool) -> dict[str, set[str]]:
  """Top-level names of the non-stdlib, non-project modules imported in ``folder``, and
  where."""
  found: dict[str, set[str]] = {}
  for path in sorted((ROOT / folder).rglob("*.py")):
    tree = ast.parse(path.read_text())
    nodes = ast.walk(tree) if not top_level else [
        n for stmt in tree.body for n in ast.walk(stmt)
        if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    for node in nodes:
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        names = [node.module]
      else:
        continue
      for name in names:
        top = name.split(".")[0]
        if top not in sys.stdlib_module_names and top not in FIRST_PARTY | set(OPTIONAL):
          found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
  return found


def _undeclared(imported: dict[str, set[str]], installed: set[str]) -> list[str]:
  return sorted(f"{name} ({', '.join(sorted(where))})" for name, where in imported.items()
                if DISTRIBUTIONS.get(name, name).lower() not in installed)


def test_all_declares_every_package_the_code_imports():
  imported: dict[str, set[str]] = {}
  for folder in sorted(FIRST_PARTY):
    for name, where in _third_party_imports(folder, top_level=False).items():
      imported.setdefault(name, set()).update(where)
  assert {"flax", "haiku", "optax", "orbax", "jax"} <= set(imported)  # the scan sees them
  assert _undeclared(imported, _closure(["all"])) == []


def test_the_core_dependencies_cover_the_core_modules():
  """Module-level imports of ``partition`` outside the adapters (``partition.flax``,
  ``partition.nnx``, ``partition.haiku`` and ``partition/_haiku``) need no extra."""
  imported = _third_party_imports("partition", top_level=True)
  adapters = re.compile(r"partition/(flax|nnx|haiku)\.py|partition/_haiku/")
  core = {name: {w for w in where if not adapters.match(w)} for name, where in imported.items()}
  core = {name: where for name, where in core.items() if where}
  assert set(core) >= {"jax", "numpy", "yaml"}
  assert _undeclared(core, _closure([])) == []
  assert not {"flax", "dm-haiku", "optax", "orbax-checkpoint"} & _closure([])


def test_the_test_and_notebook_extras_include_all():
  assert _closure(["all"]) <= _closure(["test"])
  assert _closure(["all"]) <= _closure(["notebooks"])
  assert _closure(["flax", "haiku", "recipes", "generate"]) == _closure(["all"])
