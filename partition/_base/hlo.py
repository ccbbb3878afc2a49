"""Collective traffic of a compiled program, per collective kind and per mesh axis.

``collective_stats(compiled, mesh)`` reads the optimised HLO (``compiled.as_text()``) and
lists every all-reduce, all-gather, reduce-scatter, all-to-all and collective-permute with:

* the **mesh axes** its replica groups span (every HLO spelling of the groups: explicit
  ``{{0,2},{1,3}}``, iota ``[2,4]<=[8]`` / ``[4,2]<=[2,4]T(1,0)``, and
  ``mesh['axis_0'=4,'axis_1'=2] {'axis_0'}``; device ids are positions in ``mesh.devices.flat``,
  the device order jit gives an SPMD program over a ``NamedSharding``'s mesh);
* how many times it runs per call: an op inside a ``while`` body counts once per iteration
  (its ``known_trip_count``; 1 when XLA does not know it);
* the **bytes each device sends** with the bandwidth-optimal ring algorithms, for a group of
  ``N`` devices and an array of ``S`` bytes (the full, unsharded operand of the collective):
  all-reduce ``2 S (N-1)/N``; all-gather, reduce-scatter, all-to-all ``S (N-1)/N``;
  collective-permute ``S``.

XLA:CPU lowers many reduce-scatters as an all-reduce followed by a ``dynamic-slice`` of each
device's shard. An all-reduce whose every use is such a slice (directly or inside a fusion)
to ``1/N`` of its size is counted here as the **reduce-scatter it stands for** (``kind ==
'reduce-scatter'``, ``lowered_as == 'all-reduce + dynamic-slice'``), so CPU and accelerator
programs compare against the same analytic figure.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jax.sharding import NamedSharding, PartitionSpec as P
  >>> import partition
  >>> mesh = jax.make_mesh((4, 2), ('data', 'model'),
  ...                      axis_types=(jax.sharding.AxisType.Auto,) * 2)
  >>> f = jax.jit(lambda x: x.sum(0), in_shardings=NamedSharding(mesh, P('data')),
  ...             out_shardings=NamedSharding(mesh, P()))
  >>> stats = partition.collective_stats(f.lower(jnp.ones((8, 16))).compile(), mesh)
  >>> stats.count('all-reduce', ('data',))
  1
  >>> stats.bytes('all-reduce')  # 2 * (16 * 4 bytes) * 3/4
  96.0
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from partition._base.errors import PartitionError, format_message

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
CPU_REDUCE_SCATTER = "all-reduce + dynamic-slice"


class HloParseError(PartitionError, ValueError):
  """The HLO text holds a collective this parser cannot attribute to devices."""


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective instruction of the program.

  Attributes:
    kind: one of ``KINDS`` (an XLA:CPU all-reduce + dynamic-slice is ``'reduce-scatter'``).
    axes: the mesh axes its replica groups span, in mesh order (``()``: a group of one
      device; ``None``: no mesh given, or groups that are not a product of mesh axes).
    group_size: devices per replica group ``N``.
    count: executions per call of the program (loop trip counts multiplied in).
    array_bytes: ``S``, the full array the ring formula applies to, per execution.
    bytes: bytes one device sends per call, all executions together.
    name: the HLO instruction's name.
    lowered_as: how XLA spelled it when that differs from ``kind``.
  """

  kind: str
  axes: tuple[str, ...] | None
  group_size: int
  count: int
  array_bytes: int
  bytes: float
  name: str
  lowered_as: str = ""


