"""The training config: YAML files plus ``key=value`` overrides, validated into dataclasses.

>>> from recipes.config import load_config
>>> cfg = load_config(overrides=['steps=10', 'model.embed_dim=48', 'mesh={data: 8}'])
>>> cfg.steps, cfg.model.embed_dim, cfg.mesh
(10, 48, {'data': 8})
>>> load_config(overrides=['stpes=10'])  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
recipes.config.TrainConfigError: config: 1 problem(s).
  * command-line override 'stpes=10': unknown key 'stpes' (did you mean 'steps'?).
Fix them on the command line (key=value, e.g. model.num_heads=4). Every key: ...
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import types
import typing
from collections.abc import Sequence
from typing import Any

import yaml

import layers
from partition import PartitionError
from partition.internal import did_you_mean, entry_mesh_axes, format_message

CONFIGS = pathlib.Path(__file__).resolve().parent / "configs"
DEFAULT_CONFIG = CONFIGS / "default.yaml"
PRESETS = pathlib.Path(__file__).resolve().parent / "presets"
FRAMEWORKS = ("linen", "nnx", "haiku")
TASKS = ("copy", "reverse", "sort")


class TrainConfigError(PartitionError, ValueError):
  """A config file or override has an unknown key or an ill-typed value."""


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """AdamW with linear warmup and cosine decay, and global-norm gradient clipping.

  The values live in ``recipes/configs/default.yaml`` (the one source of defaults)."""

  learning_rate: float
  warmup_steps: int
  min_lr_ratio: float         # final learning rate / peak
  weight_decay: float
  b1: float
  b2: float
  clip_norm: float            # 0 disables clipping


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """A synthetic digit task (``task``), or language modelling on a local file (``path``):
  a ``.npy`` file of token ids (a tokenizer's output), any other file byte-level."""

  task: str                   # copy | reverse | sort
  path: str | None            # a .npy of token ids, or a file read byte-level
  digits: int                 # symbols of the synthetic tasks


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  """Multi-process runs (``jax.distributed``); all ``None`` = auto-detect or single process."""

  coordinator: str | None = None   # host:port of process 0
  num_processes: int | None = None
  process_id: int | None = None
  local_devices: int | None = None  # virtual CPU devices of this process (CPU only)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Everything a run depends on. The defaults are ``recipes/configs/default.yaml`` (the one
  source: ``load_config`` always starts from it), so the fields have none here."""

  framework: str
  preset: str                       # a name in recipes/presets or a rules file path
  rules: tuple[str, ...]            # overrides of the preset, e.g. ('mlp=tensor',)
  mesh: dict[str, int]
  microbatches: int | None          # None: the serial loops the preset gives 'batch', else 1
  steps: int
  batch_size: int
  seq_len: int
  seed: int
  eval_every: int
  eval_batches: int
  log_every: int
  checkpoint_every: int             # 0: only at the end
  out_dir: str
  resume: bool
  plot: bool
  init_from: str | None             # a Hugging Face checkpoint directory to fine-tune (docs/hf.md)
  model: layers.TransformerConfig
  optimizer: OptimizerConfig
  data: DataConfig
  distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)

  def to_dict(self) -> dict[str, Any]:
    out = dataclasses.asdict(self)
    out["model"] = {k: str(v) if k.endswith("dtype") else v for k, v in out["model"].items()}
    out["rules"] = list(self.rules)
    return out


_SECTIONS = {"model": layers.TransformerConfig, "optimizer": OptimizerConfig,
             "data": DataConfig, "distributed": DistributedConfig}


def load_config(path: str | os.PathLike | None = None, overrides: list[str] = ()
                ) -> TrainConfig:
  """``recipes/configs/default.yaml``, updated by the YAML file ``path`` then by ``overrides``.

  ``default.yaml`` is the one source of defaults: every run starts from it, so a file given
  with ``--config`` needs only the keys it changes. Two keys depend on who set them:
  ``microbatches`` from ``default.yaml`` applies only to presets without their own serial
  loop on ``batch`` (``preset=microbatch`` runs its 4-step loop); set in ``path`` or an
  override it always applies, replacing a preset's loop. ``out_dir`` from ``default.yaml``
  (``runs/default``) is, for a new run, the first of ``runs/default``, ``runs/default-2``, ...
  that holds no run, so rerunning the job never clashes; one you set is used as given (a new
  run refuses it if it holds a run).

  Args:
    path: a YAML file with any subset of the keys (nested sections for ``model``,
      ``optimizer``, ``data``, ``distributed``).
    overrides: ``key=value`` strings with dotted keys (``model.num_layers=4``); values are
      YAML (``mesh={data: 4, fsdp: 2}``, ``resume=true``). ``mesh=auto`` is the preset's
      mesh axes sized to the devices present (:func:`auto_mesh`).

  Raises:
    TrainConfigError: listing every unknown key (with a "did you mean") and ill-typed value.
  """
  raw = _read(DEFAULT_CONFIG)
  user: dict[str, Any] = {}
  sources = _Sources()
  if path is not None and pathlib.Path(path).resolve() != DEFAULT_CONFIG:
    user = _read(path)
    sources.add_file(str(path), user)
  problems: list[str] = []
  for item in overrides:
    key, sep, value = str(item).partition("=")
    if not sep or not key.strip():
      problems.append(f"override {item!r} is not key=value (e.g. steps=100)")
      continue
    try:
      parsed = yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError as e:
      problems.append(f"override {item!r}: the value is not valid YAML ({e.problem})")
      continue
    _set_dotted(user, key.strip(), parsed)
    sources.add_override(str(item), key.strip(), parsed)
  _merge(raw, user)
  if raw.get("mesh") == AUTO_MESH and isinstance(raw.get("preset"), str):
    try:
      raw["mesh"] = auto_mesh(preset_rules(raw["preset"]))
    except PartitionError:
      pass  # an unknown preset is reported when the rules are built
  if "microbatches" not in user and isinstance(raw.get("preset"), str):
    try:
      if serial_loops(preset_rules(raw["preset"])):
        raw["microbatches"] = None  # the preset's own loop, not default.yaml's count
    except PartitionError:
      pass  # an unknown preset is reported when the rules are built
  if "out_dir" not in user and not raw.get("resume") and isinstance(raw.get("out_dir"), str):
    from recipes import rundir  # rundir's errors are this module's TrainConfigError
    raw["out_dir"] = str(rundir.unused(pathlib.Path(raw["out_dir"])))
  config = _build(raw, problems, sources)
  if not problems and config.init_from:
    config = _with_checkpoint_model(config, overrides, problems)
  if not problems:
    problems.extend(_semantic_problems(config))
  if problems:
    # Where to fix them: the file only where it set a key; all keys only for unknown ones
    # (a typo), not for every mistake.
    fix = "Fix them on the command line (key=value, e.g. model.num_heads=4)"
    fix += f" or in {path}." if sources.files else "."
    if sources.unmatched:  # a typo without a close match: the keys it may have meant
      fix += f" Valid keys: {', '.join(_valid_keys(sections=False))}."
    if sources.unknown:
      fix += " Every key: docs/training.md#config-keys."
    raise TrainConfigError(format_message(f"config: {len(problems)} problem(s).",
                                          bullets=problems, fix=fix))
  return config


class _Sources:
  """Where each key of a run's config was set: a command-line override, the ``--config``
  file, else ``default.yaml``; so a message blames the override the user typed, and names a
  file only for a key the file holds."""

  def __init__(self):
    self.where: dict[str, str] = {}
    self.files: list[str] = []
    self.unknown: list[str] = []  # the unknown keys found
    self.unmatched = False  # a top-level one without a close match (then: the valid keys)

  def add_file(self, path: str, doc: dict[str, Any]) -> None:
    self.files.append(path)
    self._add(path, doc)

  def add_override(self, item: str, key: str, value: Any) -> None:
    self.where[key] = f"command-line override {item!r}"
    if isinstance(value, dict):  # model={num_layers: 4}: its keys are the override's too
      for sub in value:
        self.where[f"{key}.{sub}"] = self.where[key]

  def _add(self, label: str, doc: dict[str, Any]) -> None:
    for key, value in doc.items():
      self.where[str(key)] = label
      if isinstance(value, dict):
        for sub in value:
          self.where[f"{key}.{sub}"] = label

  def of(self, dotted: str) -> str:
    """The override or file that set ``dotted`` (``model.num_layers``)."""
    if dotted in self.where:
      return self.where[dotted]
    head = dotted.partition(".")[0]
    return self.where.get(head, str(DEFAULT_CONFIG))


def _with_checkpoint_model(config: TrainConfig, overrides: Sequence[str],
                           problems: list[str]) -> TrainConfig:
  """The run with the model of its ``init_from`` checkpoint (the checkpoint's config.json),
  checked against the command line's ``model.*`` overrides."""
  from recipes import init_from
  try:
    model = init_from.resolve_model(config.init_from, config.model,
                                    init_from.explicit_model_fields(overrides))
  except PartitionError as e:
    problems.append(f"init_from: {e}")
    return config
  return dataclasses.replace(config, model=model)


def _merge(base: dict, update: dict) -> None:
  """``update`` into ``base``, section by section (a section replaces only its own keys)."""
  for key, value in update.items():
    if key in _SECTIONS and isinstance(value, dict) and isinstance(base.get(key), dict):
      _merge(base[key], value)
    else:
      base[key] = value


def _read(path) -> dict[str, Any]:
  try:
    text = pathlib.Path(path).read_text()
  except OSError as e:
    raise TrainConfigError(f"config: cannot read {str(path)!r} ({e.strerror}). Pass an "
                           "existing YAML file, e.g. --config recipes/configs/default.yaml."
                           ) from None
  try:
    doc = yaml.safe_load(text) or {}
  except yaml.YAMLError as e:
    raise TrainConfigError(f"config {path}: not valid YAML: {e}") from None
  if not isinstance(doc, dict):
    raise TrainConfigError(f"config {path}: the top level must be a mapping of keys, got "
                           f"{type(doc).__name__}.")
  return _nest_dotted_keys(doc, path)


def _nest_dotted_keys(doc: dict[str, Any], path) -> dict[str, Any]:
  """``model.num_layers: 3`` in a file means what it means on the command line."""
  out: dict[str, Any] = {}
  for key, value in doc.items():
    head, dot, rest = key.partition(".") if isinstance(key, str) else (key, "", "")
    entry = _nest_dotted_keys({rest: value}, path) if dot else value
    before = out.get(head)
    if isinstance(before, dict) and isinstance(entry, dict):
      if clash := sorted(set(before) & set(entry), key=str):
        raise TrainConfigError(f"config {path}: {head}.{clash[0]} is set twice (as "
                               f"'{head}.{clash[0]}' and under '{head}:'); keep one of the two.")
      entry = {**before, **entry}
    elif head in out:
      raise TrainConfigError(f"config {path}: {head!r} is set twice; keep one of the two.")
    out[head] = entry
  return out


def _set_dotted(raw: dict, key: str, value: Any) -> None:
  head, _, rest = key.partition(".")
  if not rest:
    raw[head] = value
    return
  section = raw.setdefault(head, {})
  if not isinstance(section, dict):
    section = raw[head] = {}
  _set_dotted(section, rest, value)


def _valid_keys(sections: bool = True) -> list[str]:
  """Every key, sections spelled out: ``optimizer.{learning_rate, warmup_steps, ...}``
  (``sections=False``: ``optimizer.*``)."""
  out = []
  for f in dataclasses.fields(TrainConfig):
    if f.name in _SECTIONS:
      names = [g.name for g in dataclasses.fields(_SECTIONS[f.name])]
      out.append(f"{f.name}.{{{', '.join(names)}}}" if sections else f"{f.name}.*")
    else:
      out.append(f.name)
  return sorted(out)


def _build(raw: dict[str, Any], problems: list[str], sources: _Sources | None = None
           ) -> TrainConfig | None:
  sources = sources or _Sources()
  kwargs = _check_fields(TrainConfig, raw, "", problems, sources)
  for name, cls in _SECTIONS.items():
    section = raw.get(name, {})
    if not isinstance(section, dict):
      problems.append(f"{name} must be a mapping of {cls.__name__} fields, got {section!r} "
                      f"(from {sources.of(name)})")
      kwargs.pop(name, None)
      continue
    before = len(problems)
    fields = _check_fields(cls, section, f"{name}.", problems, sources)
    if len(problems) > before:
      continue  # the section's own field errors say it all
    try:
      kwargs[name] = cls(**fields)
    except (TypeError, ValueError) as e:
      problems.extend(_section_problems(name, e))
      kwargs.pop(name, None)
  if problems:
    return None
  return TrainConfig(**kwargs)


def _section_problems(section: str, error: Exception) -> list[str]:
  """A section class's own error as ``section.key`` bullets: the command line's words, not
  the Python API's (``model.num_heads=3 ...``, never ``dataclasses.replace``)."""
  bullets = [line.strip()[2:] for line in str(error).splitlines()
             if line.strip().startswith("* ")]
  if not bullets:
    return [f"{section}: {error}"]
  return [f"{section}.{b}" for b in bullets]


def _check_fields(cls, raw: dict, prefix: str, problems: list[str], sources: _Sources
                  ) -> dict[str, Any]:
  fields = {f.name: f for f in dataclasses.fields(cls)}
  hints = typing.get_type_hints(cls)
  out = {}
  for key, value in raw.items():
    dotted = prefix + str(key)
    if key not in fields:
      sources.unknown.append(dotted)
      hint = _suggest(str(key), prefix, list(fields))
      # only a key with no close match lists its section's keys (top level: the fix line)
      valid = f" Valid keys of {prefix[:-1]}: {', '.join(fields)}." if prefix and not hint \
          else ""
      sources.unmatched |= not prefix and not hint
      problems.append(f"{sources.of(dotted)}: unknown key {dotted!r}{hint}.{valid}")
      continue
    if key in _SECTIONS and not prefix:
      continue
    converted, error = _convert(value, hints[key])
    if error:
      problems.append(f"{dotted}={value!r}: {error} (from {sources.of(dotted)})")
    else:
      out[key] = converted
  return out


def _suggest(key: str, prefix: str, fields: list[str]) -> str:
  """`` (did you mean 'model.num_layers'?)``: the full dotted key, as it is typed; a
  top-level key that is a section's (``num_layers``) gets that section's prefix."""
  hint = did_you_mean(key, fields, abbreviations=True)
  if hint:
    return hint.replace("'", f"'{prefix}", 1) if prefix else hint
  if not prefix:
    owners = [f"{name}.{key}" for name, cls in _SECTIONS.items()
              if key in {f.name for f in dataclasses.fields(cls)}]
    if len(owners) == 1:
      return f" (did you mean {owners[0]!r}?)"
  return ""


def _convert(value: Any, hint: Any) -> tuple[Any, str | None]:
  """``value`` checked against a field's type hint (ints are floats where floats go)."""
  origin, args = typing.get_origin(hint), typing.get_args(hint)
  if origin in (typing.Union, types.UnionType):
    if value is None and type(None) in args:
      return None, None
    return _convert(value, next(a for a in args if a is not type(None)))
  if hint is Any:
    return value, None
  if hint is bool:
    return (value, None) if isinstance(value, bool) else (None, "expected true or false")
  if hint is int:
    ok = isinstance(value, int) and not isinstance(value, bool)
    return (value, None) if ok else (None, "expected an integer")
  if hint is float:
    if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
      try:
        return float(value), None
      except ValueError:
        pass
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return (float(value), None) if ok else (None, "expected a number")
  if hint is str:
    return (value, None) if isinstance(value, str) else (None, "expected a string")
  if origin is tuple:
    if isinstance(value, str):
      value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
      return None, "expected a list of strings (e.g. [mlp=tensor, heads=null])"
    return tuple(value), None
  if origin is dict:
    ok = isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, int)
                                         and not isinstance(v, bool) for k, v in value.items())
    if ok:
      return dict(value), None
    # YAML reads {data:8} as the key 'data:8' with no value: a flow mapping needs a space
    # after each colon
    glued = [k for k, v in value.items() if v is None and ":" in str(k)] if isinstance(
        value, dict) else []
    hint = (f" (YAML reads {glued[0]!r} as one key: put a space after the colon, "
            f"{{{str(glued[0]).replace(':', ': ', 1)}}})" if glued else "")
    return None, ("expected a mapping {mesh axis: size}, e.g. {data: 2, fsdp: 2, tensor: 2}, "
                  f"or auto{hint}")
  return value, None


