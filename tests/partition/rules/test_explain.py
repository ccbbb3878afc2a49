"""explain: per-leaf placement report, bytes against real shards, flags and notes."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from mesh_testlib import make_mesh

import partition
from partition import AxisRules

RULES = AxisRules([("batch", ("data", "fsdp")), ("embed", "fsdp"), ("mlp", "tensor"),
                   ("mlp", "fsdp"), ("heads", "tensor"), ("kv", None)])
AXES = {"dense": {"w": ("embed", "mlp"), "b": ("mlp",)},
        "attn": {"qkv": ("embed", "heads", "kv")},
        "norm": None, "typo": ("mpl",), "odd": ("embed",)}


def shapes(dtype=jnp.float32):
  return {"dense": {"w": jax.ShapeDtypeStruct((16, 32), dtype),
                    "b": jax.ShapeDtypeStruct((32,), dtype)},
          "attn": {"qkv": jax.ShapeDtypeStruct((16, 4, 8), dtype)},
          "norm": jax.ShapeDtypeStruct((16,), dtype),
          "typo": jax.ShapeDtypeStruct((32,), dtype),
          "odd": jax.ShapeDtypeStruct((5,), dtype)}


@pytest.fixture
def mesh():
  return make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), AxisType.Explicit)


def test_rows_match_tree_specs_and_real_shards(mesh):
  report = partition.explain(shapes(), AXES, RULES, mesh)
  specs = RULES.tree_specs(AXES, shapes(), mesh)
  by_path = {r.path: r for r in report.rows}
  assert by_path["dense/w"].spec == specs["dense"]["w"] == P("fsdp", "tensor")
  assert by_path["odd"].spec == P(None)
  shardings = RULES.tree_shardings(AXES, mesh, shapes())
  params = jax.jit(lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes()),
                   out_shardings=shardings)()
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    row = by_path["/".join(k.key for k in path)]
    shard = leaf.addressable_shards[0].data
    assert row.bytes_per_device == shard.size * shard.dtype.itemsize
    assert row.bytes_total == leaf.size * leaf.dtype.itemsize
    assert row.shape == leaf.shape and row.dtype == "float32"
  assert report.total_bytes == sum(r.bytes_total for r in report.rows)
  assert report.bytes_per_device == sum(r.bytes_per_device for r in report.rows)


def test_flags_replicated_and_explains_skips(mesh):
  report = partition.explain(shapes(jnp.bfloat16), AXES, RULES, mesh)
  assert set(report.replicated) == {"norm", "typo", "odd"}
  text = str(report)
  assert "Fully replicated on 8 devices (marked !)" in text
  assert "typo dim 0 'mpl' (size 32): no rule for this name (did you mean 'mlp'?)" in text
  assert ("odd dim 0 'embed' (size 5): rule #1 'fsdp': not divisible "
          "(size 5, needs a multiple of 2)") in text
  assert "P('fsdp', 'tensor')" in text and "bfloat16" in text
  assert text.splitlines()[0].split() == ["path", "shape", "dtype", "logical", "axes", "spec",
                                          "per", "device", "total"]


def test_markdown(mesh):
  md = partition.explain(shapes(), AXES, RULES, mesh).to_markdown()
  lines = md.splitlines()
  assert lines[0] == "| path | shape | dtype | logical axes | spec | per device | total |"
  assert lines[1] == "|---|---|---|---|---|---|---|"
  assert "| dense/w | (16, 32) | float32 | ('embed', 'mlp') | P('fsdp', 'tensor') |" \
      " 512 B | 2.00 KiB |" in md
  assert "- Fully replicated" in md and "**6 arrays" in md


def test_arrays_context_and_no_mesh():
  params = {"w": jnp.ones((8, 4)), "s": jnp.ones(())}
  axes = {"w": ("batch", "embed"), "s": ()}
  report = partition.explain(params, axes, [("batch", "data")])
  assert report.mesh == "no mesh" and report.replicated == ()
  assert report.rows[1].bytes_per_device == report.rows[1].bytes_total == 128
  mesh = make_mesh((8,), ("data",), AxisType.Explicit)
  with partition.axis_rules([("batch", "data")], mesh):
    report = partition.explain(params, axes)
  assert report.rows[1].spec == P("data", None) and report.rows[1].bytes_per_device == 16
  assert report.rows[0].replicated is False  # a scalar is not flagged


def test_errors():
  with pytest.raises(partition.NoRulesError, match="partition.explain needs rules"):
    partition.explain({"w": jnp.ones(2)}, {"w": ("a",)})
  with pytest.raises(ValueError, match=r"(?s)v/w: logical axes \('a', 'b', 'c'\) name 3 dims"
                     r".*at most one logical name"):
    partition.explain({"v": {"w": jnp.ones((2, 2))}}, {"v": {"w": ("a", "b", "c")}},
                      [("a", "x")])


def test_short_axes_prefix_and_non_array_leaves():
  mesh = make_mesh((2, 4), ("x", "y"), AxisType.Explicit)
  report = partition.explain(
      {"w": jnp.ones((4, 8)), "n": 3, "s": "name", "k": jax.random.key(0)},
      {"w": ("a",), "n": None, "s": None, "k": None}, [("a", "x")], mesh)
  rows = {r.path: r for r in report.rows}
  # Independent reference: flax's resolver on the declared (short) names, padded by JAX.
  assert rows["w"].spec == P(*nn.logical_to_mesh_axes(("a",), [("a", "x")]), None)
  assert rows["w"].logical_axes == ("a", None)
  assert rows["n"].shape == () and rows["n"].bytes_total == np.asarray(3).nbytes
  assert rows["k"].dtype == "key<fry>" and rows["k"].bytes_total == 8
  assert "s: not an array, skipped" in report.notes


def test_human_bytes():
  from partition._rules.explain import human_bytes

  assert [human_bytes(n) for n in (0, 1023, 1024, 3 * 2**20, 2**40)] == [
      "0 B", "1023 B", "1.00 KiB", "3.00 MiB", "1024.00 GiB"]
  assert np.isclose(float(human_bytes(1536).split()[0]), 1.5)
