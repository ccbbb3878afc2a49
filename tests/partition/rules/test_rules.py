"""AxisRules: construction, resolution (against flax linen's resolver), fallbacks, strict."""

import pathlib
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from mesh_testlib import make_mesh

import partition
from partition import AxisRules, SerialLoop

MESH_AXES = ("x", "y", "z", "w")
NAMES = ("batch", "embed", "mlp", "heads", "kv", "length")
PRESETS = pathlib.Path(__file__).resolve().parents[3] / "recipes" / "presets"


# -- construction ---------------------------------------------------------------------------


def test_canonical_equal_hashable_frozen():
  a = AxisRules([("batch", "data"), ("embed", ["fsdp"]), ("kv", ()), ("mb", SerialLoop(2))])
  b = AxisRules([("batch", ("data",)), ("embed", "fsdp"), ("kv", None),
                 ("mb", {"serial_loop": 2})])
  assert a == b and hash(a) == hash(b) and len({a, b}) == 1
  assert a.pairs == (("batch", ("data",)), ("embed", ("fsdp",)), ("kv", None),
                     ("mb", (SerialLoop(2),)))
  with pytest.raises(AttributeError):
    a.pairs = ()


def test_repr_reads_back():
  rules = AxisRules([("batch", ("data", "fsdp")), ("kv", None),
                     ("batch", ("data", SerialLoop(4)))])
  assert repr(rules) == ("AxisRules([('batch', ('data', 'fsdp')), ('kv', None), "
                         "('batch', ('data', SerialLoop(4)))])")
  assert eval(repr(rules), {"AxisRules": AxisRules, "SerialLoop": SerialLoop}) == rules


def test_mapping_and_from_dict():
  assert AxisRules({"batch": "data", "mlp": "tensor"}) == AxisRules(
      [("batch", "data"), ("mlp", "tensor")])
  rules = AxisRules.from_dict({"rules": [["batch", ["data", {"serial_loop": 4}]]]})
  assert rules.pairs == (("batch", ("data", SerialLoop(4))),)
  assert AxisRules.from_dict(rules.to_dict()) == rules
  assert rules.to_dict() == {"rules": [["batch", ["data", {"serial_loop": 4}]]]}


@pytest.mark.parametrize("pairs, match", [
    (5, "takes a list of"),
    ("batch", "takes a list of"),
    ([("batch",)], r"pairs\[0\].*expected a pair"),
    ([("", "x")], "non-empty str"),
    ([("batch", 3)], "got int 3"),
    ([("batch", (SerialLoop(2), "data"))], "serial loop must come last"),
    ([("batch", ("data", "data"))], "'data' is repeated"),
    ([("batch", {"serial_lop": 2})], "did you mean 'serial_loop'"),
])
def test_invalid_pairs(pairs, match):
  with pytest.raises(TypeError, match=match):
    AxisRules(pairs)


def test_override_and_cli_strings():
  rules = AxisRules([("batch", "data"), ("mlp", "fsdp"), ("embed", "fsdp"), ("mlp", None)])
  out = rules.override("mlp=tensor", "batch = data, fsdp", kv="null", extra=None)
  assert out == AxisRules([("batch", ("data", "fsdp")), ("mlp", "tensor"),
                           ("embed", "fsdp"), ("kv", "null"), ("extra", None)])
  assert rules.override("kv=null", "mb=serial_loop:4", "b=data,loop:2", "c=").pairs[-4:] == (
      ("kv", None), ("mb", (SerialLoop(4),)), ("b", ("data", SerialLoop(2))), ("c", None))
  assert rules.override({"a": "x"}, ("b", ("y", "z"))).pairs[-2:] == (
      ("a", ("x",)), ("b", ("y", "z")))
  assert rules == AxisRules([("batch", "data"), ("mlp", "fsdp"), ("embed", "fsdp"),
                             ("mlp", None)])  # unchanged
  with pytest.raises(ValueError, match="name=mesh_axes"):
    rules.override("mlp")
  with pytest.raises(ValueError, match="must come last"):
    rules.override("b=serial_loop:2,data")


