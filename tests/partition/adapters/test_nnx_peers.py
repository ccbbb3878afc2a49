"""NNX models in the style of flax's sharding guides, sharded as flax NNX itself shards them.

References: flax NNX's own eager sharding (``nnx.use_eager_sharding`` under
``jax.set_mesh``), ``nnx.get_partition_spec`` + flax's resolver, and one-device outputs.
"""

import pathlib
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from mesh_testlib import make_mesh

import partition
import partition.nnx

PRESET = pathlib.Path(__file__).resolve().parents[3] / "recipes" / "presets" / "fsdp_tp.yaml"


class GuideMlp(nnx.Module):
  """flax's NNX sharding guide: mesh-axis names in out_sharding, a Dropout holding Rngs."""

  def __init__(self, rngs: nnx.Rngs):
    self.w1 = nnx.Linear(16, 32, rngs=rngs, kernel_metadata={"out_sharding": (None, "model")},
                         bias_metadata={"out_sharding": ("model",)})
    self.w2 = nnx.Linear(32, 16, rngs=rngs, kernel_metadata={"out_sharding": ("model", None)})
    self.dropout = nnx.Dropout(0.5, rngs=rngs)

  def __call__(self, x):
    return self.w2(self.dropout(nnx.relu(self.w1(x)), deterministic=True))


class LogicalMlp(nnx.Module):
  """The gemma example's style: logical names in out_sharding, resolved through rules."""

  def __init__(self, rngs: nnx.Rngs):
    self.up = nnx.Linear(16, 32, rngs=rngs, kernel_metadata={"out_sharding": ("embed", "mlp")})
    self.down = nnx.Linear(32, 16, rngs=rngs,
                           kernel_metadata={"out_sharding": ("mlp", "embed")})

  def __call__(self, x):
    return self.down(nnx.relu(self.up(x)))


def shardings(model):
  return {"/".join(map(str, path)): v[...]
          for path, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)}


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
@pytest.mark.slow
def test_mesh_axis_names_pass_through_as_flax_nnx_places_them(axis_type):
  mesh = make_mesh((4, 2), ("data", "model"), axis_type)
  rules = [("batch", "data")]  # no rule for 'model': it is the mesh axis, as in flax NNX
  with warnings.catch_warnings():
    warnings.simplefilter("error", partition.ReplicatedWarning)
    ours = partition.nnx.init_sharded(lambda: GuideMlp(nnx.Rngs(0)), rules=rules, mesh=mesh)
  # Independent reference: flax NNX's own eager sharding of the same model.
  with jax.set_mesh(mesh), nnx.use_eager_sharding(True):
    theirs = GuideMlp(nnx.Rngs(0))
  got, want = shardings(ours), shardings(theirs)
  assert set(got) == set(want) and len(got) == 4
  for path in got:
    assert got[path].sharding.is_equivalent_to(want[path].sharding, got[path].ndim), path
  assert got["w1/kernel"].sharding.spec == P(None, "model")
  if axis_type == AxisType.Auto:  # on Explicit, w2's sharded contraction needs out_sharding=
    x = jnp.ones((8, 16))
    with jax.set_mesh(mesh):
      out = jax.jit(lambda m, x: m(x))(ours, x)
    np.testing.assert_allclose(out, theirs(x), rtol=1e-5)


@pytest.mark.slow
def test_logical_names_match_flax_resolver_and_one_device():
  mesh = make_mesh((2, 4), ("fsdp", "tensor"), AxisType.Auto)
  rules = [("embed", "fsdp"), ("mlp", "tensor")]
  model = partition.nnx.init_sharded(lambda: LogicalMlp(nnx.Rngs(0)), rules=rules, mesh=mesh)
  with nnx.use_eager_sharding(False):
    plain = LogicalMlp(nnx.Rngs(0))
  specs = nnx.get_partition_spec(nnx.state(plain))
  for name in ("up", "down"):
    ref = nn.logical_to_mesh_axes(tuple(specs[name]["kernel"].get_value()), rules)
    assert getattr(model, name).kernel[...].sharding.spec == ref
  x = jnp.ones((4, 16))
  with jax.set_mesh(mesh):
    out = jax.jit(lambda m, x: m(x))(model, x)
  np.testing.assert_allclose(out, plain(x), rtol=1e-5)


