"""Path rules: logical axes for parameters of code you cannot edit.

A :class:`PathRules` table is an ordered list of ``(regex, logical_axes)`` pairs. Each
parameter's path is its pytree key path joined by ``/`` — ``params/Dense_0/kernel`` for
linen variables, ``layers/0/kernel`` for an NNX state, ``mlp/~/linear_0/w`` for Haiku
params — and the first pattern that matches anywhere in it (``re.search``; anchor with
``^``/``$``) gives the parameter's logical axes. ``None`` as axes means "matched, leave it
replicated"; a tuple shorter than the parameter's rank is a prefix (trailing dims
replicated), as in flax. Parameters that already declare axes (linen boxes, T5X
``params_axes``, NNX ``out_sharding``, :class:`partition.WithAxes`) keep them and the table
only fills in the rest — unless it is built with ``override=True``, in which case a matching
pattern replaces the declared axes (the escape hatch for models whose own annotations do not
suit your mesh).

>>> import jax.numpy as jnp
>>> import partition
>>> table = partition.PathRules([(r'/w$', ('embed', 'mlp')), (r'/b$', ('mlp',))])
>>> params = {'linear': {'w': jnp.zeros((4, 8)), 'b': jnp.zeros(8)}, 'scale': jnp.ones(())}
>>> report = table.match(params)
>>> report.axes
{'linear': {'b': ('mlp',), 'w': ('embed', 'mlp')}, 'scale': None}
>>> report.unmatched
('scale',)
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from typing import Any

import jax

from partition._base.errors import PartitionError, format_message
from partition._base.logical_axes import (
  WithAxes,
  _graph_state,
  _is_nnx_variable,
  _t5x_tables,
  declared_axes,
  fit_rank,
  is_param_leaf,
  leaf_axes,
  path_str,
)

__all__ = ["PathMatch", "PathRules", "PathRulesError", "as_path_rules", "is_path_table",
           "path_str"]

AXES_FIX = "Write each entry as (regex, logical_axes), e.g. (r'.*/kernel$', ('embed', 'mlp'))."


class PathRulesError(PartitionError, ValueError):
  """A path table is malformed, or does not fit the parameters it annotates."""


class PathRulesTypeError(PathRulesError, TypeError):
  """A path table was built from a Python object of the wrong type."""


def _check_axes(axes: Any) -> bool:
  return axes is None or (isinstance(axes, (tuple, list)) and
                          all(a is None or isinstance(a, str) for a in axes))


@dataclasses.dataclass(frozen=True)
class PathMatch:
  """The result of matching a :class:`PathRules` table against one params tree.

  Attributes:
    axes: the logical-axes tree (declared axes where present, else the table's).
    matched: ``{path: index of the pattern that matched}``.
    declared: paths whose axes were already declared by the model (and kept).
    unmatched: paths with no declared axes that no pattern matched.
    unused: patterns that matched no path (a pattern matching a parameter with declared
      axes has matched it, even when the declared axes win).
    overridden: paths whose declared axes a pattern replaced (``override=True``).
    shadowed: ``{unused pattern: (earlier pattern, a path both match)}`` for the unused
      patterns that do match parameters, all of them claimed by earlier patterns first.
  """

  axes: Any
  matched: Mapping[str, int]
  declared: tuple[str, ...]
  unmatched: tuple[str, ...]
  unused: tuple[str, ...]
  overridden: tuple[str, ...] = ()
  shadowed: Mapping[str, tuple[str, str]] = dataclasses.field(default_factory=dict)

  def unused_problems(self) -> list[str]:
    """One line per unused pattern: shadowed (by which pattern) or matching no parameter.

    >>> import jax.numpy as jnp, partition
    >>> table = partition.PathRules([(r'.*', None), (r'/b$', ('mlp',)), (r'^c$', None)])
    >>> for line in table.match({'l': {'b': jnp.zeros(3)}}).unused_problems(): print(line)
    path pattern '/b$' is shadowed: every parameter it matches is claimed first by the \
earlier pattern '.*' (e.g. l/b); move it before that one or make that one more specific
    path pattern '^c$' matches no parameter
    """
    out = []
    for p in self.unused:
      if p in self.shadowed:
        earlier, path = self.shadowed[p]
        out.append(f"path pattern {p!r} is shadowed: every parameter it matches is claimed "
                   f"first by the earlier pattern {earlier!r} (e.g. {path}); move it before "
                   "that one or make that one more specific")
      else:
        out.append(f"path pattern {p!r} matches no parameter")
    return out

  def __str__(self) -> str:
    lines = [f"{len(self.matched)} parameter(s) matched, {len(self.declared)} declared by "
             f"the model, {len(self.unmatched)} unmatched, {len(self.unused)} unused "
             "pattern(s)" + (f", {len(self.overridden)} overridden" if self.overridden
                             else "")]
    lines += [f"  unmatched path: {p}" for p in self.unmatched]
    lines += [f"  unused pattern: {p!r}" + (f" (shadowed by {self.shadowed[p][0]!r})"
                                            if p in self.shadowed else "")
              for p in self.unused]
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True, init=False)
class PathRules:
  """An immutable, ordered table of ``(regex over the parameter path, logical_axes)``.

  Args:
    pairs: ``(pattern, logical_axes)`` pairs in priority order, or a mapping (kept in
      insertion order). ``logical_axes`` is a tuple with one name (or ``None``) per dim (a
      shorter tuple is a prefix), or ``None`` to match a parameter and leave it replicated.
    override: if True, a matching pattern replaces the axes the model declares itself
      (linen boxes, ``param_with_axes``, NNX ``out_sharding``); default False: declared
      axes win and the table only fills gaps.

  Raises:
    PathRulesError: for an invalid regex or axes; every bad entry is reported.

  Example:
    >>> import jax.numpy as jnp
    >>> import partition
    >>> partition.PathRules({r'kernel$': ('embed', 'mlp'), r'bias$': None})
    PathRules([('kernel$', ('embed', 'mlp')), ('bias$', None)])
    >>> declared = {'kernel': partition.WithAxes(jnp.zeros((4, 8)), ('embed', 'mlp'))}
    >>> partition.PathRules([(r'kernel$', (None, 'mlp'))], override=True).axes(declared)
    {'kernel': (None, 'mlp')}
  """

  pairs: tuple[tuple[str, tuple[str | None, ...] | None], ...]
  override: bool = False

  def __init__(self, pairs: Iterable | Mapping | PathRules = (), *, override: bool | None = None):
    if override is not None and not isinstance(override, bool):
      raise PathRulesTypeError(f"PathRules(override=...) takes True or False, got {override!r}.")
    if isinstance(pairs, PathRules):
      override = pairs.override if override is None else override
      pairs = pairs.pairs
    elif isinstance(pairs, Mapping):
      pairs = list(pairs.items())
    elif isinstance(pairs, (str, bytes)) or not isinstance(pairs, Iterable):
      raise PathRulesTypeError(
          f"PathRules(pairs) takes a list of (regex, logical_axes) pairs or a mapping, got "
          f"{type(pairs).__name__}. {AXES_FIX}")
    canon, problems = [], []
    for i, entry in enumerate(pairs):
      if not isinstance(entry, (tuple, list)) or len(entry) != 2:
        problems.append(f"entry #{i} {entry!r}: expected a (regex, logical_axes) pair")
        continue
      pattern, axes = entry
      if not isinstance(pattern, str):
        problems.append(f"entry #{i}: the pattern must be a str, got {pattern!r}")
        continue
      try:
        re.compile(pattern)
      except re.error as e:
        problems.append(f"entry #{i} {pattern!r}: invalid regex ({e})")
        continue
      if isinstance(axes, str):
        problems.append(f"entry #{i} {pattern!r}: logical axes {axes!r} is a str; write "
                        f"({axes!r},) for one dim (a str is never split into letters)")
        continue
      if not _check_axes(axes):
        problems.append(f"entry #{i} {pattern!r}: logical axes must be a tuple of names "
                        f"(str or None) or None, got {axes!r}")
        continue
      canon.append((pattern, None if axes is None else tuple(axes)))
    if problems:
      raise PathRulesTypeError(format_message(
          "PathRules(pairs) got invalid entries:", bullets=problems, fix=AXES_FIX))
    object.__setattr__(self, "pairs", tuple(canon))
    object.__setattr__(self, "override", bool(override))

  def __repr__(self) -> str:
    flag = ", override=True" if self.override else ""
    return f"PathRules({list(self.pairs)!r}{flag})"

  def __len__(self) -> int:
    return len(self.pairs)

  def __add__(self, other: PathRules | Iterable) -> PathRules:
    """Concatenation: ``other``'s patterns are tried after this table's."""
    return PathRules(list(self.pairs) + list(PathRules(other).pairs), override=self.override)

  def lookup(self, path: str) -> tuple[int, tuple | None] | None:
    """``(pattern index, logical_axes)`` of the first pattern matching ``path``, or None."""
    for i, (pattern, axes) in enumerate(self.pairs):
      if re.search(pattern, path):
        return i, axes
    return None

  def match(self, tree: Any) -> PathMatch:
    """Matches every parameter of ``tree`` and reports unmatched paths / unused patterns.

    Raises:
      PathRulesError: if a matched pattern's axes do not have one name per dim; the
        message lists every such path with its shape and the pattern.
    """
    tree = _graph_state(tree)
    tables = _t5x_tables(tree)
    matched: dict[str, int] = {}
    used: set[int] = set()  # a pattern that matches a path has matched, whichever axes win
    shadows: dict[int, tuple[int, str]] = {}  # later pattern -> (the first match, a path)
    declared, unmatched, overridden, problems = [], [], [], []

    def one(path, leaf):
      name = path_str(path)
      own = declared_axes(leaf, path, tables)
      hit = self.lookup(name)
      if hit is not None:
        used.add(hit[0])
        for j in range(hit[0] + 1, len(self.pairs)):
          if j not in shadows and re.search(self.pairs[j][0], name):
            shadows[j] = (hit[0], name)
      if own is not None and (hit is None or not self.override):
        declared.append(name)
        return fit_rank(own, leaf)[0]
      if hit is None:
        unmatched.append(name)
        return None
      if own is not None:
        overridden.append(name)
      index, axes = hit
      matched[name] = index
      axes, shape = fit_rank(axes, leaf)
      if shape is not None:
        problems.append(f"{name}: pattern #{index} {self.pairs[index][0]!r} gives {axes} "
                        f"({len(axes)} dims) but the parameter has shape {shape}")
      return axes

    axes_tree = jax.tree_util.tree_map_with_path(one, tree, is_leaf=is_param_leaf)
    if problems:
      raise PathRulesError(format_message(
          f"PathRules: {len(problems)} parameter(s) got more logical axes than dims:",
          bullets=problems,
          fix="Give those patterns at most one name (or None) per dim, or make them more "
              "specific (anchor with '$', e.g. r'/kernel$') so they skip parameters of other "
              "ranks."))
    unused = tuple(p for i, (p, _) in enumerate(self.pairs) if i not in used)
    shadowed = {self.pairs[j][0]: (self.pairs[i][0], path)
                for j, (i, path) in sorted(shadows.items()) if j not in used}
    return PathMatch(axes_tree, matched, tuple(declared), tuple(unmatched), unused,
                     tuple(overridden), shadowed)

  def axes(self, tree: Any, *, strict: bool = False) -> Any:
    """The logical-axes tree of ``tree`` (see :meth:`match`).

    Args:
      tree: any params pytree (linen variables, an ``nnx.State``, Haiku params).
      strict: raise if a parameter has no axes or a pattern matched nothing.

    Raises:
      PathRulesError: on rank mismatches; with ``strict=True`` also on unmatched paths
        and unused patterns.
    """
    report = self.match(tree)
    if strict and (report.unmatched or report.unused):
      raise PathRulesError(format_message(
          "PathRules(strict=True): the table does not cover the parameters exactly:",
          bullets=[f"no pattern matches {p}" for p in report.unmatched]
          + [line[5:] for line in report.unused_problems()],
          fix="Add a pattern for each unmatched path (use None as axes to replicate it), "
              "fix, reorder or remove the unused patterns, or pass strict=False."))
    return report.axes

  def annotate(self, tree: Any, *, strict: bool = False) -> Any:
    """``tree`` with each matched plain parameter wrapped in :class:`partition.WithAxes`.

    NNX Variables get the axes as ``out_sharding`` metadata (on a copy) instead; declared
    parameters and unmatched ones are returned unchanged. With ``override=True``, matched
    :class:`WithAxes` boxes and NNX Variables get the table's axes instead of their own
    (linen boxes are left as they are: :meth:`axes` reports the override for them).
    """
    axes_tree = self.axes(tree, strict=strict)

    def box(leaf, axes):
      own = leaf_axes(leaf)
      if axes is None or (own is not None and (not self.override or own == axes)):
        return leaf
      if _is_nnx_variable(leaf):
        return leaf.copy(out_sharding=axes)
      if isinstance(leaf, WithAxes):
        return WithAxes(leaf.value, axes)
      return leaf if is_param_leaf(leaf) else WithAxes(leaf, axes)

    return jax.tree.map(box, tree, axes_tree, is_leaf=is_param_leaf)


def is_path_table(x: Any) -> bool:
  """True for a non-empty list of ``(regex, logical axes or None)`` pairs.

  >>> is_path_table([(r'kernel$', ('embed', 'mlp'))]), is_path_table([('embed', 'mlp')])
  (True, False)
  """
  return isinstance(x, list) and bool(x) and all(
      isinstance(e, (tuple, list)) and len(e) == 2 and isinstance(e[0], str)
      and (e[1] is None or isinstance(e[1], (tuple, list))) for e in x)


def as_path_rules(table: Any) -> PathRules | None:
  """``None``, a :class:`PathRules`, or anything ``PathRules(...)`` accepts."""
  if table is None or isinstance(table, PathRules):
    return table
  return PathRules(table)
