"""Continue prompts with a trained or downloaded model (``python -m recipes.generate``).

The model comes from a training run (``--checkpoint runs/x``: its config, framework, preset
and mesh; its latest checkpoint or ``--step``) or from a Hugging Face directory
(``init_from=DIR``: Llama / Mistral / Qwen2 / Qwen3 / Mixtral, with the preset and mesh of
the run config, as in ``python -m recipes.train init_from=DIR``). Preset, mesh and rules can
be overridden like
the training recipe's (``preset=tensor_parallel mesh='{data: 2, tensor: 4}'``). Params are
restored into their shards; the KV cache is created in its shards (``layers._decode``).

Prompts (``--prompt``, repeatable; a batch of different lengths is fine) are text:

* a Hugging Face directory with a ``tokenizer.json``: encoded by the ``tokenizers`` package
  (``pip install 'named-partition[generate]'``) and the continuation decoded back;
* a run on a synthetic digit task (the default recipe): the digits of the question, e.g.
  ``--prompt 31415926`` (the separator is appended), answered in digits;
* a byte-level run (``data.path`` a text file): UTF-8 bytes.

``--tokens "5 3 6 1"`` gives token ids instead (any model). It prints each continuation and
the prefill and decode throughput separately (tokens/s, after compilation)::

  python -m recipes.generate --checkpoint runs/default --prompt 31415926
  python -m recipes.generate init_from=hf/llama --prompt "The capital of France is"
  python -m recipes.generate --checkpoint runs/x --tokens "1 2 3" --temperature 0.8 --top-p 0.9

Exit status 2 with a message naming the flag for any mistake in the arguments (a prompt
longer than the model's ``max_len``, a prompt or ``--stop`` id outside the vocabulary,
``--top-p`` outside (0, 1], a checkpoint whose config the model cannot express). A digit
``--prompt`` of another length than the synthetic task's questions gets a note on stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import warnings
from collections.abc import Sequence
from typing import Any

if __name__ == "__main__":
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from partition import PartitionError  # noqa: E402
from partition.internal import format_message, needs_extra  # noqa: E402
from recipes import report  # noqa: E402


class GenerateArgumentError(PartitionError, ValueError):
  """The command line of ``recipes.generate`` is inconsistent."""


# -- arguments -------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      prog="python -m recipes.generate", description=report.plain(__doc__.splitlines()[0]),
      epilog="Overrides are key=value as in python -m recipes.train: init_from=DIR, "
             "preset=NAME, mesh='{data: 2, tensor: 4}', rules=[...], framework=linen.")
  parser.add_argument("--checkpoint", metavar="DIR",
                      help="a training run's out_dir (or its checkpoints/ folder)")
  parser.add_argument("--step", type=int, default=None, help="default: the latest step")
  parser.add_argument("--prompt", action="append", default=[],
                      help="a text prompt (repeat for a batch)")
  parser.add_argument("--tokens", action="append", default=[],
                      help="a prompt as token ids, e.g. '5 3 6 1' (repeat for a batch)")
  parser.add_argument("--max-new-tokens", type=int, default=None,
                      help="per prompt (default: the answer length of a synthetic task, "
                           "else 32)")
  parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
  parser.add_argument("--top-k", type=int, default=0, help="0 = no top-k cut")
  parser.add_argument("--top-p", type=float, default=1.0, help="nucleus mass, in (0, 1]")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--stop", action="append", default=None, metavar="ID",
                      help="a stop token id (repeatable; default: the checkpoint's "
                           "eos_token_id, if any)")
  parser.add_argument("overrides", nargs="*", help="key=value overrides")
  return parser.parse_intermixed_args(argv)   # overrides before or after the options


# -- where the model comes from --------------------------------------------------------------


@dataclasses.dataclass
class Source:
  """The run config to generate with and how text maps to ids."""

  config: Any                    # recipes.config.TrainConfig
  checkpoint: pathlib.Path | None
  step: int | None
  meta: dict[str, Any] | None
  codec: Codec


def _step_dirs(directory: pathlib.Path) -> list[int]:
  """The complete steps (``recipes.checkpoint.complete_steps``: the rule of
  ``recipes.export`` and ``resume=true``); an incomplete step folder is skipped, warning."""
  from recipes.checkpoint import complete_steps
  return complete_steps(directory)


def run_source(path: str, step: int | None, overrides: Sequence[str]) -> Source:
  """A training run's config (its recorded keys, then ``overrides``) and checkpoint step.

  Reads the checkpoint's JSON metadata directly (no JAX backend started), so the devices can
  be set up for the run's mesh afterwards."""
  from recipes.config import load_config
  from recipes.export import checkpoint_dir, step_problem
  directory = checkpoint_dir(path).resolve()   # orbax restores from absolute paths only
  steps = _step_dirs(directory)
  if step is not None and step not in steps and (problem := step_problem(directory, step,
                                                                         steps)):
    raise GenerateArgumentError(problem)
  if not steps:
    raise GenerateArgumentError(f"--checkpoint {path!r} holds no checkpoint steps. Train "
                                "first (python -m recipes.train out_dir=...).")
  if step is not None and step not in steps:
    raise GenerateArgumentError(f"--step {step}: no such checkpoint in {path!r}; it has "
                                f"steps {steps}. Pass one of them, or leave --step out.")
  step = max(steps) if step is None else step
  meta = json.loads((directory / str(step) / "meta" / "metadata").read_text())
  if "config" not in meta:
    raise GenerateArgumentError(f"--checkpoint {path!r} step {step} was not written by "
                                "python -m recipes.train (its metadata has no config).")
  recorded = meta["config"]
  keys = [f"{k}={json.dumps(recorded[k])}" for k in ("framework", "preset", "mesh", "rules",
                                                    "seq_len")]
  keys += [f"model.{k}={json.dumps(v)}" for k, v in recorded["model"].items()]
  keys += [f"data.{k}={json.dumps(v)}" for k, v in recorded["data"].items()]
  for item in overrides:
    if item.partition("=")[0].strip() in ("init_from",):
      raise GenerateArgumentError("give either --checkpoint or init_from=DIR, not both")
  config = load_config(None, [*keys, *overrides])
  _check_checkpoint_overrides(path, recorded, config)
  return Source(config, directory, step, meta, Codec.for_run(config))


