"""Random junk at every public entry point of the rules engine (hypothesis).

Each call either succeeds (and then the result is checked against an independent reading of
the input) or raises a ``PartitionError`` that is also a ``ValueError``/``TypeError`` and
names the offending token. Never another exception type, never a changed file.
"""

import json
import os
import pathlib
import tempfile

import jax
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from mesh_testlib import make_mesh

import partition
from partition import AxisRules, PartitionError, SerialLoop

SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
MESH = make_mesh((2, 4), ("data", "fsdp"), AxisType.Auto)
BASE = AxisRules([("batch", ("data", "fsdp")), ("batch", "data"), ("embed", "fsdp"),
                  ("kv", None), ("micro", ("data", SerialLoop(2)))])

scalars = (st.none() | st.booleans() | st.integers(-3, 2 ** 22) | st.floats(allow_nan=True)
           | st.text(alphabet="abfdt_=:,[]{} .-", max_size=8))
junk = st.recursive(
    scalars,
    lambda inner: (st.lists(inner, max_size=4) | st.tuples(inner, inner)
                   | st.dictionaries(st.text(alphabet="abrs_lopie", max_size=11), inner,
                                     max_size=3)),
    max_leaves=12)
names = st.text(alphabet="abdeht_", min_size=1, max_size=6)
axes_values = st.none() | names | st.lists(names, max_size=3).map(tuple)
good_pairs = st.lists(st.tuples(names, axes_values), max_size=5)


def assert_clear(e: BaseException, *tokens: str) -> None:
  """A PartitionError that is a ValueError/TypeError and names one of ``tokens``."""
  assert isinstance(e, PartitionError), f"{type(e).__name__}: {e}"
  assert isinstance(e, (ValueError, TypeError))
  if tokens:
    assert any(t in str(e) for t in tokens), (tokens, str(e))


def expected_pairs(raw):
  """An independent reading of valid (name, value) pairs: what AxisRules must hold."""
  out = []
  for name, value in raw:
    items = () if value is None else (value,) if isinstance(value, str) else tuple(value)
    out.append((name, items or None))
  return out


@SETTINGS
@given(junk)
def test_constructor_takes_junk(raw):
  try:
    rules = AxisRules(raw)
  except Exception as e:  # noqa: BLE001 - the assertion is on the type
    assert_clear(e, "pairs[", "AxisRules(pairs) takes")
  else:
    assert all(isinstance(n, str) and n.strip() for n, _ in rules.pairs)
    assert rules == AxisRules(rules.to_dict()["rules"])


@SETTINGS
@given(good_pairs)
def test_constructor_keeps_valid_pairs(raw):
  dups = [v for _, v in raw if isinstance(v, tuple) and len(set(v)) < len(v)]
  try:
    rules = AxisRules(raw)
  except Exception as e:  # noqa: BLE001
    assert dups, str(e)
    assert_clear(e, "is repeated in one entry")
  else:
    assert not dups and list(rules.pairs) == expected_pairs(raw)


@SETTINGS
@given(junk)
def test_from_dict_takes_junk(doc):
  try:
    AxisRules.from_dict(doc)
  except Exception as e:  # noqa: BLE001
    assert_clear(e, "rules", "top level")


override_text = st.text(alphabet="ambtd=,:._-!() 0123456789serial_loopnul", max_size=24)


@SETTINGS
@given(st.lists(override_text | st.lists(override_text, max_size=3) | junk, max_size=3))
def test_override_takes_junk(items):
  try:
    rules = BASE.override(*items)
  except Exception as e:  # noqa: BLE001
    tokens = [repr(t) for t in items if isinstance(t, str)]
    tokens += [repr(t) for x in items if isinstance(x, list) for t in x if isinstance(t, str)]
    assert_clear(e, *tokens, "override #", "override(s)")
  else:
    assert isinstance(rules, AxisRules) and len(rules) >= 1


@SETTINGS
@given(st.sampled_from(["batch", "embed", "kv", "x"]), override_text)
def test_valid_override_strings_match_an_independent_parse(name, rhs):
  text = f"{name}={rhs}"
  try:
    rules = BASE.override(text)
  except Exception as e:  # noqa: BLE001
    assert_clear(e, repr(text))
    return
  got = dict(rules.pairs)[name]
  tokens = [t.strip() for t in rhs.split(",")]
  if rhs.strip().lower() in ("", "null", "none", "~"):
    assert got is None
  else:
    assert len(got) == len(tokens)
    for token, res in zip(tokens, got):
      if isinstance(res, SerialLoop):
        assert token.endswith(str(res.length)) and "loop" in token.lower()
      else:
        assert res == token and "=" not in token and " " not in token


shapes = junk | st.tuples(st.integers(-2, 16), st.integers(-2, 16)) | st.lists(
    st.floats(0, 16) | st.integers(0, 16) | st.text(max_size=2), max_size=3).map(tuple)