@dataclasses.dataclass(frozen=True)
class CollectiveStats:
  """Every collective of one compiled program; query by ``kind`` and ``axes``."""

  ops: tuple[Collective, ...]

  def select(self, kind: str | None = None,
             axes: str | Sequence[str] | None = None) -> tuple[Collective, ...]:
    """The ops of ``kind`` (all if ``None``) whose groups span exactly ``axes`` (a name or a
    tuple in any order; all if ``None``)."""
    if kind is not None and kind not in KINDS:
      raise ValueError(f"collective_stats: unknown kind {kind!r}; choose from {KINDS}.")
    want = None if axes is None else frozenset((axes,) if isinstance(axes, str) else axes)
    return tuple(op for op in self.ops
                 if (kind is None or op.kind == kind)
                 and (want is None or (op.axes is not None and frozenset(op.axes) == want)))

  def count(self, kind: str | None = None, axes: str | Sequence[str] | None = None) -> int:
    """Executions per call of the selected ops."""
    return sum(op.count for op in self.select(kind, axes))

  def bytes(self, kind: str | None = None, axes: str | Sequence[str] | None = None) -> float:
    """Ring bytes one device sends per call for the selected ops."""
    return float(sum(op.bytes for op in self.select(kind, axes)))

  @property
  def total_bytes(self) -> float:
    return self.bytes()

  def table(self) -> dict[tuple[str, tuple[str, ...] | None], dict[str, float]]:
    """``{(kind, axes): {'count': ..., 'bytes': ...}}`` over the ops present."""
    out: dict[tuple[str, tuple[str, ...] | None], dict[str, float]] = {}
    for op in self.ops:
      row = out.setdefault((op.kind, op.axes), {"count": 0, "bytes": 0.0})
      row["count"] += op.count
      row["bytes"] += op.bytes
    return out

  def as_dict(self) -> dict[str, Any]:
    """JSON-ready ``{kind: {'axis,axis': {'count': ..., 'bytes': ...}}}`` (``'?'``: axes
    unknown)."""
    out: dict[str, Any] = {}
    for (kind, axes), row in self.table().items():
      key = "?" if axes is None else ",".join(axes)
      out.setdefault(kind, {})[key] = {"count": int(row["count"]), "bytes": row["bytes"]}
    return out

  def __repr__(self) -> str:
    rows = [f"  {kind} over {axes}: count {int(v['count'])}, {v['bytes']:.0f} B/device"
            for (kind, axes), v in sorted(self.table().items(), key=str)]
    return "\n".join([f"CollectiveStats({self.total_bytes:.0f} B/device per call)"] + rows)


def collective_stats(program: Any, mesh: Any = None) -> CollectiveStats:
  """Collectives of a compiled program, with ring bytes per device, per kind and mesh axes.

  Args:
    program: a ``jax.stages.Compiled`` (``jit(f).lower(...).compile()``) or its HLO text.
    mesh: the ``jax.sharding.Mesh`` (or ``AbstractMesh``) the program was compiled for; its
      axis names label the replica groups. ``None``: ops are counted with ``axes=None``.

  Returns:
    A :class:`CollectiveStats`; ``stats.count(kind, axes)`` and ``stats.bytes(kind, axes)``
    sum over the selected ops (see the module docstring for the formulas, loops and the
    XLA:CPU reduce-scatter).

  Raises:
    HloParseError: a collective's replica groups are in a form this parser does not read.
  """
  text = program if isinstance(program, str) else program.as_text()
  module = _Module.parse(text)
  shape = _mesh_shape(mesh)
  n_devices = math.prod(shape.values()) if shape else module.num_partitions
  times = module.executions()
  ops = []
  for comp in module.computations.values():
    for ins in comp.instructions:
      kind = _kind(ins.opcode)
      if kind is not None:
        ops.extend(_collectives(module, comp, ins, kind, times.get(comp.name, 1), shape,
                                n_devices))
  return CollectiveStats(tuple(ops))


# ---------------------------------------------------------------------- HLO structure


_HEADER = re.compile(r"^(ENTRY )?%?(?P<name>[\w.\-]+) \((?P<params>.*)\) -> .*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%?(?P<name>[\w.\-]+) = (?P<type>\(.*?\)|[^\s(]+(?:\{[^}]*\})?)"
                    r" (?P<opcode>[\w\-]+)\((?P<operands>[^)]*)\)(?P<attrs>.*)$")