def _check_checkpoint_overrides(path: str, recorded: dict[str, Any], config) -> None:
  """Overrides that change what the checkpoint's weights are (the framework, a dimension,
  the layer layout) cannot be generated with: the restore would fail deep inside."""
  from recipes.init_from import checkpoint_free_fields
  from recipes.rundir import model_changes
  free = checkpoint_free_fields()
  problems = []
  for key, saved, now in model_changes(config, recorded, free):
    shown = (lambda v: v) if key == "framework" else json.dumps
    why = " (its weights are laid out for that framework)" if key == "framework" else ""
    problems.append(f"{key}={shown(now)} here, {shown(saved)} in the checkpoint{why}")
  if problems:
    raise GenerateArgumentError(
        f"--checkpoint {path!r}: these overrides change the model the checkpoint holds: "
        + "; ".join(problems) + ". Leave them out (the checkpoint's config is used), or "
        f"change only how it runs ({', '.join('model.' + f for f in free)})"
        "; to run it in another framework, export it (python -m recipes.export) and "
        "generate with init_from=DIR framework=...")


def hf_source(overrides: Sequence[str]) -> Source:
  """The run config of ``init_from=DIR`` (its architecture from ``DIR/config.json``)."""
  from recipes import init_from
  from recipes.config import load_config
  config = load_config(None, list(overrides))
  model = init_from.resolve_model(config.init_from, config.model,
                                  init_from.explicit_model_fields(overrides))
  config = dataclasses.replace(config, model=model)
  return Source(config, None, None, None, Codec.for_hf(pathlib.Path(config.init_from)))


# -- text <-> ids ----------------------------------------------------------------------------


