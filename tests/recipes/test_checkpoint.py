"""Checkpointer.restore_on: placement by the recorded logical axes, never silently replicated."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from mesh_testlib import make_mesh

import partition
from recipes.checkpoint import Checkpointer

RULES = partition.AxisRules([("embed", "data"), ("mlp", None)])


def _saved(tmp_path, rows):
  ckpt = Checkpointer(tmp_path / "ckpt", async_save=False)
  state = {"w": jnp.arange(rows * 16, dtype=jnp.float32).reshape(rows, 16)}
  ckpt.save(1, state, {"w": ("embed", "mlp")}, {"rules": RULES.to_dict()})
  ckpt.wait()
  return ckpt, np.asarray(state["w"])


def test_restore_on_places_by_the_recorded_axes_silently_when_the_rules_fit(tmp_path):
  ckpt, want = _saved(tmp_path, rows=8)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    state, meta = ckpt.restore_on(1, make_mesh((4,), ("data",), AxisType.Explicit,
                                               devices=jax.devices()[:4]))
  ckpt.close()
  assert state["w"].sharding.spec == P("data", None) and meta["logical_axes"]["w"]
  np.testing.assert_array_equal(np.asarray(state["w"]), want)


def test_restore_on_a_mesh_no_rule_divides_warns_naming_the_array(tmp_path):
  ckpt, want = _saved(tmp_path, rows=6)
  with pytest.warns(partition.PartitionWarning) as caught:
    state, _ = ckpt.restore_on(1, make_mesh((4,), ("data",), AxisType.Explicit,
                                            devices=jax.devices()[:4]))
  ckpt.close()
  (message,) = [str(w.message) for w in caught]
  assert re.search(r"Checkpointer.restore_on: w dim 0 'embed' \(size 6\) is replicated: no "
                   r"rule for it divides the dim", message), message
  assert state["w"].sharding.spec == P(None, None)
  np.testing.assert_array_equal(np.asarray(state["w"]), want)
