""""Why this sharding?" reports over a tree of parameters.

``partition.explain(params, axes)`` resolves every leaf through the rules (shape-aware, so
indivisible dims fall back as they will at run time) and returns an :class:`ExplainReport`:
a table of path, shape, dtype, logical axes, ``PartitionSpec``, bytes per device and total
bytes, then the leaves left fully replicated on a multi-device mesh, then every rule that was
skipped and why. ``str(report)`` is plain text; ``report.to_markdown()`` is a Markdown table.

Paths are written ``a/b/c`` (the format of path tables and error messages). PRNG-key arrays
are listed with their key dtype (``key<fry>``); Python numbers count as 0-d arrays; other
non-array leaves (strings, objects) are skipped and named in the notes. A logical-axes tuple
shorter than the rank is a prefix, as in flax (trailing dims replicated).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

from partition._base.errors import did_you_mean, format_message
from partition._base.logical_axes import LogicalAxesError, path_str
from partition._base.mesh import AnyMesh, axis_sizes, describe, entry_mesh_axes
from partition._rules.constrain import NoRulesError
from partition._rules.context import current_rules, current_rules_mesh
from partition._rules.resolve import FIRED, Resolution
from partition._rules.table import AxisRules, map_axes_tree

COLUMNS = ("path", "shape", "dtype", "logical axes", "spec", "per device", "total")


@dataclasses.dataclass(frozen=True)
class ExplainRow:
  """One leaf of the report."""

  path: str
  shape: tuple[int, ...]
  dtype: str
  logical_axes: tuple | None
  spec: PartitionSpec
  bytes_per_device: int
  bytes_total: int
  replicated: bool
  resolution: Resolution | None

  def cells(self) -> tuple[str, ...]:
    axes = "-" if self.logical_axes is None else str(tuple(self.logical_axes))
    spec = str(self.spec) + (" !" if self.replicated else "")
    return (self.path, str(self.shape), self.dtype, axes, spec,
            human_bytes(self.bytes_per_device), human_bytes(self.bytes_total))


@dataclasses.dataclass(frozen=True)
class ExplainReport:
  """The result of :func:`explain`: rows plus totals, flags and notes."""

  rows: tuple[ExplainRow, ...]
  mesh: str
  num_devices: int
  notes: tuple[str, ...]

  @property
  def total_bytes(self) -> int:
    return sum(r.bytes_total for r in self.rows)

  @property
  def bytes_per_device(self) -> int:
    return sum(r.bytes_per_device for r in self.rows)

  @property
  def replicated(self) -> tuple[str, ...]:
    """Paths of leaves left fully replicated on a mesh of more than one device."""
    return tuple(r.path for r in self.rows if r.replicated)

  def summary(self) -> str:
    return (f"{len(self.rows)} arrays, {human_bytes(self.total_bytes)} total, "
            f"{human_bytes(self.bytes_per_device)} per device on {self.mesh}")

  def _tail(self) -> list[str]:
    lines = []
    if self.replicated:
      lines.append(f"Fully replicated on {self.num_devices} devices (marked !): "
                   + ", ".join(self.replicated))
    return lines + list(self.notes)

  def __str__(self) -> str:
    table = [COLUMNS] + [r.cells() for r in self.rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(COLUMNS))]
    fmt = lambda row: "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
    lines = [fmt(table[0]), "  ".join("-" * w for w in widths)] + [fmt(r) for r in table[1:]]
    return "\n".join(lines + [self.summary()] + [f"* {t}" for t in self._tail()])

  def to_markdown(self) -> str:
    esc = lambda c: c.replace("|", "\\|")
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(esc(c) for c in r.cells()) + " |" for r in self.rows]
    return "\n".join(lines + ["", f"**{self.summary()}**", ""]
                     + [f"- {esc(t)}" for t in self._tail()]) + "\n"


def human_bytes(n: int) -> str:
  """A byte count in binary units, as reports print it.

  >>> human_bytes(512), human_bytes(131072), human_bytes(3 * 2**30)
  ('512 B', '128.00 KiB', '3.00 GiB')
  """
  for unit in ("B", "KiB", "MiB", "GiB"):
    if n < 1024 or unit == "GiB":
      return f"{n} {unit}" if unit == "B" else f"{n:.2f} {unit}"
    n /= 1024
  raise AssertionError  # unreachable


def _shard_bytes(shape, spec: PartitionSpec, mesh_sizes, itemsize: int) -> int:
  shard = list(shape)
  for i, entry in enumerate(tuple(spec)[:len(shape)]):
    names = entry_mesh_axes(entry)
    shard[i] = -(-shard[i] // math.prod(mesh_sizes.get(a, 1) for a in names))
  return math.prod(shard) * itemsize


def explain(tree: Any, axes_tree: Any, rules: Any = None, mesh: AnyMesh | None = None, *,
            strict: bool = False) -> ExplainReport:
  """Reports how every leaf of ``tree`` is sharded by ``rules`` on ``mesh``.

  Args:
    tree: a pytree of arrays or ``jax.ShapeDtypeStruct`` (e.g. ``jax.eval_shape(init)``).
    axes_tree: the matching pytree of logical-axes tuples (``None`` = unannotated).
    rules: default: the ``axis_rules`` context.
    mesh: default: the ``axis_rules`` mesh, else the ``jax.set_mesh`` mesh, else none (the
      report then shows specs without divisibility checks, per device = total).
    strict: resolve with ``strict=True``.

  Returns:
    An :class:`ExplainReport`; print it, or call ``.to_markdown()``.

  Example:
    >>> import jax, jax.numpy as jnp, partition
    >>> mesh = jax.make_mesh((4, 2), ('fsdp', 'tensor'))
    >>> rules = partition.AxisRules([('embed', 'fsdp'), ('mlp', 'tensor')])
    >>> params = {'w': jax.ShapeDtypeStruct((6, 8), jnp.float32),
    ...           'b': jax.ShapeDtypeStruct((8,), jnp.float32)}
    >>> report = partition.explain(params, {'w': ('embed', 'mlp'), 'b': ('mlp',)}, rules,
    ...                            mesh)
    >>> print(report)
    path  shape   dtype    logical axes      spec               per device  total
    ----  ------  -------  ----------------  -----------------  ----------  -----
    b     (8,)    float32  ('mlp',)          P('tensor',)       16 B        32 B
    w     (6, 8)  float32  ('embed', 'mlp')  P(None, 'tensor')  96 B        192 B
    2 arrays, 224 B total, 112 B per device on mesh(fsdp=4 Explicit, tensor=2 Explicit)
    * w dim 0 'embed' (size 6): rule #0 'fsdp': not divisible (size 6, needs a multiple of 4)
  """
  found = current_rules(rules)
  if found is None:
    raise NoRulesError("partition.explain needs rules: pass rules=partition.AxisRules([...]) "
                       "or call it inside `with partition.axis_rules(rules):`.")
  found_mesh = current_rules_mesh(mesh)
  sizes = dict(axis_sizes(found_mesh))
  devices = math.prod(sizes.values()) if found_mesh is not None else 1
  rows: list[ExplainRow] = []
  notes: list[str] = []
  too_long: list[str] = []

  def row(path, axes, leaf):
    name = path_str(path) or "<root>"
    if leaf is None:
      notes.append(f"{name}: not an array, skipped")
      return PartitionSpec()
    if isinstance(axes, (tuple, list)) and len(axes) > len(leaf.shape):
      too_long.append(f"{name}: logical axes {tuple(axes)} name {len(axes)} dims but the "
                      f"array has shape {tuple(leaf.shape)}")
      return PartitionSpec()
    axes = _pad(axes, leaf.shape)
    res = _resolution(found, axes, leaf.shape, found_mesh, strict)
    spec = res.spec if res is not None else found.spec(axes)
    itemsize, dtype = _itemsize(leaf.dtype)
    total = math.prod(leaf.shape) * itemsize
    per = _shard_bytes(leaf.shape, spec, sizes, itemsize)
    rows.append(ExplainRow(name, tuple(leaf.shape), dtype,
                           None if res is None else tuple(axes), spec, per, total,
                           devices > 1 and len(leaf.shape) > 0 and per == total, res))
    notes.extend(_notes(name, res, found))
    return spec

  map_axes_tree(row, axes_tree, _arrays_only(tree), "partition.explain")
  if too_long:
    raise LogicalAxesError(format_message(
        f"partition.explain: {len(too_long)} array(s) have more logical axes than dims:",
        bullets=too_long,
        fix="Give at most one logical name (or None) per dim; a shorter tuple leaves the "
            "trailing dims replicated."))
  return ExplainReport(tuple(rows), describe(found_mesh), devices, tuple(notes))


def _arrays_only(tree: Any) -> Any:
  """Python numbers as 0-d arrays; other leaves without a shape as ``None`` (skipped)."""
  def one(x):
    if hasattr(x, "shape") and hasattr(x, "dtype"):
      return x
    if isinstance(x, (bool, int, float, complex)):
      return np.asarray(x)
    return None
  return jax.tree.map(one, tree)


def _itemsize(dtype: Any) -> tuple[int, str]:
  """``(bytes per element, dtype name)``; PRNG key dtypes have no numpy equivalent."""
  if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    return dtype.itemsize, str(dtype)
  d = np.dtype(dtype)
  return d.itemsize, str(d)


def _pad(axes: Any, shape: tuple) -> Any:
  """A short logical-axes tuple is a prefix (flax): pad with ``None`` to the rank."""
  if isinstance(axes, (tuple, list)) and not isinstance(axes, PartitionSpec) and (
      len(axes) < len(shape)):
    return tuple(axes) + (None,) * (len(shape) - len(axes))
  return axes


def _resolution(rules: AxisRules, axes, shape, mesh, strict) -> Resolution | None:
  if axes is None or axes == "" or isinstance(axes, PartitionSpec):
    return None
  return rules.resolve(axes, shape, mesh, strict=strict)


def _notes(name: str, res: Resolution | None, rules: AxisRules) -> list[str]:
  if res is None:
    return []
  out = []
  for d in res.dims:
    head = f"{name} dim {d.index} {d.logical!r}" + (
        f" (size {d.size})" if d.size is not None else "")
    if isinstance(d.logical, str) and d.logical and d.logical not in rules.names:
      out.append(f"{head}: no rule for this name{did_you_mean(d.logical, rules.names)}")
    out += [f"{head}: {a}" for a in d.attempts if a.outcome != FIRED]
  return out