@dataclasses.dataclass
class Codec:
  """Text <-> token ids for one model: ``kind`` is ``'tokenizer'``, ``'digits'``,
  ``'bytes'`` or ``'ids'`` (no text: ``--tokens`` only)."""

  kind: str
  tokenizer: Any = None
  digits: int = 10
  answer_length: int | None = None
  eos: tuple[int, ...] = ()
  why: str = ""
  task: str | None = None        # a synthetic task's name: its questions have answer_length
                                 # digits (recipes.data.SyntheticTask)
  seq_len: int | None = None

  @classmethod
  def for_run(cls, config) -> Codec:
    if config.data.path is None:
      return cls("digits", digits=config.data.digits, answer_length=config.seq_len // 2,
                 task=config.data.task, seq_len=config.seq_len)
    if not str(config.data.path).endswith(".npy"):
      return cls("bytes")
    return cls("ids", why=f"the run trained on token ids ({config.data.path})")

  @classmethod
  def for_hf(cls, directory: pathlib.Path) -> Codec:
    eos = _eos_ids(directory)
    if not (directory / "tokenizer.json").is_file():
      return cls("ids", eos=eos, why=f"{directory} has no tokenizer.json")
    try:
      import tokenizers
    except ImportError:
      raise GenerateArgumentError(
          f"{directory}/tokenizer.json needs the tokenizers package: pip install "
          "'named-partition[generate]' (or pass --tokens)") from None
    return cls("tokenizer", tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json")),
               eos=eos)

  def encode(self, text: str) -> list[int]:
    from recipes.data import FIRST_DIGIT, SEP
    if self.kind == "tokenizer":
      return self.tokenizer.encode(text).ids
    if self.kind == "bytes":
      return list(text.encode("utf-8"))
    if self.kind == "digits":
      chars = text.replace(" ", "")
      bad = [c for c in chars if not c.isdigit() or int(c) >= self.digits]
      if bad or not chars:
        raise GenerateArgumentError(
            f"--prompt {text!r}: this run's task reads digits 0..{self.digits - 1} (e.g. "
            f"--prompt 31415926); got {''.join(bad) or 'nothing'}. Pass digits, or ids "
            "with --tokens.")
      return [int(c) + FIRST_DIGIT for c in chars] + [SEP]
    raise GenerateArgumentError(f"--prompt needs a tokenizer, but {self.why}: pass token "
                                "ids with --tokens '1 2 3'")

  def length_note(self, text: str) -> str | None:
    """A note for a digit prompt whose length is not the task's: the model saw questions of
    ``seq_len // 2`` digits only, and continues any other length with an answer of no
    meaning (no error: the model can be run on it)."""
    n, got = self.answer_length, len(text.replace(" ", ""))
    if self.kind != "digits" or n is None or got == n:
      return None
    example = "".join(str(int(c) % self.digits) for c in "31415926535897932384" * n)[:n]
    return (f"note: --prompt {text!r} has {got} digit(s), but this run's {self.task} task "
            f"was trained on questions of {n} digits (seq_len={self.seq_len}): the model "
            f"has seen no other length, so expect a wrong answer. Pass {n} digits (e.g. "
            f"--prompt {example}).")

  def decode(self, ids: Sequence[int]) -> str | None:
    from recipes.data import FIRST_DIGIT, SEP
    if self.kind == "tokenizer":
      return self.tokenizer.decode(list(ids), skip_special_tokens=True)
    if self.kind == "bytes":
      return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
    if self.kind == "digits":
      return "".join(str(i - FIRST_DIGIT) if FIRST_DIGIT <= i < FIRST_DIGIT + self.digits
                     else "|" if i == SEP else "?" for i in ids)
    return None


def _eos_ids(directory: pathlib.Path) -> tuple[int, ...]:
  """``eos_token_id`` of ``generation_config.json``, else of ``config.json`` (int or list)."""
  for name in ("generation_config.json", "config.json"):
    path = directory / name
    if path.is_file():
      eos = json.loads(path.read_text()).get("eos_token_id")
      if eos is not None:
        return tuple(eos) if isinstance(eos, list) else (int(eos),)
  return ()


