"""Step time of a sharded train step on a chip: a roofline over compute, HBM and the network.

The planner measures memory, FLOPs and collective bytes by compiling (or, for machines too
big to compile for here, estimates them, see :mod:`recipes.plan`); only the *time* is a model:

* a step is a forward phase and a backward phase (which also holds the optimizer update);
  FLOPs and HBM bytes split between them in proportion to their FLOPs (1 : 2, or 1 : 3 with
  full rematerialisation, which reruns the forward inside the backward);
* **overlap assumption**: inside a phase, compute, HBM traffic and the collectives of that
  phase overlap perfectly, so the phase takes the longest of the three; a collective cannot
  overlap the other phase (the gradient reduction only exists once the backward computes it,
  an FSDP all-gather of the forward is needed before the forward's matmuls). This is the
  Scaling Book's accounting ("Training at scale": data parallelism is compute-bound when the
  backward's matmuls outlast the gradient all-reduce, i.e. tokens per chip > C / W_ici);
* collectives on different mesh-axis groups run one after another within a phase (their
  times add); a collective over several axes uses all of their links at once (bandwidths
  add: the book's ``n_axes``); an axis that spans hosts (``--hosts``) runs at DCN speed, and
  a collective over ICI and DCN axes is hierarchical (ICI first, then DCN on 1/n_ICI of it);
  so is one over an axis that spans hosts with part of it inside each (:class:`AxisLink`).

Ring collectives: per device and per call, an all-reduce of ``S`` bytes over ``n`` devices
sends ``2 S (n-1)/n``, an all-gather or reduce-scatter (``S`` = the full array) ``S (n-1)/n``.

>>> round(wire_bytes('all-reduce', 800, 8))
1400
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from recipes.chips import Chip

PHASES = ("forward", "backward")


def wire_bytes(kind: str, full_bytes: float, n: int) -> float:
  """Bytes one device sends in a ring ``kind`` over ``n`` devices of a ``full_bytes`` array
  (for all-reduce: the array every device holds; gather/scatter: the full, unsharded one;
  permute: the array each device sends its neighbour, all of it)."""
  if n <= 1:
    return 0.0
  if kind == "permute":   # a ppermute sends its whole operand to one neighbour
    return full_bytes
  frac = (n - 1) / n
  return 2 * full_bytes * frac if kind == "all-reduce" else full_bytes * frac


@dataclasses.dataclass(frozen=True)
class AxisLink:
  """The bandwidth one device has along one mesh axis.

  An axis larger than the number of domains it spans is *hybrid* (MaxText's
  ``dcn_fsdp_parallelism=2`` x ``ici_fsdp_parallelism=64``: one ``fsdp`` axis of 128 over two
  slices): ``hosts`` of its factors cross the DCN at ``dcn_bandwidth``, the rest stay inside
  a domain at ``bandwidth``, and its collectives are hierarchical like a collective over an
  ICI axis and a DCN axis."""

  bandwidth: float   # bytes/s one device sends along the axis (a hybrid axis: its ICI part)
  dcn: bool          # the axis spans hosts / slices (data-centre network)
  hosts: int = 0     # a hybrid axis: the domains it spans (its DCN factor); 0: not hybrid
  dcn_bandwidth: float = 0.0   # a hybrid axis: its DCN factor's bytes/s per device


def axis_links(mesh: Mapping[str, int], chip: Chip, hosts: int = 1) -> dict[str, AxisLink]:
  """Per mesh axis: its bandwidth on ``chip`` when the machine is ``hosts`` high-bandwidth
  domains (TPU slices, GPU nodes) of ``N / hosts`` chips.

  The outermost axes (mesh order) span the hosts: an axis whose devices sit in different
  domains runs at DCN speed; one larger than the number of domains left to span, and a
  multiple of it, is hybrid (:class:`AxisLink`: that many domains across, the rest inside
  each); one larger but not a multiple stays all DCN. Inside a domain the torus dimensions
  are shared out: every ICI axis of size > 1 gets one, and the rest go to the largest axes
  (so pure FSDP on a 3-D v5p slice gets 3 links, FSDP + TP gets 2 + 1, as the Scaling Book
  assumes).

  >>> from recipes.chips import get_chip
  >>> links = axis_links({'data': 2, 'fsdp': 64, 'tensor': 4}, get_chip('v5p'), hosts=2)
  >>> links['data'].dcn, links['fsdp'].bandwidth / 1.8e11, links['tensor'].bandwidth / 1.8e11
  (True, 2.0, 1.0)
  """
  links: dict[str, AxisLink] = {}
  span = max(1, hosts)
  ici, hybrid = [], {}
  for name, size in mesh.items():
    if span > 1 and size > 1:
      if size > span and size % span == 0:   # part of it inside each domain
        hybrid[name] = span
        ici.append(name)
        span = 1
      else:
        links[name] = AxisLink(chip.dcn_bandwidth, True)
        span = max(1, span // size)
    else:
      ici.append(name)
  inner = {a: mesh[a] // hybrid.get(a, 1) for a in ici}
  busy = sorted((a for a in ici if inner[a] > 1), key=lambda a: -inner[a])
  dims = dict.fromkeys(ici, 1)
  for i in range(max(0, chip.torus_dims - len(busy))):
    if busy:
      dims[busy[i % len(busy)]] += 1
  for name in ici:
    bandwidth = chip.ici_bandwidth * dims[name]
    links[name] = (AxisLink(bandwidth, True, hybrid[name], chip.dcn_bandwidth)
                   if name in hybrid else AxisLink(bandwidth, False))
  return {name: links[name] for name in mesh}


def collective_seconds(axes: tuple[str, ...], kind: str, full_bytes: float,
                       mesh: Mapping[str, int], links: Mapping[str, AxisLink]) -> float:
  """Seconds for one ``kind`` collective of ``full_bytes`` over the mesh axes ``axes``."""
  n_ici, n_dcn, ici_bandwidth, dcn_bandwidth = 1, 1, 0.0, []
  for a in axes:
    link, n = links[a], mesh[a]
    if link.hosts:                       # hybrid: its inner factor on ICI, the rest on DCN
      n_ici, n_dcn = n_ici * (n // link.hosts), n_dcn * link.hosts
      ici_bandwidth += link.bandwidth
      dcn_bandwidth.append(link.dcn_bandwidth)
    elif link.dcn:
      n_dcn *= n
      dcn_bandwidth.append(link.bandwidth)
    else:
      n_ici *= n
      ici_bandwidth += link.bandwidth
  t = 0.0
  if n_ici > 1:
    t += wire_bytes(kind, full_bytes, n_ici) / ici_bandwidth
  if n_dcn > 1:
    t += wire_bytes(kind, full_bytes / n_ici, n_dcn) / min(dcn_bandwidth)
  return t


def wire_seconds(axes: tuple[str, ...], wire: float, mesh: Mapping[str, int],
                 links: Mapping[str, AxisLink]) -> float:
  """Seconds to send ``wire`` bytes (already ring bytes per device, as measured from a
  compile, whose array size is not kept) over the group ``axes``: the ring collective that
  sends them (``S (n-1)/n`` for an ``S``-byte array over the group's ``n`` devices), run
  hierarchically as :func:`collective_seconds` runs it, ICI first, then DCN on ``1/n_ICI``."""
  n = math.prod(mesh[a] for a in axes)
  if not axes or wire <= 0 or n <= 1:
    return 0.0
  return collective_seconds(axes, "all-gather", wire * n / (n - 1), mesh, links)


@dataclasses.dataclass(frozen=True)
class StepTime:
  """The predicted time of one step.

  Attributes:
    compute_s, memory_s, comm_s: per phase (``forward``, ``backward``) seconds: the compute
      (calibrated: every op class of :mod:`recipes.cost_model`; bound: FLOPs at peak), the
      HBM bound, and the collectives.
    comm_by_axes: per phase, per mesh-axis group (``'data,fsdp'``), seconds.
    step_s: the predicted step (calibrated when ``terms`` were given, else the bound).
    bound: what limits the step: ``'compute'`` (matmuls and attention), ``'HBM'`` (the
      memory-bound ops; ``'memory'`` in the bare roofline), ``'overhead'`` (per-op
      latency) or ``'communication'`` (some phase's collectives outlast its compute).
    bound_axes: for communication, the axis group taking longest in the worst phase.
    mfu: model FLOPs / (devices x peak x step time).
    terms: per phase, seconds per op class (``{}`` for the bare roofline).
    roofline_s: the bare roofline (datasheet peaks, perfect overlap): a lower bound.
    band: the relative uncertainty of ``step_s`` (the chip's calibration band; 0 for the
      bare roofline, which is a bound, not a prediction).
  """

  compute_s: dict[str, float]
  memory_s: dict[str, float]
  comm_s: dict[str, float]
  comm_by_axes: dict[str, dict[str, float]]
  step_s: float
  bound: str
  bound_axes: str
  mfu: float
  terms: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
  roofline_s: float = 0.0
  band: float = 0.0

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


def step_time(*, flops: Mapping[str, float], hbm_bytes: Mapping[str, float],
              comm_s: Mapping[str, Mapping[str, float]], chip: Chip, model_flops: float,
              devices: int, terms: Mapping[str, Mapping[str, float]] | None = None,
              dcn_axes: frozenset[str] | set[str] = frozenset(),
              serial_axes: frozenset[str] | set[str] | tuple = frozenset()) -> StepTime:
  """The step time from per-device, per-phase figures.

  Without ``terms``: the bare roofline (each phase the longest of FLOPs at peak, HBM
  bytes at full bandwidth and its collectives). With ``terms`` (seconds per op class,
  :func:`recipes.cost_model.step_terms`): the calibrated prediction, in which a phase's
  op classes run one after another (their sum is its compute), the FSDP and data-parallel
  collectives over ICI / NVLink axes overlap that compute (asynchronous collectives, XLA's
  latency-hiding scheduler: a layer's weights are gathered while the previous layer
  computes), and two kinds do not and are added: those over an axis in ``dcn_axes`` (the
  gradient all-reduce across nodes or slices waits for the backward; MaxText's A3 rows
  drop 14-24 % from one node to several) and those over ``serial_axes`` (a tensor-parallel
  all-reduce sits between two matmuls that need its result). A pipeline's bubble is in the
  ``terms`` already, on the block stack alone (:func:`recipes.cost_model.step_terms`: the
  head, the loss and the optimizer update run once, outside the stage loop), and the
  collectives are counted as the schedule runs them (a stage hand-off per iteration).
  ``Estimate.bubble`` records the factor.

  Args:
    flops: per phase, FLOPs one device executes.
    hbm_bytes: per phase, HBM bytes one device reads and writes.
    comm_s: per phase, per axis group, collective seconds (:func:`collective_seconds`).
    chip: the chip.
    model_flops: the step's useful FLOPs over all devices, for MFU.
    devices: number of chips.
    terms: per phase, per op class, seconds (calibrated model) or ``None``.
    dcn_axes: mesh axes that span hosts (their collectives are not hidden).
    serial_axes: mesh axes whose collectives are on the critical path (not hidden).

  >>> from recipes.chips import get_chip
  >>> t = step_time(flops={'forward': 1e12, 'backward': 2e12},
  ...               hbm_bytes={'forward': 0, 'backward': 0},
  ...               comm_s={'forward': {}, 'backward': {'data': 0.01}},
  ...               chip=get_chip('v5p'), model_flops=3e12 * 4, devices=4)
  >>> t.bound, t.bound_axes, round(t.step_s * 1e3, 3)   # 2.179 ms + 10 ms
  ('communication', 'data', 12.179)
  """
  peak = {p: flops.get(p, 0.0) / chip.bf16_flops for p in PHASES}
  memory = {p: hbm_bytes.get(p, 0.0) / chip.hbm_bandwidth for p in PHASES}
  by_axes = {p: {k: float(v) for k, v in comm_s.get(p, {}).items() if v > 0} for p in PHASES}
  comm = {p: sum(by_axes[p].values()) for p in PHASES}
  roof = sum(max(peak[p], memory[p], comm[p]) for p in PHASES)
  if terms is None:
    compute, step, band = peak, roof, 0.0
  else:
    compute = {p: sum(terms.get(p, {}).values()) for p in PHASES}
    frac = chip.cal.serial_exposed if chip.cal else 1.0
    exposed = {p: sum(v if set(k.split(",")) & set(dcn_axes) else
                      frac * v if set(k.split(",")) & set(serial_axes) else 0.0
                      for k, v in by_axes[p].items()) for p in PHASES}
    hidden = {p: comm[p] - exposed[p] for p in PHASES}
    step = sum(max(compute[p], hidden[p]) + exposed[p] for p in PHASES)
    band = chip.cal.band if chip.cal else 0.0
  bound, axes, worst = "compute", "", 0.0
  for p in PHASES:
    busy = compute[p] if terms is not None else max(compute[p], memory[p])
    if comm[p] > busy and comm[p] - compute[p] > worst:
      worst = comm[p] - compute[p]
      bound, axes = "communication", max(by_axes[p], key=by_axes[p].get)
  if bound == "compute":
    if terms is not None:
      from recipes.cost_model import bound_of
      total = {n: sum(terms.get(p, {}).get(n, 0.0) for p in PHASES)
               for p0 in PHASES for n in terms.get(p0, {})}
      bound = bound_of(total)
    elif any(memory[p] > compute[p] for p in PHASES):
      bound = "memory"
  mfu = model_flops / (devices * chip.bf16_flops * step) if step > 0 else 0.0
  return StepTime(compute, memory, comm, by_axes, step, bound, axes, mfu,
                  {p: dict(terms.get(p, {})) for p in PHASES} if terms is not None else {},
                  roof, band)
