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
import functools
import operator
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from partition._base.caller import outside_stacklevel
from partition._base.errors import MeshError, did_you_mean, format_message, short
from partition._base.logical_axes import path_str
from partition._base.mesh import AnyMesh, axis_sizes
from partition._base.resources import SerialLoop, named_loops
from partition._rules import files as _files
from partition._rules import schema as _schema
from partition._rules.errors import RulesError, RulesTypeError
from partition._rules.fallbacks import PartitionWarning, indivisible_attempts
from partition._rules.overrides import OVERRIDE_FIX, collect_overrides
from partition._rules.resolve import Resolution, resolve
from partition._rules.schema import Resource, Value
from partition._rules.scope import current_rules_mesh

LogicalAxes = Sequence[str | None] | None


def is_axes_leaf(x: Any) -> bool:
  """True for a leaf of a logical-axes tree: ``None``, ``''`` or a tuple/list of names.

  Named tuples are containers, never axes: optax's ``EmptyState()`` is an empty NamedTuple
  and must stay a (leafless) node of an optimizer-state tree.

  >>> import optax
  >>> is_axes_leaf(('batch', None)), is_axes_leaf(()), is_axes_leaf(optax.EmptyState())
  (True, True, False)
  """
  if x is None or (isinstance(x, str) and x == "") or isinstance(x, PartitionSpec):
    return True
  if isinstance(x, tuple) and hasattr(type(x), "_fields"):
    return False
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
  axes and axes the mesh lacks still count as used (as in flax) but are dropped from the
  final spec; with a shape too, a candidate that does not divide the dim is skipped and the
  next rule tried.

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
          f"got {type(pairs).__name__} {short(pairs)}. Write e.g. "
          "AxisRules([('batch', 'data')]) or AxisRules.from_file('rules.yaml').")
    else:
      canon, problems = _schema.parse_entries(
          pairs if isinstance(pairs, Mapping) else list(pairs), "pairs")
      if problems:
        raise RulesTypeError(format_message(
            "AxisRules(pairs) got invalid entries:", bullets=problems,
            fix="Write each entry as (logical_name, mesh_axes), e.g. ('mlp', 'tensor'), "
                "('batch', ('data', 'fsdp')), ('kv', None), ('batch', ('data', "
                "partition.SerialLoop(4)))."))
    object.__setattr__(self, "pairs", tuple(canon))

  # -- construction and serialisation ------------------------------------------------------

  @classmethod
  def from_dict(cls, d: Mapping[str, Any], *, key: str | Sequence[str] | None = None
                ) -> AxisRules:
    """Builds rules from a document ``{'rules': [[name, mesh_axes], ...]}`` (see to_dict).

    Args:
      d: the document, or (with ``key``) any config mapping that holds a rules list.
      key: where the rules list lives in ``d``: a dotted key (``'logical_axis_rules'``,
        ``'partitioning.rules'``) or a list of keys; other keys are then ignored.

    Example:
      >>> import partition
      >>> cfg = {'model': {'logical_axis_rules': [['batch', 'data'], ['kv', []]]}}
      >>> partition.AxisRules.from_dict(cfg, key='model.logical_axis_rules')
      AxisRules([('batch', 'data'), ('kv', None)])
    """
    if key is None:
      pairs, problems = _schema.parse_document(d)
    else:
      _schema.key_parts(key, RulesTypeError)
      value, label = _schema.select(d, key, "AxisRules.from_dict")
      pairs, problems = _schema.parse_selected(value, label, d)
    if problems:
      raise (RulesTypeError if not isinstance(d, Mapping) else RulesError)(format_message(
          "AxisRules.from_dict got an invalid document:", bullets=problems,
          fix=_schema.ENTRY_FIX))
    return cls(pairs)

  @classmethod
  def from_file(cls, path: str | os.PathLike, *, format: str | None = None,
                key: str | Sequence[str] | None = None) -> AxisRules:
    """Reads a YAML (``.yaml``/``.yml``), TOML or JSON rules file; see docs/rules.md.

    Args:
      path: the file (``str``, ``bytes`` or ``os.PathLike``), at most 1 MiB.
      format: ``'yaml'``, ``'toml'`` or ``'json'``; default: from the extension.
      key: for rules embedded in a larger config: the dotted key of the rules list, e.g.
        ``key='logical_axis_rules'`` for MaxText's ``base.yml`` (entries ``[name, axes]``,
        ``[]`` meaning replicated). Other keys of the file are then ignored.

    Raises:
      RulesConfigError: naming the file, the key/entry and the fix: bad syntax, a key given
        twice, nesting deeper than 64 levels, unknown keys, malformed entries.
    """
    return cls(_files.load(path, format=format, key=key)["rules"])

  def to_dict(self) -> dict[str, Any]:
    """``{'rules': [[name, mesh_axes], ...]}`` with plain str/list/None/dict values."""
    return {"rules": [[n, _value_out(v)] for n, v in self.pairs]}

  def to_file(self, path: str | os.PathLike, *, format: str | None = None) -> None:
    """Writes the table as YAML, TOML or JSON (by extension); ``from_file`` reads it back.

    The write is atomic: the format and the directory are checked first and the text goes
    to a temporary file that replaces ``path`` only when complete, so a failed call leaves
    an existing file byte-identical.
    """
    _files.dump(self.to_dict(), path, format=format)

  def override(self, *overrides: str | Sequence[str] | tuple[str, Any] | Mapping[str, Any],
               **entries: Any) -> AxisRules:
    """Returns a copy where each given logical name maps to the given mesh axes only.

    An existing name keeps the position of its first entry (its other entries, fallbacks
    included, are removed); a new name is appended (lowest priority). Overrides are
    ``'name=axes'`` strings as on a command line (``'mlp=tensor'``, ``'batch=data,fsdp'``,
    ``'kv=null'``, ``'batch=data,serial_loop:4'``), lists of such strings (as argparse
    gives them: ``override(['mlp=fsdp', 'kv=null'])`` is two overrides), ``(name, axes)``
    pairs, mappings, or keywords. Every bad override of the call is reported in one
    :class:`RulesError`, naming the token.

    Example:
      >>> import partition
      >>> rules = partition.AxisRules([('batch', 'data'), ('mlp', 'tensor')])
      >>> rules.override(['mlp=fsdp', 'kv=null'], 'batch=data,serial_loop:2')
      AxisRules([('batch', ('data', SerialLoop(2))), ('mlp', 'fsdp'), ('kv', None)])
    """
    new, problems, type_error = collect_overrides(overrides, entries)
    if problems:
      raise (RulesTypeError if type_error else RulesError)(format_message(
          f"AxisRules.override got {len(problems)} invalid override(s):", bullets=problems,
          fix=OVERRIDE_FIX))
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

  @property
  def mesh_axes(self) -> tuple[str, ...]:
    """Every mesh axis the rules name, in the order they first appear.

    A mesh for these rules needs these axes (size 1 where one is unused on purpose). The
    table alone cannot tell a mesh axis from a loop name bound by
    :func:`partition.serial_loop`, so such a name is listed too.

    Example:
      >>> import partition
      >>> rules = partition.AxisRules([('batch', ('data', 'fsdp')), ('mlp', 'tensor'),
      ...                              ('batch', ('data', partition.SerialLoop(4))),
      ...                              ('kv', None)])
      >>> rules.mesh_axes
      ('data', 'fsdp', 'tensor')
    """
    return tuple(dict.fromkeys(
        r for _, value in self.pairs for r in value or () if isinstance(r, str)))

  @property
  def serial_loops(self) -> dict[str, SerialLoop]:
    """``{logical_name: SerialLoop}`` of the names whose first rule ends in a serial loop.

    A name's first rule is the one resolution tries first; a later rule (a fallback) fires
    only where the first cannot (its mesh axes times the loop length do not divide the
    size), so this is the loop an xmap axis of that name runs on divisible sizes: the
    number of micro-batches the table asks for. A loop that only a fallback names is not
    listed (:meth:`without_serial_loops` removes it all the same).

    Example:
      >>> import partition
      >>> rules = partition.AxisRules([('batch', ('data', partition.SerialLoop(4))),
      ...                              ('batch', 'data'), ('mb', {'serial_loop': 2})])
      >>> rules.serial_loops
      {'batch': SerialLoop(4), 'mb': SerialLoop(2)}
      >>> rules.serial_loops.get('embed', partition.SerialLoop(1)).length
      1
    """
    first: dict[str, Value] = {}
    for name, value in self.pairs:
      first.setdefault(name, value)
    return {name: value[-1] for name, value in first.items()
            if value and isinstance(value[-1], SerialLoop)}

  def without_serial_loops(self, *names: str) -> AxisRules:
    """A copy without the serial loops of the rules of ``names`` (none given: every rule).

    Array shardings do not change (they ignore loops): a rule that was only a loop becomes
    ``None``, which still claims the dim, replicated. For xmap axes the loops are gone, as
    where an explicit micro-batch count replaces the loop a preset gives ``batch``.

    Raises:
      RulesTypeError: a name that is not a str.
      RulesError: a name without a rule (with a did-you-mean).

    Example:
      >>> import partition
      >>> rules = partition.AxisRules([('batch', ('data', partition.SerialLoop(4))),
      ...                              ('mb', partition.SerialLoop(2))])
      >>> rules.without_serial_loops()
      AxisRules([('batch', 'data'), ('mb', None)])
      >>> rules.without_serial_loops('mb').serial_loops
      {'batch': SerialLoop(4)}
    """
    _check_names(names, self.names, "AxisRules.without_serial_loops")
    chosen = set(names or self.names)
    return AxisRules([
        (n, v if n not in chosen or v is None
         else tuple(r for r in v if not isinstance(r, SerialLoop)) or None)
        for n, v in self.pairs])

  def __repr__(self) -> str:
    body = ", ".join(f"({n!r}, {_value_repr(v)})" for n, v in self.pairs)
    return f"AxisRules([{body}])"

  # -- resolution ----------------------------------------------------------------------------

  def resolve(self, logical_axes: LogicalAxes, shape: Sequence[int] | None = None,
              mesh: AnyMesh | None = None, *, strict: bool = False) -> Resolution:
    """Resolves one array's logical axes; the result explains every dim (``str()``).

    Raises:
      RulesTypeError: ``logical_axes`` is not a tuple of names, ``shape`` not a tuple of
        non-negative ints of the same length (all problems in one message).
      MeshError: ``mesh`` is not a ``jax.sharding.Mesh``/``AbstractMesh``.
    """
    api = "AxisRules.resolve"
    _check_mesh(mesh, api)
    _check_flag(strict, "strict", api)
    names, dims = _check_axes(logical_axes, shape, api)
    mesh_sizes = None if mesh is None else tuple(axis_sizes(mesh).items())
    try:
      return _resolve_cached(self.pairs, names, dims, mesh_sizes, strict)
    except TypeError:  # an unhashable name slipped through: resolve without the cache
      return _resolve_cached.__wrapped__(self.pairs, names, dims, mesh_sizes, strict)

  def spec(self, logical_axes: LogicalAxes, shape: Sequence[int] | None = None,
           mesh: AnyMesh | None = None, strict: bool = False) -> PartitionSpec:
    """The ``PartitionSpec`` of an array with these logical axes (``None`` -> ``P()``).

    Uses only the ``mesh`` passed (not the context), so that without shape and mesh the
    result equals ``flax.linen.logical_to_mesh_axes(logical_axes, rules)``. A
    ``PartitionSpec`` passes through after a check (no mesh axis twice, every axis in
    ``mesh``, no more entries than ``shape`` has dims).

    Raises:
      ResolutionError: with ``strict=True``, for a name without a rule, a mesh axis the
        mesh lacks, or a dim no candidate divides.
      RulesTypeError: malformed ``logical_axes`` or ``shape`` (see :meth:`resolve`).
    """
    if logical_axes is None or (isinstance(logical_axes, str) and logical_axes == ""):
      _check_mesh(mesh, "AxisRules.spec")
      return PartitionSpec()
    if isinstance(logical_axes, PartitionSpec):
      _check_mesh(mesh, "AxisRules.spec")
      return check_partition_spec(logical_axes, shape, mesh, "AxisRules.spec")
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
    _check_mesh(mesh, "AxisRules.tree_specs")
    _check_flag(strict, "strict", "AxisRules.tree_specs")
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
                     strict: bool = False,
                     warn: bool = True) -> dict[str, tuple[Resource, ...]]:
    """Resources of xmap axes ``names``, resolved like the dims of one array.

    Loops (``SerialLoop`` and names bound by ``serial_loop``) are kept after the mesh
    axes and count in the divisibility check; names without a rule get ``()``.

    Args:
      names: a list/tuple of axis names (a single str is an error, never split into
        letters).
      mesh: the mesh, for the size-1 / missing-axis / divisibility checks.
      sizes: ``{name: size}`` of the axes whose size is known (positive ints).
      strict: raise on names without a rule, unknown mesh axes and indivisible sizes.
      warn: give a ``PartitionWarning`` for a rule's mesh axis the mesh lacks and for an
        axis no rule divides (``False`` for a caller that says so in its own terms).

    Example:
      >>> import partition
      >>> rules = partition.AxisRules([('batch', ('data', partition.SerialLoop(4)))])
      >>> rules.xmap_resources(['batch', 'heads'])
      {'batch': ('data', SerialLoop(4)), 'heads': ()}
    """
    api = "AxisRules.xmap_resources"
    _check_mesh(mesh, api)
    _check_flag(strict, "strict", api)
    _check_flag(warn, "warn", api)
    names, size_list = _check_xmap_names(names, sizes, api)
    loops = named_loops()
    res = resolve(self.pairs, names, size_list, None if mesh is None else dict(
        axis_sizes(mesh)), strict=strict, loops=True, named_loops=loops)
    if warn and mesh is not None:
      _warn_absent_axes(res, mesh, loops)
    if warn:
      _warn_indivisible_axes(res)
    return {d.logical: tuple(d.resources or ()) for d in res.dims}


