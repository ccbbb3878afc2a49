"""Checkpoints of the train state with orbax, restorable onto any mesh without model code.

Each checkpoint step holds ``state`` (params, optimizer state, step; written by orbax in
parallel from every process's shards, asynchronously, atomically committed) and ``meta`` (JSON:
the logical axes of every array, by path, plus the config and rules of the run). Restoring
needs only a mesh and rules: the shapes come from orbax's metadata and the shardings from the
recorded logical axes, so a run saved on 8 devices restores on 4 or 1 (or 64) directly into
its new shards.
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from partition.internal import audit_placement, needs_extra
from partition.internal import path_str as path_of

with needs_extra("recipes", by="recipes.checkpoint"):
  import orbax.checkpoint as ocp

import partition


def axes_by_path(tree: Any, axes_tree: Any) -> dict[str, list | None]:
  """``{path: logical axes}`` for every array of ``tree`` (JSON-ready); ``axes_tree`` is a
  prefix of ``tree`` whose leaves are axes tuples or ``None``."""
  # type() is tuple: optax states are NamedTuples, e.g. ScaleByScheduleState(count=None)
  is_axes = lambda a: a is None or (type(a) is tuple and all(
      n is None or isinstance(n, str) for n in a))
  structure = jax.tree_util.tree_structure(axes_tree, is_leaf=is_axes)
  per_leaf = [a for a, sub in zip(structure.flatten_up_to(axes_tree),
                                  structure.flatten_up_to(tree))
              for _ in jax.tree_util.tree_leaves(sub)]
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {path_of(path): None if a is None else list(a) for (path, _), a in zip(flat, per_leaf)}


def restore_target(tree: Any, axes: dict[str, list | None], rules: Any, mesh: Any,
                   prefix: str = "", api: str = "Checkpointer.restore_on") -> Any:
  """Abstract arrays for restoring the checkpointed ``tree`` (orbax metadata) into shards:
  each leaf placed on ``mesh`` by ``rules`` from its logical axes (``axes``, keyed by
  ``prefix + path``, as :func:`axes_by_path` records them); leaves without axes replicated.

  Audited as ``init_sharded`` audits a new model's parameters: a named dim the rules leave
  replicated on this mesh (no rule, or none that divides it) is a ``PartitionWarning``
  naming ``api`` and the array."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))
  paths = [path_of(path) for path, _ in flat]
  logical = {p: tuple(a) if (a := axes.get(prefix + p)) else None for p in paths}
  shapes = {p: jax.ShapeDtypeStruct(tuple(x.shape), np.dtype(x.dtype))
            for p, (_, x) in zip(paths, flat)}
  specs = {p: rules.spec(logical[p], shapes[p].shape, mesh) if logical[p] else PartitionSpec()
           for p in paths}
  audit_placement(shapes, logical, specs, rules, mesh, strict=False, api=api)
  return treedef.unflatten([jax.ShapeDtypeStruct(shapes[p].shape, shapes[p].dtype,
                                                 sharding=NamedSharding(mesh, specs[p]))
                            for p in paths])


class Checkpointer:
  """Periodic, asynchronous orbax checkpoints under ``directory``.

  Example:
    >>> import tempfile, jax.numpy as jnp
    >>> from recipes.checkpoint import Checkpointer
    >>> ckpt = Checkpointer(tempfile.mkdtemp())
    >>> ckpt.save(1, {'w': jnp.ones(2)}, {'w': ('embed',)}, {'note': 'x'})
    >>> ckpt.wait(); ckpt.latest_step()
    1
    >>> ckpt.restore_like(1, {'w': jnp.zeros(2)})['w'].tolist()
    [1.0, 1.0]
    >>> ckpt.close()
  """

  def __init__(self, directory: str | pathlib.Path, *, max_to_keep: int = 3,
               async_save: bool = True):
    self.directory = pathlib.Path(directory).absolute()
    self.manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, enable_async_checkpointing=async_save, create=True),
        # Named handlers, so a fresh manager can read metadata it did not write itself.
        item_handlers={"state": ocp.StandardCheckpointHandler(),
                       "meta": ocp.JsonCheckpointHandler()})

  def save(self, step: int, state: Any, axes: Any, extra: dict[str, Any] | None = None) -> None:
    """Saves ``state`` (returns at once: the write finishes in the background).

    A checkpoint already at ``step`` (a resumed run reaching it again) is replaced: the
    newest state of a step wins, and orbax never sees a duplicate step."""
    if step in self.manager.all_steps():
      self.manager.wait_until_finished()
      self.manager.delete(step)
    meta = {"logical_axes": axes_by_path(state, axes), **(extra or {})}
    self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                    meta=ocp.args.JsonSave(meta)), force=True)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self.manager.all_steps())

  def restore_like(self, step: int, like: Any) -> Any:
    """Restores into the shapes, dtypes and shardings of ``like`` (arrays or
    ``ShapeDtypeStruct``s with ``.sharding``)."""
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                         sharding=x.sharding), like)
    return self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target)))["state"]

  def meta(self, step: int) -> dict[str, Any]:
    return self.manager.restore(step, args=ocp.args.Composite(
        meta=ocp.args.JsonRestore()))["meta"]

  def restore_on(self, step: int | None, mesh: jax.sharding.Mesh,
                 rules: partition.AxisRules | None = None) -> tuple[Any, dict[str, Any]]:
    """Restores onto ``mesh`` with no model code: shapes from orbax's metadata, shardings from
    the recorded logical axes through ``rules`` (default: the rules the run recorded).

    Returns:
      ``(state, meta)``: the state as nested dicts of sharded arrays, and the JSON metadata.
    """
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    meta = self.meta(step)
    if rules is None:
      rules = partition.AxisRules.from_dict(meta["rules"])
    abstract = restore_target(self.manager.item_metadata(step)["state"].tree,
                              meta["logical_axes"], rules, mesh)
    state = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract)))["state"]
    return state, meta

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()
