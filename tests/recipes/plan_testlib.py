"""What the planner's tests share: the tiny model they plan for, and running the CLI."""

import io
from contextlib import redirect_stderr, redirect_stdout

from recipes import plan, train
from recipes.config import load_config

# One layer, small batches: candidates compile in well under a second on CPU.
TINY = ["model.embed_dim=16", "model.mlp_dim=32", "model.num_layers=1", "batch_size=16",
        "seq_len=8", "model.vocab_size=16"]


def plan_config(*overrides, base=TINY):
  """The default recipe with ``base`` and then ``overrides`` applied."""
  return load_config(train.default_config_path(), list(base) + list(overrides))


def run_plan(*argv) -> tuple[int, str, str]:
  """``python -m recipes.plan *argv`` in this process: ``(exit code, stdout, stderr)``."""
  out, err = io.StringIO(), io.StringIO()
  with redirect_stdout(out), redirect_stderr(err):
    code = plan.main(list(argv))
  return code, out.getvalue(), err.getvalue()
