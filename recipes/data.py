"""Training data on Grain: synthetic digit tasks made on the fly, or a local file of tokens.

Each source is a ``grain.MapDataset`` of single examples (random access, lazy): example ``i``
is a function of ``(seed, split, i)`` alone. The global batch of step ``s`` holds examples
``s * batch_size .. (s + 1) * batch_size - 1`` in row order; that index map is the whole
sampler. So

* a run is deterministic given ``seed``, and a run resumed at step ``s`` reads exactly the
  batches an uninterrupted run reads from step ``s`` on (no iterator state to checkpoint);
* in a multi-process run each process reads only the rows its own devices hold (the rows the
  batch sharding gives them, ``jax.make_array_from_callback``), and the global batch is the
  same for any number of processes, so 2 processes x 4 devices train like 1 x 8.

A synthetic example is ``[x_1 .. x_n, SEP, y_1 .. y_n]`` where ``y`` is ``x`` copied,
reversed or sorted; the model reads it shifted by one and is scored only on the ``y`` part
(``mask``). Token ids: 0 padding (unused), 1 separator, 2.. the digits. A file source is
language modelling on windows of ``seq_len + 1`` tokens: a ``.npy`` file holds a tokenizer's
ids (1-D integers), any other file is read byte-level; windows are memory-mapped, so a
process reads only the windows of its rows. The last 10% of a file is the eval split.

>>> import numpy as np
>>> from recipes.data import SyntheticTask
>>> task = SyntheticTask('reverse', seq_len=8, digits=10)
>>> b = task.batch(seed=0, step=0, batch_size=2)
>>> sorted(b), b['inputs'].shape
(['inputs', 'mask', 'targets'], (2, 8))
>>> full = np.concatenate([b['inputs'][0], b['targets'][0, -1:]])
>>> bool((full[5:] == full[:4][::-1]).all()) and int(full[4]) == 1
True
>>> np.array_equal(task.dataset(seed=0)[1]['inputs'], b['inputs'][1])  # row 1 = example 1
True
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from partition.internal import needs_extra

with needs_extra("recipes", by="recipes.data"):
  import grain

from recipes.config import TrainConfigError

SEP = 1
FIRST_DIGIT = 2
SPLITS = ("train", "eval")
# Examples per split of the synthetic tasks: far more than any run reads (they are made on
# demand, so the size costs nothing).
SYNTHETIC_EXAMPLES = 1 << 40

Example = dict[str, np.ndarray]
Batch = dict[str, np.ndarray]


def _split_id(split: str) -> int:
  if split not in SPLITS:
    raise ValueError(f"split={split!r} must be one of {SPLITS}")
  return SPLITS.index(split)


def _stack(examples: list[Example]) -> Batch:
  return {k: np.stack([e[k] for e in examples]) for k in examples[0]}


class _Source:
  """A source: ``dataset(seed, split)``; ``batch`` reads a whole global batch (on one host)."""

  def dataset(self, seed: int, split: str = "train") -> grain.MapDataset:
    raise NotImplementedError

  def batch(self, seed: int, step: int, batch_size: int, split: str = "train") -> Batch:
    """The global batch of ``step`` as numpy arrays (every row)."""
    ds = self.dataset(seed, split)
    return _stack([ds[step * batch_size + r] for r in range(batch_size)])


@dataclasses.dataclass(frozen=True)
class SyntheticTask(_Source):
  """``copy``, ``reverse`` or ``sort`` ``seq_len // 2`` digits."""

  task: str
  seq_len: int
  digits: int = 10

  def dataset(self, seed: int, split: str = "train") -> grain.MapDataset:
    return grain.MapDataset.range(SYNTHETIC_EXAMPLES).map(
        functools.partial(self.example, seed, _split_id(split)))

  def example(self, seed: int, split_id: int, index: int) -> Example:
    rng = np.random.default_rng([seed, split_id, index])
    n = self.seq_len // 2
    x = rng.integers(0, self.digits, size=n)
    y = {"copy": x, "reverse": x[::-1], "sort": np.sort(x)}[self.task]
    full = np.concatenate([x + FIRST_DIGIT, [SEP], y + FIRST_DIGIT]).astype(np.int32)
    mask = np.zeros(self.seq_len, np.float32)
    mask[n:] = 1.0  # targets[n:] are the answer digits
    return {"inputs": full[:-1], "targets": full[1:], "mask": mask}