def parse_ids(text: str) -> list[int]:
  """``'5 3, 6'`` -> ``[5, 3, 6]``.

  >>> parse_ids('5 3, 6')
  [5, 3, 6]
  """
  parts = text.replace(",", " ").split()
  bad = [p for p in parts if not p.lstrip("-").isdigit()]
  if bad or not parts:
    raise GenerateArgumentError(f"--tokens {text!r}: give integer ids separated by spaces "
                                f"(got {bad or 'nothing'})")
  return [int(p) for p in parts]


# -- the model -------------------------------------------------------------------------------


def restore_params(source: Source, rules, mesh) -> Any:
  """The run's params restored straight into their shards on ``mesh`` (nothing else of
  the train state is read)."""
  with needs_extra("recipes", by="recipes.generate"):
    import orbax.checkpoint as ocp

  from recipes.checkpoint import Checkpointer, earlier_step_fix, reading, restore_target

  fix = earlier_step_fix(source.checkpoint, source.step)
  ckpt = Checkpointer(source.checkpoint)
  try:
    abstract = restore_target(ckpt.state_metadata(source.step, fix=fix)["params"],
                              source.meta["logical_axes"], rules, mesh, prefix="params/",
                              api="recipes.generate")
  finally:
    ckpt.close()
  item = {"params": abstract}
  with ocp.PyTreeCheckpointer() as reader, reading(   # the params alone (no optimizer state)
      source.checkpoint, source.step, fix):
    state = reader.restore(source.checkpoint / str(source.step) / "state",
                           args=ocp.args.PyTreeRestore(
                               item, ocp.checkpoint_utils.construct_restore_args(item),
                               partial_restore=True))
  return state["params"]


def decode_params(framework: str, params: Any, model_config) -> Any:
  """The parameter tree of ``layers._decode`` from a ``recipes.model.Model``'s params."""
  if framework == "linen":
    from layers import linen
    return linen.decode_params(params, model_config)
  if framework == "nnx":
    from layers import nnx
    return nnx.decode_params(params, model_config)
  from layers import haiku
  return haiku.decode_params(params, model_config)


def load(source: Source, rules, mesh) -> Any:
  """``layers._decode`` params of the source, in their shards."""
  if source.checkpoint is not None:
    return decode_params(source.config.framework, restore_params(source, rules, mesh),
                         source.config.model)
  from recipes import init_from
  model = init_from.build_model(source.config.init_from, source.config, rules=rules,
                                mesh=mesh)
  return decode_params(model.framework, model.params, model.config)


# -- the command -----------------------------------------------------------------------------


def prompts_of(args: argparse.Namespace, codec: Codec) -> list[list[int]]:
  prompts = [codec.encode(p) for p in args.prompt] + [parse_ids(t) for t in args.tokens]
  if not prompts:
    raise GenerateArgumentError("no prompt: pass --prompt TEXT or --tokens '1 2 3' (each "
                                "repeatable)")
  return prompts


def prompt_problems(args: argparse.Namespace, prompts: Sequence[Sequence[int]], model,
                    *, checkpoint: bool) -> list[str]:
  """What the model cannot read in the prompts (``prompts[i]`` encodes the ``i``-th of
  ``--prompt ... --tokens ...``), in the flags' words, each with its fix. ``layers``
  checks the same, in its own words."""
  typed = [f"--prompt {_short(t)!r}" for t in args.prompt] + [
      f"--tokens {_short(t)!r}" for t in args.tokens]
  vocab = model.vocab_size
  problems = [f"{typed[i]} encodes to no tokens: give at least one character"
              for i, p in enumerate(prompts) if not p]
  long = [i for i, p in enumerate(prompts) if len(p) > model.max_len]
  if long:
    fix = ("shorten them, or pass model.max_len=N to lift it (the checkpoint's weights do "
           "not depend on it, but its model is trained only for the lengths it saw)"
           if checkpoint else "shorten them (the checkpoint's config.json sets max_len; "
           "model.max_len may only lower it)")
    problems.append(f"prompt(s) {long} have {max(len(prompts[i]) for i in long)} tokens > "
                    f"the model's max_len={model.max_len} ({', '.join(typed[i] for i in long)}"
                    f"): {fix}")
  for i, p in enumerate(prompts):
    bad = sorted({t for t in p if not 0 <= t < vocab})
    if not bad:
      continue
    ids = ", ".join(map(str, bad[:8])) + (", ..." if len(bad) > 8 else "")
    head = (f"{typed[i]}: id{'s' if len(bad) > 1 else ''} {ids} "
            f"{'are' if len(bad) > 1 else 'is'} out of range for the model's "
            f"vocab_size={vocab} (ids 0..{vocab - 1})")
    if i >= len(args.prompt):
      problems.append(f"{head}: pass ids from 0 to {vocab - 1}, those of the tokenizer the "
                      "model was trained with")
    else:
      problems.append(f"{head}: this text encodes to ids the model has no embedding for; "
                      "use text within its vocabulary (a byte-level run with vocab_size < 256 "
                      "reads ASCII only), the tokenizer that belongs to this checkpoint, or "
                      "--tokens")
  return problems


