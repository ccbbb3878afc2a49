"""Logical axis rules: the table between the names a model uses and the mesh.

Model code says *what* an axis is (``'batch'``, ``'embed'``, ``'mlp'``); an
:class:`AxisRules` table says *where* it lives (``'data'``, ``('data', 'fsdp')``, ``None``,
or a :class:`~partition.SerialLoop` for xmap micro-batching). One table serves parameters,
activations (:func:`partition.constrain`) and xmap axes (``axis_resources=rules``):

>>> import partition
>>> rules = partition.AxisRules([('batch', ('data', 'fsdp')), ('embed', 'fsdp'),
...                              ('mlp', 'tensor'), ('batch', 'data')])
>>> rules.spec(('batch', 'length', 'embed'))
P(('data', 'fsdp'), None, None)

``'embed'`` stayed replicated because ``'fsdp'`` was already used by ``'batch'``. With a
shape and a mesh the resolver also skips candidates that do not divide the dim; ask it why:

>>> import jax
>>> mesh = jax.make_mesh((2, 4), ('data', 'fsdp'))
>>> print(rules.resolve(('batch', 'embed'), shape=(6, 16), mesh=mesh))
('batch', 'embed') -> P('data', 'fsdp')
  dim 0 'batch' (size 6) -> 'data'
    rule #0 ('data', 'fsdp'): not divisible (size 6, needs a multiple of 8)
    rule #3 'data': fired
  dim 1 'embed' (size 16) -> 'fsdp'
    rule #1 'fsdp': fired
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from partition import _config
from partition._config import Resource, RulesError, RulesTypeError, Value
from partition._errors import MeshError, format_message
from partition._mesh import AnyMesh, axis_sizes
from partition._resolve import Resolution, resolve
from partition._resources import SerialLoop, named_loops

LogicalAxes = Sequence[str | None] | None


def is_axes_leaf(x: Any) -> bool:
  """True for a leaf of a logical-axes tree: ``None``, ``''`` or a tuple/list of names."""
  if x is None or x == "" or isinstance(x, PartitionSpec):
    return True
  return isinstance(x, (tuple, list)) and all(
      e is None or isinstance(e, str) or e is PartitionSpec.UNCONSTRAINED for e in x)


def _value_out(value: Value) -> Any:
  if value is None:
    return None
  items = [{"serial_loop": r.length} if isinstance(r, SerialLoop) else r for r in value]
  return items[0] if len(items) == 1 and isinstance(items[0], str) else items


def _value_repr(value: Value) -> str:
  if value is None:
    return "None"
  if len(value) == 1:
    return repr(value[0])
  return "(" + ", ".join(map(repr, value)) + ")"


@dataclasses.dataclass(frozen=True, init=False)
class AxisRules:
  """An immutable, ordered table of ``(logical_name, mesh_axes)`` rules.

  ``mesh_axes`` is ``None`` (replicated), a mesh axis name, a tuple of names, and may end
  in a ``SerialLoop(n)`` (xmap only; ignored for array shardings). A logical name may appear
  several times: later entries are fallbacks.

  Resolution of one array (flax linen's ``logical_to_mesh_axes`` algorithm): for each rule
  in order, each dim with that logical name that is still unassigned gets the rule's mesh
  axes, unless one of them is already used by another dim of the array. A ``None`` rule
  claims the dim as replicated; names no rule assigns are replicated. With a mesh, size-1
  axes and axes the mesh lacks are dropped; with a shape too, a candidate that does not
  divide the dim is skipped and the next rule tried.

  Walking ``(('batch', 'X'), ('features', 'X'), ('heads', 'Y'), ('batch', 'Z'))`` over the
  axes ``('batch', 'length', 'heads', 'features')``: ``batch`` takes ``X``; ``features``
  wants ``X`` but it is used; ``heads`` takes ``Y``; the ``batch -> Z`` fallback is not
  needed. Result ``PartitionSpec('X', None, 'Y', None)``.

  Args:
    pairs: ``(name, mesh_axes)`` pairs, a mapping ``{name: mesh_axes}``, or an AxisRules.

  Example:
    >>> import partition
    >>> rules = partition.AxisRules([('batch', 'X'), ('features', 'X'), ('heads', 'Y'),
    ...                              ('batch', 'Z')])
    >>> rules.spec(('batch', 'length', 'heads', 'features'))
    P('X', None, 'Y', None)
    >>> rules.override('heads=Z', features=None).to_dict()['rules']
    [['batch', 'X'], ['features', None], ['heads', 'Z'], ['batch', 'Z']]
  """

  pairs: tuple[tuple[str, Value], ...]

  def __init__(self, pairs: Iterable | Mapping | AxisRules = ()):
    if isinstance(pairs, AxisRules):
      canon = list(pairs.pairs)
    elif isinstance(pairs, (str, bytes)) or not isinstance(pairs, (Iterable, Mapping)):
      raise RulesTypeError(
          f"AxisRules(pairs) takes a list of (logical_name, mesh_axes) pairs or a mapping, "
          f"got {type(pairs).__name__}. Write e.g. AxisRules([('batch', 'data')]) or "
          f"AxisRules.from_file('rules.yaml').")
    else:
      canon, problems = _config.parse_entries(
          pairs if isinstance(pairs, Mapping) else list(pairs))
      if problems:
        raise RulesTypeError(format_message(
            "AxisRules(pairs) got invalid entries:", bullets=problems,
            fix="Write each entry as (logical_name, mesh_axes), e.g. ('mlp', 'tensor'), "
                "('batch', ('data', 'fsdp')), ('kv', None), ('batch', ('data', "
                "partition.SerialLoop(4)))."))
    object.__setattr__(self, "pairs", tuple(canon))

  # -- construction and serialisation ------------------------------------------------------

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> AxisRules:
    """Builds rules from a document ``{'rules': [[name, mesh_axes], ...]}`` (see to_dict)."""
    pairs, problems = _config.parse_document(d)
    if problems:
      raise RulesError(format_message(
          "AxisRules.from_dict got an invalid document:", bullets=problems,
          fix=_config.ENTRY_FIX))
    return cls(pairs)

  @classmethod
  def from_file(cls, path: str | os.PathLike, *, format: str | None = None) -> AxisRules:
    """Reads a YAML (``.yaml``/``.yml``), TOML or JSON rules file; see DESIGN.md §3."""
    return cls(_config.load(path, format=format)["rules"])

  def to_dict(self) -> dict[str, Any]:
    """``{'rules': [[name, mesh_axes], ...]}`` with plain str/list/None/dict values."""
    return {"rules": [[n, _value_out(v)] for n, v in self.pairs]}

  def to_file(self, path: str | os.PathLike, *, format: str | None = None) -> None:
    """Writes the table as YAML, TOML or JSON (by extension); ``from_file`` reads it back."""
    _config.dump(self.to_dict(), path, format=format)

  def override(self, *overrides: str | tuple[str, Any] | Mapping[str, Any],
               **entries: Any) -> AxisRules:
    """Returns a copy where each given logical name maps to the given mesh axes only.

    An existing name keeps the position of its first entry (its other entries, fallbacks
    included, are removed); a new name is appended (lowest priority). Overrides are
    ``'name=axes'`` strings as on a command line (``'mlp=tensor'``, ``'batch=data,fsdp'``,
    ``'kv=null'``, ``'batch=data,serial_loop:4'``), ``(name, axes)`` pairs, mappings, or
    keywords.
    """
    new: dict[str, Value] = {}
    for item in [*overrides, entries]:
      if isinstance(item, str):
        name, value = _config.parse_override(item)
        new[name] = value
      else:
        items = item.items() if isinstance(item, Mapping) else [item]
        new.update(dict(AxisRules(items).pairs))
    pairs, placed = [], set()
    for name, value in self.pairs:
      if name in new:
        if name not in placed:
          pairs.append((name, new[name]))
          placed.add(name)
      else:
        pairs.append((name, value))
    pairs += [(n, v) for n, v in new.items() if n not in placed]
    return AxisRules(pairs)

  def __add__(self, other: AxisRules | Iterable) -> AxisRules:
    """Concatenation: ``other``'s entries become fallbacks after this table's."""
    return AxisRules(list(self.pairs) + list(AxisRules(other).pairs))

  def __iter__(self) -> Iterator[tuple[str, Value]]:
    return iter(self.pairs)

  def __len__(self) -> int:
    return len(self.pairs)

  @property
  def names(self) -> tuple[str, ...]:
    """Logical names with at least one rule, in first-appearance order."""
    return tuple(dict.fromkeys(n for n, _ in self.pairs))

  def __repr__(self) -> str:
    body = ", ".join(f"({n!r}, {_value_repr(v)})" for n, v in self.pairs)
    return f"AxisRules([{body}])"

  # -- resolution ----------------------------------------------------------------------------

  def resolve(self, logical_axes: LogicalAxes, shape: Sequence[int] | None = None,
              mesh: AnyMesh | None = None, *, strict: bool = False) -> Resolution:
    """Resolves one array's logical axes; the result explains every dim (``str()``)."""
    names = _check_axes(logical_axes, shape)
    mesh_sizes = None if mesh is None else dict(axis_sizes(mesh))
    return resolve(self.pairs, names, None if shape is None else tuple(shape), mesh_sizes,
                   strict=strict)

  def spec(self, logical_axes: LogicalAxes, shape: Sequence[int] | None = None,
           mesh: AnyMesh | None = None, strict: bool = False) -> PartitionSpec:
    """The ``PartitionSpec`` of an array with these logical axes (``None`` -> ``P()``).

    Uses only the ``mesh`` passed (not the context), so that without shape and mesh the
    result equals ``flax.linen.logical_to_mesh_axes(logical_axes, rules)``.

    Raises:
      ResolutionError: with ``strict=True``, for a name without a rule, a mesh axis the
        mesh lacks, or a dim no candidate divides.
    """
    if logical_axes is None or logical_axes == "":
      return PartitionSpec()
    if isinstance(logical_axes, PartitionSpec):
      return logical_axes
    return self.resolve(logical_axes, shape, mesh, strict=strict).spec

  def sharding(self, logical_axes: LogicalAxes, mesh: AnyMesh | None,
               shape: Sequence[int] | None = None, strict: bool = False) -> NamedSharding:
    """``NamedSharding(mesh, self.spec(...))``; ``mesh=None`` uses the mesh in context."""
    mesh = _need_mesh(mesh, "AxisRules.sharding")
    return NamedSharding(mesh, self.spec(logical_axes, shape, mesh, strict))

  def tree_specs(self, axes_tree: Any, shapes: Any = None, mesh: AnyMesh | None = None,
                 strict: bool = False) -> Any:
    """``spec`` over a pytree whose leaves are logical-axes tuples (``None`` = replicated).

    ``shapes`` is a matching pytree of arrays / ``ShapeDtypeStruct``s, or ``None``. All
    failing leaves are reported together, by keypath.
    """
    return map_axes_tree(
        lambda _, axes, leaf: self.spec(axes, None if leaf is None else leaf.shape, mesh,
                                        strict), axes_tree, shapes, "AxisRules.tree_specs")

  def tree_shardings(self, axes_tree: Any, mesh: AnyMesh | None, shapes: Any = None,
                     strict: bool = False) -> Any:
    """``sharding`` over a pytree of logical-axes tuples (for ``jit(out_shardings=)``)."""
    mesh = _need_mesh(mesh, "AxisRules.tree_shardings")
    specs = self.tree_specs(axes_tree, shapes, mesh, strict)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, PartitionSpec))

  def xmap_resources(self, names: Sequence[str], *, mesh: AnyMesh | None = None,
                     sizes: Mapping[str, int] | None = None,
                     strict: bool = False) -> dict[str, tuple[Resource, ...]]:
    """Resources of xmap axes ``names``, resolved like the dims of one array.

    Loops (``SerialLoop`` and names bound by ``serial_loop``) are kept after the mesh
    axes and count in the divisibility check; names without a rule get ``()``.

    Example:
      >>> import partition
      >>> rules = partition.AxisRules([('batch', ('data', partition.SerialLoop(4)))])
      >>> rules.xmap_resources(['batch', 'heads'])
      {'batch': ('data', SerialLoop(4)), 'heads': ()}
    """
    names = list(names)
    size_list = None if sizes is None else [sizes.get(n) for n in names]
    res = resolve(self.pairs, names, size_list, None if mesh is None else dict(
        axis_sizes(mesh)), strict=strict, loops=True, named_loops=named_loops())
    return {d.logical: tuple(d.resources or ()) for d in res.dims}


