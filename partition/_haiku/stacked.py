"""The logical axes of the created tree: declared, from the path table, and the leading
dims that ``hk.layer_stack`` adds (the stacked axis)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax

from partition._base.logical_axes import fit_rank
from partition._haiku.errors import _PARAMS, _STATE, Axes
from partition._haiku.recording import _Created
from partition._params.path_rules import PathMatch, PathRules, path_str

# -- axes of the created tree ------------------------------------------------------------------


@dataclasses.dataclass
class _Matching:
  """Path-table bookkeeping over params and state (for strict mode and errors)."""

  table: PathRules | None
  stack_axis: str | None
  leads: Mapping[str, int]
  matched: dict[str, int] = dataclasses.field(default_factory=dict)
  used: set[int] = dataclasses.field(default_factory=set)  # patterns that matched a path
  declared: list[str] = dataclasses.field(default_factory=list)
  unmatched: list[str] = dataclasses.field(default_factory=list)
  problems: list[str] = dataclasses.field(default_factory=list)  # declared axes misfit
  table_problems: list[str] = dataclasses.field(default_factory=list)  # table axes misfit

  def path_match(self, axes: Any) -> PathMatch | None:
    if self.table is None:
      return None
    used = self.used
    unused = tuple(p for i, (p, _) in enumerate(self.table.pairs) if i not in used)
    return PathMatch(axes, dict(self.matched), tuple(self.declared), tuple(self.unmatched),
                     unused)


def _stacked_dims(shape: tuple[int, ...], created: tuple[int, ...]) -> int:
  """How many leading dims a lift (``hk.layer_stack``) added to a param created per layer."""
  extra = len(shape) - len(created)
  return extra if extra > 0 and shape[extra:] == created else 0


def _leaf_axes(m: _Matching, kind: str, shown: str, name: str, leaf: Any,
               created: dict[tuple[str, str], _Created]) -> Axes | None:
  entry = created.get((kind, name))
  shape = tuple(leaf.shape)
  lead = (_stacked_dims(shape, entry.shape) if entry is not None
          else _lifted_lead(m.leads, name, len(shape)))
  hit = None if m.table is None else m.table.lookup(name)
  if hit is not None:
    m.used.add(hit[0])
  if entry is not None and entry.axes is not None and (hit is None or not m.table.override):
    axes, source = entry.axes, "the model declares"
    m.declared.append(shown)
  elif m.table is not None:
    if hit is None:
      m.unmatched.append(shown)
      return None
    m.matched[shown] = hit[0]
    axes, source = hit[1], f"pattern #{hit[0]} {m.table.pairs[hit[0]][0]!r} gives"
    if axes is None:
      return None
  else:
    return None
  per_layer = len(shape) - lead
  if lead and len(axes) <= per_layer:
    # Per-layer axes (a short tuple is a prefix, as in flax); the stacked dims go in front.
    return (m.stack_axis,) * lead + tuple(axes) + (None,) * (per_layer - len(axes))
  fitted, mismatch = fit_rank(axes, leaf)
  if mismatch is None and (not lead or len(axes) == len(shape)):
    return tuple(fitted)
  detail = ""
  if lead:
    detail = (f"; it is stacked by hk.layer_stack (or a lifted scan): {lead} leading dim(s) "
              f"over per-layer shape {shape[lead:]}, so give at most {per_layer} per-layer "
              f"names (the stacked dim gets {m.stack_axis!r}) or all {len(shape)}")
  problems = m.problems if source == "the model declares" else m.table_problems
  problems.append(f"{shown}: {source} {tuple(axes)} ({len(axes)} names) but it has shape "
                  f"{shape}{detail}")
  return None


def _lifted_lead(leads: Mapping[str, int], name: str, ndim: int) -> int:
  """Stacked dims of a value created without a creator (``hk.set_state`` of a new name, as
  BatchNorm's EMA ``average``): those of the other values under the same lifted prefix."""
  prefixes = [p for p in leads if name.startswith(p)]
  lead = leads[max(prefixes, key=len)] if prefixes else 0
  return lead if lead <= ndim else 0


def _stack_leads(out: Any, with_state: bool, created: dict) -> dict[str, int]:
  """``{lifted prefix: stacked dims}`` seen on the recorded values."""
  leads = {}
  trees = ((_PARAMS, out[0]), (_STATE, out[1])) if with_state else ((_PARAMS, out),)
  for kind, tree in trees:
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
      entry = created.get((kind, path_str(path)))
      if entry is not None and entry.prefix:
        lead = _stacked_dims(tuple(leaf.shape), entry.shape)
        if lead:
          leads[entry.prefix] = lead
  return leads


def _axes_tree(m: _Matching, kind: str, tree: Any, created: dict, prefix: str) -> Any:
  def one(path, leaf):
    name = path_str(path)
    return _leaf_axes(m, kind, prefix + name, name, leaf, created)
  return jax.tree_util.tree_map_with_path(one, tree)
