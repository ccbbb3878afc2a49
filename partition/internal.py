"""Helpers for the packages built on ``partition`` in this repository (``layers``,
``recipes``, ``benchmarks``): one message layout, one way to write files, one spelling of
spec entries. Not part of the user-facing API: no deprecation period when they change.
"""

from partition._base.deprecations import deprecated_getattr as deprecated_getattr
from partition._base.errors import did_you_mean as did_you_mean
from partition._base.errors import format_message as format_message
from partition._base.extras import MissingExtraError as MissingExtraError
from partition._base.extras import needs_extra as needs_extra
from partition._base.io import atomic_write as atomic_write
from partition._base.logical_axes import path_str as path_str
from partition._base.mesh import entry_mesh_axes as entry_mesh_axes
from partition._base.mesh import to_spec_entry as to_spec_entry
from partition._params.audit import audit_placement as audit_placement
from partition._rules.explain import human_bytes as human_bytes
