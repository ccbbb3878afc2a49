"""Warnings for fallbacks the user may not have meant (``strict=False``).

Nothing falls back silently. Where the input cannot be intended (a mesh axis that is a typo
of one the mesh has, a path pattern that matches no parameter) the library raises; where a
fallback may be intended it warns: one :class:`PartitionWarning` per distinct cause (a
logical name without a rule, a dim no candidate divides) and call site, naming the
name/dim and the fix, whatever the size of the array. A fallback stated in the rules
(a ``null`` rule, as in the ``data_parallel`` preset) is intended and warns about nothing.

>>> import warnings, jax, partition
>>> from partition._rules.fallbacks import warn_fallbacks
>>> mesh = jax.make_mesh((8,), ('data',))
>>> rules = partition.AxisRules([('batch', 'data'), ('mlp', 'data')])
>>> with warnings.catch_warnings(record=True) as caught:
...   warnings.simplefilter('always')
...   spec = rules.spec(('batch', 'mpl'), (8, 16), mesh)
...   warn_fallbacks('demo', [('x', rules.resolve(('batch', 'mpl'), (8, 16), mesh))], rules)
>>> print(caught[0].message)
demo: logical axis 'mpl' has no rule (did you mean 'mlp'?), so x dim 1 is replicated.
Add a rule for 'mpl' (a null rule, e.g. ['mpl', null], replicates it on purpose and silences this), or fix the name.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence

from partition._base.errors import did_you_mean, format_message
from partition._rules.resolve import INDIVISIBLE, Resolution


class PartitionWarning(UserWarning):
  """A fallback that may not be what was meant (replicated for want of a rule or a divisor).

  One warning per distinct cause and call site; ``strict=True`` (where the API takes it)
  makes these errors. Silence one on purpose by saying so in the rules (a ``null`` rule).
  """


def indivisible_attempts(dim) -> str:
  """``'rule #i: detail; ...'`` for a resolved dim that no candidate divides, else ``''``
  (a dim some rule placed, or one with no rule, has none to report)."""
  if dim.rule is not None:
    return ""
  return "; ".join(f"rule #{a.rule}: {a.detail}" for a in dim.attempts
                   if a.outcome == INDIVISIBLE)


def fallback_causes(where: str, res: Resolution, rule_names: Sequence[str]
                    ) -> list[tuple[tuple, str, str]]:
  """``(cause key, what happened, fix)`` per fallback in ``res`` (``where`` names the
  array, e.g. a keypath)."""
  out = []
  for d in res.dims:
    if not isinstance(d.logical, str) or not d.logical:
      continue
    if d.logical not in rule_names:
      out.append((("no rule", d.logical),
                  f"logical axis {d.logical!r} has no rule"
                  f"{did_you_mean(d.logical, rule_names)}, so {where} dim {d.index} is "
                  "replicated",
                  f"Add a rule for {d.logical!r} (a null rule, e.g. [{d.logical!r}, null], "
                  "replicates it on purpose and silences this), or fix the name."))
    elif tried := indivisible_attempts(d):
      out.append((("indivisible", d.logical, d.size, tried),
                  f"{where} dim {d.index} {d.logical!r} (size {d.size}) is replicated: no "
                  f"rule for it divides the dim ({tried})",
                  f"Pad the dim to a multiple of the mesh axes' size, add a fallback rule "
                  f"for {d.logical!r} that divides it, or a null rule to replicate it on "
                  "purpose."))
  return out


def warn_fallbacks(api: str, items: Iterable[tuple[str, Resolution]],
                   rule_names: Sequence[str] | object, *, stacklevel: int = 2) -> None:
  """One :class:`PartitionWarning` per distinct cause among ``items`` (``(where,
  Resolution)`` pairs); ``rule_names`` is the rules' names (or an ``AxisRules``)."""
  names = list(getattr(rule_names, "names", rule_names))
  seen: dict[tuple, tuple[str, str, int]] = {}
  for where, res in items:
    for key, what, fix in fallback_causes(where, res, names):
      if key in seen:
        first_what, first_fix, count = seen[key]
        seen[key] = (first_what, first_fix, count + 1)
      else:
        seen[key] = (what, fix, 1)
  for what, fix, count in seen.values():
    more = f" (and {count - 1} more array(s) for the same reason)" if count > 1 else ""
    warnings.warn(format_message(f"{api}: {what}{more}.", fix=fix), PartitionWarning,
                  stacklevel=stacklevel + 1)