logical = junk | st.tuples(st.sampled_from(["batch", "embed", "kv", None]),
                           st.sampled_from(["batch", "embed", "kv", None]))


@SETTINGS
@given(logical, shapes, st.sampled_from([None, MESH, "mesh", 3]), st.booleans())
def test_spec_resolve_and_sharding_take_junk(axes, shape, mesh, strict):
  try:
    spec = BASE.spec(axes, shape, mesh, strict)
  except Exception as e:  # noqa: BLE001
    assert_clear(e, "logical_axes", "shape", "mesh", "PartitionSpec", "Logical axes",
                 "Strict resolution")
    return
  assert isinstance(spec, P)
  if isinstance(axes, tuple) and shape is not None:
    assert len(spec) == len(axes)
    used = [a for e in spec if e for a in ((e,) if isinstance(e, str) else e)]
    assert len(used) == len(set(used))  # never a repeated mesh axis
  if mesh is MESH:
    assert partition.AxisRules.sharding(BASE, axes, MESH, shape, strict).spec == spec


@SETTINGS
@given(junk, st.sampled_from([None, MESH]))
def test_tree_specs_take_junk(tree, mesh):
  try:
    BASE.tree_specs(tree, None, mesh)
  except Exception as e:  # noqa: BLE001
    assert_clear(e, "AxisRules.tree_specs", "logical_axes", "PartitionSpec")


@SETTINGS
@given(junk, junk)
def test_xmap_resources_take_junk(names_arg, sizes):
  try:
    res = BASE.xmap_resources(names_arg, sizes=sizes)
  except Exception as e:  # noqa: BLE001
    assert_clear(e, "names", "sizes", "Strict")
  else:
    assert not isinstance(names_arg, str)
    assert list(res) == list(dict.fromkeys(names_arg))


file_text = (st.text(max_size=200)
             | junk.map(lambda d: yaml.safe_dump(d))
             | junk.map(lambda d: json.dumps(d))
             | st.builds(lambda r: yaml.safe_dump({"rules": r}), junk)
             | st.binary(max_size=64).map(lambda b: b.decode("latin-1")))


@SETTINGS
@given(file_text, st.sampled_from(["yaml", "json", "toml"]),
       st.sampled_from([None, "rules", "a.b", "logical_axis_rules"]) | junk)
def test_from_file_takes_junk_and_never_changes_the_file(text, fmt, key):
  with tempfile.TemporaryDirectory() as d:
    path = pathlib.Path(d) / f"r.{fmt}"
    path.write_bytes(text.encode("utf-8", "surrogatepass"))
    before = path.read_bytes()
    try:
      AxisRules.from_file(path, key=key)
    except Exception as e:  # noqa: BLE001
      assert_clear(e, str(path), "key=")
    assert path.read_bytes() == before and os.listdir(d) == [path.name]


any_text = st.text(min_size=1, max_size=5)  # any unicode: emoji, DEL, controls, quotes


@SETTINGS
@given(good_pairs | st.lists(st.tuples(any_text, st.none() | any_text), max_size=4),
       st.sampled_from(["yaml", "toml", "json", "xml", None, 3]),
       st.sampled_from(["r.yaml", "r.toml", "r.json", "r.txt", "missing/r.yaml"]))
def test_to_file_round_trips_or_leaves_the_old_file(raw, fmt, name):
  try:
    rules = AxisRules(raw)
  except PartitionError:
    return
  with tempfile.TemporaryDirectory() as d:
    path = pathlib.Path(d) / name
    if path.parent.exists():
      path.write_text("old: contents\n")
    before = sorted(os.listdir(d))
    try:
      rules.to_file(path, format=fmt)
    except Exception as e:  # noqa: BLE001
      assert_clear(e, "format", "extension", "does not exist")
      assert sorted(os.listdir(d)) == before
      if path.exists():
        assert path.read_text() == "old: contents\n"
    else:
      assert AxisRules.from_file(path, format=fmt) == rules


@pytest.mark.parametrize("length", [0, -1, 1.5, "4", True, None, 2 ** 21])
def test_serial_loop_lengths(length):
  for call in (lambda: SerialLoop(length), lambda: partition.serial_loop("l", length).__enter__()):
    with pytest.raises(PartitionError, match=r"positive int") as e:
      call()
    assert_clear(e.value, repr(length) if not isinstance(length, bool) else "True")


@SETTINGS
@given(logical, st.sampled_from([(8, 4), (6, 4), (8,)]), st.booleans())
def test_constrain_takes_junk(axes, shape, strict):
  x = jax.numpy.ones(shape)
  with partition.axis_rules(BASE, MESH):
    try:
      y = partition.constrain(x, axes, strict=strict)
    except Exception as e:  # noqa: BLE001
      assert_clear(e, "partition.constrain")
    else:
      assert y.shape == x.shape and (y == x).all()
      if isinstance(axes, tuple) and len(axes) == len(shape):
        assert y.sharding.spec == BASE.spec(axes, shape, MESH)
