"""Reading the logical axes that a model declares on its parameters.

Every framework keeps a parameter's logical axes in its own place:

* Flax linen wraps the value in a box: ``nn.LogicallyPartitioned`` (from
  ``nn.with_logical_partitioning``, logical names) or ``nn.Partitioned`` (from
  ``nn.with_partitioning``, *mesh-axis* names, read as a ``PartitionSpec``). T5X /
  flaxformer models declare axes with ``param_with_axes``, which stores an ``AxisMetadata``
  per parameter in a sibling collection (``params_axes/.../kernel_axes``).
* Flax NNX keeps them in the Variable's metadata under ``out_sharding`` (older code uses the
  deprecated aliases ``sharding`` and ``sharding_names``).
* Haiku has no place at all; this project annotates Haiku params (and any other pytree) by
  wrapping leaves in an :class:`WithAxes` box (see ``partition.haiku`` and
  :class:`partition.PathRules`).

:func:`logical_axes` reads all of these and returns one tree in the shape of the input with
a logical-axes tuple per parameter (``None`` for unannotated ones, a ``PartitionSpec`` for
mesh axes given directly) — the tree that ``AxisRules.tree_shardings`` turns into
``jit(out_shardings=...)``. As in flax, a tuple shorter than the parameter's rank is a
prefix: the trailing dims are replicated (the tuple is padded with ``None``).

>>> import jax.numpy as jnp
>>> import partition
>>> params = {'w': partition.WithAxes(jnp.zeros((4, 8)), ('embed', 'mlp')),
...           'b': jnp.zeros(8)}
>>> partition.logical_axes(params)
{'b': None, 'w': ('embed', 'mlp')}
>>> partition.unbox(params)['w'].shape
(4, 8)

Flax is never imported here: a tree can only hold flax objects if flax is already imported.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

from partition._base.errors import PartitionError, format_message

_DEPRECATED_NNX_KEYS = ("sharding_names", "sharding")


class LogicalAxesError(PartitionError, ValueError):
  """Declared logical axes do not fit the parameter they annotate."""


class LogicalAxesTypeError(LogicalAxesError, TypeError):
  """Logical axes of the wrong Python type (e.g. a ``str`` instead of a tuple of names)."""


def check_names(names: Any, where: str) -> tuple:
  """``names`` as a tuple of ``str | None``; a ``str`` is never split into letters.

  Raises:
    LogicalAxesTypeError: naming ``where``, the bad value and the fix.
  """
  if isinstance(names, str):
    raise LogicalAxesTypeError(
        f"{where}: logical axes must be a sequence of names, got the str {names!r}. Write "
        f"({names!r},) for one dim (a str would be split into the letters "
        f"{tuple(names)!r}).")
  if not isinstance(names, (tuple, list)) or not all(
      n is None or isinstance(n, str) for n in names):
    raise LogicalAxesTypeError(
        f"{where}: logical axes must be a tuple of names (str or None), got {names!r}. "
        "Write e.g. ('embed', 'mlp') or (None, 'mlp').")
  return tuple(names)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WithAxes:
  """A pytree box that attaches logical axes to one parameter (framework-free).

  The value is the box's only child, so ``jax.tree.map``, ``jax.jit`` and ``eval_shape``
  see through it, like flax's ``nn.Partitioned``. ``names`` has one entry per dim.

  Args:
    value: an array, a ``jax.ShapeDtypeStruct``, or anything with a ``shape``.
    names: one logical name (or ``None``) per dim of ``value``; a shorter tuple is a prefix
      (trailing dims replicated), as in flax. A ``str`` is an error: write ``('embed',)``.

  Raises:
    LogicalAxesTypeError: if ``names`` is a ``str`` or not a tuple of ``str | None``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import partition
    >>> box = partition.WithAxes(jnp.ones((2, 3)), ('embed', None))
    >>> box
    WithAxes(f32[2,3], names=('embed', None))
    >>> jax.tree.map(lambda x: x * 2, box).names
    ('embed', None)
  """

  value: Any
  names: tuple[str | None, ...] = dataclasses.field(metadata=dict(static=True))

  def __post_init__(self):
    object.__setattr__(self, "names", check_names(self.names, "WithAxes(names=...)"))

  def __repr__(self) -> str:
    return f"WithAxes({_short(self.value)}, names={self.names!r})"


def _short(value: Any) -> str:
  shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
  if shape is None or dtype is None:
    return repr(value)
  return dtype_shape(dtype, shape)


def dtype_shape(dtype: Any, shape: Sequence[int]) -> str:
  if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    return f"{dtype}[{','.join(map(str, shape))}]"
  d = np.dtype(dtype)
  kind = {"f": "f", "i": "s", "u": "u", "b": "pred", "c": "c"}.get(d.kind, d.kind)
  name = "pred" if kind == "pred" else f"{kind}{d.itemsize * 8}"
  return f"{name}[{','.join(map(str, shape))}]"


# -- recognising framework leaves -------------------------------------------------------------


def _flax_meta():
  return sys.modules.get("flax.core.meta")


def _nnx_variablelib():
  return sys.modules.get("flax.nnx.variablelib")


def _is_mesh_box(x: Any) -> bool:
  """A linen ``nn.Partitioned`` box, whose names are mesh axes (not logical names)."""
  meta, spmd = _flax_meta(), sys.modules.get("flax.linen.spmd")
  return (meta is not None and isinstance(x, meta.Partitioned)
          and not (spmd is not None and isinstance(x, spmd.LogicallyPartitioned)))


def _is_t5x_axes(x: Any) -> bool:
  """An ``AxisMetadata`` entry of T5X's ``params_axes`` collection (``param_with_axes``)."""
  lib = sys.modules.get("flax.linen.partitioning")
  return lib is not None and isinstance(x, lib.AxisMetadata)