def _check_axes(logical_axes: LogicalAxes, shape: Sequence[int] | None) -> tuple:
  if not is_axes_leaf(logical_axes) or logical_axes is None or isinstance(
      logical_axes, (str, PartitionSpec)):
    raise RulesTypeError(
        f"Logical axes must be a tuple of names (str or None), got {logical_axes!r}. "
        "Write e.g. ('batch', 'embed') or (None, 'mlp').")
  names = tuple(logical_axes)
  if shape is not None and len(tuple(shape)) != len(names):
    raise RulesError(
        f"Logical axes {names} name {len(names)} dims but the shape {tuple(shape)} has "
        f"{len(tuple(shape))}. Give one name (or None) per dim.")
  return names


def _need_mesh(mesh: AnyMesh | None, api: str) -> AnyMesh:
  from partition._context import current_rules_mesh  # the context module imports this one

  found = current_rules_mesh(mesh)
  if found is None:
    raise MeshError(f"{api} needs a mesh: pass mesh=jax.make_mesh(...), or call it inside "
                    "`with jax.set_mesh(mesh):` or `with partition.axis_rules(rules, mesh):`.")
  return found


def map_axes_tree(fn, axes_tree: Any, shapes: Any, api: str) -> Any:
  """Maps ``fn(keypath, axes, leaf_or_None)`` over ``axes_tree``; collects failures."""
  problems: list[str] = []
  kinds: set[type] = set()

  def one(path, axes, leaf=None):
    where = jax.tree_util.keystr(path) or "<root>"
    if leaf is not None and not hasattr(leaf, "shape"):
      problems.append(f"{where}: expected an array or ShapeDtypeStruct, got "
                      f"{type(leaf).__name__}")
      return PartitionSpec()
    try:
      return fn(path, axes, leaf)
    except RulesError as e:
      kinds.add(type(e))
      problems.append(f"{where}: " + str(e).strip().replace("\n", "\n    "))
      return PartitionSpec()

  try:
    if shapes is None:
      out = jax.tree_util.tree_map_with_path(one, axes_tree, is_leaf=is_axes_leaf)
    else:
      out = jax.tree_util.tree_map_with_path(one, axes_tree, shapes, is_leaf=is_axes_leaf)
  except ValueError as e:
    if isinstance(e, RulesError):
      raise
    raise RulesError(format_message(
        f"{api}: the logical-axes tree and the shapes tree do not match.",
        bullets=[str(e).splitlines()[0]],
        fix="Give one logical-axes tuple (or None) per array, in the same structure.")) from None
  if problems:
    cls = kinds.pop() if len(kinds) == 1 else RulesError
    raise cls(format_message(
        f"{api}: {len(problems)} leaf/leaves could not be resolved:", bullets=problems,
        fix="Fix the logical axes of those leaves (one name or None per dim), the rules, "
            "or pass strict=False."))
  return out
