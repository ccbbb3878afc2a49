"""JAX's own errors from inside an xmapped function, said in xmap's terms.

A collective over an axis no xmap binds, a collective over a serial-loop axis, a sharding
constraint on a mesh axis the xmap maps, an Explicit-sharded closure: JAX reports these deep
in its tracing with its own names; these errors name the axis, the xmap and the fix.
"""

from __future__ import annotations

import contextlib
import re
import traceback
from collections.abc import Iterator, Sequence

from partition._base import mesh as _mesh
from partition._base.errors import (
  AxisNameError,
  LoopCollectiveError,
  MeshError,
  ResourceError,
  did_you_mean,
  format_message,
)
from partition._xmap.layout import MapLayout
from partition._xmap.nesting import enclosing


@contextlib.contextmanager
def in_xmap_terms(layout: MapLayout, name: str, defined: Sequence[str]) -> Iterator[None]:
  """Re-raises the JAX errors a user's function can cause while traced as xmap errors."""
  try:
    yield
  except NameError as e:
    raise unbound_name_error(e, layout, name, defined) from None
  except ValueError as e:
    if "cannot appear in with_sharding_constraint" not in str(e):
      raise
    raise mapped_axis_constraint_error(e, layout, name) from e
  except AssertionError as e:
    error = collective_assertion(e, name)
    if error is e:
      raise
    raise error from e


def mapped_axis_constraint_error(e: ValueError, layout: MapLayout, name: str) -> ResourceError:
  """A constraint in the body names a mesh axis this xmap maps (a hard-coded
  ``PartitionSpec``; logical constraints drop such axes by themselves)."""
  text = str(e).splitlines()[0]
  spec = re.search(r"got spec (P\(.*\))", text)
  axes = re.search(r"spmd_axis_name (\(.*?\))", text)
  mapped = ", ".join(f"{m!r} (axis {n!r})" for n, ax in layout.axes.items() for m in ax.mesh_axes)
  return ResourceError(format_message(
      f"xmap({name}): a sharding constraint in the function names mesh axes "
      f"{axes.group(1) if axes else ''} that this xmap maps its named axes to.",
      context=[f"constraint: with_sharding_constraint(x, {spec.group(1) if spec else '?'})",
               f"mapped mesh axes: {mapped}",
               "Inside the body each call sees one slice of those axes; the constraint cannot "
               "place a dim on them."],
      fix="Constrain by logical name (partition.constrain or nn.with_logical_constraint: "
          "mapped mesh axes are dropped there), drop those axes from the PartitionSpec, or "
          "train with partition.value_and_grad, which splits the batch by rules instead of "
          "a named xmap axis."))


def explicit_closure_error(name: str, mesh) -> MeshError:
  return MeshError(format_message(
      f"xmap({name}): the function uses a value with Explicit sharding on "
      f"{_mesh.describe(mesh)} that is not one of its arguments (a closure over an array or "
      "tracer from outside).",
      context=["On meshes with Explicit axes, xmap runs its body with those axes Auto (as "
               "jax.sharding.auto_axes does), and JAX rejects mixing the two."],
      fix="Pass the value to the xmapped function as an argument (in_axes [...] if it has no "
          "named dims), or use an Auto mesh."))


_UNBOUND = re.compile(r"unbound axis name: (.+?)(?:\. |\.?$)", re.M)


def unbound_name_error(e: NameError, layout: MapLayout, name: str, defined: Sequence[str]
                        ) -> Exception:
  match = _UNBOUND.search(str(e))
  if match is None:
    return e
  axis = match.group(1)
  if axis in layout.loop_axes:
    return loop_collective_error(axis, layout, name)
  hint = did_you_mean(axis, list(defined) + list(enclosing.axes))
  return AxisNameError(format_message(
      f"xmap({name}): a collective (psum, pmean, all_gather, axis_index, ...) refers to axis "
      f"{axis!r}, which no enclosing xmap or vmap binds{hint}.",
      context=[f"axes of this xmap: {list(defined)}"]
              + ([f"axes of enclosing xmaps: {list(enclosing.axes)}"] if enclosing.axes
                 else []),
      fix="Use one of those names, or add the axis to in_axes / axis_sizes."))


def collective_assertion(e: AssertionError, name: str) -> Exception:
  """JAX's vmap rule of ppermute asserts on several axes at once; say what to do instead."""
  frames = [f.name for f in traceback.extract_tb(e.__traceback__)]
  if not any("ppermute" in f for f in frames):
    return e
  return AxisNameError(format_message(
      f"xmap({name}): lax.ppermute over several named axes at once is not supported.",
      context=["Named axes are vectorised (jax.vmap), whose ppermute rule handles one axis."],
      fix="Call ppermute once per axis, with the permutation of that axis; or all_gather "
          "over one axis and index."))


def loop_collective_error(axis: str, layout: MapLayout, name: str) -> Exception:
  return LoopCollectiveError(format_message(
      f"xmap({name}): a collective (psum, axis_index, all_gather, ...) refers to axis "
      f"{axis!r}, which is mapped to a serial loop {layout.axes[axis].resources_repr()}.",
      context=["Loop iterations run one after another, so there is no axis to communicate "
               "over inside the function."],
      fix=f"Reduce over it in out_axes instead, e.g. out_axes=partition.Sum({axis!r}) or "
          f"partition.Mean({axis!r}); or map {axis!r} to mesh axes / no resources."))