def _short(text: str, width: int = 24) -> str:
  return text if len(text) <= width else text[:width - 4].rstrip() + " ..."


SAMPLING_FLAGS = {"max_new_tokens": "--max-new-tokens", "temperature": "--temperature",
                  "top_k": "--top-k", "top_p": "--top-p", "seed": "--seed",
                  "stop_tokens": "--stop"}


def sampling_problems(args: argparse.Namespace, stops: Sequence[int]) -> list[str]:
  """What ``layers.Sampling`` would refuse in the flags, each led by the flags as typed
  (its own message names the fields and says ``Sampling(temperature=...)``)."""
  import layers
  given = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
           "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed}
  given = {k: v for k, v in given.items() if v is not None}
  out = []
  for fields, message in layers.Sampling.problems(**given, stop_tokens=stops):
    typed = [f"{SAMPLING_FLAGS[f]} {getattr(args, 'stop' if f == 'stop_tokens' else f)}"
             if f != "stop_tokens" else f"--stop {' '.join(map(str, stops))}"
             for f in fields if f in given or (f == "stop_tokens" and args.stop)]
    out.append(f"{', '.join(typed) or 'the checkpoint'}: {message}")
  return out


def check_flags(problems: Sequence[str], what: str, fix: str) -> None:
  """Raises ``GenerateArgumentError`` listing ``problems`` (if any)."""
  if problems:
    raise GenerateArgumentError(format_message(
        f"python -m recipes.generate: {len(problems)} {what}.", bullets=problems, fix=fix))


def check_stops(args: argparse.Namespace, stops: Sequence[int], vocab_size: int) -> None:
  """``--stop`` ids the model cannot emit (``layers`` says ``stop_tokens``)."""
  bad = [t for t in stops if t >= vocab_size]
  if args.stop is not None and bad:
    raise GenerateArgumentError(
        f"--stop {' '.join(map(str, bad))}: stop token(s) {bad} are not in the model's "
        f"vocabulary (vocab_size={vocab_size}, ids 0..{vocab_size - 1}). Pass --stop ids "
        "below that, or leave --stop out (default: the checkpoint's eos_token_id, if any).")


def sampling_of(args: argparse.Namespace, codec: Codec):
  import layers
  stops = codec.eos if args.stop is None else tuple(
      i for s in args.stop for i in parse_ids(s))
  check_flags(sampling_problems(args, stops), "problem(s) with the sampling flags",
              "Fix the flags listed above, e.g. --temperature 0.8 --top-p 0.9.")
  n = args.max_new_tokens if args.max_new_tokens is not None else codec.answer_length or 32
  return layers.Sampling(max_new_tokens=n, temperature=args.temperature, top_k=args.top_k,
                         top_p=args.top_p, seed=args.seed, stop_tokens=stops)


