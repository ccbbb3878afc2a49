"""The Python snippets of README.md and docs/*.md run as written, one runner for every page.

A page's ``python`` blocks are one program, run top to bottom in a fresh namespace on the 8
CPU devices of the root conftest. What differs between pages is a parameter of ``Doc``: how
many blocks it must have, the folder it runs in, text swapped in before it runs, what it
must print. docs/errors.md is not here: each of its sections must raise the error it shows
(tests/partition/rules/test_bad_input_rules.py). The README's ``python -m recipes.*``
commands: tests/recipes/test_readme_commands.py.
"""

from __future__ import annotations

import dataclasses
import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Doc:
  path: str                          # from the repository root
  min_blocks: int = 1
  max_blocks: int | None = None
  cwd: str = "root"                  # "root", or "tmp": a fresh folder holding only `links`
  links: tuple[str, ...] = ()        # repository folders the page reads by relative path
  replace: tuple[tuple[str, str], ...] = ()  # (text, by) before running; "{tmp}" is tmp_path
  names: tuple[tuple[str, str], ...] = ()  # (name, module) the page uses without importing
  prints: tuple[str, ...] = ()       # the first lines the page prints
  writes: tuple[str, ...] = ()       # files the page writes under tmp_path


SLOW = pytest.mark.slow  # each page compiles and runs models (more than 1.5 s)
DOCS = [
    pytest.param(Doc("README.md"), marks=SLOW, id="README.md"),
    pytest.param(Doc("docs/adapters.md", min_blocks=5), marks=SLOW, id="adapters.md"),
    pytest.param(Doc("docs/layers.md", min_blocks=3), marks=SLOW, id="layers.md"),
    # rules.md loads the peers' config excerpts from tests/partition/data and recipes' presets
    pytest.param(Doc("docs/rules.md", cwd="tmp", links=("recipes", "tests"),
                     names=(("jax", "jax"), ("jnp", "jax.numpy"))), marks=SLOW, id="rules.md"),
    pytest.param(Doc("docs/hf.md", min_blocks=2, max_blocks=2,
                     replace=(("/tmp/qwen2_copy", "{tmp}"),),
                     prints=("2 True True 1000000.0", "P(None, 'fsdp', 'tensor', None)"),
                     writes=("model.safetensors",)), marks=SLOW, id="hf.md"),
    pytest.param(Doc("docs/xmap.md", min_blocks=2), marks=SLOW, id="xmap.md"),
    pytest.param(Doc("docs/generate.md", max_blocks=1), marks=SLOW, id="generate.md"),
]


def _program(doc: Doc, tmp_path: pathlib.Path) -> str:
  text = (ROOT / doc.path).read_text(encoding="utf-8")
  for old, new in doc.replace:
    text = text.replace(old, new.format(tmp=tmp_path))
  blocks = re.findall(r"```python\n(.*?)```", text, re.S)
  assert len(blocks) >= doc.min_blocks, f"{doc.path}: {len(blocks)} python blocks"
  assert doc.max_blocks is None or len(blocks) <= doc.max_blocks, doc.path
  return "\n".join(blocks)


@pytest.mark.parametrize("doc", DOCS)
def test_doc_python_blocks_run(doc, tmp_path, monkeypatch, capsys):
  program = _program(doc, tmp_path)
  if doc.cwd == "tmp":
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    for name in doc.links:
      (cwd / name).symlink_to(ROOT / name)
  else:
    cwd = ROOT
  monkeypatch.chdir(cwd)
  namespace = {name: importlib.import_module(module) for name, module in doc.names}
  exec(compile(program, str(ROOT / doc.path), "exec"), namespace)  # noqa: S102
  if doc.prints:
    assert capsys.readouterr().out.split("\n")[:len(doc.prints)] == list(doc.prints)
  for name in doc.writes:
    assert (tmp_path / name).is_file(), name


@SLOW
def test_readme_test_command_is_what_ci_runs():
  ci = (ROOT / ".ci" / "run").read_text()
  readme = (ROOT / "README.md").read_text()
  command = re.search(r"^(python -m pytest[^\n#]*?)\s*(#|$)", readme, re.M).group(1).strip()
  assert command.replace("python ", "python3 ", 1) in ci