def test_preset_with_vanished_axes_under_axis_rules_and_eager_sharding():
  # fsdp_tp.yaml maps mlp -> tensor; on a (data, fsdp) mesh 'tensor' is absent. flax NNX
  # resolves names with rules.get(name, name): the installed table must map mlp -> None.
  mesh = make_mesh((2, 4), ("data", "fsdp"), AxisType.Auto)
  rules = partition.AxisRules.from_file(PRESET)
  with partition.axis_rules(rules, mesh), jax.set_mesh(mesh):
    layer = nnx.Linear(8, 16, rngs=nnx.Rngs(0),
                       kernel_metadata={"out_sharding": ("embed", "mlp")})
    flax_table = nn.get_logical_axis_rules()
  assert dict(flax_table)["mlp"] is None
  assert layer.kernel[...].sharding.spec == P("fsdp", None)
  assert layer.kernel[...].sharding.spec == rules.spec(("embed", "mlp"), (8, 16), mesh)


def test_explain_and_init_on_a_module_holding_rngs():
  mesh = make_mesh((4, 2), ("data", "model"), AxisType.Explicit)
  report = partition.nnx.explain(lambda: GuideMlp(nnx.Rngs(0)), rules=[("batch", "data")],
                                 mesh=mesh)
  rows = {r.path: r for r in report.rows}
  assert rows["w1/kernel"].spec == P(None, "model")
  keys = [r for r in report.rows if r.dtype.startswith("key<")]
  assert keys and all(r.bytes_total == 8 for r in keys)
  assert any(r.path.endswith("count") and r.dtype == "uint32" for r in report.rows)


def test_strict_and_replicated_warning():
  mesh = make_mesh((2, 4), ("fsdp", "tensor"), AxisType.Explicit)

  def big():
    return nnx.Linear(128, 256, rngs=nnx.Rngs(0),
                      kernel_metadata={"out_sharding": ("embd", "mlp")})

  with pytest.warns(partition.PartitionWarning) as caught:
    partition.nnx.init_sharded(big, rules=[("embed", "fsdp")], mesh=mesh)
  texts = sorted(str(w.message).splitlines()[0] for w in caught)
  assert texts == [
      "partition.nnx.init_sharded: logical axis 'embd' has no rule (did you mean 'embed'?), "
      "so kernel dim 0 is replicated.",
      "partition.nnx.init_sharded: logical axis 'mlp' has no rule, so kernel dim 1 is "
      "replicated."]
  with pytest.raises(partition.PlacementError) as e:
    partition.nnx.init_sharded(big, rules=[("embed", "fsdp")], mesh=mesh, strict=True)
  text = str(e.value)
  assert "kernel dim 0: logical axis 'embd' has no rule (did you mean 'embed'?)" in text
  assert "kernel dim 1: logical axis 'mlp' has no rule" in text
  # A mesh axis written directly is not "unknown": it is placed, as flax NNX places it
  # (the bias declares its axes too: strict refuses a parameter that declares none).
  model = partition.nnx.init_sharded(
      lambda: nnx.Linear(128, 256, rngs=nnx.Rngs(0),
                         kernel_metadata={"out_sharding": ("fsdp", "tensor")},
                         bias_metadata={"out_sharding": ("tensor",)}),
      rules=[("embed", "fsdp")], mesh=mesh, strict=True)
  assert model.kernel[...].sharding.spec == P("fsdp", "tensor")
  assert model.bias[...].sharding.spec == P("tensor")