def _warn_indivisible_axes(res: Resolution) -> None:
  """An xmap axis that has rules none of which divides its size is neither split nor looped:
  say so (the rules asked for placement; a ``null`` rule asks for none and is silent)."""
  for d in res.dims:
    if tried := indivisible_attempts(d):
      warnings.warn(format_message(
          f"xmap axis {d.logical!r} (size {d.size}) gets no resources: no rule for it "
          f"divides its size ({tried}), so it is vectorised on each device, neither split "
          "nor looped.",
          fix=f"Make the size a multiple of the rule's mesh axes and loop lengths, add a "
              f"fallback rule for {d.logical!r} that divides it, or a null rule to leave it "
              "unplaced on purpose."),
          PartitionWarning, stacklevel=outside_stacklevel())


def _warn_absent_axes(res: Resolution, mesh: AnyMesh, loops: Mapping[str, int]) -> None:
  """An xmap axis whose rule names mesh axes the mesh lacks runs on fewer devices than the
  rule asks for: say so (a typo of a mesh axis is an error in ``resolve`` already)."""
  sizes = axis_sizes(mesh)
  for d in res.dims:
    for a in d.attempts:
      absent = [r for r in a.value or () if isinstance(r, str) and r not in sizes
                and r not in loops]
      if a.outcome == "fired" and absent:
        warnings.warn(format_message(
            f"xmap axis {d.logical!r}: rule #{a.rule} places it on mesh axes "
            f"{tuple(absent)} that the mesh lacks, so it is not split over them.",
            context=[f"mesh axes: {dict(sizes)}"],
            fix="Add those axes to the mesh (size 1 says they are unused on purpose), or "
                "drop them from the rule."), PartitionWarning,
            stacklevel=outside_stacklevel())


