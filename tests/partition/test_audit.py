"""partition._audit.audit_placement: one strict error, one replicated warning."""

import warnings

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import partition
from partition._audit import WARN_BYTES, audit_placement


def sds(*shape):
  return jax.ShapeDtypeStruct(shape, jnp.float32)


@pytest.fixture
def mesh():
  return jax.make_mesh((4, 2), ("fsdp", "tensor"))


RULES = partition.AxisRules([("embed", "fsdp"), ("mlp", "tensor"), ("kv", None)])


def run(tree, axes, mesh, rules=RULES, **kw):
  specs = rules.tree_specs(axes, tree, mesh)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    audit_placement(tree, axes, specs, rules, mesh, api="api", **kw)
  return [w for w in caught if issubclass(w.category, partition.ReplicatedWarning)]


def test_sharded_tree_is_silent(mesh):
  tree = {"w": sds(256, 256), "b": sds(256)}
  assert run(tree, {"w": ("embed", "mlp"), "b": ("mlp",)}, mesh, strict=False) == []
  run(tree, {"w": ("embed", "mlp"), "b": ("mlp",)}, mesh, strict=True)  # no error


def test_one_warning_lists_big_replicated_params_with_bytes(mesh):
  tree = {"a": {"w": sds(256, 128)}, "b": {"w": sds(128, 128)}, "scale": sds(128),
          "ok": sds(256, 256)}
  axes = {"a": {"w": ("embd", "kv")}, "b": {"w": None}, "scale": None,
          "ok": ("embed", "mlp")}
  caught = run(tree, axes, mesh, strict=False)
  assert len(caught) == 1
  text = str(caught[0].message)
  # total bytes per device of the replicated leaves: 128 KiB + 64 KiB + 512 B
  assert text.startswith("api: 3 parameter(s) are fully replicated on 8 devices, "
                         "192.50 KiB per device:")
  assert "a/w f32[256,128] ('embd', 'kv'): no rule for 'embd' (did you mean 'embed'?)" in text
  assert "b/w f32[128,128]: no logical axes" in text
  assert "ok" not in text.replace("Look", "")
  assert "pass strict=True" in text


def test_small_replicated_params_do_not_warn(mesh):
  tree = {"bias": sds(512), "scale": sds(512)}
  assert run(tree, {"bias": None, "scale": ("embd",)}, mesh, strict=False) == []
  big = {"w": jax.ShapeDtypeStruct((WARN_BYTES // 4,), jnp.float32)}
  assert len(run(big, {"w": None}, mesh, strict=False)) == 1
  assert run(big, {"w": None}, mesh, strict=False, warn_bytes=WARN_BYTES + 1) == []


def test_single_device_mesh_never_warns():
  mesh = jax.make_mesh((1,), ("fsdp",), devices=jax.devices()[:1])
  assert run({"w": sds(512, 512)}, {"w": None}, mesh, strict=False) == []


def test_strict_collects_every_problem_in_one_error(mesh):
  rules = partition.AxisRules([("embed", "fsdp"), ("mlp", ("tensor", "pipe")),
                               ("heads", "fsdp")])
  tree = {"enc": {"w": sds(8, 8)}, "dec": {"w": sds(6, 8)}, "h": sds(8)}
  axes = {"enc": {"w": ("embd", "mlp")}, "dec": {"w": ("heads", None)}, "h": ("tensor",)}
  with pytest.raises(partition.PlacementError, match="Add a rule for each name") as e:
    run(tree, axes, mesh, rules=rules, strict=True)
  text = str(e.value)
  assert text.startswith("api(strict=True): 4 problem(s)")
  assert "mesh: mesh(fsdp=4" in text
  assert "enc/w dim 0: logical axis 'embd' has no rule (did you mean 'embed'?)" in text
  assert "enc/w dim 1 'mlp': rule #1 names 'pipe', which is not a mesh axis" in text
  assert ("dec/w dim 0 'heads': no rule divides it (size 6, needs a multiple of 4)"
          in text)
  assert "h dim 0: logical axis 'tensor' has no rule" in text
  assert "'tensor' is a mesh axis" in text
  assert isinstance(e.value, ValueError)


def test_strict_reports_path_table_gaps(mesh):
  table = partition.PathRules([(r"/w$", ("embed", "mlp")), (r"/nothing$", None)])
  tree = {"l": {"w": sds(8, 8), "b": sds(8)}}
  report = table.match(tree)
  with pytest.raises(partition.PlacementError) as e:
    run(tree, report.axes, mesh, strict=True, path_match=report)
  assert "l/b: no declared axes and no path pattern matches it" in str(e.value)
  assert "path pattern '/nothing$' matches no parameter" in str(e.value)


def test_partition_spec_leaves_with_bad_mesh_axes_fail_in_both_modes(mesh):
  tree = {"w": sds(8, 6), "v": sds(8, 8)}
  axes = {"w": P("fsdp", "tensor"), "v": P("tensr")}
  specs = {"w": P("fsdp", "tensor"), "v": P("tensr")}
  for strict in (False, True):
    with pytest.raises(partition.PlacementError) as e:
      audit_placement(tree, axes, specs, RULES, mesh, strict=strict, api="api")
    text = str(e.value)
    assert "v dim 0: P('tensr',) names mesh axis 'tensr', which the mesh lacks " \
           "(did you mean 'tensor'?)" in text
    assert "w dim" not in text  # 8 % 4 == 0 and 6 % 2 == 0
    assert "must be axes of the mesh" in text
  bad = {"w": sds(8, 5)}
  with pytest.raises(partition.PlacementError, match=r"w dim 1: size 5 is not divisible by 2"):
    audit_placement(bad, {"w": P(None, "tensor")}, {"w": P(None, "tensor")}, RULES, mesh,
                    strict=False, api="api")


def test_named_shardings_and_empty_namedtuple_nodes(mesh):
  import optax

  state = optax.adam(1e-3).init({"w": jnp.zeros((256, 256))})
  tree = {"params": {"w": sds(256, 256)}, "empty": optax.EmptyState()}
  axes = {"params": {"w": ("embed", "mlp")}, "empty": optax.EmptyState()}
  specs = {"params": {"w": NamedSharding(mesh, P("fsdp", "tensor"))},
           "empty": optax.EmptyState()}
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    audit_placement(tree, axes, specs, RULES, mesh, strict=True, api="api")
  assert state  # optax imported and usable
