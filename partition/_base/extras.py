"""Optional dependencies: one message for a module whose pip extra is not installed.

``import partition`` needs only jax, numpy and PyYAML. The adapters and the packages built
on the core need more, grouped in pip extras (``pyproject.toml``): ``[flax]`` for
``partition.flax``, ``partition.nnx``, ``layers.linen``, ``layers.nnx``; ``[haiku]`` for
``partition.haiku``, ``layers.haiku``; ``[recipes]`` for the training jobs and benchmarks;
``[all]`` for everything. Such a module wraps its third-party imports in
:func:`needs_extra`, so a missing package is reported with the command that installs it
instead of a bare ``ModuleNotFoundError``:

>>> try:
...   with needs_extra("flax", by="partition.flax"):
...     import flax_xyz
... except ImportError as err:
...   print(err)
partition.flax needs flax_xyz, which is not installed: pip install 'named-partition[flax]'
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

# The distribution to install when the import name differs from it.
_DISTRIBUTIONS = {
    "haiku": "dm-haiku",
    "orbax": "orbax-checkpoint",
    "yaml": "PyYAML",
}


class MissingExtraError(ImportError):
  """A module of a pip extra was imported without the extra installed.

  An ``ImportError`` (and not a ``ModuleNotFoundError``) so that code testing for an optional
  module with ``except ImportError`` keeps working; ``name`` is the missing module.
  """


def missing_extra_message(missing: str, *, extra: str, by: str) -> str:
  """The message for module ``by`` failing to import ``missing`` (a dotted module name).

  >>> print(missing_extra_message("haiku", extra="haiku", by="layers.haiku"))
  layers.haiku needs dm-haiku, which is not installed: pip install 'named-partition[haiku]'
  """
  top = missing.split(".")[0]
  package = _DISTRIBUTIONS.get(top, top)
  return (f"{by} needs {package}, which is not installed: "
          f"pip install 'named-partition[{extra}]'")


@contextlib.contextmanager
def needs_extra(extra: str, *, by: str) -> Iterator[None]:
  """Turns a ``ModuleNotFoundError`` raised by the imports in the block into an
  ``ImportError`` naming the missing package and ``pip install 'named-partition[extra]'``.

  Args:
    extra: the pip extra of ``named-partition`` that installs the block's imports.
    by: the module doing the imports (its ``__name__``), named in the message.

  Example (at the top of ``layers/linen.py``)::

    with needs_extra("flax", by=__name__):
      import flax.linen as nn
  """
  try:
    yield
  except ModuleNotFoundError as err:
    # err.name is None only for a hand-made error; keep that one as it is.
    if err.name is None:
      raise
    raise MissingExtraError(missing_extra_message(err.name, extra=extra, by=by),
                            name=err.name) from err
