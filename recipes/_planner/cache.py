"""Compiled plans by what they depend on, in one JSON file (``--cache``).

The key (:func:`cache_key`) holds every config field the compiled step depends on, the
device count, the JAX version and a hash of the code the step is made of
(:func:`code_version`), so a cached figure never outlives a change to any of them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pathlib

_REPO = pathlib.Path(__file__).resolve().parents[2]
# the config fields the compiled train step depends on (not steps, out_dir, seed, ...)
_STEP_FIELDS = ("framework", "preset", "rules", "mesh", "microbatches", "batch_size",
                "seq_len", "model", "optimizer")


@functools.cache
def code_version() -> str:
  """A hash of the code the compiled step is made of (``partition``, ``layers``, the
  train step and the presets), so a cached result never outlives a change to it."""
  files = sorted([*_REPO.glob("partition/**/*.py"), *_REPO.glob("layers/**/*.py"),
                  *_REPO.glob("recipes/presets/*.yaml"),
                  *(_REPO / "recipes" / f for f in ("train.py", "model.py", "explain.py",
                                                   "_planner/compile_pool.py"))])
  digest = hashlib.sha256()
  for f in files:
    digest.update(f.read_bytes())
  return digest.hexdigest()[:12]


def cache_key(config, devices: int) -> str:
  """The cache key of a compiled plan: everything the compiled step depends on."""
  import jax
  d = config.to_dict()
  text = json.dumps({"config": {k: d[k] for k in _STEP_FIELDS}, "devices": devices,
                     "jax": jax.__version__, "code": code_version()},
                    sort_keys=True, default=str)
  return hashlib.sha256(text.encode()).hexdigest()[:20]


class Cache:
  """Compiled results by :func:`cache_key`, in one JSON file (``None``: in memory only)."""

  def __init__(self, path: str | os.PathLike | None):
    self.path = pathlib.Path(path) if path else None
    self.data: dict[str, dict] = {}
    if self.path and self.path.exists():
      try:
        self.data = json.loads(self.path.read_text())
      except (OSError, json.JSONDecodeError):
        self.data = {}   # an unreadable cache is an empty one: the plans compile again

  def good(self, key: str) -> dict | None:
    """The cached result of ``key`` unless absent or a failed compile."""
    got = self.data.get(key)
    return got if got and "error" not in got else None

  def save(self) -> None:
    """Writes the results, except ``transient`` failures (a worker killed from outside,
    e.g. for memory): those plans compile again next time."""
    if self.path:
      self.path.parent.mkdir(parents=True, exist_ok=True)
      kept = {k: v for k, v in self.data.items() if not v.get("transient")}
      self.path.write_text(json.dumps(kept, indent=1, sort_keys=True))

  def __repr__(self) -> str:
    return f"Cache({self.path}, {len(self.data)} plans)"
