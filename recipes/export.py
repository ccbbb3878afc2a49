"""Canonical weights of a training run's checkpoint (``python -m recipes.export``).

Restores the parameters of a checkpoint written by ``python -m recipes.train`` onto one device
(shapes from orbax's metadata, no model code needed), converts them with
``layers.to_canonical`` to the framework-independent names (``embed/embedding``,
``blocks/attn/query/kernel`` with a leading ``layers`` dim, ...) and writes

* ``OUT`` (``.npz``): ``{canonical name: array}``;
* ``OUT`` with the suffix ``.json``: the ``TransformerConfig``, the framework and step it came
  from, and every weight's shape and dtype.

Both files are written atomically. Load them into any framework with
``layers.from_canonical(weights, like=params)`` (:func:`load` reads both files).

With ``--to hf``, ``OUT`` is a directory that ``transformers`` loads
(``AutoModelForCausalLM.from_pretrained(OUT)``): ``config.json`` and ``model.safetensors``
written by ``layers.to_hf`` (Qwen2 when the model has q/k/v biases, Qwen3 with q/k norms,
Mixtral with experts, else Llama, or ``--architecture``)::

  python -m recipes.export --checkpoint runs/default --out weights.npz
  python -m recipes.export --checkpoint runs/default/checkpoints --step 100 --out w100.npz
  python -m recipes.export --checkpoint runs/finetune --to hf --out runs/finetune/hf

  weights, model_config = recipes.export.load('weights.npz')
  model = layers.nnx.Transformer(model_config, rngs=nnx.Rngs(0))
  model = layers.from_canonical(weights, like=model)
"""

from __future__ import annotations

import argparse
import io
import json
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from partition import PartitionError
from recipes import report


class ExportError(PartitionError, ValueError):
  """The checkpoint to export is missing or is not a ``recipes.train`` run."""


def checkpoint_dir(path: str | pathlib.Path) -> pathlib.Path:
  """The orbax directory: ``path`` itself, or ``path/checkpoints`` for a run's ``out_dir``.

  >>> checkpoint_dir('no/such/run')  # doctest: +ELLIPSIS
  Traceback (most recent call last):
  ...
  recipes.export.ExportError: --checkpoint 'no/such/run' does not exist. Pass the out_dir ...
  """
  path = pathlib.Path(path)
  if (path / "checkpoints").is_dir():
    return path / "checkpoints"
  if path.is_dir():
    return path
  raise ExportError(f"--checkpoint {str(path)!r} does not exist. Pass the out_dir of a "
                    "python -m recipes.train run (e.g. runs/default) or its checkpoints/ "
                    "folder.")


def restore_params(directory: str | pathlib.Path, step: int | None = None
                   ) -> tuple[dict[str, Any], dict[str, Any], int]:
  """``(params, meta, step)`` of a checkpoint, on one device (default: the latest step).

  ``params`` is the run's plain nested dict of arrays; ``meta`` holds the run's ``config``
  and ``rules``.
  """
  import jax

  from recipes.checkpoint import Checkpointer, earlier_step_fix

  ckpt = Checkpointer(checkpoint_dir(directory))
  try:
    steps = ckpt.all_steps()   # the complete ones (recipes.checkpoint.complete_steps)
    if step is not None and step not in steps and (problem := step_problem(
        ckpt.directory, step, steps)):
      raise ExportError(problem)
    if not steps:
      raise ExportError(f"--checkpoint {str(directory)!r} holds no checkpoint steps. Train "
                        "first (python -m recipes.train out_dir=...), or pass the out_dir "
                        "of a run that saved one.")
    if step is not None and step not in steps:
      raise ExportError(f"--step {step}: no such checkpoint in {str(directory)!r}; it has "
                        f"steps {sorted(steps)}. Pass one of them, or leave --step out for "
                        "the latest.")
    step = max(steps) if step is None else step
    meta = ckpt.meta(step)
    if "config" not in meta or "rules" not in meta:
      raise ExportError(f"checkpoint {str(directory)!r} step {step} was not written by "
                        "python -m recipes.train (its metadata has no config/rules).")
    # One device with the run's mesh axis names, each of size 1: every array is whole there.
    names = tuple(meta["config"]["mesh"]) or ("data",)
    mesh = jax.make_mesh((1,) * len(names), names, devices=jax.devices()[:1])
    state, meta = ckpt.restore_on(step, mesh, fix=earlier_step_fix(ckpt.directory, step))
  finally:
    ckpt.close()
  return state["params"], meta, step


