"""What the job's tests share: one tiny run, the README's commands, the losses a run logged.

One definition of the tiny run matters for speed too: runs with equal configs compile equal
programs, which the session's compilation cache (``conftest.py``) then compiles once.
"""

import json
import pathlib
import re
import shlex

REPO = pathlib.Path(__file__).resolve().parents[2]
README = REPO / "README.md"

# Appended to a run's own keys: a one-layer model, small batches, three logged steps, no
# checkpoints or plots unless the test asks. batch_size 32 = 8 devices x preset=microbatch's
# 4-step loop.
TINY = ["model.embed_dim=16", "model.mlp_dim=32", "model.num_heads=2", "model.num_kv_heads=1",
        "model.head_dim=8", "model.num_layers=1", "batch_size=32", "seq_len=8", "steps=3",
        "eval_every=3", "eval_batches=1", "checkpoint_every=0", "plot=false", "log_every=1"]


def key(override: str) -> str:
  return override.split("=", 1)[0]


def losses(out_dir) -> list[float]:
  """The training loss of every logged step of the run in ``out_dir``."""
  lines = pathlib.Path(out_dir, "metrics.jsonl").read_text().splitlines()
  return [json.loads(line)["loss"] for line in lines]


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