# -- argument checks ----------------------------------------------------------------------------


def _check_names(names: tuple, known: Sequence[str], api: str) -> None:
  """Every problem of ``names`` (logical names that must have a rule) in one message."""
  wrong_type = [f"names[{i}] is {type(n).__name__} {short(n)}; a logical name is a str"
                for i, n in enumerate(names) if not isinstance(n, str)]
  if wrong_type:
    raise RulesTypeError(format_message(f"{api} got invalid arguments:", bullets=wrong_type,
                                        fix="Pass logical names as str, e.g. 'batch'."))
  unknown = [f"{n!r} has no rule{did_you_mean(n, known)}" for n in dict.fromkeys(names)
             if n not in known]
  if unknown:
    raise RulesError(format_message(
        f"{api}: {len(unknown)} name(s) without a rule:", bullets=unknown,
        context=[f"names with a rule: {', '.join(map(repr, known))}"],
        fix="Name logical axes the table has a rule for (or call it without names for all)."))


def _check_flag(value: Any, arg: str, api: str) -> None:
  if not isinstance(value, bool):
    raise RulesTypeError(f"{api}({arg}=...) takes True or False, got "
                         f"{type(value).__name__} {short(value)}.")


def _check_mesh(mesh: Any, api: str) -> None:
  if mesh is not None and not isinstance(mesh, (Mesh, AbstractMesh)):
    raise MeshError(f"{api}(mesh=...) takes a jax.sharding.Mesh or AbstractMesh, got "
                    f"{type(mesh).__name__} {short(mesh)}. Build one with "
                    "jax.make_mesh(shape, names), or leave mesh=None.")