_ARRAY = re.compile(r"(?P<dtype>[a-z]+[0-9a-z]*)\[(?P<dims>[\d,]*)\]")
_DTYPE_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16,
               "f16": 16, "bf16": 16, "s32": 32, "u32": 32, "f32": 32, "s64": 64, "u64": 64,
               "f64": 64, "c64": 64, "c128": 128}


@dataclasses.dataclass
class _Instr:
  name: str
  type: str
  opcode: str
  operands: list[str]
  attrs: str


@dataclasses.dataclass
class _Computation:
  name: str
  instructions: list[_Instr]

  def users(self, name: str) -> list[tuple[_Instr, int]]:
    return [(i, pos) for i in self.instructions for pos, o in enumerate(i.operands)
            if o == name]

  def parameter(self, number: int) -> _Instr | None:
    return next((i for i in self.instructions
                 if i.opcode == "parameter" and i.operands == [str(number)]), None)


@dataclasses.dataclass
class _Module:
  computations: dict[str, _Computation]
  entry: str | None
  num_partitions: int

  @staticmethod
  def parse(text: str) -> _Module:
    comps: dict[str, _Computation] = {}
    entry, current = None, None
    loose = _Computation("", [])  # instructions outside any computation (snippets)
    for line in text.splitlines():
      head = _HEADER.match(line)
      if head:
        current = comps.setdefault(head["name"], _Computation(head["name"], []))
        entry = head["name"] if head.group(1) else entry
        continue
      m = _INSTR.match(line)
      if m:
        operands = [o.strip().split(" ")[-1].lstrip("%") for o in m["operands"].split(",")
                    if o.strip()]
        (current or loose).instructions.append(
            _Instr(m["name"], m["type"], m["opcode"], operands, m["attrs"]))
    if loose.instructions:
      comps.setdefault("", loose)
      entry = entry or ""
    parts = re.search(r"num_partitions=(\d+)", text)
    return _Module(comps, entry, int(parts[1]) if parts else 1)

  def executions(self) -> dict[str, int]:
    """Runs per call of each computation: a while body runs ``known_trip_count`` times
    (1 if unknown) per run of the computation holding the loop; called computations
    (fusions, async wrappers, branches) once per run of their caller."""
    times: dict[str, int] = {}

    def visit(name: str, mult: int, depth: int = 0) -> None:
      if depth > 64 or name not in self.computations:
        return
      times[name] = times.get(name, 0) + mult
      for ins in self.computations[name].instructions:
        for child, n in _callees(ins):
          visit(child, mult * n, depth + 1)

    if self.entry is not None:
      visit(self.entry, 1)
    for name in self.computations:  # unreachable text (e.g. a snippet): once
      times.setdefault(name, 1)
    return times


def _callees(ins: _Instr) -> list[tuple[str, int]]:
  out = []
  if ins.opcode == "while":
    body = re.search(r"\bbody=%?([\w.\-]+)", ins.attrs)
    trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attrs)
    if body:
      out.append((body[1], int(trip[1]) if trip else 1))
  for attr in ("calls", "branch_computations"):
    for group in re.findall(attr + r"=\{?([^}\s]+(?:, ?%[\w.\-]+)*)\}?", ins.attrs):
      out.extend((c.strip().lstrip("%"), 1) for c in group.split(",") if c.strip())
  return out


def _kind(opcode: str) -> str | None:
  base = opcode[:-len("-start")] if opcode.endswith("-start") else opcode
  return base if base in KINDS else None


