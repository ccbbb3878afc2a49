"""The rules' exception classes: one family, so ``except partition.RulesError`` catches all.

Each class refines a built-in too, so ``except ValueError`` / ``except TypeError`` keep
working::

  RulesError(PartitionError, ValueError)       a table (Python or file) is malformed
  ├── RulesTypeError(TypeError)                built from an object of the wrong type
  ├── RulesConfigError                         a rules file cannot be read or written
  │   └── RulesConfigTypeError(RulesTypeError) a file argument of the wrong type
  └── ResolutionError (resolve.py)             strict resolution failed
"""

from __future__ import annotations

from partition._base.errors import PartitionError


class RulesError(PartitionError, ValueError):
  """A rule table (built in Python or read from a file) is malformed."""


class RulesTypeError(RulesError, TypeError):
  """A rule table was built from a Python object of the wrong type."""


class RulesConfigError(RulesError):
  """A rules file cannot be read: bad syntax, unknown key, wrong type or order."""


class RulesConfigTypeError(RulesConfigError, RulesTypeError):
  """A rules-file argument has the wrong type (a path that is not a path, a bad key)."""