def _shape_problems(shape: Any) -> tuple[tuple[int, ...] | None, list[str]]:
  """``shape`` as a tuple of ints, and what is wrong with it."""
  if shape is None:
    return None, []
  if isinstance(shape, (str, bytes, Mapping)) or not isinstance(shape, Iterable):
    return None, [f"shape must be a tuple of ints, got {type(shape).__name__} {short(shape)}"]
  dims, problems = [], []
  for i, d in enumerate(tuple(shape)):
    try:
      n = None if isinstance(d, bool) else operator.index(d)
    except TypeError:
      n = None
    if n is None or n < 0:
      problems.append(f"shape[{i}] is {type(d).__name__} {short(d)}; a dim size is an int "
                      ">= 0")
    dims.append(n)
  return (None if problems else tuple(dims)), problems


@functools.lru_cache(maxsize=8192)
def _resolve_cached(pairs, names, dims, mesh_sizes, strict) -> Resolution:
  """Resolutions are immutable and a model repeats a few axes tuples over many parameters
  (every layer's kernels): resolve each (rules, axes, shape, mesh) once."""
  return resolve(pairs, names, dims, None if mesh_sizes is None else dict(mesh_sizes),
                 strict=strict)


def _check_axes(logical_axes: LogicalAxes, shape: Any, api: str = "AxisRules.resolve"
                ) -> tuple[tuple, tuple[int, ...] | None]:
  """Validated ``(names, shape)``; every problem of the call in one message."""
  problems = []
  if isinstance(logical_axes, str):
    problems.append(f"logical_axes must be a tuple of names, got the str "
                    f"{short(logical_axes)}; write ({logical_axes!r},) for one dim (a str is "
                    "never split into letters)")
  elif not is_axes_leaf(logical_axes) or logical_axes is None or isinstance(
      logical_axes, PartitionSpec):
    problems.append(f"logical_axes must be a tuple of names (str or None), got "
                    f"{short(logical_axes)}; write e.g. ('batch', 'embed') or (None, 'mlp')")
  dims, shape_problems = _shape_problems(shape)
  problems += shape_problems
  if not problems and dims is not None and len(dims) != len(logical_axes):
    raise RulesError(
        f"Logical axes {tuple(logical_axes)} name {len(logical_axes)} dims but the shape "
        f"{dims} has {len(dims)}. Give one name (or None) per dim.")
  if problems:
    raise RulesTypeError(format_message(f"{api} got invalid arguments:", bullets=problems))
  return tuple(logical_axes), dims