def _is_flax_box(x: Any) -> bool:
  meta = _flax_meta()
  return meta is not None and isinstance(x, meta.AxisMetadata)


def _is_nnx_variable(x: Any) -> bool:
  lib = _nnx_variablelib()
  return lib is not None and isinstance(x, lib.Variable)


def _is_nnx_graph(x: Any) -> bool:
  """An NNX Module (or other graph node) that should be read through ``nnx.state``."""
  nnx = sys.modules.get("flax.nnx")
  return nnx is not None and isinstance(x, nnx.Module)


def is_param_leaf(x: Any) -> bool:
  """True for a box/Variable that holds one parameter (stop here when walking a tree)."""
  return isinstance(x, WithAxes) or _is_flax_box(x) or _is_nnx_variable(x)


def param_value(x: Any) -> Any:
  """The array (or ShapeDtypeStruct) inside a box / Variable; other leaves unchanged."""
  if isinstance(x, WithAxes):
    return x.value
  if _is_flax_box(x):
    return x.unbox(apply_constraint=False) if hasattr(x, "unbox") else x.value
  if _is_nnx_variable(x):
    return x.get_value()
  return x


def nnx_axes(variable: Any) -> tuple | None:
  """An NNX Variable's logical axes, read from metadata without deprecation warnings."""
  metadata = variable.get_metadata()  # a plain dict: reading keys never warns
  for key in ("out_sharding", *_DEPRECATED_NNX_KEYS):
    names = metadata.get(key)
    if names:
      names = _as_names(names, f"the Variable's {key!r} metadata")
      own_rules = metadata.get("sharding_rules")
      return _own_rules_spec(names, own_rules) if own_rules else names
  return None


def _own_rules_spec(names: tuple, own_rules: Any) -> PartitionSpec:
  """A Variable with its own ``sharding_rules`` (flax applies those, not the context's):
  its mesh axes, resolved now as ``flax.linen.logical_to_mesh_axes`` would."""
  from partition._rules.table import AxisRules

  try:
    return AxisRules(own_rules).spec(names)
  except PartitionError as e:
    raise LogicalAxesError(f"the Variable's 'sharding_rules' metadata: {e}") from None


def _as_names(names: Any, where: str = "the logical axes metadata") -> tuple | None:
  if names is None:
    return None
  if isinstance(names, jax.sharding.NamedSharding):
    names = names.spec
  if isinstance(names, (tuple, list, PartitionSpec)):
    for i, entry in enumerate(names):
      if isinstance(entry, (tuple, list)) and all(isinstance(n, str) for n in entry):
        raise LogicalAxesTypeError(
            f"{where}: dim {i} is {tuple(entry)!r}, several names for one dim. Each dim "
            "takes one logical name, and the rules map it to mesh axes: give it a name, e.g. "
            f"'{'_'.join(entry)}', and the rule ('{'_'.join(entry)}', {tuple(entry)!r}).")
  if isinstance(names, PartitionSpec):
    return tuple(names)
  return check_names(names, where)


