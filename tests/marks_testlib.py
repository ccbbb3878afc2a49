"""Parametrisations split between the everyday loop and the full suite.

``conftest.py`` puts ``tests/`` on ``sys.path``: ``from marks_testlib import everyday``.
"""

import pytest


def everyday(values, *kept):
  """``values`` for ``pytest.mark.parametrize``, those not in ``kept`` marked ``slow``: the
  everyday loop (``-m 'not slow'``) runs the kept cases, the full suite runs them all."""
  return [v if v in kept else pytest.param(v, marks=pytest.mark.slow) for v in values]