def check_partition_spec(spec: PartitionSpec, shape: Any, mesh: AnyMesh | None,
                         api: str) -> PartitionSpec:
  """Checks a ``PartitionSpec`` given where logical axes go; returns it unchanged."""
  problems, seen = [], {}
  sizes = None if mesh is None else axis_sizes(mesh)
  for i, entry in enumerate(spec):
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
      continue
    axes = (entry,) if isinstance(entry, str) else entry
    if not isinstance(axes, tuple) or not all(isinstance(a, str) for a in axes):
      problems.append(f"entry {i} {short(entry)} is not a mesh axis name or tuple of names")
      continue
    for a in axes:
      if a in seen:
        problems.append(f"mesh axis {a!r} is used by entries {seen[a]} and {i}; a mesh "
                        "axis shards at most one dim")
      seen.setdefault(a, i)
      if sizes is not None and a not in sizes:
        problems.append(f"entry {i}: {a!r} is not a mesh axis"
                        f"{did_you_mean(a, list(sizes))}; the mesh has "
                        f"{tuple(sizes)}")
  dims, shape_problems = _shape_problems(shape)
  problems += shape_problems
  if dims is not None and len(spec) > len(dims):
    problems.append(f"{spec} has {len(spec)} entries but the shape {dims} only {len(dims)}")
  if problems:
    raise RulesError(format_message(f"{api}: the PartitionSpec {spec} cannot be used:",
                                    bullets=problems,
                                    fix="Name each mesh axis at most once, only axes of the "
                                        "mesh, one entry per dim at most."))
  return spec


