"""Fine-tuning from a Hugging Face checkpoint: ``python -m recipes.train init_from=DIR``.

The model's *architecture* (sizes, heads, RoPE theta, norm epsilon, tied or untied output,
q/k/v biases, ``max_len``) comes from ``DIR/config.json`` via ``layers.from_hf``; how it
*runs* (``dtype``, ``param_dtype``, ``scan_layers``, ``remat``) comes from the run's config.
A ``model.*`` override that contradicts the checkpoint is an error rather than a silently
ignored setting (``model.max_len`` may only shrink it). The initial params are the
checkpoint's, read by each device for its own block (``from_hf(mesh=, rules=)``) and
placed in the framework's layout and shardings by ``layers.from_canonical``.

Wiring (``recipes/train.py``)::

  model_cfg = init_from.resolve_model(config.init_from, config.model,
                                      init_from.explicit_model_fields(overrides))
  config = dataclasses.replace(config, model=model_cfg)
  ...
  model = init_from.build_model(config.init_from, config, rules=rules, mesh=mesh)

>>> sorted(explicit_model_fields(['steps=5', 'model.dtype=bfloat16', 'model.num_layers=4']))
['dtype', 'num_layers']
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Iterable, Sequence
from typing import Any

import jax

import layers
from partition import PartitionError

# How the model runs, not what it computes: the run's config decides these.
# How the run computes, not what the checkpoint is: the attention kernel and its block, the
# loss's chunking and MoE token capacity change speed and memory (capacity: which tokens
# overflow), never the weights' meaning.
RUN_FIELDS = ("dtype", "param_dtype", "scan_layers", "remat", "pipeline_microbatches",
              "pipeline_repeats", "loss_chunk", "attention", "attention_block",
              "capacity_factor")


def checkpoint_free_fields() -> tuple[str, ...]:
  """Model fields a checkpoint's weights do not depend on: how the run computes
  (:data:`RUN_FIELDS`, less the two that change the restored tree, the stored dtype and the
  layers' stacking) and how long a sequence it is asked for (RoPE keeps no table in the
  weights). What ``recipes.generate --checkpoint`` and ``resume=true`` let a run change."""
  return tuple(f for f in RUN_FIELDS if f not in ("param_dtype", "scan_layers")) + ("max_len",)


class InitFromError(PartitionError, ValueError):
  """``init_from`` conflicts with the run's model settings."""


def explicit_model_fields(overrides: Sequence[str]) -> set[str]:
  """The ``TransformerConfig`` fields a list of ``key=value`` overrides sets (``model.X``)."""
  fields = set()
  for item in overrides:
    key = str(item).partition("=")[0].strip()
    if key.startswith("model."):
      fields.add(key.removeprefix("model."))
  return fields


def checkpoint_config(path: str | pathlib.Path, dtype: Any = "float32"
                      ) -> layers.TransformerConfig:
  """The ``TransformerConfig`` of a Hugging Face checkpoint directory (its config.json)."""
  config_file = pathlib.Path(path) / "config.json"
  if not config_file.is_file():
    raise InitFromError(f"init_from={str(path)!r} has no config.json. Pass a local "
                        "directory written by transformers' save_pretrained or by "
                        "python -m recipes.export --to hf.")
  return layers.hf.config_from_hf(layers.hf.read_json(config_file, f"init_from={str(path)!r}"),
                                  dtype=dtype,
                                  where=str(config_file))[0]


def resolve_model(path: str | pathlib.Path, run_model: layers.TransformerConfig,
                  explicit: Iterable[str] = ()) -> layers.TransformerConfig:
  """The run's model: the checkpoint's architecture with the run's ``RUN_FIELDS``.

  Args:
    path: the checkpoint directory (``init_from``).
    run_model: the run's ``config.model`` (defaults, YAML and overrides applied).
    explicit: the fields the user set on the command line (:func:`explicit_model_fields`);
      each must agree with the checkpoint (``max_len`` may be smaller).

  Raises:
    InitFromError: listing every conflicting override.
  """
  ckpt = checkpoint_config(path, run_model.param_dtype)
  problems, max_len = [], ckpt.max_len
  for field in sorted(set(explicit) - set(RUN_FIELDS)):
    ours, theirs = getattr(run_model, field), getattr(ckpt, field, None)
    if field == "max_len" and ours <= theirs:
      max_len = ours
    elif ours != theirs:
      problems.append(f"model.{field}={ours!r}, but the checkpoint has {field}={theirs!r}")
  if problems:
    raise InitFromError(_conflicts_message(path, problems))
  return dataclasses.replace(ckpt, max_len=max_len,
                             **{f: getattr(run_model, f) for f in RUN_FIELDS})


def _conflicts_message(path: str | pathlib.Path, problems: Sequence[str]) -> str:
  return "\n".join([
      f"init_from={str(path)!r}: {len(problems)} model override(s) contradict the "
      "checkpoint's config.json:",
      *(f"  - {p}" for p in problems),
      "  Drop these model.* overrides: the architecture comes from the checkpoint "
      f"(only {', '.join(RUN_FIELDS)} and a smaller max_len may be set)."])


def build_model(path: str | pathlib.Path, config: Any, *, rules: Any,
                mesh: jax.sharding.Mesh) -> Any:
  """The run's ``recipes.model.Model`` with the checkpoint's weights as its params.

  Args:
    path: the checkpoint directory.
    config: the run's ``TrainConfig``, its ``model`` from :func:`resolve_model`.
    rules, mesh: the run's; each device reads only its block of each tensor.

  Returns:
    ``Model`` (framework ``config.framework``) whose ``params`` hold the checkpoint,
    sharded like freshly initialised params.

  Raises:
    InitFromError: ``config.model`` is not the checkpoint's architecture (call
      :func:`resolve_model` first).
  """
  from recipes import model as model_lib

  weights, ckpt = layers.from_hf(path, mesh=mesh, rules=rules, dtype=config.model.param_dtype)
  keep = {f: getattr(config.model, f) for f in (*RUN_FIELDS, "max_len")}
  if dataclasses.replace(ckpt, **keep) != config.model:
    raise InitFromError(f"init_from={str(path)!r}: config.model {config.model} is not the "
                        f"checkpoint's {ckpt}. Build it with "
                        "recipes.init_from.resolve_model.")
  # The framework's params as sharded shapes to fill (nothing allocated but the weights).
  model = model_lib.build(config.framework, config.model, seed=config.seed,
                          example=model_lib.example_tokens(config.batch_size,
                                                           min(config.seq_len,
                                                               config.model.max_len)),
                          rules=rules, mesh=mesh, abstract=True)
  params = layers.from_canonical(weights, like=model.params)
  return dataclasses.replace(model, params=params)