@dataclasses.dataclass(frozen=True)
class TokenFile(_Source):
  """Language modelling on a file: ``.npy`` token ids, or any other file byte-level.

  Every window start is one example; an epoch visits each once in a seeded shuffle (Grain's
  lazy index shuffle), epochs repeat with new orders.
  """

  path: str
  seq_len: int
  vocab_size: int

  def __post_init__(self):
    tokens = _open_tokens(self.path)
    if tokens.size < 4 * (self.seq_len + 1):
      raise TrainConfigError(
          f"data.path={self.path!r} has {tokens.size} tokens; it needs at least "
          f"{4 * (self.seq_len + 1)} for seq_len={self.seq_len} (use a longer file or a "
          "smaller seq_len).")
    if tokens.dtype != np.uint8:
      largest = int(tokens.max())
      if largest >= self.vocab_size:
        raise TrainConfigError(
            f"data.path={self.path!r} holds token id {largest}, but model.vocab_size="
            f"{self.vocab_size}: set model.vocab_size={largest + 1} or more.")
    object.__setattr__(self, "_tokens", tokens)

  def _bounds(self, split: str) -> tuple[int, int]:
    n = len(self._tokens)  # type: ignore[attr-defined]
    cut = int(n * 0.9)
    lo, hi = (0, cut) if split == "train" else (cut, n)
    if hi - lo < self.seq_len + 2:
      lo, hi = 0, n
    return lo, hi

  def dataset(self, seed: int, split: str = "train") -> grain.MapDataset:
    lo, hi = self._bounds(split)
    starts = grain.MapDataset.range(lo, hi - self.seq_len).shuffle(
        seed=seed * len(SPLITS) + _split_id(split))
    return starts.repeat(None).map(self.window)

  def window(self, start: int) -> Example:
    w = np.asarray(self._tokens[start:start + self.seq_len + 1],  # type: ignore[attr-defined]
                   np.int32)
    return {"inputs": w[:-1], "targets": w[1:], "mask": np.ones(self.seq_len, np.float32)}


def _open_tokens(path: str) -> np.ndarray:
  """The file's tokens, memory-mapped (only the windows read are loaded)."""
  p = pathlib.Path(path)
  try:
    if p.suffix == ".npy":
      tokens = np.load(p, mmap_mode="r")
      if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise TrainConfigError(
            f"data.path={path!r} holds a {tokens.dtype} array of shape {tokens.shape}; a "
            ".npy source must be 1-D integer token ids (e.g. np.save(path, "
            "np.asarray(ids, np.int32))).")
      return tokens
    return np.memmap(p, np.uint8, mode="r")
  except (OSError, ValueError) as e:
    if isinstance(e, TrainConfigError):
      raise
    raise TrainConfigError(f"data.path={path!r} cannot be read ({e}). Give an existing "
                           "text file or a .npy of token ids.") from None


def make_source(config) -> SyntheticTask | TokenFile:
  if config.data.path is not None:
    return TokenFile(config.data.path, config.seq_len, config.model.vocab_size)
  return SyntheticTask(config.data.task, config.seq_len, config.data.digits)


@dataclasses.dataclass
class Pipeline:
  """The sharded global batches of a run: ``pipeline.batch(step, split)``.

  Each process reads only the examples of the rows its devices hold.
  """

  source: Any
  seed: int
  batch_size: int
  shardings: dict[str, NamedSharding]

  def __post_init__(self):
    self.datasets = {s: self.source.dataset(self.seed, s) for s in SPLITS}

  def batch(self, step: int, split: str = "train") -> dict[str, jax.Array]:
    ds = self.datasets[split]
    first = step * self.batch_size
    cache: dict[int, Example] = {}

    def rows(index: tuple[slice, ...], key: str) -> np.ndarray:
      wanted = range(first, first + self.batch_size)[index[0]]
      for i in wanted:
        if i not in cache:
          cache[i] = ds[i]
      return np.stack([cache[i][key] for i in wanted])[(slice(None),) + tuple(index[1:])]

    shape = (self.batch_size, self.source.seq_len)
    return {k: jax.make_array_from_callback(shape, s, functools.partial(rows, key=k))
            for k, s in self.shardings.items()}
