"""docs/adapters.md: its Python snippets run as written (one program, top to bottom)."""

import pathlib
import re

import pytest

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "adapters.md"


@pytest.mark.slow
def test_adapters_doc_python_blocks_run():
  blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
  assert len(blocks) >= 5
  exec(compile("\n".join(blocks), str(DOC), "exec"), {})