def test_concatenation_adds_fallbacks():
  rules = AxisRules([("batch", ("data", "fsdp"))]) + [("batch", "data")]
  assert rules.pairs == (("batch", ("data", "fsdp")), ("batch", ("data",)))
  assert rules.names == ("batch",)


# -- flax semantics ------------------------------------------------------------------------

values = st.one_of(
    st.none(), st.sampled_from(MESH_AXES),
    st.lists(st.sampled_from(MESH_AXES), min_size=0, max_size=3, unique=True).map(tuple))
tables = st.lists(st.tuples(st.sampled_from(NAMES), values), max_size=8)
axes_tuples = st.lists(st.one_of(st.none(), st.sampled_from(NAMES + ("unknown",))),
                       max_size=5).filter(
    lambda a: len([n for n in a if n]) == len({n for n in a if n}))


@settings(max_examples=400, deadline=None)
@given(tables, axes_tuples)
def test_matches_flax_logical_to_mesh_axes(table, axes):
  expected = nn.logical_to_mesh_axes(tuple(axes), table)
  assert AxisRules(table).spec(tuple(axes)) == expected


@settings(max_examples=200, deadline=None)
@given(tables, st.lists(st.sampled_from(NAMES + (None,)), max_size=5),
       st.lists(st.integers(1, 12), min_size=5, max_size=5))
def test_one_entry_per_dim_and_no_repeated_mesh_axis(table, axes, sizes):
  mesh = make_mesh((2, 2, 2), ("x", "y", "z"))
  for shape, m in ((None, None), (tuple(sizes[:len(axes)]), mesh)):
    spec = AxisRules(table).spec(tuple(axes), shape, m)
    assert len(spec) == len(axes)
    used = [a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e)]
    assert len(used) == len(set(used))
    if m is not None:
      assert all(shape[i] % m.shape[e if isinstance(e, str) else e[0]] == 0
                 for i, e in enumerate(spec) if isinstance(e, str))


@settings(max_examples=200, deadline=None)
@given(tables.map(lambda t: [(n, v) for n, v in t if v != ("w",) and v != "w" and
                             (not isinstance(v, tuple) or "w" not in v)]),
       axes_tuples.filter(lambda a: "unknown" not in a))
def test_equals_flax_on_divisible_shapes(table, axes):
  mesh = make_mesh((2, 2, 2), ("x", "y", "z"))
  shape = (8,) * len(axes)
  assert AxisRules(table).spec(tuple(axes), shape, mesh) == nn.logical_to_mesh_axes(
      tuple(axes), table)


def test_flax_docstring_example():
  rules = AxisRules((("batch", "X"), ("features", "X"), ("heads", "Y"), ("batch", "Z")))
  assert rules.spec(("batch", "length", "heads", "features")) == P("X", None, "Y", None)


def test_none_rule_claims_dim_and_blocks_fallback():
  rules = AxisRules([("kv", None), ("kv", "x")])
  assert rules.spec(("kv",)) == P(None)
  assert AxisRules([("kv", "x"), ("embed", "x"), ("embed", "y")]).spec(
      ("kv", "embed")) == P("x", "y")


def test_duplicate_logical_names_resolve_in_order():
  rules = AxisRules([("embed", "fsdp"), ("embed", "tensor")])
  assert rules.spec(("embed", "embed")) == P("fsdp", "tensor")
  assert AxisRules([("embed", "fsdp")]).spec(("embed", "embed")) == P("fsdp", None)


def test_unannotated_and_passthrough():
  rules = AxisRules([("batch", "x")])
  assert rules.spec(None) == P() and rules.spec("") == P()
  assert rules.spec(("batch", None, P.UNCONSTRAINED)) == P("x", None, P.UNCONSTRAINED)
  assert rules.spec(P("y")) == P("y")
  with pytest.raises(TypeError, match="tuple of names"):
    rules.spec("batch")
  with pytest.raises(ValueError, match="name 1 dims but the shape"):
    rules.spec(("batch",), (4, 4))