def _arrays(type_text: str) -> list[int]:
  """Bytes of each array in an HLO type (a tuple gives several)."""
  out = []
  for m in _ARRAY.finditer(type_text):
    dims = [int(d) for d in m["dims"].split(",") if d]
    bits = _DTYPE_BITS.get(m["dtype"])
    if bits is None:  # f8e4m3fn, f8e5m2, ...: the width follows the letter
      width = re.match(r"[a-z]+(\d+)", m["dtype"])
      bits = int(width[1]) if width else 32
    out.append(math.prod(dims) * bits // 8)
  return out


def _result_arrays(ins: _Instr) -> list[int]:
  """Bytes of the arrays an op produces (async starts return (operands, results, ...))."""
  arrays = _arrays(ins.type)
  if not ins.opcode.endswith("-start") or ins.opcode == "all-reduce-start":
    return arrays
  n = len(ins.operands) if ins.opcode != "collective-permute-start" else 1
  return arrays[n:2 * n] or arrays[-1:]


# ------------------------------------------------------------------------- device groups


def _mesh_shape(mesh: Any) -> dict[str, int] | None:
  if mesh is None:
    return None
  return {str(k): int(v) for k, v in dict(mesh.shape).items()}


def _iota(dims: str, perm: str | None) -> np.ndarray:
  shape = [int(d) for d in dims.split(",") if d]
  ids = np.arange(math.prod(shape)).reshape(shape)
  return ids.transpose([int(p) for p in perm.split(",")]) if perm else ids


def _groups(ins: _Instr, n_devices: int) -> list[list[int]]:
  """The replica groups of a collective as lists of device ids (positions in the mesh)."""
  a = ins.attrs
  if ins.opcode.startswith("collective-permute"):
    pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", a)
    if not pairs:
      return [[d] for d in range(n_devices)]
    return [[int(x) for x in p.split(",")] for p in re.findall(r"\{(\d+,\d+)", pairs[1] + "}")]
  m = re.search(r"replica_groups=mesh\[(?P<axes>[^\]]*)\]"
                r"(?:,? ?device_ids=\((?:\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?"
                r"|(?P<ids>[\d, ]+))\))?\s*\{(?P<used>[^}]*)\}", a)
  if m:  # mesh['a'=4,'b'=2] {'a'}, with device_ids=([2,4]T(1,0)) or (0,2,...) as the order
    names = re.findall(r"'([^']+)'=(\d+)", m["axes"])
    sizes = [int(s) for _, s in names]
    if m["dims"]:
      ids = _iota(m["dims"], m["perm"]).reshape(sizes)
    elif m["ids"]:
      ids = np.array([int(x) for x in m["ids"].split(",")]).reshape(sizes)
    else:
      ids = np.arange(math.prod(sizes)).reshape(sizes)
    used = [[n for n, _ in names].index(u) for u in re.findall(r"'([^']+)'", m["used"])]
    rest = [i for i in range(len(sizes)) if i not in used]
    return ids.transpose(rest + used).reshape(-1, math.prod(sizes[i] for i in used)).tolist()
  m = re.search(r"replica_groups=\[(?P<shape>[\d,]+)\]<=\[(?P<dims>[\d,]+)\]"
                r"(?:T\((?P<perm>[\d,]+)\))?", a)
  if m:
    shape = [int(s) for s in m["shape"].split(",")]
    return _iota(m["dims"], m["perm"]).reshape(shape[0], -1).tolist()
  m = re.search(r"replica_groups=\{(?P<groups>(?:\{[\d,]*\},?)*)\}", a)
  if m and m["groups"]:
    return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}",
                                                                      m["groups"])]
  if m or "replica_groups" not in a:
    return [list(range(n_devices))]
  raise HloParseError(format_message(
      f"collective_stats: cannot read the replica groups of %{ins.name}.",
      context=[f"attributes: {a.strip()[:200]}"],
      fix="Please report the HLO line; pass its text to collective_stats to reproduce."))