def _check_xmap_names(names: Any, sizes: Any, api: str
                      ) -> tuple[list[str], list[int | None] | None]:
  problems = []
  if isinstance(names, str):
    raise RulesTypeError(f"{api}(names) got the str {short(names)}; pass a list of axis "
                         f"names, e.g. [{names!r}] (a str is never split into letters).")
  if isinstance(names, (bytes, Mapping)) or not isinstance(names, Iterable):
    raise RulesTypeError(f"{api}(names) takes a list of axis names, got "
                         f"{type(names).__name__} {short(names)}.")
  names = list(names)
  for i, n in enumerate(names):
    if not isinstance(n, str) or not n:
      problems.append(f"names[{i}] is {short(n)}; an axis name is a non-empty str")
    elif names.index(n) != i:
      problems.append(f"names[{i}] {n!r} repeats names[{names.index(n)}]")
  size_list = None
  if sizes is not None and not isinstance(sizes, Mapping):
    problems.append(f"sizes must be a mapping {{name: size}}, got {type(sizes).__name__} "
                    f"{short(sizes)}")
  elif sizes is not None:
    for k, v in sizes.items():
      if not isinstance(k, str):
        problems.append(f"sizes key {short(k)} is not an axis name (str)")
      elif _size(v) is None:
        problems.append(f"sizes[{k!r}] is {short(v)}; a size is an int >= 0")
  if problems:
    raise RulesTypeError(format_message(f"{api} got invalid arguments:", bullets=problems,
                                        fix="Pass names=['batch', ...] and sizes={'batch': 8}."))
  if sizes is not None:
    size_list = [None if sizes.get(n) is None else _size(sizes[n]) for n in names]
  return names, size_list