def step_problem(directory: pathlib.Path, step: int, steps: Sequence[int]) -> str | None:
  """For ``--step`` naming a numbered folder of ``directory`` that is not a complete
  checkpoint: what is missing there and the complete ``steps`` (``None``: no such folder).
  The message ``recipes.export`` and ``recipes.generate`` give."""
  from recipes.checkpoint import incomplete
  folder = pathlib.Path(directory).absolute() / str(step)
  why = incomplete(folder) if folder.is_dir() else None
  if why is None:
    return None
  return (f"--step {step}: the folder {folder} is not a complete checkpoint ({why}); the "
          f"complete steps are {list(steps)}. Pass one of them, or leave --step out for the "
          "latest.")


def check_hf_out(out: str | pathlib.Path) -> None:
  """``--out`` of ``--to hf`` is a directory: an existing file there is an ``ExportError``."""
  out = pathlib.Path(out)
  if out.exists() and not out.is_dir():
    other = out.with_suffix("") if out.suffix else out.with_name(f"{out.name}_hf")
    raise ExportError(f"--out {str(out)!r} is a file, but with --to hf --out is the "
                      "directory to write (config.json, model.safetensors). Pass a new or "
                      f"existing directory (e.g. --out {other}), or leave --to hf out to "
                      "write an .npz.")


def model_config(meta: dict[str, Any]):
  """The run's ``layers.TransformerConfig`` from checkpoint metadata."""
  import layers
  return layers.TransformerConfig(**meta["config"]["model"])


def _storable(x) -> np.ndarray:
  """A numpy array ``np.savez`` can store: bfloat16 and other ml_dtypes become float32."""
  a = np.asarray(x)
  if a.dtype.kind == "V" or a.dtype.type.__module__.startswith("ml_dtypes"):
    return a.astype(np.float32)
  return a


def export(directory: str | pathlib.Path, out: str | pathlib.Path, step: int | None = None,
           *, to: str = "npz", architecture: str | None = None) -> dict[str, Any]:
  """Writes the canonical weights of a checkpoint to ``out`` (``.npz``) and its config JSON,
  or (``to='hf'``) a Hugging Face checkpoint directory.

  Args:
    directory: a run's ``out_dir`` or its ``checkpoints`` folder.
    out: the ``.npz`` path (the JSON goes next to it with the suffix ``.json``), or the
      directory for ``to='hf'``.
    step: the checkpoint step (default: the latest).
    to: ``'npz'`` or ``'hf'``.
    architecture: for ``'hf'``: a key of ``layers.hf.ARCHITECTURES`` (``'llama'``,
      ``'mistral'``, ``'qwen2'``, ``'qwen3'``, ``'mixtral'``; default: from the model, see
      ``layers.to_hf``).

  Returns:
    The document describing the export (``model``, ``framework``, ``step``, ``weights``;
    for ``'hf'`` also ``files``); the ``.npz`` export writes it as its JSON.
  """
  import layers
  from partition.internal import atomic_write

  if architecture is not None and to != "hf":
    raise ExportError(architecture_without_hf(architecture, to))
  out = pathlib.Path(out)
  if to == "hf":   # before the restore: a mistake in the arguments is said at once
    check_hf_out(out)
  params, meta, step = restore_params(directory, step)
  canonical = {name: np.asarray(v) for name, v in layers.to_canonical(params).items()}
  if to == "npz":
    canonical = {name: _storable(v) for name, v in canonical.items()}
  doc = {"model": meta["config"]["model"], "framework": meta["config"]["framework"],
         "step": step, "checkpoint": str(checkpoint_dir(directory).absolute()),
         "weights": {k: {"shape": list(v.shape), "dtype": str(v.dtype)}
                     for k, v in sorted(canonical.items())}}
  if to == "hf":   # safetensors stores bfloat16 as is
    source = _fine_tuned_from(meta)
    base = layers.hf.read_json(source / "config.json", "recipes.export") if source else {}
    if source is not None:
      doc["source"] = str(source)
      if architecture is None and base.get("model_type") in layers.hf.ARCHITECTURES:
        architecture = base["model_type"]
    doc["files"] = layers.to_hf(canonical, model_config(meta), out, architecture=architecture,
                                token_ids=layers.hf.token_ids(base))
    doc["files"] += _copy_tokenizer(source, out) if source else []
    return doc
  buffer = io.BytesIO()
  np.savez(buffer, **canonical)
  atomic_write(out, buffer.getvalue())
  atomic_write(config_path(out), json.dumps(doc, indent=2, sort_keys=True) + "\n")
  return doc


