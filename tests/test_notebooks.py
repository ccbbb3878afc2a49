"""The tutorials in notebooks/: each runs top to bottom in a fresh kernel, and is stored stripped.

Execution uses nbclient (the ``[notebooks]`` extra): one new kernel per notebook, started
without the test run's JAX settings, so the notebook's own first cell must create the 8 CPU
devices, as it does for a reader who opens it in Jupyter. The working directory is a temporary
directory, so files a notebook writes never land in the repository. The notebooks assert their
results against references (numpy, one-device runs, plain ``jax.value_and_grad``), so a cell
that computes something wrong fails here.

The stripped check needs only ``json``: committed notebooks carry no outputs and no execution
counts (what ``nbstripout`` removes), so diffs show code, not run artefacts.
"""

from __future__ import annotations

import json
import pathlib
import re
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
EXPECTED = ("01_named_axes_xmap", "02_axis_rules", "03_flax_linen", "04_flax_nnx", "05_haiku",
            "06_training_recipe")
CELL_TIMEOUT_S = 300        # one cell; a whole notebook takes well under a minute alone
# Settings of the test process that would make a notebook pass without its own setup cell
# (``child_env`` already drops a forced device count from XLA_FLAGS).
KERNEL_ENV_DROP = ("JAX_PLATFORMS", "JAX_NUM_CPU_DEVICES", "MPLBACKEND")
# Tutorials with a bit-for-bit claim that holds with JAX's default compile, not at -O0
# (conftest.py's `bitwise`): their kernel compiles with JAX's defaults, the others at -O0 like
# the suite.
BITWISE = ("05_haiku",)  # Haiku's eager init against the sharded, jitted one
WARNING_LINE = re.compile(r"\b\w*Warning: ")   # how Python shows a warning on stderr


def _load(path: pathlib.Path) -> dict:
  return json.loads(path.read_text(encoding="utf-8"))


def _code_cells(nb: dict) -> list[dict]:
  return [c for c in nb["cells"] if c["cell_type"] == "code"]


def _source(cell: dict) -> str:
  src = cell["source"]
  return src if isinstance(src, str) else "".join(src)


def test_every_tutorial_is_there_and_indexed():
  assert tuple(p.stem for p in NOTEBOOKS) == EXPECTED
  index = (NOTEBOOK_DIR / "README.md").read_text(encoding="utf-8")
  for stem in EXPECTED:
    assert f"({stem}.ipynb)" in index, f"notebooks/README.md does not link {stem}.ipynb"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stripped(path):
  nb = _load(path)
  assert nb["nbformat"] == 4
  problems = []
  for i, cell in enumerate(nb["cells"]):
    if cell["cell_type"] == "code":
      if cell.get("outputs"):
        problems.append(f"cell {i} has outputs")
      if cell.get("execution_count") is not None:
        problems.append(f"cell {i} has execution_count {cell['execution_count']}")
    if "execution" in cell.get("metadata", {}):
      problems.append(f"cell {i} has execution timing metadata")
  if "widgets" in nb.get("metadata", {}):
    problems.append("notebook metadata has widget state")
  assert not problems, (f"{path.name} is not stripped: {problems}. Clear the outputs "
                        "(Jupyter: Edit > Clear Outputs of All Cells, or `nbstripout "
                        f"notebooks/{path.name}`) before committing.")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_first_code_cell_sets_eight_cpu_devices(path):
  first = _source(_code_cells(_load(path))[0])
  assert re.search(r"jax\.config\.update\(['\"]jax_num_cpu_devices['\"], 8\)", first)
  # Nothing may compute before the devices are configured (that would freeze the backend).
  before = first.split("jax_num_cpu_devices")[0]
  assert "jnp." not in before and "jax.devices" not in before


@pytest.mark.parametrize("path", [
    pytest.param(p, marks=[pytest.mark.bitwise] if p.stem in BITWISE else []) for p in NOTEBOOKS
], ids=lambda p: p.stem)
def test_notebook_executes(path, tmp_path, record_property, child_env):
  nbclient = pytest.importorskip(
      "nbclient", reason="executing notebooks needs the [notebooks] extra: "
                         "pip install -e '.[test,notebooks]'")
  import nbformat

  nb = nbformat.read(path, as_version=4)
  # This checkout's packages first, also when another copy of the project is installed.
  env = {k: v for k, v in child_env.items() if k not in KERNEL_ENV_DROP}
  client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                   resources={"metadata": {"path": str(tmp_path)}})
  start = time.perf_counter()
  client.execute(env=env)
  record_property("seconds", round(time.perf_counter() - start, 1))

  code = _code_cells(nb)
  assert all(c.get("execution_count") for c in code), "some code cells did not run"
  errors = [o for c in code for o in c["outputs"] if o["output_type"] == "error"]
  assert not errors
  # A reader sees no warning the notebook does not teach: its rules have a rule (a null one
  # where replicated on purpose) for every logical name its models use. A notebook whose
  # lesson is a warning catches it and prints it (``warnings.catch_warnings(record=True)``).
  warned = [f"cell {i}: {line.strip()}" for i, c in enumerate(nb.cells) if c.cell_type == "code"
            for o in c["outputs"] if o["output_type"] == "stream" and o["name"] == "stderr"
            for line in o["text"].splitlines() if WARNING_LINE.search(line)]
  assert not warned, f"{path.name} shows warnings a reader was not taught about: {warned}"
  # A notebook that draws a plot shows it (the inline backend produced a PNG).
  shows = sum("plt.show()" in _source(c) for c in code)
  pngs = sum("image/png" in o.get("data", {}) for c in code for o in c["outputs"])
  assert pngs >= shows
  # Files the notebook wrote stayed out of the repository.
  assert not [p for p in NOTEBOOK_DIR.iterdir() if p.suffix not in (".ipynb", ".md")
              and p.name != "__pycache__"]
