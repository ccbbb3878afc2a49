"""Checkpoints of the train state with orbax, restorable onto any mesh without model code.

Each checkpoint step holds ``state`` (params, optimizer state, step; written by orbax in
parallel from every process's shards, asynchronously, atomically committed) and ``meta`` (JSON:
the logical axes of every array, by path, plus the config and rules of the run). Restoring
needs only a mesh and rules: the shapes come from orbax's metadata and the shardings from the
recorded logical axes, so a run saved on 8 devices restores on 4 or 1 (or 64) directly into
its new shards.

A step is *complete* when its folder holds both items' metadata (``meta/metadata`` and
``state/_METADATA``): :func:`complete_steps` is the one rule ``recipes.generate``,
``recipes.export`` and ``resume=true`` use, and a step folder without them (an interrupted
copy, an emptied folder) is skipped with a warning naming it. A complete step whose arrays
cannot be read (their files deleted or truncated) is a :class:`CheckpointError` naming the
folder when it is restored (:func:`reading`).
"""

from __future__ import annotations

import contextlib
import pathlib
import re
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from partition.internal import audit_placement, needs_extra
from partition.internal import path_str as path_of

with needs_extra("recipes", by="recipes.checkpoint"):
  import orbax.checkpoint as ocp

import partition
from partition import PartitionError
from partition.internal import format_message

# The files that make a step folder a complete checkpoint (orbax writes them last, per item).
REQUIRED = ("meta/metadata", "state/_METADATA")


class CheckpointError(PartitionError, ValueError):
  """A checkpoint step that is incomplete or damaged (its arrays cannot be read)."""


def incomplete(step_dir: str | pathlib.Path) -> str | None:
  """Why the step folder ``step_dir`` is not a complete checkpoint (``None``: it is), e.g.
  ``'no meta/metadata, no state/_METADATA'``."""
  step_dir = pathlib.Path(step_dir)
  missing = [f"no {name}" for name in REQUIRED if not (step_dir / name).is_file()]
  return ", ".join(missing) or None


def complete_steps(directory: str | pathlib.Path, *, warn: bool = True) -> list[int]:
  """The steps of the checkpoint folder ``directory`` that are complete, in order.

  The one rule for which steps a run has: a numbered folder missing one of ``REQUIRED`` is
  skipped, with a ``UserWarning`` naming it (``warn=False``: silently). Orbax's own
  in-progress folders (``400.orbax-checkpoint-tmp-...``) are not numbered and never count.
  """
  directory = pathlib.Path(directory).absolute()
  if not directory.is_dir():
    return []
  folders = sorted((int(p.name), p) for p in directory.iterdir()
                   if p.name.isdigit() and p.is_dir())
  steps = [step for step, folder in folders if incomplete(folder) is None]
  if warn:
    for _, folder in folders:
      if (why := incomplete(folder)) is not None:
        warnings.warn(f"skipping checkpoint folder {folder}: it is not a complete checkpoint "
                      f"({why}); using steps {steps}. Delete it or move it out of "
                      f"{directory} to silence this.", UserWarning, stacklevel=2)
  return steps


# What tensorstore and orbax say when a step's array files are missing or unreadable.
_UNREADABLE = re.compile(r"NOT_FOUND|DATA_LOSS|OUT_OF_RANGE|FAILED_PRECONDITION|"
                         r"No such file|not found", re.IGNORECASE)


@contextlib.contextmanager
def reading(directory: str | pathlib.Path, step: int, fix: str | None = None) -> Iterator[None]:
  """Reads step ``step`` of ``directory`` in the block: an error of the reader about missing
  or unreadable files becomes a :class:`CheckpointError` naming the step folder, with the
  reader's words as context and ``fix`` (default: :func:`earlier_step_fix`) as the fix."""
  try:
    yield
  except PartitionError:
    raise
  except (ValueError, OSError, KeyError) as e:
    if not _UNREADABLE.search(str(e)):
      raise
    folder = pathlib.Path(directory).absolute() / str(step)
    said = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    said = said.split(" [tensorstore_spec=")[0]   # the spec: a page of JSON, no news
    raise CheckpointError(format_message(
        f"checkpoint step {step} in {folder} is incomplete or damaged: reading its arrays "
        "failed:", context=[said if len(said) <= 400 else said[:400] + " ..."],
        fix=fix or earlier_step_fix(directory, step))) from e


def earlier_step_fix(directory: str | pathlib.Path, step: int, flag: str = "--step") -> str:
  """The fix for a damaged ``step``: pass ``flag`` with the latest complete step before it."""
  earlier = [s for s in complete_steps(directory, warn=False) if s < step]
  if not earlier:
    return ("There is no complete step before it: copy that folder again if it came from "
            "elsewhere, or train the run again.")
  return (f"Pass {flag} {earlier[-1]} to use the latest step before it (the complete steps "
          f"before it: {earlier}), or copy that folder again if it came from elsewhere.")


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
    """The latest complete step (:func:`complete_steps`; ``None``: there is none)."""
    steps = complete_steps(self.directory)
    return steps[-1] if steps else None

  def all_steps(self) -> list[int]:
    """The complete steps (:func:`complete_steps`), in order."""
    return complete_steps(self.directory)

  def restore_like(self, step: int, like: Any, *, fix: str | None = None) -> Any:
    """Restores into the shapes, dtypes and shardings of ``like`` (arrays or
    ``ShapeDtypeStruct``s with ``.sharding``).

    Raises:
      CheckpointError: the step's arrays cannot be read; ``fix`` says what to do instead.
    """
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                         sharding=x.sharding), like)
    with reading(self.directory, step, fix):
      return self.manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(target)))["state"]

  def state_metadata(self, step: int, *, fix: str | None = None) -> Any:
    """Orbax's metadata tree of the state of ``step`` (shapes and dtypes, no arrays read).

    Raises:
      CheckpointError: the step's array files are gone; ``fix`` says what to do instead.
    """
    with reading(self.directory, step, fix):
      return self.manager.item_metadata(step)["state"].tree

  def meta(self, step: int) -> dict[str, Any]:
    """The JSON metadata of ``step`` (logical axes, and the run's config and rules)."""
    return self.manager.restore(step, args=ocp.args.Composite(
        meta=ocp.args.JsonRestore()))["meta"]

  def restore_on(self, step: int | None, mesh: jax.sharding.Mesh,
                 rules: partition.AxisRules | None = None, *, fix: str | None = None
                 ) -> tuple[Any, dict[str, Any]]:
    """Restores onto ``mesh`` with no model code: shapes from orbax's metadata, shardings from
    the recorded logical axes through ``rules`` (default: the rules the run recorded).

    Returns:
      ``(state, meta)``: the state as nested dicts of sharded arrays, and the JSON metadata.

    Raises:
      CheckpointError: no complete step, or the step's arrays cannot be read (``fix`` says
        what to do instead).
    """
    step = self.latest_step() if step is None else step
    if step is None:
      raise CheckpointError(f"no complete checkpoint step in {self.directory}: train first "
                            "(python -m recipes.train out_dir=...), or pass the checkpoints/ "
                            "folder of a run that saved one.")
    meta = self.meta(step)
    if rules is None:
      rules = partition.AxisRules.from_dict(meta["rules"])
    abstract = restore_target(self.state_metadata(step, fix=fix), meta["logical_axes"],
                              rules, mesh)
    with reading(self.directory, step, fix):
      state = self.manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract)))["state"]
    return state, meta

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()