# -- shape- and mesh-aware resolution -------------------------------------------------------


def test_indivisible_candidate_falls_back():
  mesh = make_mesh((2, 4), ("data", "fsdp"))
  rules = AxisRules([("batch", ("data", "fsdp")), ("batch", "data"), ("embed", "fsdp")])
  assert rules.spec(("batch", "embed"), (16, 8), mesh) == P(("data", "fsdp"), None)
  assert rules.spec(("batch", "embed"), (6, 8), mesh) == P("data", "fsdp")
  assert rules.spec(("batch", "embed"), (3, 6), mesh) == P(None, None)
  res = rules.resolve(("batch", "embed"), (6, 8), mesh)
  assert [a.outcome for a in res.dims[0].attempts] == ["not divisible", "fired"]
  assert res.dims[0].rule == 1 and res.dims[1].rule == 2
  assert "size 6, needs a multiple of 8" in str(res)


def drop_absent_and_size_one(spec, mesh):
  """flax's spec with mesh axes of size 1 or absent removed (what placing it does)."""
  def keep(entry):
    axes = [a for a in ((entry,) if isinstance(entry, str) else entry or ())
            if mesh.shape.get(a, 1) > 1]
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)
  return P(*(keep(e) for e in spec))


def test_size_one_and_absent_axes_place_as_flax():
  mesh = make_mesh((8, 1), ("data", "tensor"))
  rules = AxisRules([("batch", ("data", "tensor")), ("mlp", "tensor"), ("mlp", "data"),
                     ("embed", ("fsdp", "data")), ("b", "fsdp"), ("b", "data")])
  for axes in [("batch",), ("mlp",), ("mlp", "batch"), ("batch", "mlp"), ("embed",),
               ("embed", "mlp"), ("b",), ("b", "embed")]:
    flax_spec = nn.logical_to_mesh_axes(axes, list(rules.pairs))
    want = drop_absent_and_size_one(flax_spec, mesh)
    assert rules.spec(axes, (8,) * len(axes), mesh) == want, axes
    # A mesh that lacks an axis places like one that has it with size 1.
    assert rules.spec(axes, None, make_mesh((8, 1, 1), ("data", "tensor", "fsdp"))) == want
  # A rule whose axes all have size 1 fires (flax placement): the dim is replicated.
  res = rules.resolve(("mlp",), (8,), mesh)
  assert [a.outcome for a in res.dims[0].attempts] == ["fired"]
  assert "'tensor' has size 1, dropped" in str(res)
  assert "'fsdp' is not a mesh axis" in str(rules.resolve(("embed",), None, mesh))


def test_serial_loop_is_ignored_for_arrays():
  rules = AxisRules([("batch", ("data", SerialLoop(4))), ("mb", SerialLoop(2)), ("mb", "x")])
  assert rules.spec(("batch", "mb")) == P("data", None)
  mesh = make_mesh((4, 2), ("data", "x"))
  assert rules.spec(("batch", "mb"), (4, 4), mesh) == P("data", None)


@pytest.mark.parametrize("shape, names", [((8,), ("a",)), ((4, 2), ("a", "b")),
                                          ((2, 2, 2), ("a", "b", "c"))])
