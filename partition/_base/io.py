"""Safe file reading and writing for everything the project reads or writes.

Writes are **atomic**: the destination is checked first (a path of the right type, an
existing directory, not a directory itself), the data goes to a temporary file in the same
directory, and only a complete file is renamed over the destination (``os.replace``). A
failure at any point leaves an existing file byte-identical and no temporary file behind.
Reads have a size limit, so a wrong path (a dataset, a device) fails with a message instead
of filling memory.

>>> import os, tempfile
>>> from partition._base.io import FileError, atomic_write, read_bytes
>>> d = tempfile.mkdtemp()
>>> atomic_write(os.path.join(d, 'a.txt'), 'hello\\n')
>>> read_bytes(os.path.join(d, 'a.txt'))
b'hello\\n'
>>> try:
...   atomic_write(os.path.join(d, 'missing', 'a.txt'), 'x')
... except FileError as e:
...   print('does not exist. Create it first' in str(e))
True
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterator
from typing import IO

from partition._base.errors import PartitionError, short

MAX_READ_BYTES = 1 << 20  # 1 MiB: a rules/config file is a few KiB (MaxText's base.yml: 70)


class FileError(PartitionError, ValueError):
  """A file cannot be read or written: bad path, missing directory, too large, no access."""


class FilePathTypeError(FileError, TypeError):
  """A path argument is not a ``str``, ``bytes`` or ``os.PathLike``."""


def fspath(path: object, what: str = "path",
           error: type[Exception] = FilePathTypeError) -> str:
  """``path`` as a ``str``; ``bytes`` and ``os.PathLike`` are decoded, anything else raises.

  Args:
    path: the value given by the user.
    what: how to name the argument in the message (e.g. ``"AxisRules.from_file(path)"``).
    error: the exception class to raise (a ``PartitionError`` that is a ``TypeError``).
  """
  if isinstance(path, (str, bytes, os.PathLike)):
    try:
      text = os.fsdecode(path)
    except (TypeError, UnicodeDecodeError):  # a PathLike whose __fspath__ returns junk
      text = None
    if text:
      if "\0" in text:
        raise error(f"{what} contains a NUL character: {text!r}. Pass a valid file path.")
      return text
  raise error(f"{what} must be a file path (str or pathlib.Path), got "
              f"{type(path).__name__} {short(path)}. Pass e.g. 'rules.yaml'.")


def check_destination(path: str, error: type[Exception] = FileError) -> str:
  """Checks that ``path`` can be written; returns the real path (symlinks followed)."""
  real = os.path.realpath(path)
  directory = os.path.dirname(real) or "."
  if os.path.isdir(real):
    raise error(f"Cannot write {path!r}: it is a directory. Pass a file name inside it, "
                f"e.g. {os.path.join(path, 'rules.yaml')!r}.")
  if not os.path.isdir(directory):
    raise error(f"Cannot write {path!r}: the directory {directory!r} does not exist. "
                "Create it first (os.makedirs(...)) or choose another path.")
  if os.path.exists(real) and not os.access(real, os.W_OK):
    raise error(f"Cannot write {path!r}: the file is read-only. Make it writable "
                "(chmod u+w) or choose another path.")
  if not os.access(directory, os.W_OK | os.X_OK):
    raise error(f"Cannot write {path!r}: no permission to create files in {directory!r}. "
                "Choose a writable directory.")
  return real


def _default_mode() -> int:
  """The mode ``open(path, 'w')`` would give a new file (0o666 minus the umask)."""
  try:
    with open("/proc/self/status") as f:  # reading the umask without changing it (threads)
      for line in f:
        if line.startswith("Umask:"):
          return 0o666 & ~int(line.split()[1], 8)
  except (OSError, ValueError, IndexError):
    pass
  return 0o644


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", *,
                error: type[Exception] = FileError) -> Iterator[IO]:
  """Opens a temporary file next to ``path``; on success it replaces ``path`` atomically.

  If the ``with`` body raises, the temporary file is removed and ``path`` is untouched.

  Args:
    path: the destination.
    mode: ``'w'`` (text, UTF-8) or ``'wb'``.
    error: the ``PartitionError`` class raised for a bad destination or an OS failure.

  Example:
    >>> import os, tempfile
    >>> from partition._base.io import atomic_open
    >>> p = os.path.join(tempfile.mkdtemp(), 'log.txt')
    >>> with atomic_open(p) as f:
    ...   _ = f.write('step 1\\n')
    >>> open(p).read()
    'step 1\\n'
  """
  if mode not in ("w", "wb"):
    raise ValueError(f"atomic_open mode must be 'w' or 'wb', got {mode!r}")
  text_path = fspath(path)
  real = check_destination(text_path, error)
  directory = os.path.dirname(real) or "."
  try:
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(real)}.",
                               suffix=".tmp")
  except OSError as e:
    raise error(f"Cannot write {text_path!r}: {e.strerror}. Check the directory.") from e
  try:
    with os.fdopen(fd, mode, **({"encoding": "utf-8"} if mode == "w" else {})) as f:
      yield f
      f.flush()
      os.fsync(f.fileno())
    os.chmod(tmp, os.stat(real).st_mode & 0o7777 if os.path.exists(real) else _default_mode())
    os.replace(tmp, real)
  except OSError as e:
    _remove(tmp)
    raise error(f"Cannot write {text_path!r}: {e.strerror or e}. The old file (if any) is "
                "unchanged; check free space and permissions.") from e
  except BaseException:
    _remove(tmp)
    raise


def _remove(tmp: str) -> None:
  with contextlib.suppress(OSError):
    os.unlink(tmp)


def atomic_write(path: str | os.PathLike, data: str | bytes, *,
                 error: type[Exception] = FileError) -> None:
  """Writes ``data`` (``str`` as UTF-8, or ``bytes``) to ``path`` atomically.

  Raises:
    FileError: (or ``error``) for a missing directory, a directory path, no permission or an
      OS failure; the old file is then byte-identical.
  """
  if not isinstance(data, (str, bytes)):
    raise TypeError(f"atomic_write data must be str or bytes, got {type(data).__name__}")
  with atomic_open(path, "w" if isinstance(data, str) else "wb", error=error) as f:
    f.write(data)


def read_bytes(path: str | os.PathLike, *, max_bytes: int = MAX_READ_BYTES,
               what: str = "file", error: type[Exception] = FileError) -> bytes:
  """Reads a whole file of at most ``max_bytes`` bytes.

  Raises:
    FileError: (or ``error``) naming the path for a missing file, a directory, no
      permission, or a file larger than ``max_bytes``.
  """
  text_path = fspath(path)
  try:
    if os.path.exists(text_path) and not os.path.isdir(text_path) and not stat.S_ISREG(
        os.stat(text_path).st_mode):  # a FIFO or a device would block or never end
      raise error(f"Cannot read {what} {text_path!r}: it is not a regular file (a pipe or "
                  "a device). Pass the path of a file.")
    with open(text_path, "rb") as f:
      data = f.read(max_bytes + 1)
  except OSError as e:
    raise error(f"Cannot read {what} {text_path!r}: {e.strerror or e} (working directory "
                f"{os.getcwd()!r}). Check the path.") from None
  if len(data) > max_bytes:
    raise error(f"{what.capitalize()} {text_path!r} is larger than {max_bytes} bytes; it is "
                "probably not the file you meant. Check the path.")
  return data