def leaf_axes(x: Any) -> tuple | None:
  """Logical axes of one leaf (box, Variable or plain array); ``None`` if unannotated."""
  if isinstance(x, WithAxes):
    return x.names
  if _is_mesh_box(x):
    return PartitionSpec(*x.names)
  if _is_flax_box(x):
    return _as_names(getattr(x, "names", None))
  if _is_nnx_variable(x):
    return nnx_axes(x)
  return None


def path_str(path: tuple) -> str:
  """A key path as ``a/b/0/c``: the one path format of patterns, reports and errors.

  >>> import jax
  >>> [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path({'a': [{'b': 1}]})[0]]
  ['a/0/b']
  """
  parts = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return "/".join(parts)


def _t5x_tables(tree: Any) -> dict[str, dict[str, tuple]]:
  """``{collection: {path inside it: names}}`` from T5X ``<collection>_axes`` collections."""
  if not isinstance(tree, Mapping):
    return {}
  out: dict[str, dict[str, tuple]] = {}
  for key, sub in tree.items():
    base = key[:-len("_axes")] if isinstance(key, str) and key.endswith("_axes") else None
    if base is None or base not in tree:
      continue
    flat = jax.tree_util.tree_flatten_with_path(sub, is_leaf=_is_t5x_axes)[0]
    table = {}
    for path, meta in flat:
      name = path_str(path)
      if _is_t5x_axes(meta) and name.endswith("_axes"):
        table[name[:-len("_axes")]] = _as_names(meta.names)
    out[base] = table
  return out


def _t5x_lookup(tables: Mapping[str, Mapping[str, tuple]], path: tuple) -> tuple | None:
  if not tables or not path:
    return None
  name = path_str(path)
  collection, _, rest = name.partition("/")
  return tables.get(collection, {}).get(rest)


def declared_axes(leaf: Any, path: tuple, t5x_tables: Mapping[str, Mapping[str, tuple]]
                  ) -> tuple | None:
  """A parameter's own logical axes: its box / Variable metadata, else T5X's ``params_axes``
  entry for its path (``t5x_tables`` from :func:`_t5x_tables` of the whole tree)."""
  try:
    axes = leaf_axes(leaf)
  except LogicalAxesError as e:
    raise type(e)(f"{path_str(path) or '<root>'}: {e}") from None
  return _t5x_lookup(t5x_tables, path) if axes is None else axes


def fit_rank(axes: Any, leaf: Any) -> tuple[Any, tuple[int, ...] | None]:
  """``(axes padded to the rank, None)``, or ``(axes, shape)`` if ``axes`` is too long.

  Shorter tuples are a prefix, as in flax: trailing dims get ``None`` (replicated).
  """
  shape = getattr(param_value(leaf), "shape", None)
  if axes is None or shape is None:
    return axes, None
  if len(axes) > len(shape):
    return axes, tuple(shape)
  if isinstance(axes, PartitionSpec):
    return axes, None
  return tuple(axes) + (None,) * (len(shape) - len(axes)), None


# -- public API --------------------------------------------------------------------------------


def _graph_state(tree: Any) -> Any:
  if _is_nnx_graph(tree):
    from flax import nnx

    return nnx.state(tree)
  return tree