def generate(args: argparse.Namespace, out=None) -> Any:
  """Runs the command; returns the ``layers.Generation`` (printed to ``out``)."""
  from recipes.train import (
      check_run,
      effective_microbatches,
      make_mesh,
      make_rules,
      setup_devices,
  )
  out = sys.stdout if out is None else out
  overrides = list(args.overrides)
  if args.checkpoint:
    source = run_source(args.checkpoint, args.step, overrides)
  elif any(o.partition("=")[0].strip() == "init_from" for o in overrides):
    source = hf_source(overrides)
  else:
    raise GenerateArgumentError("no model: pass --checkpoint runs/x (a training run) or "
                                "init_from=DIR (a Hugging Face checkpoint directory)")
  prompts = prompts_of(args, source.codec)
  sampling = sampling_of(args, source.codec)
  check_stops(args, sampling.stop_tokens, source.config.model.vocab_size)
  check_flags(prompt_problems(args, prompts, source.config.model,
                              checkpoint=source.checkpoint is not None),
              "problem(s) with the prompts", "Fix the prompts listed above (as each one says).")
  for text in args.prompt:
    note = source.codec.length_note(text)
    if note:
      print(note, file=sys.stderr)
  setup_devices(source.config)

  from layers import _decode
  from partition import PartitionWarning
  config = source.config
  mesh, rules = make_mesh(config), make_rules(config)
  # The run's checks of preset against mesh (the batch is the prompts': any size works).
  rows = mesh.devices.size * effective_microbatches(config, rules)
  check_run(dataclasses.replace(config, batch_size=rows), rules, mesh)
  params = load(source, rules, mesh)
  with warnings.catch_warnings():
    # A batch of a few prompts (or the one-token steps under sequence parallelism) need not
    # divide the mesh: those dims are replicated, which is what decoding wants.
    warnings.simplefilter("ignore", PartitionWarning)
    result = _decode.generate(params, config.model, prompts, sampling, rules=rules, mesh=mesh,
                              where="recipes.generate")
  shown = [repr(p) for p in args.prompt] + [f"ids {t}" for t in args.tokens]
  print_result(shown, result, source.codec, out)
  _note_cut_rows(prompts, result, sampling, config.model.max_len,
                 from_hf=config.init_from is not None)
  return result


def _note_cut_rows(prompts, result, sampling, max_len: int, from_hf: bool = False) -> None:
  """Says on stderr which rows stopped short of ``max_new_tokens`` at the model's length
  (not at a stop token), so a short answer is not mistaken for the model's choice. A
  Hugging Face checkpoint's max_len is its max_position_embeddings: it cannot grow."""
  stops = set(sampling.stop_tokens)
  cut = [(i, len(ids)) for i, (p, ids) in enumerate(zip(prompts, result.continuations()))
         if len(ids) < sampling.max_new_tokens and not (ids and ids[-1] in stops)
         and len(p) + len(ids) >= max_len]
  if cut:
    rows = ", ".join(f"[{i}] after {n}" for i, n in cut)
    how = ("the checkpoint's max_position_embeddings: shorten the prompt to generate "
           "further" if from_hf else "pass model.max_len=N to generate further; the weights "
           "do not depend on it, but a model is only trained for the lengths it saw")
    print(f"note: prompt(s) {rows} of {sampling.max_new_tokens} new tokens: they reached the "
          f"model's max_len={max_len} ({how})", file=sys.stderr)


def print_result(shown: Sequence[str], result, codec: Codec, out) -> None:
  """Each prompt as given, its continuation (as text when the codec has one) and ids, then
  the prefill and decode throughput."""
  for prompt, ids in zip(shown, result.continuations()):
    print(f"prompt: {prompt}", file=out)
    answer = codec.decode(ids)
    if answer is not None:
      print(f"  -> {answer}", file=out)
    print(f"  ids: {' '.join(map(str, ids))}", file=out)
  new = int(result.lengths.sum())
  print(f"prefill: {result.prompt_tokens} tokens in {result.prefill_seconds * 1e3:.1f} ms "
        f"({result.prefill_tokens_per_s:,.0f} tokens/s); decode: {new} tokens in "
        f"{result.decode_steps} steps, {result.decode_seconds * 1e3:.1f} ms "
        f"({result.decode_tokens_per_s:,.0f} tokens/s)", file=out)


def main(argv: Sequence[str] | None = None) -> int:
  """0 done; 2 a mistake in the arguments, the checkpoint or the prompts (a message)."""
  try:
    generate(parse_args(argv))
  except PartitionError as e:   # GenerateError, HFError, TrainConfigError, ...: say the fix
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
