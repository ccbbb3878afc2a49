"""Parsing ``in_axes``/``out_axes``: which positional dims of a leaf carry which axis names.

A spec leaf is one of

* a dict ``{positional_dim: 'name'}``, e.g. ``{0: 'batch', 2: 'heads'}``;
* a list or tuple of names with ``None`` for unnamed dims, e.g. ``['batch', None, 'heads']``
  (asserts the exact rank) or ``['batch', ...]`` (any rank, names the leading dims);
* ``{}``, ``[...]`` or ``None``: the leaf has no named dims;
* in ``out_axes`` only: ``Sum(*names, axes=spec)`` / ``Mean(*names, axes=spec)``, which
  reduce the output over ``names`` and place the remaining named axes as ``axes`` says.

Named dims are the *mapped* ones. The other (positional) dims keep the sharding their data
has, unless a leaf states it:

* a ``PartitionSpec`` leaf, e.g. ``P('fsdp', 'tensor')``: no named dims, the positional dims
  sharded over those mesh axes (trailing dims replicated, as in a ``PartitionSpec``);
* ``Logical('embed', 'mlp')``: the same, with logical axes resolved through the rules
  (``axis_resources=rules`` or ``partition.axis_rules``); ``Logical(..., named=['batch', ...])``
  adds named dims, and the logical names then describe the remaining positional dims.

Specs form a pytree *prefix* of the arguments (or outputs): one spec applies to every array
of the subtree it stands for. This module is pure Python; nothing here traces.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec

from partition._base.errors import (
  AxisNameError,
  NegativeDimError,
  SpecError,
  format_message,
  prefix_mismatch,
)

AxisName = str


@dataclasses.dataclass(frozen=True)
class AxisSpec:
  """Named dims of one leaf: ``names[i]`` lives at positional dim ``dims[i]``."""

  names: tuple[AxisName, ...]
  dims: tuple[int, ...]
  rank: int | None  # asserted rank, or None for "any rank"
  user_repr: str
  # Stated sharding of the positional dims, in order: a PartitionSpec (mesh axes) or a
  # Logical (logical names); None = keep the data's sharding / leave it to propagation.
  sharding: PartitionSpec | Logical | None = None

  def dim_of(self, name: AxisName) -> int | None:
    return self.dims[self.names.index(name)] if name in self.names else None

  def __repr__(self) -> str:
    return self.user_repr


UNMAPPED = AxisSpec((), (), None, "{}")


@dataclasses.dataclass(frozen=True, init=False)
class Logical:
  """A spec leaf stating the logical axes of the positional (unnamed) dims of a value.

  The names resolve through the rules in use (``axis_resources=rules`` or the
  ``partition.axis_rules`` context), like ``partition.constrain``; fewer names than dims
  leave the trailing dims replicated, as a ``PartitionSpec`` would. ``named`` is an ordinary
  spec (dict or list) for the named dims of the same value.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import partition
    >>> from jax.sharding import PartitionSpec as P
    >>> rules = partition.AxisRules([('batch', 'data'), ('embed', 'model')])
    >>> mesh = jax.make_mesh((4, 2), ('data', 'model'))
    >>> f = partition.xmap(lambda w, x: w * x,
    ...                    in_axes=(partition.Logical('embed'), ['batch', ...]),
    ...                    out_axes=partition.Logical('embed', named=['batch', ...]),
    ...                    axis_resources=rules, mesh=mesh)
    >>> f(jnp.ones(6), jnp.ones((8, 6))).sharding.spec
    P('data', 'model')
  """

  names: tuple[str | None, ...]
  named: Any

  def __init__(self, *names: str | None, named: Any = None):
    bad = [n for n in names if n is not None and not isinstance(n, str)]
    if bad or (len(names) == 1 and isinstance(names[0], (list, tuple))):
      raise SpecError(format_message(
          f"Logical{names!r}: takes logical axis names (str or None) as separate arguments, "
          f"got {(bad or names)[0]!r}.",
          fix="Write partition.Logical('embed', 'mlp'), not Logical(('embed', 'mlp'))."))
    object.__setattr__(self, "names", tuple(names))
    object.__setattr__(self, "named", named)

  def __repr__(self) -> str:
    args = ", ".join(repr(n) for n in self.names)
    if self.named is not None:
      args += (", " if args else "") + f"named={self.named!r}"
    return f"Logical({args})"

  def __hash__(self):
    return hash((self.names, repr(self.named)))

  def __eq__(self, other):
    return isinstance(other, Logical) and (self.names, repr(self.named)) == (
        other.names, repr(other.named))


@dataclasses.dataclass(frozen=True, init=False)
class Reduction:
  """An ``out_axes`` leaf that reduces the output over named axes (base of Sum and Mean)."""

  names: tuple[AxisName, ...]
  axes: Any
  kind = "sum"

  def __init__(self, *names: AxisName, axes: Any = None):
    if not names:
      raise SpecError(f"{type(self).__name__}() needs at least one axis name to reduce over, "
                      f"e.g. {type(self).__name__}('batch').")
    for n in names:
      if not isinstance(n, str):
        raise SpecError(f"{type(self).__name__} takes axis names (str), got {n!r}.")
    if len(set(names)) != len(names):
      kind = type(self).__name__
      twice = sorted({n for n in names if names.count(n) > 1})
      raise AxisNameError(
          f"{kind}{names} names axis {twice[0]!r} twice. Name each axis to reduce once: "
          f"{kind}({', '.join(map(repr, dict.fromkeys(names)))}) (reducing an axis twice is not "
          "defined; to "
          f"scale the result, multiply it).")
    object.__setattr__(self, "names", tuple(names))
    object.__setattr__(self, "axes", {} if axes is None else axes)
    spec = parse_leaf(self.axes, "out_axes")
    object.__setattr__(self, "_spec", spec)
    if set(spec.names) & set(names):
      raise AxisNameError(
          f"{self!r} both reduces and keeps axes {sorted(set(spec.names) & set(names))}; "
          "an axis is either reduced (positional args) or placed (axes=).")

  @property
  def spec(self) -> AxisSpec:
    return self._spec  # type: ignore[attr-defined]

  def __repr__(self) -> str:
    args = ", ".join(repr(n) for n in self.names)
    if self.spec.names:
      args += f", axes={self.spec.user_repr}"
    return f"{type(self).__name__}({args})"

  def __hash__(self):
    return hash((type(self), self.names, self.spec))

  def __eq__(self, other):
    return type(self) is type(other) and (self.names, self.spec) == (other.names, other.spec)


class Sum(Reduction):
  """``out_axes`` leaf: sum the output over ``names`` wherever those axes live.

  Vectorised axes are summed, mesh axes all-reduced, serial-loop axes accumulated in the
  loop carry (and all-reduced once after the loop).

  Example:
    >>> import jax.numpy as jnp
    >>> import partition
    >>> f = partition.xmap(lambda x: x * 2, in_axes=['i', ...], out_axes=partition.Sum('i'))
    >>> float(f(jnp.arange(4.0)))
    12.0
  """

  kind = "sum"


class Mean(Reduction):
  """``out_axes`` leaf: average the output over ``names`` (see :class:`Sum`).

  Example:
    >>> import jax.numpy as jnp
    >>> import partition
    >>> f = partition.xmap(lambda x: x, in_axes=['i', ...], out_axes=partition.Mean('i'),
    ...                    axis_resources={'i': partition.SerialLoop(2)})
    >>> float(f(jnp.arange(4.0)))
    1.5
  """

  kind = "mean"


def _is_name(x: Any) -> bool:
  return isinstance(x, str)


_CONTAINERS = (Mapping, list, tuple, Reduction, Logical, PartitionSpec)


def is_spec_leaf(x: Any) -> bool:
  """Whether ``x`` is a spec leaf rather than a pytree node of specs."""
  if x is None or isinstance(x, (Reduction, Logical, PartitionSpec)):
    return True
  if isinstance(x, Mapping):
    # {0: 'batch'} is a leaf; {0: {...}, 1: {...}} (an NNX list of layers) is a container
    # of specs: int keys alone do not decide, the values do.
    return (all(isinstance(k, int) and not isinstance(k, bool) for k in x)
            and not any(isinstance(v, _CONTAINERS) for v in x.values()))
  if isinstance(x, (list, tuple)):
    if all(e is None or e is Ellipsis or _is_name(e) for e in x):
      return True
    # A list with names or '...' and a bad entry ([1, ...]) is a bad spec leaf, reported as
    # such, rather than a container of specs; (3,) stays a container holding a bad leaf.
    has_marker = any(e is Ellipsis or _is_name(e) for e in x)
    return has_marker and not any(isinstance(e, (list, tuple, Mapping, Reduction)) for e in x)
  return False


_SPEC_HELP = (
    "A spec leaf is a dict {positional_dim: 'name'} (e.g. {0: 'batch'}), a list of names "
    "with None for unnamed dims, optionally ending in ... (e.g. ['batch', None, ...]), "
    "or {} / [...] / None for a leaf without named dims.")


def parse_leaf(entry: Any, arg_name: str, where: str = "") -> AxisSpec:
  """Parses one spec leaf into an :class:`AxisSpec` (``where`` is its keypath)."""
  at = f"{arg_name}{where}"
  if entry is None:
    return UNMAPPED
  if isinstance(entry, PartitionSpec):
    return dataclasses.replace(UNMAPPED, user_repr=repr(entry), sharding=entry)
  if isinstance(entry, Logical):
    if isinstance(entry.named, (Logical, PartitionSpec, Reduction)):
      raise SpecError(f"xmap {at} = {entry!r}: named= takes a dict or list spec of named "
                      f"dims, got {entry.named!r}.")
    inner = parse_leaf(entry.named, arg_name, where)
    return dataclasses.replace(inner, user_repr=repr(entry), sharding=entry)
  if isinstance(entry, Mapping) and is_spec_leaf(entry):
    items = sorted(entry.items())
    for dim, name in items:
      if dim < 0:
        raise NegativeDimError(format_message(
            f"xmap {at} = {entry!r} uses the negative dim {dim}.",
            fix="Negative dims are ambiguous for named axes; count dims from 0."))
      if not _is_name(name):
        raise SpecError(f"xmap {at} = {entry!r}: axis names must be str, got {name!r}.")
    names = tuple(n for _, n in items)
    dims = tuple(d for d, _ in items)
    spec = AxisSpec(names, dims, None, repr(dict(entry)))
  elif isinstance(entry, (list, tuple)) and is_spec_leaf(entry):
    body = list(entry)
    ellipsis = bool(body) and body[-1] is Ellipsis
    if ellipsis:
      body = body[:-1]
    if Ellipsis in body:
      raise SpecError(format_message(
          f"xmap {at} = {entry!r} has '...' before its end.",
          fix="'...' may only close a list spec: ['batch', ...]."))
    bad = [n for n in body if n is not None and not _is_name(n)]
    if bad:
      raise SpecError(format_message(
          f"xmap {at} = {_list_repr(entry)}: axis names must be str, got {bad[0]!r}.",
          fix=_SPEC_HELP))
    pairs = [(d, n) for d, n in enumerate(body) if n is not None]
    spec = AxisSpec(tuple(n for _, n in pairs), tuple(d for d, _ in pairs),
                    None if ellipsis else len(body), _list_repr(entry))
  else:
    raise SpecError(format_message(
        f"xmap {at} has an invalid axis specification: {entry!r}.", fix=_SPEC_HELP))
  if len(set(spec.names)) != len(spec.names):
    dup = sorted({n for n in spec.names if spec.names.count(n) > 1})
    raise AxisNameError(format_message(
        f"xmap {at} = {entry!r} names axis {dup[0]!r} more than once.",
        fix="Each named axis can map at most one dim of a value; use distinct names."))
  return spec


def _list_repr(entry: Sequence[Any]) -> str:
  inner = ", ".join("..." if e is Ellipsis else repr(e) for e in entry)
  return f"[{inner}]" if isinstance(entry, list) else f"({inner}{',' if len(entry) == 1 else ''})"


def canonical_in_axes(in_axes: Any) -> Any:
  """A top-level list of specs means a tuple (one per argument), as in ``jax.vmap``."""
  if isinstance(in_axes, list) and not is_spec_leaf(in_axes):
    return tuple(in_axes)
  return in_axes


def flatten_specs(specs: Any, tree: Any, arg_name: str, fun_name: str
                  ) -> tuple[list[Any], list[Any], list[str], Any]:
  """Broadcasts a spec prefix over ``tree``.

  Returns ``(leaves, leaf_specs, keypaths, treedef)``: for every leaf of ``tree`` its spec
  (an :class:`AxisSpec`, or a :class:`Reduction` in ``out_axes``) and its keypath string.
  """
  if (isinstance(specs, list) and not is_spec_leaf(specs) and isinstance(tree, tuple)
      and len(specs) == len(tree)):
    specs = tuple(specs)  # a list of specs for a tuple of values, as users often write it
  path_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  leaves = [leaf for _, leaf in path_leaves]
  paths = [jax.tree_util.keystr(p) for p, _ in path_leaves]
  spec_leaves_def = jax.tree_util.tree_structure(specs, is_leaf=is_spec_leaf)
  what = "arguments" if arg_name == "in_axes" else "outputs"
  try:
    per_leaf = spec_leaves_def.flatten_up_to(tree)
  except (ValueError, TypeError):
    raise SpecError(format_message(
        f"xmap({fun_name}): {arg_name} is not a pytree prefix of the {what}.",
        context=[f"{arg_name} structure: {spec_leaves_def}", f"actual structure: {treedef}",
                 f"details: {prefix_mismatch(spec_leaves_def, tree)}"],
        fix=f"Give {arg_name} the same container structure as the {what} (for in_axes: a "
            "tuple, one entry per argument), or a single spec that applies to all of them."
    )) from None
  parsed: list[Any] = []
  for spec, subtree in zip(parse_specs(specs, arg_name), per_leaf):
    parsed.extend([spec] * len(jax.tree_util.tree_leaves(subtree)))
  return leaves, parsed, paths, treedef


def _check_sortable(tree: Any, arg_name: str, where: str = "") -> None:
  """jax.tree_util sorts dict keys; keys of mixed types ({0: ..., 'i': ...}) cannot be."""
  if isinstance(tree, Mapping):
    try:
      sorted(tree)
    except TypeError:
      raise SpecError(format_message(
          f"xmap {arg_name}{where} = {tree!r} mixes key types "
          f"({sorted({type(k).__name__ for k in tree})}).",
          fix="A spec dict maps positional dims (int) to names, e.g. {0: 'batch'}; a "
              "container of specs has the keys of the value it describes.")) from None
    for k, v in tree.items():
      _check_sortable(v, arg_name, f"{where}[{k!r}]")
  elif isinstance(tree, (list, tuple)) and not isinstance(tree, PartitionSpec):
    for i, v in enumerate(tree):
      _check_sortable(v, arg_name, f"{where}[{i}]")


def parse_specs(specs: Any, arg_name: str) -> list[AxisSpec | Reduction]:
  """Every spec leaf of an ``in_axes``/``out_axes`` tree, parsed (errors name its keypath)."""
  _check_sortable(specs, arg_name)
  parsed = []
  for spec_path, raw in jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec_leaf)[0]:
    where = jax.tree_util.keystr(spec_path)
    if isinstance(raw, Reduction) and arg_name != "out_axes":
      raise SpecError(f"xmap {arg_name}{where} = {raw!r}: Sum/Mean only make sense in out_axes.")
    parsed.append(raw if isinstance(raw, Reduction) else parse_leaf(raw, arg_name, where))
  return parsed


def spec_names(spec: AxisSpec | Reduction) -> tuple[AxisName, ...]:
  """All axis names a spec mentions (placed and reduced)."""
  if isinstance(spec, Reduction):
    return spec.names + spec.spec.names
  return spec.names


def placed(spec: AxisSpec | Reduction) -> AxisSpec:
  return spec.spec if isinstance(spec, Reduction) else spec