def _semantic_problems(c: TrainConfig) -> list[str]:
  problems = []
  if c.framework not in FRAMEWORKS:
    problems.append(f"framework={c.framework!r} must be one of {list(FRAMEWORKS)}"
                    f"{did_you_mean(c.framework, FRAMEWORKS)}.")
  if c.data.path is None and c.data.task not in TASKS:
    problems.append(f"data.task={c.data.task!r} must be one of {list(TASKS)}"
                    f"{did_you_mean(c.data.task, TASKS)}.")
  for name in ("steps", "batch_size", "seq_len", "microbatches", "eval_every", "log_every",
               "eval_batches"):
    if getattr(c, name) is not None and getattr(c, name) < 1:
      problems.append(f"{name}={getattr(c, name)} must be >= 1")
  if c.optimizer.warmup_steps < 0:
    problems.append(f"optimizer.warmup_steps={c.optimizer.warmup_steps} must be >= 0 "
                    "(0: no warmup)")
  if c.checkpoint_every < 0:
    problems.append(f"checkpoint_every={c.checkpoint_every} must be >= 0 (0: only at the end)")
  sizes = [v for v in c.mesh.values()]
  if sum(v == -1 for v in sizes) > 1 or any(v == 0 or v < -1 for v in sizes):
    problems.append(f"mesh={c.mesh}: sizes are positive ints, and at most one -1 (fills the "
                    "remaining devices)")
  if c.data.path is None and c.seq_len % 2:
    problems.append(f"seq_len={c.seq_len} must be even for the synthetic tasks (input and "
                    "answer take half each)")
  if c.data.path is None and c.model.vocab_size < c.data.digits + 2:
    problems.append(f"model.vocab_size={c.model.vocab_size} must be >= data.digits + 2 = "
                    f"{c.data.digits + 2} (the digits, a separator and padding)")
  # a .npy holds a tokenizer's ids: the data checks them against vocab_size when it opens them
  byte_level = c.data.path is not None and not c.data.path.endswith(".npy")
  if byte_level and c.model.vocab_size < 256:
    problems.append(f"model.vocab_size={c.model.vocab_size} must be >= 256 for byte-level "
                    f"language modelling of data.path={c.data.path!r} (each byte is a "
                    "token); or give a .npy of token ids (np.save('ids.npy', "
                    "np.asarray(tokenizer(text), np.int32))), whose largest id is below "
                    "model.vocab_size")
  if c.seq_len > c.model.max_len:
    problems.append(f"seq_len={c.seq_len} exceeds model.max_len={c.model.max_len}")
  return problems


