"""Resolving one array's logical axes through a rule table, and explaining the result.

The algorithm is flax linen's ``logical_to_mesh_axes``: rules are tried in priority order;
rule ``(name, mesh_axes)`` is applied to each dim called ``name`` that is still unassigned,
provided none of ``mesh_axes`` is already used by another dim of the same array. A rule
whose value is ``None`` claims the dim as replicated (later fallbacks for that name are not
tried); names that no rule assigns replicate.

When a mesh is known, placement stays flax's: the "already used" check sees a rule's full
mesh axes, size-1 axes and axes the mesh lacks included, and a rule whose axes all have
size 1 (or are absent) still fires (the dim is replicated, as flax's spec is once those
axes are dropped). Such axes are dropped only from the final spec, so a mesh that lacks an
axis places exactly like one that has it with size 1. Two differences remain, documented in
``docs/rules.md``: when the dim size is known, a candidate whose total size does not divide
the dim is skipped and the next rule is tried; ``strict`` reports names without a rule,
axes the mesh lacks and dims no candidate divides instead of replicating silently.
Every decision is recorded as an :class:`Attempt` so that a resolution can explain itself.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from jax.sharding import PartitionSpec

from partition._base.errors import did_you_mean, format_message
from partition._base.mesh import to_spec_entry
from partition._base.resources import SerialLoop
from partition._rules.errors import RulesError
from partition._rules.schema import Resource, Value

FIRED = "fired"
USED = "mesh axis already used"
INDIVISIBLE = "not divisible"
TYPO_CUTOFF = 0.8  # 'tensr'/'tensor' 0.91, 'dta'/'data' 0.86; 'sequence'/'tensor_sequence' 0.70


class ResolutionError(RulesError):
  """``strict=True`` resolution found an unknown name, unknown mesh axis or bad shape."""


@dataclasses.dataclass(frozen=True)
class Attempt:
  """One rule tried on one dim: ``outcome`` is ``'fired'`` or why the rule was skipped."""

  rule: int
  value: Value
  outcome: str
  detail: str = ""

  def __str__(self) -> str:
    text = f"rule #{self.rule} {_show(self.value)}: {self.outcome}"
    return f"{text} ({self.detail})" if self.detail else text


@dataclasses.dataclass(frozen=True)
class DimResolution:
  """How one dim was resolved: its final resources and every rule tried on it."""

  index: int
  logical: object
  size: int | None
  resources: tuple[Resource, ...] | None
  attempts: tuple[Attempt, ...]

  @property
  def rule(self) -> int | None:
    """Index of the rule that fired, or ``None``."""
    fired = [a.rule for a in self.attempts if a.outcome == FIRED]
    return fired[0] if fired else None

  def why(self) -> str:
    """Which rule fired for this dim and why the others were skipped, one rule a line."""
    head = f"dim {self.index} {self.logical!r}" + (
        f" (size {self.size})" if self.size is not None else "")
    if not isinstance(self.logical, str) or not self.logical:
      return f"{head}: unannotated -> {self.logical!r}"
    if not self.attempts:
      return f"{head}: no rule for this name -> replicated"
    result = _show(self.resources) if self.rule is not None else "replicated"
    return "\n".join([f"{head} -> {result}"] + [f"  {a}" for a in self.attempts])


@dataclasses.dataclass(frozen=True)
class Resolution:
  """The resolution of one array: the spec plus one :class:`DimResolution` per dim."""

  logical_axes: tuple
  shape: tuple[int, ...] | None
  dims: tuple[DimResolution, ...]

  @property
  def spec(self) -> PartitionSpec:
    return PartitionSpec(*(_entry(d) for d in self.dims))

  @property
  def skipped(self) -> tuple[tuple[DimResolution, Attempt], ...]:
    return tuple((d, a) for d in self.dims for a in d.attempts if a.outcome != FIRED)

  def __str__(self) -> str:
    lines = [f"{self.logical_axes} -> {self.spec}"]
    return "\n".join(lines + ["  " + d.why().replace("\n", "\n  ") for d in self.dims])


def _show(value: Value) -> str:
  if not value:
    return "None"
  return repr(value[0]) if len(value) == 1 else "(" + ", ".join(map(repr, value)) + ")"


def _entry(d: DimResolution):
  if not isinstance(d.logical, str):
    return d.logical  # None or PartitionSpec.UNCONSTRAINED pass through, as in flax
  return to_spec_entry(r for r in d.resources or () if isinstance(r, str))


class _Dim:
  def __init__(self, index: int, logical: object, size: int | None):
    self.index, self.logical, self.size = index, logical, size
    self.resources: tuple[Resource, ...] | None = None
    self.done = not isinstance(logical, str)
    self.attempts: list[Attempt] = []


def resolve(
    pairs: Sequence[tuple[str, Value]],
    names: Sequence[object],
    sizes: Sequence[int | None] | None,
    mesh_sizes: Mapping[str, int] | None,
    *,
    strict: bool = False,
    loops: bool = False,
    named_loops: Mapping[str, int] | None = None,
) -> Resolution:
  """Resolves ``names`` (one array's logical axes, or one xmap's axis names).

  Args:
    pairs: the rule table, canonical ``(name, None | tuple of resources)``.
    names: logical names per dim; non-str entries (``None``) pass through.
    sizes: size per dim, or ``None`` when the shape is unknown.
    mesh_sizes: ``{mesh axis: size}``, or ``None`` when no mesh is known.
    strict: raise :class:`ResolutionError` instead of falling back silently.
    loops: keep ``SerialLoop`` resources (xmap) instead of dropping them (arrays).
    named_loops: ``{name: length}`` of loops bound by ``serial_loop`` (xmap only).
  """
  dims = [_Dim(i, n, None if sizes is None else sizes[i]) for i, n in enumerate(names)]
  used: dict[str, int] = {}
  problems: list[str] = []
  for r, (name, value) in enumerate(pairs):
    for dim in dims:
      if dim.done or dim.logical != name:
        continue
      outcome, detail, kept, missing, claimed = _try(value, dim, used, mesh_sizes, loops,
                                                     named_loops or {})
      dim.attempts.append(Attempt(r, value, outcome, detail))
      # A missing axis that is a near-miss of one the mesh has ('tensr', 'dta') cannot be
      # intended: an error even without strict. Others act as size-1 axes (as in flax), so
      # MaxText's table ('tensor_sequence' beside 'sequence') works on smaller meshes.
      reported = missing if strict else [
          a for a in missing if did_you_mean(a, mesh_sizes or (), cutoff=TYPO_CUTOFF)]
      problems += [f"dim {dim.index} {name!r}: rule #{r} names {a!r}, which is not a mesh "
                   f"axis{did_you_mean(a, list(mesh_sizes or ()))}" for a in reported]
      if outcome == FIRED:
        dim.resources, dim.done = kept, True
        # Every axis the rule names counts as used (size 1 and absent ones too), as in flax.
        used.update({a: dim.index for a in claimed})
  if strict:
    problems += _strict_problems(pairs, dims, mesh_sizes)
  if problems:
    if not strict:
      raise ResolutionError(format_message(
          f"Resolution of logical axes {tuple(names)} failed: a rule names a mesh axis the "
          "mesh does not have:",
          context=[f"mesh axes: {dict(mesh_sizes)}"], bullets=problems,
          fix="Fix the mesh axis name in the rule table (or add that axis to the mesh)."))
    raise ResolutionError(format_message(
        f"Strict resolution of logical axes {tuple(names)} failed:",
        context=[f"mesh axes: {dict(mesh_sizes)}" if mesh_sizes is not None else "no mesh"],
        bullets=problems,
        fix="Fix the name or the rule table, add a fallback rule (e.g. [batch, data] after "
            "[batch, [data, fsdp]]), pad the dim, or pass strict=False."))
  return Resolution(tuple(names), None if sizes is None else tuple(sizes), tuple(
      DimResolution(d.index, d.logical, d.size, d.resources, tuple(d.attempts)) for d in dims))


def _try(value, dim, used, mesh_sizes, loops, named_loops):
  """``(outcome, detail, resources, missing mesh axes, claimed mesh axes)`` of ``value``.

  ``resources`` are what the spec gets (size-1 axes dropped); ``claimed`` are all mesh axes
  the rule names, which flax marks as used when the rule fires.
  """
  if value is None:
    return FIRED, "", None, [], []
  axes, loop_list, dropped, missing = [], [], [], []
  for res in value:
    if isinstance(res, SerialLoop):
      if loops:
        loop_list.append(res)
    elif loops and res in named_loops and res not in (mesh_sizes or ()):
      loop_list.append(res)
    elif mesh_sizes is None or res in mesh_sizes:
      (dropped if mesh_sizes is not None and mesh_sizes[res] == 1 else axes).append(res)
    else:
      missing.append(res)
  claimed = axes + dropped + missing
  if not claimed and not loop_list:
    return FIRED, "", None, [], []  # a loop-only rule on an array dim: replicated
  notes = [f"{a!r} has size 1, dropped" for a in dropped]
  notes += [f"{a!r} is not a mesh axis{did_you_mean(a, list(mesh_sizes or ()))}, dropped"
            for a in missing]
  clash = [a for a in claimed if a in used]
  if clash:
    return USED, f"{clash[0]!r} is used by dim {used[clash[0]]}", None, missing, []
  factor = math.prod(mesh_sizes[a] for a in axes) if mesh_sizes is not None else 1
  factor *= math.prod(named_loops[x] if isinstance(x, str) else x.length for x in loop_list)
  if dim.size is not None and dim.size % factor:
    return (INDIVISIBLE, f"size {dim.size}, needs a multiple of {factor}", None, missing,
            [])
  return FIRED, "; ".join(notes), tuple(axes) + tuple(loop_list), missing, claimed


def _strict_problems(pairs, dims, mesh_sizes) -> list[str]:
  known = [n for n, _ in pairs]
  out = []
  for d in dims:
    if not isinstance(d.logical, str) or not d.logical:
      continue
    if d.logical not in known:
      out.append(f"dim {d.index}: logical axis {d.logical!r} has no rule"
                 f"{did_you_mean(d.logical, known)}")
    elif not any(a.outcome == FIRED for a in d.attempts) and any(
        a.outcome == INDIVISIBLE for a in d.attempts):
      tried = "; ".join(a.detail for a in d.attempts if a.outcome == INDIVISIBLE)
      out.append(f"dim {d.index} {d.logical!r}: no rule divides it ({tried})")
  return out
