"""Names ``partition`` exported before, served for one release with a ``DeprecationWarning``.

Helpers meant only for the sibling packages moved to :mod:`partition.internal`;
``Annotated`` became :class:`partition.WithAxes` (it shadowed ``typing.Annotated``) and
``PipelinePlan`` :class:`partition.PipelineShape` (it is the static shape of a pipeline call,
not a plan).
"""

from __future__ import annotations

from partition import internal
from partition._base.deprecations import deprecated_getattr
from partition._base.logical_axes import WithAxes
from partition._training.pipeline import PipelineShape

_MOVED_TO_INTERNAL = {"did_you_mean": "did_you_mean", "format_message": "format_message",
                      "human_bytes": "human_bytes", "atomic_write": "atomic_write",
                      "path_str": "path_str", "axes_entry": "to_spec_entry",
                      "entry_axes": "entry_mesh_axes"}

module_getattr = deprecated_getattr("partition", {
    "Annotated": ("partition.WithAxes", lambda: WithAxes),
    "PipelinePlan": ("partition.PipelineShape", lambda: PipelineShape),
    **{old: (f"partition.internal.{new}", lambda new=new: getattr(internal, new))
       for old, new in _MOVED_TO_INTERNAL.items()},
})