def preset_path(preset: str) -> pathlib.Path:
  """A preset name (``fsdp_tp``) or a rules file path -> the file."""
  candidate = PRESETS / f"{preset}.yaml"
  if candidate.exists():
    return candidate
  path = pathlib.Path(preset)
  if path.exists():
    return path
  names = sorted(p.stem for p in PRESETS.glob("*.yaml"))
  raise TrainConfigError(f"preset={preset!r} is neither a preset ({', '.join(names)}) nor an "
                         f"existing rules file{did_you_mean(preset, names)}.")


# Each built-in preset's mesh, as the README's preset table gives it (the error messages
# suggest these; tests run every preset on its mesh).
PRESET_MESHES = {
    "data_parallel": {"data": 8},
    "fsdp": {"data": 2, "fsdp": 4},
    "tensor_parallel": {"data": 4, "tensor": 2},
    "fsdp_tp": {"data": 2, "fsdp": 2, "tensor": 2},
    "sequence_parallel": {"data": 2, "sequence": 4},
    "expert_parallel": {"data": 2, "expert": 4},
    "microbatch": {"data": 8},
}
BATCH_AXIS = "batch"


def preset_rules(preset: str):
  """The ``partition.AxisRules`` of a preset name or rules file."""
  import partition
  return partition.AxisRules.from_file(preset_path(preset))


