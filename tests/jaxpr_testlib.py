"""Counting what a jaxpr computes, for tests that hold a cost figure against the program.

``conftest.py`` puts ``tests/`` on ``sys.path``: ``from jaxpr_testlib import matmul_flops``.
"""

import math


def matmul_flops(jaxpr, times: int = 1) -> int:
  """``2 * prod(out) * prod(contracted)`` over every ``dot_general`` of a jaxpr, loop bodies
  counted once per iteration (``scan``'s length), nested jaxprs included."""
  total = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      (contract, _), _ = eqn.params["dimension_numbers"]
      lhs = eqn.invars[0].aval.shape
      total += times * 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(
          lhs[d] for d in contract)
    inner = times * (eqn.params["length"] if eqn.primitive.name == "scan" else 1)
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else [param]:
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          total += matmul_flops(sub, inner)
  return total
