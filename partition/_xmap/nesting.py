"""What enclosing xmaps have bound while a nested one is traced.

Loop-mapped axes are bound under private names, so ``lax.axis_size`` cannot see them; this
module records the axes, mesh axes and mesh of every xmap being traced, for the checks a
nested xmap makes (no shadowed names, no reused mesh axes) and its default mesh.
"""

from __future__ import annotations

import threading

import jax

from partition._base.errors import AxisNameError, ResourceError, format_message
from partition._rules import scope as _scope
from partition._xmap.layout import MapLayout


class _Enclosing(threading.local):
  """What the xmaps being traced around the current one have bound (per thread)."""

  def __init__(self):
    self.axes: tuple[str, ...] = ()
    self.mesh_axes: dict[str, str] = {}  # mesh axis -> the enclosing named axis on it
    self.mesh = None  # the enclosing xmap's mesh: nested xmaps default to it


enclosing = _Enclosing()


class tracing:
  """Records the axes of the xmap being traced, for the shadowing check of nested xmaps
  (loop-mapped axes are bound under private names, so lax.axis_size cannot see them)."""

  def __init__(self, layout: MapLayout):
    self.axes = tuple(layout.axes)
    self.mesh_axes = {m: n for n, ax in layout.axes.items() for m in ax.mesh_axes}
    self.mesh = layout.mesh

  def __enter__(self):
    self.saved = (enclosing.axes, enclosing.mesh_axes, enclosing.mesh)
    enclosing.axes = self.saved[0] + self.axes
    enclosing.mesh_axes = {**self.saved[1], **self.mesh_axes}
    enclosing.mesh = self.mesh or self.saved[2]
    # Constraints in the body (partition.constrain, flax's nn.with_logical_constraint)
    # drop the mesh axes this body maps: JAX rejects them there, and xmap places that dim.
    self.mapping = _scope.mapping(frozenset(self.mesh_axes))
    self.mapping.__enter__()

  def __exit__(self, *exc):
    self.mapping.__exit__(*exc)
    enclosing.axes, enclosing.mesh_axes, enclosing.mesh = self.saved


def check_not_shadowing(layout: MapLayout, name: str) -> None:
  bound = []
  for axis in layout.axes:
    if axis in enclosing.axes:
      bound.append(axis)
      continue
    try:
      jax.lax.axis_size(axis)
    except NameError:
      continue
    bound.append(axis)
  if bound:
    raise AxisNameError(format_message(
        f"xmap({name}): axis names {bound} are already bound by an enclosing xmap/vmap.",
        context=["Collectives over them would be ambiguous (the inner name would shadow the "
                 "outer one)."],
        fix="Rename the inner axes."))
  clashes = [f"axis {axis!r} is placed on mesh axis {m!r}, which the enclosing xmap uses for "
             f"its axis {enclosing.mesh_axes[m]!r}"
             for axis, ax in layout.axes.items() for m in ax.mesh_axes if m in enclosing.mesh_axes]
  if clashes:
    raise ResourceError(format_message(
        f"xmap({name}): a nested xmap reuses mesh axes of the enclosing one.", bullets=clashes,
        context=["Inside the outer map every device already holds one slice along those mesh "
                 "axes; they cannot split another axis too."],
        fix="Place the inner axes on other mesh axes, on a SerialLoop, or on no resources."))