AUTO_MESH = "auto"


def auto_mesh(rules) -> dict[str, int]:
  """``mesh=auto``: the mesh axes ``rules`` shard over, every device on the batch's first one
  (``-1``, which fills the devices the run finds: the local accelerators, else 8 virtual CPU
  devices) and the others size 1, so the preset's layout runs unchanged on any device count.

  >>> auto_mesh(preset_rules('fsdp_tp')), auto_mesh(preset_rules('pipeline_parallel'))
  ({'data': -1, 'fsdp': 1, 'tensor': 1}, {'data': -1, 'stage': 1})
  """
  axes = rules.mesh_axes
  batch = entry_mesh_axes(rules.spec((BATCH_AXIS,))[0])  # its first rule: nothing else competes
  fill = batch[0] if batch else (axes[0] if axes else "data")
  return {a: -1 if a == fill else 1 for a in ([fill] + [a for a in axes if a != fill])}


def serial_loops(rules) -> tuple[int, ...]:
  """The length of the serial loop ``rules`` give ``batch`` (``()``: none), the micro-batches
  a preset asks for.

  >>> serial_loops(preset_rules('microbatch')), serial_loops(preset_rules('fsdp'))
  ((4,), ())
  """
  loop = rules.serial_loops.get(BATCH_AXIS)
  return (loop.length,) if loop else ()


def example_mesh(preset: str, axes: Sequence[str]) -> str:
  """A mesh for ``preset`` as a command-line value: the README's for a built-in preset, else
  one with every axis of ``axes`` (the first fills the devices)."""
  sizes = PRESET_MESHES.get(preset) or {a: -1 if i == 0 else 2 for i, a in enumerate(axes)}
  return "mesh='{" + ", ".join(f"{k}: {v}" for k, v in sizes.items()) + "}'"