def logical_axes(tree: Any) -> Any:
  """The logical axes of every parameter in ``tree``, as a matching pytree.

  Reads linen boxes (``nn.LogicallyPartitioned``; ``nn.Partitioned``, whose mesh-axis
  names become a ``PartitionSpec``), T5X ``param_with_axes`` metadata (the ``params_axes``
  collection, for parameters without a box), NNX Variables (``out_sharding`` metadata, or
  the deprecated ``sharding`` / ``sharding_names``, read without warnings), NNX Modules
  (through ``nnx.state``) and :class:`WithAxes` boxes. Each box / Variable becomes a tuple
  of names padded with ``None`` to the parameter's rank (a short tuple is a prefix, as in
  flax); unannotated leaves become ``None`` (replicated by ``AxisRules.tree_specs``).

  Args:
    tree: linen variables, an NNX Module / ``nnx.State`` / Variable, Haiku params annotated
      by this project, or any pytree mixing these.

  Returns:
    A pytree with the structure of ``tree`` (of ``nnx.state(tree)`` for an NNX Module) whose
    leaves are logical-axes tuples, ``PartitionSpec``s (mesh axes given directly) or
    ``None``.

  Raises:
    LogicalAxesError: if a declared tuple names more dims than its parameter has; the
      message names every offending path (``a/b/c``).

  Example:
    >>> import jax, flax.linen as nn
    >>> import partition
    >>> dense = nn.Dense(3, kernel_init=nn.with_logical_partitioning(
    ...     nn.initializers.lecun_normal(), ('embed', 'mlp')))
    >>> variables = jax.eval_shape(dense.init, jax.random.key(0), jax.numpy.ones((1, 2)))
    >>> partition.logical_axes(variables)
    {'params': {'bias': None, 'kernel': ('embed', 'mlp')}}
  """
  tree = _graph_state(tree)
  tables = _t5x_tables(tree)
  problems: list[str] = []
  stacked: list[str] = []

  def one(path, leaf):
    declared = declared_axes(leaf, path, tables)
    axes, shape = fit_rank(declared, leaf)
    if shape is not None:
      problems.append(f"{path_str(path) or '<root>'}: logical axes {tuple(axes)} name "
                      f"{len(axes)} dims but the parameter has shape {shape}")
    elif _is_nnx_variable(leaf) and declared is not None and len(declared) < len(axes):
      stacked.append(f"{path_str(path) or '<root>'} {dtype_shape(leaf.dtype, leaf.shape)}: "
                     f"{tuple(declared)} read as {tuple(axes)}")
    return axes

  out = jax.tree_util.tree_map_with_path(one, tree, is_leaf=is_param_leaf)
  if stacked:
    _warn_short_nnx_axes(stacked)
  if problems:
    raise LogicalAxesError(format_message(
        f"logical_axes: {len(problems)} parameter(s) declare more logical axes than dims:",
        bullets=problems,
        fix="Give at most one logical name (or None) per dim of each parameter, e.g. "
            "('embed', 'mlp') for a 2-D kernel; a shorter tuple leaves the trailing dims "
            "replicated."))
  return out


def _warn_short_nnx_axes(stacked: list[str]) -> None:
  """NNX keeps a Variable's axes as declared when ``nnx.vmap`` / ``nnx.scan`` stack it without
  ``transform_metadata``: the names then sit on the leading dims, the layer dim included."""
  from partition._rules.fallbacks import PartitionWarning

  warnings.warn(format_message(
      f"logical_axes: {len(stacked)} NNX Variable(s) declare fewer logical axes than dims; "
      "the names are read as the leading dims', the rest replicated:",
      bullets=stacked,
      fix="If nnx.vmap / nnx.scan stacked them (a layer stack), pass it transform_metadata="
          "{nnx.PARTITION_NAME: 'layers'} (or None for an unnamed dim) so the names follow the "
          "per-layer dims; otherwise give one name (or None) per dim."),
      PartitionWarning, stacklevel=3)


def unbox(tree: Any) -> Any:
  """Replaces every box / Variable in ``tree`` by the array it holds.

  Args:
    tree: a pytree with :class:`WithAxes` boxes, linen boxes or NNX Variables.

  Returns:
    The same structure with plain arrays (or ``ShapeDtypeStruct``s) at the leaves.
  """
  return jax.tree.map(param_value, _graph_state(tree), is_leaf=is_param_leaf)


def abstract(tree: Any, shardings: Any = None) -> Any:
  """``ShapeDtypeStruct``s for the arrays of ``tree``, with ``shardings`` if given.

  ``shardings`` is a tree of ``NamedSharding`` (or ``None``) that is a prefix of the
  unboxed ``tree``; the boxes of ``tree`` are kept, so the result can serve as a
  checkpoint-restore target.
  """
  if shardings is None:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)

  def with_sharding(leaf, sharding):
    def sds(x):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    return jax.tree.map(sds, leaf)

  return jax.tree.map(with_sharding, tree, shardings, is_leaf=is_param_leaf)
