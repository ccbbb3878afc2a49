"""The training config: YAML files plus ``key=value`` overrides, validated into dataclasses.

>>> from recipes.config import load_config
>>> cfg = load_config(overrides=['steps=10', 'model.embed_dim=48', 'mesh={data: 8}'])
>>> cfg.steps, cfg.model.embed_dim, cfg.mesh
(10, 48, {'data': 8})
>>> load_config(overrides=['stpes=10'])  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
recipes.config.TrainConfigError: config: 1 problem(s).
  * unknown key 'stpes'. Did you mean 'steps'?
Valid keys: batch_size, checkpoint_every, data.*, distributed.*, eval_batches, ...
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import types
import typing
from typing import Any

import yaml

import layers
from partition import PartitionError, format_message
from recipes._hints import did_you_mean

CONFIGS = pathlib.Path(__file__).resolve().parent / "configs"
PRESETS = pathlib.Path(__file__).resolve().parent / "presets"
FRAMEWORKS = ("linen", "nnx", "haiku")
TASKS = ("copy", "reverse", "sort")


class TrainConfigError(PartitionError, ValueError):
  """A config file or override has an unknown key or an ill-typed value."""


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """AdamW with linear warmup and cosine decay, and global-norm gradient clipping."""

  learning_rate: float = 3e-3
  warmup_steps: int = 20
  min_lr_ratio: float = 0.1   # final learning rate / peak
  weight_decay: float = 0.01
  b1: float = 0.9
  b2: float = 0.98
  clip_norm: float = 1.0      # 0 disables clipping


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """A synthetic digit task (``task``), or a byte-level LM on a local text file (``path``)."""

  task: str = "reverse"       # copy | reverse | sort
  path: str | None = None     # a text file: byte-level language modelling instead
  digits: int = 10            # symbols of the synthetic tasks


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  """Multi-process runs (``jax.distributed``); all ``None`` = auto-detect or single process."""

  coordinator: str | None = None   # host:port of process 0
  num_processes: int | None = None
  process_id: int | None = None
  local_devices: int | None = None  # virtual CPU devices of this process (CPU only)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Everything a run depends on. See ``recipes/configs/default.yaml`` for the defaults."""

  framework: str = "linen"
  preset: str = "fsdp_tp"           # a name in recipes/presets or a rules file path
  rules: tuple[str, ...] = ()       # overrides of the preset, e.g. ('mlp=tensor',)
  mesh: dict[str, int] = dataclasses.field(default_factory=lambda: {"data": 2, "fsdp": 2,
                                                                    "tensor": 2})
  microbatches: int | None = None  # None: the serial loops the preset gives 'batch', else 1
  steps: int = 200
  batch_size: int = 32
  seq_len: int = 16
  seed: int = 0
  eval_every: int = 50
  eval_batches: int = 4
  log_every: int = 10
  checkpoint_every: int = 100       # 0: only at the end
  out_dir: str = "runs/default"
  resume: bool = False
  plot: bool = True
  model: layers.TransformerConfig = dataclasses.field(default_factory=layers.TransformerConfig)
  optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
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
  """The default config, updated by the YAML file ``path`` then by ``overrides``.

  Args:
    path: a YAML file with any subset of the keys (nested sections for ``model``,
      ``optimizer``, ``data``, ``distributed``).
    overrides: ``key=value`` strings with dotted keys (``model.num_layers=4``); values are
      YAML (``mesh={data: 4, fsdp: 2}``, ``resume=true``).

  Raises:
    TrainConfigError: listing every unknown key (with a "did you mean") and ill-typed value.
  """
  raw: dict[str, Any] = {}
  if path is not None:
    raw = _read(path)
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
    _set_dotted(raw, key.strip(), parsed)
  config = _build(raw, problems)
  if problems:
    raise TrainConfigError(format_message(
        f"config{f' {path}' if path else ''}: {len(problems)} problem(s).", bullets=problems,
        fix=f"Valid keys: {', '.join(_valid_keys())}."))
  return config


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
  return doc


def _set_dotted(raw: dict, key: str, value: Any) -> None:
  head, _, rest = key.partition(".")
  if not rest:
    raw[head] = value
    return
  section = raw.setdefault(head, {})
  if not isinstance(section, dict):
    section = raw[head] = {}
  _set_dotted(section, rest, value)


def _valid_keys() -> list[str]:
  return sorted(f.name + (".*" if f.name in _SECTIONS else "")
                for f in dataclasses.fields(TrainConfig))


def _build(raw: dict[str, Any], problems: list[str]) -> TrainConfig:
  kwargs = _check_fields(TrainConfig, raw, "", problems)
  for name, cls in _SECTIONS.items():
    section = raw.get(name, {})
    if not isinstance(section, dict):
      problems.append(f"{name} must be a mapping of {cls.__name__} fields, got {section!r}")
      kwargs.pop(name, None)
      continue
    fields = _check_fields(cls, section, f"{name}.", problems)
    try:
      kwargs[name] = cls(**fields)
    except (TypeError, ValueError) as e:
      problems.append(f"{name}: {e}")
      kwargs.pop(name, None)
  if problems:
    return TrainConfig()
  config = TrainConfig(**kwargs)
  problems.extend(_semantic_problems(config))
  return config


def _check_fields(cls, raw: dict, prefix: str, problems: list[str]) -> dict[str, Any]:
  fields = {f.name: f for f in dataclasses.fields(cls)}
  hints = typing.get_type_hints(cls)
  out = {}
  for key, value in raw.items():
    if key not in fields:
      problems.append(f"unknown key {prefix + str(key)!r}."
                      f"{did_you_mean(str(key), list(fields))}")
      continue
    if key in _SECTIONS and not prefix:
      continue
    converted, error = _convert(value, hints[key])
    if error:
      problems.append(f"{prefix}{key}={value!r}: {error}")
    else:
      out[key] = converted
  return out


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
    return (dict(value), None) if ok else (None, "expected a mapping {mesh axis: size}, "
                                                 "e.g. {data: 2, fsdp: 2, tensor: 2}")
  return value, None


def _semantic_problems(c: TrainConfig) -> list[str]:
  problems = []
  if c.framework not in FRAMEWORKS:
    problems.append(f"framework={c.framework!r} must be one of {list(FRAMEWORKS)}."
                    f"{did_you_mean(c.framework, FRAMEWORKS)}")
  if c.data.path is None and c.data.task not in TASKS:
    problems.append(f"data.task={c.data.task!r} must be one of {list(TASKS)}."
                    f"{did_you_mean(c.data.task, TASKS)}")
  for name in ("steps", "batch_size", "seq_len", "microbatches", "eval_every", "log_every",
               "eval_batches"):
    if getattr(c, name) is not None and getattr(c, name) < 1:
      problems.append(f"{name}={getattr(c, name)} must be >= 1")
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
  if c.data.path is not None and c.model.vocab_size < 256:
    problems.append(f"model.vocab_size={c.model.vocab_size} must be >= 256 for byte-level "
                    "language modelling (data.path)")
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
                         f"existing rules file.{did_you_mean(preset, names)}")
