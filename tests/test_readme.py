"""The README's Python snippets run as written (they are one program, top to bottom)."""

import pathlib
import re
import shlex
import subprocess
import sys

import pytest

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


# -- the README's commands, verbatim ---------------------------------------------------------

# Appended to every training command: the test is about each command's parsing and checks
# (every key it names is still set as written; these only make the model and the run tiny).
TINY_RUN = ["model.embed_dim=16", "model.mlp_dim=32", "model.num_layers=1", "batch_size=32",
            "seq_len=8", "steps=2", "eval_every=2", "eval_batches=1", "checkpoint_every=0",
            "plot=false"]


def readme_commands(module: str) -> list[list[str]]:
  """Every ``python -m recipes.<module> ...`` of the README (code blocks and the preset table),
  as argument lists, in order."""
  found = []
  for line in README.read_text().splitlines():
    for text in re.findall(r"`(python -m recipes\.[^`]+)`", line) or [line]:
      if f"python -m recipes.{module}" not in text:
        continue
      text = text[text.index(f"python -m recipes.{module}"):]
      args = shlex.split(text, comments=True)[3:]
      if args not in found:  # the main command is printed twice (quick start, prose)
        found.append(args)
  return found


def test_readme_has_the_commands():
  train_commands = readme_commands("train")
  assert [] in train_commands and ["resume=true"] in train_commands
  assert ["preset=microbatch", "mesh={data: 8}", "out_dir=runs/microbatch"] in train_commands
  assert len(train_commands) >= 11


# The planner's output config (README: recipes.plan --out runs/plan/best.yaml) is trained by
# tests/recipes/test_plan.py::test_written_config_trains_unchanged.
TRAIN_COMMANDS = [c for c in readme_commands("train")
                  if c[:2] != ["--config", "runs/plan/best.yaml"] and c != ["resume=true"]]


def _train_as_printed(args: list[str], folder, monkeypatch, capsys) -> str:
  """``python -m recipes.train *args`` in ``folder`` (made tiny by TINY_RUN); its stderr."""
  from recipes import train
  monkeypatch.chdir(folder)  # relative out_dirs and files land here
  (folder / "my.yaml").write_text("framework: haiku\nseed: 3\n")
  (folder / "notes.txt").write_text("the quick brown fox jumps over the lazy dog. " * 20)
  if not (folder / "tests").exists():
    (folder / "tests").symlink_to(README.parent / "tests")  # init_from=tests/layers/data/hf/...
  given = {a.split("=", 1)[0] for a in args}  # a key the command sets stays as printed
  if "init_from" in given:  # the checkpoint decides the model
    given |= {t.split("=", 1)[0] for t in TINY_RUN if t.startswith("model.")}
  code = train.main(args + [t for t in TINY_RUN if t.split("=", 1)[0] not in given])
  err = capsys.readouterr().err
  assert code == 0, (args, err)
  return err


@pytest.mark.slow
@pytest.mark.parametrize("args", TRAIN_COMMANDS, ids=lambda args: " ".join(args) or "default")
def test_readme_train_command_runs_as_printed(args, tmp_path, monkeypatch, capsys):
  _train_as_printed(args, tmp_path, monkeypatch, capsys)
  out_dir = next((a.split("=", 1)[1] for a in args if a.startswith("out_dir=")), "runs/default")
  assert (tmp_path / out_dir / "summary.json").exists()


@pytest.mark.slow
def test_readme_resume_command_continues_the_default_run(tmp_path, monkeypatch, capsys):
  _train_as_printed([], tmp_path, monkeypatch, capsys)
  err = _train_as_printed(["resume=true", "steps=3"], tmp_path, monkeypatch, capsys)
  assert "resumed from step 2 of " in err  # one more step than the first run


@pytest.mark.slow
def test_readme_explain_command_parses_and_plans():
  [args] = readme_commands("explain")
  proc = subprocess.run([sys.executable, "-m", "recipes.explain", *args, "--no-compile",
                         "--json"], cwd=README.parent, capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert '"num_devices": 64' in proc.stdout
