"""Exception classes and message builders.

Every user-facing error of the library is built here so that messages share one layout
(modelled on ``jax.shard_map``'s): a headline naming the API and the user's function, the
context, one bullet per failing leaf with its keypath, then a fix.
"""

from __future__ import annotations

import difflib
import reprlib
from collections.abc import Iterable
from typing import Any

import jax

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 40, 40
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 6


class PartitionError(Exception):
  """Base class of every error raised by named-partition."""


class SpecError(PartitionError, TypeError):
  """An ``in_axes``/``out_axes`` leaf is not a valid axis specification."""


class NegativeDimError(SpecError, ValueError):
  """A spec names a negative dim (ambiguous for named axes): a ValueError, as in xmap."""


class AxisNameError(PartitionError, ValueError):
  """An axis name is duplicated, undefined, shadowed or otherwise misused."""


class AxisSizeError(PartitionError, ValueError):
  """Axis sizes are inconsistent, missing, or not divisible by their resources."""


class ResourceError(PartitionError, ValueError):
  """``axis_resources`` names a resource that is missing, repeated or misordered."""


class LoopCollectiveError(AxisNameError):
  """A collective refers to an axis that is mapped to a serial loop."""


class OutputAxesError(PartitionError, ValueError):
  """An output does not match its ``out_axes`` specification."""


class MeshError(PartitionError, ValueError):
  """No usable mesh, or a mesh that does not match what was asked for."""


class PlacementError(PartitionError, ValueError):
  """``strict=True`` placement found names, paths or dims that would not be sharded as asked."""


def did_you_mean(word: str, options: Iterable[str], *, cutoff: float = 0.6, n: int = 1,
                 abbreviations: bool = False) -> str:
  """`` (did you mean 'x'?)`` for the option closest to ``word``, or ``''``.

  The one format of the library's hints (partition, layers and the recipes' CLIs); it reads
  well mid-sentence and at the end. The closest spelling wins (difflib; a higher ``cutoff``,
  0 to 1, asks for a nearer miss); with ``abbreviations`` (for keys people shorten, not for
  names where a prefix is another name, like mesh axes ``fsdp`` / ``fsdp_transpose``), else
  the one option ``word`` abbreviates: its initials (``lr`` -> ``learning_rate``) or a prefix
  (``warmup`` -> ``warmup_steps``). ``n > 1`` offers up to ``n`` spellings.

  >>> 'no rule for ' + repr('mpl') + did_you_mean('mpl', ['mlp', 'embed'])
  "no rule for 'mpl' (did you mean 'mlp'?)"
  >>> did_you_mean('lr', ['learning_rate', 'warmup_steps'], abbreviations=True)
  " (did you mean 'learning_rate'?)"
  >>> did_you_mean('head_dim', ['heads', 'embed'])  # another name, not a typo of 'heads'
  ''
  """
  word = str(word)
  options = [o for o in options if isinstance(o, str)]
  # A near spelling of about the same length: 'head_dim' shares 'head' with 'heads' (a ratio
  # above the cutoff) but is another name, not a typo of it.
  close = [c for c in difflib.get_close_matches(word, options, n=n, cutoff=cutoff)
           if abs(len(c) - len(word)) <= max(2, len(word) // 3)]
  if not close and word and abbreviations:
    initials = [o for o in options if "".join(p[:1] for p in o.split("_")) == word]
    prefixed = [o for o in options if len(word) >= 2 and o.startswith(word)]
    close = (initials or prefixed)[:1] if len(initials or prefixed) == 1 else []
  return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""


def short(x: Any) -> str:
  """A bounded ``repr`` for messages (junk can be huge, deep or self-referential).

  >>> short(list(range(100)))
  '[0, 1, 2, 3, 4, 5, ...]'
  """
  return _REPR.repr(x)


class _Shown:
  """Prints as the text it was given (an array as ``f32[8,16]`` in JAX's own messages)."""

  def __init__(self, text: str):
    self.text = text

  def __repr__(self) -> str:
    return self.text


def prefix_mismatch(structure: Any, tree: Any) -> str:
  """Why ``tree`` does not fit the pytree prefix ``structure``: JAX's words (from
  ``structure.flatten_up_to``), with every array written as its dtype and shape, never its
  values (JAX's message prints the whole subtree).

  >>> import jax, numpy as np
  >>> prefix_mismatch(jax.tree_util.tree_structure((0,)), (np.ones((8, 100)), 1))
  'Tuple arity mismatch: 2 != 1; tuple: (f64[8,100], 1).'
  """
  from partition._base.logical_axes import dtype_shape  # here: that module imports this one

  shown = jax.tree.map(lambda x: _Shown(dtype_shape(x.dtype, x.shape)) if hasattr(
      x, "shape") and hasattr(x, "dtype") else x, tree)
  try:
    structure.flatten_up_to(shown)
  except (ValueError, TypeError) as e:
    return str(e)
  return "the structures differ"


def fun_name(fun) -> str:
  return getattr(fun, "__qualname__", None) or getattr(fun, "__name__", None) or repr(fun)


def format_message(
    headline: str,
    *,
    context: Iterable[str] = (),
    bullets: Iterable[str] = (),
    fix: str | None = None,
) -> str:
  """Builds an error message: headline, context lines, one bullet per problem, a fix.

  A multi-line context line or bullet (another error's message, a nested list) keeps its
  continuation lines under its own text, so nested lines never read as more bullets:

  >>> print(format_message("config: 1 problem(s).", bullets=["a: two things:\\n- x\\n- y"]))
  config: 1 problem(s).
    * a: two things:
      - x
      - y
  """
  lines = [headline]
  lines += [_indented("  ", c) for c in context]
  lines += [_indented("  * ", b) for b in bullets]
  if fix:
    lines.append(fix)
  return "\n".join(lines)


def _indented(lead: str, text: str) -> str:
  return lead + str(text).replace("\n", "\n" + " " * len(lead))