def _axes(groups: list[list[int]], shape: dict[str, int] | None,
          permute: bool) -> tuple[str, ...] | None:
  """The mesh axes along which the devices of each group differ, if the groups are exactly
  the products of those axes (a permute: the axes its pairs move along)."""
  if shape is None:
    return None
  names, sizes = list(shape), list(shape.values())
  n = math.prod(sizes)
  if any(d >= n for g in groups for d in g):
    return None
  coords = [np.array(np.unravel_index(np.asarray(g), sizes)).T for g in groups]
  varying = sorted({i for c in coords for i in range(len(sizes)) if len(set(c[:, i])) > 1})
  axes = tuple(names[i] for i in varying)
  if permute:
    return axes
  size = math.prod(sizes[i] for i in varying)
  return axes if all(len(g) == size for g in groups) else None


# ------------------------------------------------------------------------------ counting


def _collectives(module: _Module, comp: _Computation, ins: _Instr, kind: str, times: int,
                 shape: dict[str, int] | None, n_devices: int) -> list[Collective]:
  groups = _groups(ins, n_devices)
  permute = kind == "collective-permute"
  g = len(groups[0]) if groups and not permute else n_devices
  axes = _axes(groups, shape, permute)
  arrays = _result_arrays(ins)
  sliced = _cpu_reduce_scatter(module, comp, ins, len(arrays), g) if kind == "all-reduce" \
      else [False] * len(arrays)
  out = []
  for as_rs in (False, True):
    sizes = [s for s, rs in zip(arrays, sliced) if rs == as_rs]
    if not sizes:
      continue
    k = "reduce-scatter" if as_rs else kind
    full = sum(sizes) * (g if kind == "reduce-scatter" else 1)
    out.append(Collective(k, axes, g, times, full, _ring_bytes(k, full, g) * times, ins.name,
                          CPU_REDUCE_SCATTER if as_rs else ""))
  return out


def _ring_bytes(kind: str, full: int, g: int) -> float:
  """Bytes one device sends, ring algorithms, ``full`` = the whole array's bytes."""
  if kind == "collective-permute":
    return float(full)
  if g <= 1:
    return 0.0
  frac = (g - 1) / g
  return 2 * full * frac if kind == "all-reduce" else full * frac


def _cpu_reduce_scatter(module: _Module, comp: _Computation, ins: _Instr, n_arrays: int,
                        g: int) -> list[bool]:
  """Per array of an all-reduce: is every use a dynamic-slice to 1/g of it (the reduce-scatter
  XLA:CPU writes as all-reduce + dynamic-slice)?"""
  if g <= 1:
    return [False] * n_arrays
  arrays = _arrays(ins.type)
  if n_arrays == 1 and not ins.type.startswith("("):
    return [_only_sliced(module, comp, ins.name, arrays[0], g)]
  out = []
  for index in range(n_arrays):
    getters = [u for u, _ in comp.users(ins.name) if u.opcode == "get-tuple-element"
               and re.search(rf"\bindex={index}\b", u.attrs)]
    out.append(bool(getters) and all(_only_sliced(module, comp, u.name, arrays[index], g)
                                     for u in getters))
  return out


_PASS_THROUGH = ("bitcast", "reshape", "copy")


def _only_sliced(module: _Module, comp: _Computation, name: str, size: int, g: int,
                 depth: int = 0) -> bool:
  users = comp.users(name)
  if not users or depth > 8:
    return False
  for user, pos in users:
    if user.opcode == "dynamic-slice" and pos == 0:
      if sum(_arrays(user.type)) * g != size:
        return False
    elif user.opcode in _PASS_THROUGH:
      if not _only_sliced(module, comp, user.name, size, g, depth + 1):
        return False
    elif user.opcode == "fusion":
      callee = next((c for c, _ in _callees(user) if c in module.computations), None)
      param = module.computations[callee].parameter(pos) if callee else None
      if param is None or not _only_sliced(module, module.computations[callee], param.name,
                                           size, g, depth + 1):
        return False
    else:
      return False
  return True