# What a Hugging Face directory holds besides its weights and config.json, for text in and
# out (tokenizers, transformers' generate defaults); a fine-tune keeps its base model's.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "generation_config.json")


def _fine_tuned_from(meta: dict[str, Any]) -> pathlib.Path | None:
  """The Hugging Face directory the run started from (``init_from``), if it is still there."""
  source = meta["config"].get("init_from")
  if not source or not (pathlib.Path(source) / "config.json").is_file():
    return None
  return pathlib.Path(source)


def _copy_tokenizer(source: pathlib.Path, out: pathlib.Path) -> list[str]:
  from partition.internal import atomic_write
  copied = [name for name in TOKENIZER_FILES if (source / name).is_file()]
  for name in copied:
    atomic_write(out / name, (source / name).read_bytes())
  return copied


def architecture_without_hf(architecture: str, to: str) -> str:
  """The message for ``--architecture`` without ``--to hf`` (it was silently ignored)."""
  return (f"--architecture {architecture} only applies with --to hf (it picks the Hugging "
          f"Face model class to write); the {to} export holds the canonical names, which "
          f"have no architecture. Add --to hf to write a transformers directory as "
          f"{architecture}, or leave --architecture out.")


def config_path(out: str | pathlib.Path) -> pathlib.Path:
  return pathlib.Path(out).with_suffix(".json")


def load(path: str | pathlib.Path) -> tuple[dict[str, np.ndarray], Any]:
  """``(weights, TransformerConfig)`` of an export: feed ``weights`` to
  ``layers.from_canonical(weights, like=params)`` of a model built from the config."""
  import layers
  with np.load(path) as f:
    weights = {k: f[k] for k in f.files}
  doc = json.loads(config_path(path).read_text())
  return weights, layers.TransformerConfig(**doc["model"])


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="python -m recipes.export",
                                   description=report.plain(__doc__.splitlines()[0]))
  parser.add_argument("--checkpoint", required=True, metavar="DIR",
                      help="a run's out_dir or its checkpoints/ folder")
  parser.add_argument("--step", type=int, default=None, help="default: the latest step")
  parser.add_argument("--out", required=True,
                      help="the .npz to write (and OUT.json); with --to hf, a directory")
  parser.add_argument("--to", choices=("npz", "hf"), default="npz",
                      help="npz: canonical weights; hf: a transformers checkpoint directory")
  from layers.hf import ARCHITECTURES
  parser.add_argument("--architecture", choices=tuple(ARCHITECTURES), default=None,
                      help="with --to hf (default: from the model: qwen2 with q/k/v biases, "
                           "qwen3 with q/k norms, mixtral with experts, else llama)")
  args = parser.parse_args(argv)
  if args.architecture is not None and args.to != "hf":
    parser.error(architecture_without_hf(args.architecture, args.to))
  return args


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  try:
    doc = export(args.checkpoint, args.out, args.step, to=args.to,
                 architecture=args.architecture)
  except PartitionError as e:  # ExportError, FileError, HFError: say what to fix
    print(f"error: {e}", file=sys.stderr)
    return 2
  count = sum(int(np.prod(w["shape"])) for w in doc["weights"].values())
  summary = (f"{len(doc['weights'])} arrays, {count:,} parameters; {doc['framework']} "
             f"step {doc['step']}")
  if args.to == "hf":
    print(f"wrote {args.out}/ ({summary}): {', '.join(doc['files'])}")
  else:
    print(f"wrote {args.out} ({summary}) and {config_path(args.out)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
