"""partition._params.audit.audit_placement: one strict error, one replicated warning."""

import warnings

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from mesh_testlib import make_mesh

import partition
from partition._params.audit import WARN_BYTES, audit_placement


def sds(*shape):
  return jax.ShapeDtypeStruct(shape, jnp.float32)


@pytest.fixture
def mesh():
  return make_mesh((4, 2), ("fsdp", "tensor"), AxisType.Explicit)


RULES = partition.AxisRules([("embed", "fsdp"), ("mlp", "tensor"), ("kv", None)])


def run(tree, axes, mesh, rules=RULES, **kw):
  """The PartitionWarnings (ReplicatedWarning is one) of one audit."""
  specs = rules.tree_specs(axes, tree, mesh)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    audit_placement(tree, axes, specs, rules, mesh, api="api", **kw)
  return [w for w in caught if issubclass(w.category, partition.PartitionWarning)]


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
  replicated = [w for w in caught if w.category is partition.ReplicatedWarning]
  fallbacks = [w for w in caught if w.category is partition.PartitionWarning]
  assert len(replicated) == 1 and len(fallbacks) == 1
  text = str(replicated[0].message)
  # parameters without logical axes, bytes per device: 64 KiB + 512 B
  assert text.startswith("api: 2 parameter(s) are fully replicated on 8 devices, "
                         "64.50 KiB per device:")
  assert "b/w f32[128,128]: no logical axes" in text
  assert "a/w" not in text and "ok" not in text.replace("Look", "")
  assert "pass strict=True" in text
  # the named one gets its own warning, with the cause and the fix ('kv' has a null rule)
  assert str(fallbacks[0].message) == (
      "api: logical axis 'embd' has no rule (did you mean 'embed'?), so a/w dim 0 is "
      "replicated.\nAdd a rule for 'embd' (a null rule, e.g. ['embd', null], replicates it "
      "on purpose and silences this), or fix the name.")


def test_small_replicated_params_do_not_warn_but_fallbacks_do_whatever_the_size(mesh):
  tree = {"bias": sds(512), "scale": sds(512)}
  caught = run(tree, {"bias": None, "scale": ("embd",)}, mesh, strict=False)
  assert [w.category for w in caught] == [partition.PartitionWarning]
  assert "logical axis 'embd' has no rule" in str(caught[0].message)
  big = {"w": jax.ShapeDtypeStruct((WARN_BYTES // 4,), jnp.float32)}
  assert len(run(big, {"w": None}, mesh, strict=False)) == 1
  assert run(big, {"w": None}, mesh, strict=False, warn_bytes=WARN_BYTES + 1) == []


def test_null_rules_replicate_on_purpose_and_warn_nothing(mesh):
  """The data_parallel preset: every parameter name has a null rule."""
  rules = partition.AxisRules([("batch", "fsdp"), ("embed", None), ("mlp", None)])
  tree = {f"layer{i}": {"w": sds(256, 512)} for i in range(20)}
  axes = {f"layer{i}": {"w": ("embed", "mlp")} for i in range(20)}
  assert run(tree, axes, mesh, rules=rules, strict=False) == []


def test_indivisible_dim_warns_once_per_cause(mesh):
  tree = {"a": sds(6, 8), "b": sds(6, 8), "c": sds(10, 8)}
  axes = {"a": ("embed", "mlp"), "b": ("embed", "mlp"), "c": ("embed", "mlp")}
  caught = run(tree, axes, mesh, strict=False)
  texts = sorted(str(w.message) for w in caught)
  assert len(texts) == 2, texts  # sizes 6 and 10 are two causes; a and b share one
  assert texts[0].startswith("api: a dim 0 'embed' (size 6) is "
                             "replicated: no rule for it divides the dim (rule #0: size 6, "
                             "needs a multiple of 4) (and 1 more array(s) for the same reason)")
  assert "Pad the dim" in texts[0] and "c dim 0 'embed' (size 10)" in texts[1]


def test_unused_path_pattern_is_an_error_without_strict(mesh):
  table = partition.PathRules([(r"^w$", ("embed", "mlp")), (r"^gone$", None)])
  tree = {"w": sds(256, 256)}
  match = table.match(tree)
  specs = RULES.tree_specs(match.axes, tree, mesh)
  with pytest.raises(partition.PlacementError) as info:
    audit_placement(tree, match.axes, specs, RULES, mesh, api="api", strict=False,
                    path_match=match)
  message = str(info.value)
  assert "api: 1 problem(s) in the placement of the parameters:" in message
  assert "* path pattern '^gone$' matches no parameter" in message
  assert "Fix or remove the path patterns that match nothing" in message


def test_single_device_mesh_never_warns():
  mesh = make_mesh((1,), ("fsdp",), AxisType.Explicit, devices=jax.devices()[:1])
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
