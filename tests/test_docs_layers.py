"""docs/layers.md: its Python snippets run as written (one program, top to bottom)."""

import pathlib
import re

import pytest

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "layers.md"


@pytest.mark.slow
def test_layers_doc_python_blocks_run():
  blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
  assert len(blocks) >= 3
  exec(compile("\n".join(blocks), str(DOC), "exec"), {})
