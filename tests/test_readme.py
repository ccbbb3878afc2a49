"""The README's Python snippets run as written (they are one program, top to bottom)."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run():
  blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
  assert blocks, "README has no python examples"
  exec(compile("\n".join(blocks), str(README), "exec"), {})


def test_readme_test_command_is_what_ci_runs():
  ci = (README.parent / ".ci" / "run").read_text()
  readme = README.read_text()
  command = re.search(r"^(python -m pytest[^\n#]*?)\s*(#|$)", readme, re.M).group(1).strip()
  assert command.replace("python ", "python3 ", 1) in ci


# The README's `python -m recipes.*` commands: tests/recipes/test_readme_commands.py.