def test_sharding_and_placement(shape, names):
  mesh = make_mesh(shape, names)
  rules = AxisRules([("batch", names), ("embed", names[-1])])
  sharding = rules.sharding(("batch", "embed"), mesh, (16, 4))
  assert isinstance(sharding, NamedSharding)
  x = jax.device_put(jnp.ones((16, 4)), sharding)
  assert x.sharding.spec == P(names if len(names) > 1 else names[0], None)
  assert x.addressable_shards[0].data.shape == (16 // 8, 4)


def test_sharding_needs_a_mesh():
  with pytest.raises(ValueError, match="needs a mesh"):
    AxisRules([("batch", "x")]).sharding(("batch",), None)
  mesh = make_mesh((8,), ("x",))
  with jax.set_mesh(mesh):
    assert AxisRules([("batch", "x")]).sharding(("batch",), None).spec == P("x")


# -- strict mode --------------------------------------------------------------------------


def test_strict_unknown_name_did_you_mean():
  rules = AxisRules([("mlp", "tensor"), ("embed", "fsdp")])
  assert rules.spec(("embed", "mpl")) == P("fsdp", None)
  with pytest.raises(partition.ResolutionError,
                     match=r"(?s)'mpl' has no rule \(did you mean 'mlp'\?\).*strict=False"):
    rules.spec(("embed", "mpl"), strict=True)


def test_strict_unknown_mesh_axis_did_you_mean():
  mesh = make_mesh((4, 2), ("data", "tensor"))
  rules = AxisRules([("mlp", "tensr")])
  with pytest.raises(ValueError, match=r"'tensr', which is not a mesh axis \(did you mean "
                                       r"'tensor'\?\)"):
    rules.spec(("mlp",), (8,), mesh, strict=True)


def test_strict_indivisible_collects_all_problems():
  mesh = make_mesh((4, 2), ("data", "tensor"))
  rules = AxisRules([("batch", "data"), ("mlp", "tensor"), ("mlp", "data")])
  assert rules.spec(("batch", "mlp"), (8, 3), mesh) == P("data", None)
  with pytest.raises(ValueError) as err:
    rules.spec(("batch", "mlp", "oops"), (6, 3, 1), mesh, strict=True)
  msg = str(err.value)
  assert "dim 0 'batch': no rule divides it (size 6, needs a multiple of 4)" in msg
  assert "dim 1 'mlp': no rule divides it" in msg and "'oops' has no rule" in msg
  assert "pad the dim" in msg
  # a fallback that divides is not an error, even in strict mode
  fallback = AxisRules([("mlp", "data"), ("mlp", "tensor")])
  assert fallback.spec(("mlp",), (2,), mesh, strict=True) == P("tensor")


# -- trees ----------------------------------------------------------------------------------


def test_tree_specs_and_shardings():
  mesh = make_mesh((4, 2), ("fsdp", "tensor"))
  rules = AxisRules([("embed", "fsdp"), ("mlp", "tensor")])
  axes = {"w": ("embed", "mlp"), "b": ("mlp",), "scale": None, "step": ()}
  shapes = {"w": jax.ShapeDtypeStruct((6, 8), jnp.float32), "b": jnp.zeros(8),
            "scale": jnp.zeros(3), "step": jnp.zeros(())}
  assert rules.tree_specs(axes) == {"w": P("fsdp", "tensor"),
                                    "b": P("tensor"), "scale": P(), "step": P()}
  assert rules.tree_specs(axes, shapes, mesh)["w"] == P(None, "tensor")
  shardings = rules.tree_shardings(axes, mesh, shapes)
  assert shardings["w"] == NamedSharding(mesh, P(None, "tensor"))
  assert shardings["scale"].spec == P()
  params = jax.jit(lambda: jax.tree.map(jnp.zeros_like, shapes), out_shardings=shardings)()
  assert params["b"].sharding.spec == P("tensor")


def test_tree_errors_name_every_leaf():
  rules = AxisRules([("embed", "fsdp")])
  axes = {"a": ("embed",), "b": ("embed", "embed", None), "c": ("oops",)}
  shapes = {"a": jnp.zeros((2, 2)), "b": jnp.zeros((2, 2)), "c": jnp.zeros(2)}
  with pytest.raises(ValueError) as err:
    rules.tree_specs(axes, shapes, strict=True)
  msg = str(err.value)
  # paths in the project's one format, a/b/c
  assert "3 leaf/leaves" in msg and "* a: Logical axes ('embed',) name 1 dims" in msg
  assert "* b:" in msg and "* c:" in msg and "'oops' has no rule" in msg
  with pytest.raises(ValueError, match="do not match"):
    rules.tree_specs({"a": ("embed",)}, {"b": jnp.zeros(2)})


# -- xmap resources ------------------------------------------------------------------------


def test_xmap_resources_resolution():
  mesh = make_mesh((4, 2), ("data", "tensor"))
  rules = AxisRules([("batch", ("data", SerialLoop(4))), ("batch", "data"),
                     ("heads", "tensor"), ("kv", "tensor"), ("mb", SerialLoop(2))])
  out = rules.xmap_resources(["batch", "heads", "kv", "other", "mb"], mesh=mesh,
                             sizes={"batch": 32, "heads": 4, "kv": 4, "other": 3, "mb": 4})
  assert out == {"batch": ("data", SerialLoop(4)), "heads": ("tensor",), "kv": (),
                 "other": (), "mb": (SerialLoop(2),)}
  # 4 * 4 does not divide 8: fall back to 'data' alone
  assert rules.xmap_resources(["batch"], mesh=mesh, sizes={"batch": 8}) == {
      "batch": ("data",)}
  assert rules.xmap_resources(["batch"]) == {"batch": ("data", SerialLoop(4))}


def test_xmap_resources_missing_axes_and_named_loops():
  mesh = make_mesh((8,), ("data",))
  rules = AxisRules([("batch", ("data", "fsdp")), ("mb", "loop")])
  assert rules.xmap_resources(["batch"], mesh=mesh) == {"batch": ("data",)}
  with pytest.raises(ValueError, match="'fsdp', which is not a mesh axis"):
    rules.xmap_resources(["batch"], mesh=mesh, strict=True)
  with partition.serial_loop("loop", 2):
    assert rules.xmap_resources(["mb"], mesh=mesh, sizes={"mb": 4}) == {"mb": ("loop",)}
    assert rules.xmap_resources(["mb"], mesh=mesh, sizes={"mb": 3}) == {"mb": ()}


def test_xmap_resources_warn_false_resolves_the_same_without_a_word():
  """value_and_grad asks quietly (it warns about the batch leaf itself); a direct call's
  warnings name the caller's line (they pointed into pytest's plugin machinery)."""
  mesh = make_mesh((4, 2), ("data", "tensor"))
  rules = AxisRules([("batch", ("data", "fsdp")), ("heads", SerialLoop(4))])
  sizes = {"batch": 8, "heads": 6}
  with warnings.catch_warnings(record=True) as loud:
    warnings.simplefilter("always")
    want = rules.xmap_resources(["batch", "heads"], mesh=mesh, sizes=sizes)
  assert sorted(str(w.message).split(":")[0] for w in loud) == [
      "xmap axis 'batch'", "xmap axis 'heads' (size 6) gets no resources"]
  assert {w.filename for w in loud} == {__file__}
  with warnings.catch_warnings(record=True) as quiet:
    warnings.simplefilter("always")
    got = rules.xmap_resources(["batch", "heads"], mesh=mesh, sizes=sizes, warn=False)
  assert got == want == {"batch": ("data",), "heads": ()} and quiet == []
  with pytest.raises(TypeError, match=r"xmap_resources\(warn=...\) takes True or False"):
    rules.xmap_resources(["batch"], warn="no")


# -- what the table asks for: mesh axes, serial loops ---------------------------------------

loop_values = st.one_of(values, st.tuples(
    st.lists(st.sampled_from(MESH_AXES), max_size=2, unique=True),
    st.integers(1, 8)).map(lambda t: (*t[0], SerialLoop(t[1]))))
loop_tables = st.lists(st.tuples(st.sampled_from(NAMES), loop_values), max_size=8)


def test_mesh_axes_in_first_appearance_order():
  rules = AxisRules([("kv", None), ("mlp", "tensor"), ("batch", ("data", "fsdp")),
                     ("embed", "fsdp"), ("mb", SerialLoop(2)),
                     ("batch", ("data", SerialLoop(4))), ("heads", ("expert", "tensor"))])
  assert rules.mesh_axes == ("tensor", "data", "fsdp", "expert")
  assert AxisRules().mesh_axes == () and AxisRules([("kv", None)]).mesh_axes == ()
  assert AxisRules({"batch": "data"}).mesh_axes == ("data",)
  # a loop name bound by serial_loop looks like a mesh axis to the table alone
  assert AxisRules([("mb", "loop")]).mesh_axes == ("loop",)


@settings(max_examples=200, deadline=None)
@given(loop_tables)
def test_mesh_axes_match_the_file_form(table):
  # Reference: the YAML/dict form, read the way recipes read it before AxisRules answered.
  expected = []
  for _, value in AxisRules(table).to_dict()["rules"]:
    for r in value if isinstance(value, list) else [value]:
      if isinstance(r, str) and r not in expected:
        expected.append(r)
  assert AxisRules(table).mesh_axes == tuple(expected)


def test_serial_loops_are_those_of_each_names_first_rule():
  rules = AxisRules([("batch", ("data", SerialLoop(4))), ("batch", "data"),
                     ("mb", {"serial_loop": 2}), ("embed", "fsdp"),
                     ("heads", "tensor"), ("heads", ("tensor", SerialLoop(3))),
                     ("kv", None), ("named", "loop")])
  # heads: only its fallback loops; named: a loop name, not a SerialLoop
  assert rules.serial_loops == {"batch": SerialLoop(4), "mb": SerialLoop(2)}
  assert AxisRules().serial_loops == {}
  assert AxisRules.from_file(PRESETS / "microbatch.yaml").serial_loops == {
      "batch": SerialLoop(4)}
  assert AxisRules.from_file(PRESETS / "fsdp.yaml").serial_loops == {}


@settings(max_examples=200, deadline=None)
@given(loop_tables)
def test_serial_loops_are_what_xmap_runs_without_a_mesh(table):
  # Reference: the resolver. Without a mesh or sizes nothing blocks a name's first rule.
  rules = AxisRules(table)
  loops = rules.serial_loops
  for name in rules.names:
    resources = rules.xmap_resources([name])[name]
    tail = resources[-1] if resources and isinstance(resources[-1], SerialLoop) else None
    assert loops.get(name) == tail


def test_without_serial_loops():
  rules = AxisRules([("batch", ("data", SerialLoop(4))), ("batch", "data"),
                     ("mb", SerialLoop(2)), ("heads", ("tensor", SerialLoop(3))),
                     ("kv", None)])
  assert rules.without_serial_loops() == AxisRules(
      [("batch", "data"), ("batch", "data"), ("mb", None), ("heads", "tensor"), ("kv", None)])
  assert rules.without_serial_loops("batch", "kv") == AxisRules(
      [("batch", "data"), ("batch", "data"), ("mb", SerialLoop(2)),
       ("heads", ("tensor", SerialLoop(3))), ("kv", None)])
  assert rules.without_serial_loops("mb").serial_loops == {"batch": SerialLoop(4),
                                                           "heads": SerialLoop(3)}
  assert rules.without_serial_loops().serial_loops == {}
  assert rules.pairs[0] == ("batch", ("data", SerialLoop(4)))  # unchanged
  assert AxisRules().without_serial_loops() == AxisRules()


@settings(max_examples=200, deadline=None)
@given(loop_tables, axes_tuples)
def test_without_serial_loops_keeps_array_shardings(table, axes):
  # Reference: the specs of the table itself (arrays ignore loops); xmap sees no loop.
  rules = AxisRules(table)
  plain = rules.without_serial_loops()
  assert plain.spec(tuple(axes)) == rules.spec(tuple(axes))
  assert plain.mesh_axes == rules.mesh_axes and len(plain) == len(rules)
  assert not any(isinstance(r, SerialLoop) for _, v in plain for r in v or ())


def test_without_serial_loops_bad_names():
  rules = AxisRules([("batch", ("data", SerialLoop(4))), ("mlp", "tensor")])
  with pytest.raises(partition.RulesError, match=r"1 name\(s\) without a rule:\n.*\n"
                     r"  \* 'bacth' has no rule \(did you mean 'batch'\?\)\nName logical"):
    rules.without_serial_loops("bacth", "mlp")
  with pytest.raises(partition.RulesTypeError, match=r"names\[0\] is tuple \('batch',\); a "
                     "logical name is a str"):
    rules.without_serial_loops(("batch",))
