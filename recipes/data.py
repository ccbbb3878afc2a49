"""Training data: synthetic digit tasks made on the fly, or bytes of a local text file.

Every batch is a function of ``(seed, step)`` alone, so a resumed run sees the same batches
as an uninterrupted one, and every process of a multi-process run can build its own rows of
the global batch without talking to the others.

A synthetic example is ``[x_1 .. x_n, SEP, y_1 .. y_n]`` where ``y`` is ``x`` copied,
reversed or sorted; the model reads it shifted by one and is scored only on the ``y`` part
(``mask``). Token ids: 0 padding (unused), 1 separator, 2.. the digits.

>>> import numpy as np
>>> from recipes.data import SyntheticTask
>>> task = SyntheticTask('reverse', seq_len=8, digits=10)
>>> b = task.batch(seed=0, step=0, batch_size=2)
>>> sorted(b), b['inputs'].shape
(['inputs', 'mask', 'targets'], (2, 8))
>>> full = np.concatenate([b['inputs'][0], b['targets'][0, -1:]])
>>> bool((full[5:] == full[:4][::-1]).all()) and int(full[4]) == 1
True
"""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import numpy as np
from jax.sharding import NamedSharding

SEP = 1
FIRST_DIGIT = 2

Batch = dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class SyntheticTask:
  """``copy``, ``reverse`` or ``sort`` ``seq_len // 2`` digits."""

  task: str
  seq_len: int
  digits: int = 10

  def batch(self, seed: int, step: int, batch_size: int, split: str = "train") -> Batch:
    rng = np.random.default_rng([seed, step, 0 if split == "train" else 1])
    n = self.seq_len // 2
    x = rng.integers(0, self.digits, size=(batch_size, n))
    y = {"copy": x, "reverse": x[:, ::-1], "sort": np.sort(x, axis=1)}[self.task]
    full = np.concatenate([x + FIRST_DIGIT, np.full((batch_size, 1), SEP), y + FIRST_DIGIT],
                          axis=1).astype(np.int32)
    mask = np.zeros((batch_size, self.seq_len), np.float32)
    mask[:, n:] = 1.0  # targets[:, n:] are the answer digits
    return {"inputs": full[:, :-1], "targets": full[:, 1:], "mask": mask}


@dataclasses.dataclass(frozen=True)
class TextFile:
  """Byte-level language modelling: random windows of a file (the last 10% for eval)."""

  path: str
  seq_len: int

  def __post_init__(self):
    data = np.frombuffer(pathlib.Path(self.path).read_bytes(), np.uint8)
    if data.size < 4 * (self.seq_len + 1):
      raise ValueError(f"data.path={self.path!r} has {data.size} bytes; it needs at least "
                       f"{4 * (self.seq_len + 1)} for seq_len={self.seq_len}.")
    object.__setattr__(self, "_data", data)

  def batch(self, seed: int, step: int, batch_size: int, split: str = "train") -> Batch:
    data = self._data  # type: ignore[attr-defined]
    cut = int(len(data) * 0.9)
    lo, hi = (0, cut) if split == "train" else (cut, len(data))
    if hi - lo < self.seq_len + 2:
      lo, hi = 0, len(data)
    rng = np.random.default_rng([seed, step, 0 if split == "train" else 1])
    starts = rng.integers(lo, hi - self.seq_len - 1, size=batch_size)
    windows = np.stack([data[s:s + self.seq_len + 1] for s in starts]).astype(np.int32)
    return {"inputs": windows[:, :-1], "targets": windows[:, 1:],
            "mask": np.ones((batch_size, self.seq_len), np.float32)}


def make_source(config) -> SyntheticTask | TextFile:
  if config.data.path is not None:
    return TextFile(config.data.path, config.seq_len)
  return SyntheticTask(config.data.task, config.seq_len, config.data.digits)


def global_batch(host_batch: Batch, shardings: dict[str, NamedSharding]) -> dict[str, jax.Array]:
  """The global arrays of a batch every process computed in full: each process hands over
  only the rows its devices hold (``jax.make_array_from_callback``)."""
  return {k: jax.make_array_from_callback(v.shape, shardings[k], lambda idx, v=v: v[idx])
          for k, v in host_batch.items()}