def _size(v: Any) -> int | None:
  """``v`` as an axis size (an int >= 0; 0 for empty arrays), or None if it is not one."""
  if isinstance(v, bool):
    return None
  try:
    n = operator.index(v)
  except TypeError:
    return None
  return n if n >= 0 else None


def _need_mesh(mesh: AnyMesh | None, api: str) -> AnyMesh:
  _check_mesh(mesh, api)
  found = current_rules_mesh(mesh)
  if found is None:
    raise MeshError(f"{api} needs a mesh: pass mesh=jax.make_mesh(...), or call it inside "
                    "`with jax.set_mesh(mesh):` or `with partition.axis_rules(rules, mesh):`.")
  return found


def _unsortable_dict(tree: Any) -> str | None:
  """Keypath of the first dict whose keys jax.tree_util cannot sort (mixed types)."""
  stack = [("", tree)]
  while stack:
    path, node = stack.pop()
    if isinstance(node, dict):
      try:
        sorted(node)
      except TypeError:
        return f"{path or '<root>'} has keys {short(list(node))}"
      stack += [(f"{path}[{k!r}]", v) for k, v in node.items()]
    elif isinstance(node, (list, tuple)):
      stack += [(f"{path}[{i}]", v) for i, v in enumerate(node)]
  return None


def _mismatch(axes_tree: Any, shapes: Any) -> list[str]:
  """The keypaths that differ between the logical-axes tree and the shapes tree."""
  keystr = path_str
  axes_paths = [keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
      axes_tree, is_leaf=is_axes_leaf)[0]]
  shape_paths = [keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(shapes)[0]]
  only_axes = [a for a in axes_paths if not any(s.startswith(a) for s in shape_paths)]
  only_shapes = [s for s in shape_paths if not any(s.startswith(a) for a in axes_paths)]
  out = [f"{p or '<root>'}: in the logical axes, not in the shapes" for p in only_axes[:8]]
  out += [f"{p or '<root>'}: in the shapes, not in the logical axes" for p in only_shapes[:8]]
  return out


def map_axes_tree(fn, axes_tree: Any, shapes: Any, api: str) -> Any:
  """Maps ``fn(keypath, axes, leaf_or_None)`` over ``axes_tree``; collects failures."""
  problems: list[str] = []
  kinds: set[type] = set()

  def one(path, axes, leaf=None):
    where = path_str(path) or "<root>"
    if leaf is not None and not hasattr(leaf, "shape"):
      problems.append(f"{where}: expected an array or ShapeDtypeStruct, got "
                      f"{type(leaf).__name__} {short(leaf)}")
      return PartitionSpec()
    try:
      return fn(path, axes, leaf)
    except RulesError as e:
      kinds.add(type(e))
      problems.append(f"{where}: " + str(e).strip().replace("\n", "\n    "))
      return PartitionSpec()

  bad_keys = _unsortable_dict(axes_tree) or _unsortable_dict(shapes)
  if bad_keys:
    raise RulesTypeError(format_message(
        f"{api}: a dict mixes key types, which jax.tree_util cannot order:",
        bullets=[bad_keys], fix="Use keys of one type (str) in each dict."))
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
        bullets=_mismatch(axes_tree, shapes) or [str(e).splitlines()[0]],
        fix="Give one logical-axes tuple (or None) per array, in the same structure.")) from None
  if problems:
    cls = kinds.pop() if len(kinds) == 1 else RulesError
    raise cls(format_message(
        f"{api}: {len(problems)} leaf/leaves could not be resolved:", bullets=problems,
        fix="Fix the logical axes of those leaves (one name or None per dim), the rules, "
            "or pass strict=False."))
  return out
