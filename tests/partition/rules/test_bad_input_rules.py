"""Bad input to the rules engine and rules files: clear errors, no lost files, no silent rules.

Issue 9 (rules/config side) and issue 8 item 3 (rules embedded in peers' configs). Every
error test asserts the class (a PartitionError that is also ValueError/TypeError) and the
text that names the offending token and the fix.
"""

import json
import os
import pathlib
import re
import stat

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from mesh_testlib import make_mesh

import partition
from partition import AxisRules, MeshError, ResourceError, RulesConfigError, RulesError, SerialLoop
from partition._base.io import FileError, atomic_write, read_bytes
from partition._rules.errors import RulesConfigTypeError, RulesTypeError
from partition._rules.table import is_axes_leaf

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"
RULES = AxisRules([("batch", ("data", "fsdp")), ("embed", "fsdp"), ("mlp", "tensor"),
                   ("kv", None), ("microbatch", SerialLoop(4))])


# -- atomic writes ----------------------------------------------------------------------------


@pytest.fixture
def keep(tmp_path):
  path = tmp_path / "keep.yaml"
  path.write_text("rules:\n  - [batch, data]  # hand-written, must survive\n")
  return path


@pytest.mark.parametrize("kwargs, match", [
    ({"format": "xml"}, r"Unknown rules format 'xml'.*use one of 'yaml', 'toml', 'json'"),
    ({"format": 3}, r"Unknown rules format 3"),
])
def test_to_file_bad_format_leaves_the_file_byte_identical(keep, kwargs, match):
  before = keep.read_bytes()
  with pytest.raises(RulesConfigError, match=match):
    RULES.to_file(keep, **kwargs)
  assert keep.read_bytes() == before
  assert sorted(os.listdir(keep.parent)) == ["keep.yaml"]


def test_to_file_unknown_extension_leaves_the_file(tmp_path):
  notes = tmp_path / "notes.txt"
  notes.write_text("my notes\n")
  with pytest.raises(RulesConfigError, match=r"(?s)from its extension '.txt'.*format='yaml'"):
    RULES.to_file(notes)
  assert notes.read_text() == "my notes\n"


def test_to_file_missing_directory_and_directory_path(tmp_path):
  with pytest.raises(RulesConfigError, match=r"the directory .*nope' does not exist\. Create it"):
    RULES.to_file(tmp_path / "nope" / "r.yaml")
  (tmp_path / "d.yaml").mkdir()
  with pytest.raises(RulesConfigError, match=r"it is a directory\. Pass a file name inside it"):
    RULES.to_file(tmp_path / "d.yaml")


def test_to_file_failure_mid_write_keeps_the_old_file(keep, monkeypatch):
  before = keep.read_bytes()

  def broken_replace(src, dst):
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(os, "replace", broken_replace)
  with pytest.raises(RulesConfigError,
                     match=r"No space left on device\. The old file .* unchanged"):
    RULES.to_file(keep)
  assert keep.read_bytes() == before
  assert sorted(os.listdir(keep.parent)) == ["keep.yaml"]  # no temporary file left


def test_format_names_are_case_insensitive(tmp_path):
  RULES.to_file(tmp_path / "r.cfg", format="TOML")
  assert AxisRules.from_file(tmp_path / "r.cfg", format="Toml") == RULES


def test_to_file_replaces_and_keeps_permissions(keep):
  keep.chmod(0o640)
  RULES.to_file(keep)
  assert AxisRules.from_file(keep) == RULES
  assert stat.S_IMODE(keep.stat().st_mode) == 0o640


def test_to_file_through_a_symlink_writes_the_target(tmp_path):
  target = tmp_path / "real.json"
  target.write_text("{}")
  (tmp_path / "link.json").symlink_to(target)
  RULES.to_file(tmp_path / "link.json")
  assert (tmp_path / "link.json").is_symlink()
  assert AxisRules.from_file(target) == RULES


def test_atomic_write_helpers(tmp_path):
  atomic_write(tmp_path / "b.bin", b"\x00\x01")
  assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
  atomic_write(str(tmp_path / "t.txt"), "é\n")
  assert (tmp_path / "t.txt").read_text(encoding="utf-8") == "é\n"
  with pytest.raises(FileError, match="does not exist"):
    atomic_write(tmp_path / "x" / "y", "z")
  with pytest.raises(TypeError, match="must be a file path"):
    atomic_write(None, "z")
  (tmp_path / "big").write_bytes(b"x" * 11)
  with pytest.raises(FileError, match="larger than 10 bytes"):
    read_bytes(tmp_path / "big", max_bytes=10)


# -- reading files: paths, duplicates, depth, size ------------------------------------------


@pytest.mark.parametrize("path", [None, 3, 2.5, ["r.yaml"]])
def test_from_file_path_of_wrong_type(path):
  with pytest.raises(RulesConfigTypeError,
                     match=r"must be a file path .*got " + type(path).__name__):
    AxisRules.from_file(path)
  assert issubclass(RulesConfigTypeError, TypeError)
  assert issubclass(RulesConfigTypeError, RulesConfigError)


def test_from_file_bytes_path_equals_str_path(tmp_path):
  RULES.to_file(tmp_path / "r.yaml")
  assert AxisRules.from_file(os.fsencode(tmp_path / "r.yaml")) == RULES


def test_from_file_directory_and_too_large(tmp_path):
  with pytest.raises(RulesConfigError, match=r"Cannot read rules file .*Is a directory"):
    AxisRules.from_file(tmp_path, format="yaml")
  big = tmp_path / "big.yaml"
  big.write_text("rules: []\n" + "#" * (1 << 20))
  with pytest.raises(RulesConfigError, match=r"larger than 1048576 bytes"):
    AxisRules.from_file(big)


@pytest.mark.parametrize("name, text, match", [
    ("d.yaml", "rules:\n  - [a, x]\ndescription: one\nrules: []\n",
     r"key 'rules' is given twice \(line 1 and line 4\)"),
    ("d.yml", "rules:\n  - [a, {serial_loop: 2, serial_loop: 4}]\n",
     r"key 'serial_loop' is given twice \(line 2 and line 2\)"),
    ("d.json", '{"rules": [["a", "x"]],\n "description": "d",\n "rules": []}',
     r"key 'rules' is given twice in one object \(lines 1 and 3\)"),
    ("d.toml", 'rules = [["a", "x"]]\nrules = []\n',
     r"(?s)Cannot overwrite a value \(at line 2, column 11\).*line 2: rules = \[\] \(a key "
     r"given twice\?\)"),
], ids=lambda v: v if isinstance(v, str) and len(v) < 24 else "-")
def test_duplicate_keys_are_errors_with_lines(tmp_path, name, text, match):
  (tmp_path / name).write_text(text)
  with pytest.raises(RulesConfigError, match=match):
    AxisRules.from_file(tmp_path / name)


def test_yaml_merge_keys_are_not_duplicates(tmp_path):
  (tmp_path / "m.yaml").write_text(
      "base: &b {rules: [[a, x]], description: d}\nfull:\n  <<: *b\n  description: e\n")
  assert AxisRules.from_file(tmp_path / "m.yaml", key="full") == AxisRules([("a", "x")])


@pytest.mark.parametrize("name, text", [
    ("deep.yaml", "rules: " + "[" * 3000 + "]" * 3000),
    ("block.yaml", "rules:\n" + "- " * 3000 + "a\n"),
    ("deep.json", '{"rules": ' + "[" * 3000 + "]" * 3000 + "}"),
    ("deep.toml", "rules = " + "[" * 3000 + "]" * 3000),
    ("self.yaml", "rules: &a [*a]\n"),
    ("nest.json", '{"rules": ' + "[" * 70 + "]" * 70 + "}"),
], ids=lambda v: v if isinstance(v, str) and len(v) < 24 else "-")
@pytest.mark.slow
def test_deep_nesting_is_a_clear_error_not_recursion(tmp_path, name, text):
  (tmp_path / name).write_text(text)
  with pytest.raises(RulesConfigError, match=r"nested (more deeply than Python can parse|more "
                                        r"than 64 levels deep)"):
    AxisRules.from_file(tmp_path / name)


def test_alias_bomb_hits_the_node_limit(tmp_path):
  lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
  lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 8)]
  (tmp_path / "bomb.yaml").write_text("\n".join(lines) + "\nrules: []\n")
  with pytest.raises(RulesConfigError, match=r"more than 200000 values \(YAML aliases count"):
    AxisRules.from_file(tmp_path / "bomb.yaml")


@pytest.mark.parametrize("name, text, match", [
    ("date.yaml", "rules: [[a, 2001-13-45]]\n", r"not valid YAML"),
    ("digits.json", '{"rules": [["a", ' + "9" * 5000 + "]]}", r"not valid JSON"),
    ("bin.yaml", b"rules: [[a, \x00]]", r"not valid YAML"),
    ("utf.toml", b'rules = [["a", "\xff"]]', r"not valid TOML"),
], ids=lambda v: v if isinstance(v, str) and len(v) < 24 else "-")
def test_parser_crashes_become_config_errors(tmp_path, name, text, match):
  path = tmp_path / name
  path.write_bytes(text if isinstance(text, bytes) else text.encode())
  with pytest.raises(RulesConfigError, match=match):
    AxisRules.from_file(path)


def test_serial_loop_lengths_are_bounded(tmp_path):
  (tmp_path / "l.yaml").write_text("rules:\n  - [b, {serial_loop: 2097152}]\n"
                                   "  - [c, {serial_loop: 1.5}]\n")
  with pytest.raises(RulesConfigError, match=r"(?s)rules\[0\].*at most 1048576; got 2097152.*"
                                        r"rules\[1\].*positive int, got float 1\.5"):
    AxisRules.from_file(tmp_path / "l.yaml")
  with pytest.raises(ResourceError, match=r"positive int, got 2097152 \(at most 1048576"):
    SerialLoop(2 ** 21)
  assert SerialLoop(np.int64(4)) == SerialLoop(4) and type(SerialLoop(np.int64(4)).length) is int
  with pytest.raises(ResourceError, match=r"(?s)name: a loop name is a non-empty str.*"
                                          r"length: a loop length is a positive int"):
    with partition.serial_loop("", 1.5):
      pass


# -- overrides --------------------------------------------------------------------------------


@pytest.mark.parametrize("text, match", [
    ("mlp=tensor=x", r"'mlp=tensor=x': mesh axis 'tensor=x' contains '=' \(one override sets "
                     r"one name"),
    ("mlp=serial_loop:-1", r"loop length '-1' in 'serial_loop:-1' is not a positive int"),
    ("batch=serial_loop:1.5", r"loop length '1.5' in 'serial_loop:1.5' is not a positive int"),
    ("batch=serial_loop:0", r"loop length 0 in 'serial_loop:0' is not from 1 to 1048576"),
    ("batch=data,,fsdp", r"an empty mesh axis name"),
    ("batch=data,null", r"'null' in a list of mesh axes"),
    ("mlp", r"'mlp' is not of the form name=mesh_axes"),
    ("=tensor", r"'=tensor' is not of the form name=mesh_axes"),
    ("m lp=tensor", r"logical name 'm lp' in 'm lp=tensor' is not a name"),
    ("mlp=ten sor", r"mesh axis 'ten sor' contains ' '"),
])
def test_bad_override_strings(text, match):
  with pytest.raises(RulesError, match=match) as e:
    RULES.override(text)
  assert "Write one override per string as name=mesh_axes" in str(e.value)


def test_override_collects_every_problem_of_the_call():
  with pytest.raises(RulesError, match=r"(?s)got 3 invalid override\(s\).*'a=b=c'.*"
                                       r"'serial_loop:x'.*override #2 3"):
    RULES.override("a=b=c", "b=serial_loop:x", 3)


def test_override_list_is_several_overrides():
  assert RULES.override(["mlp=fsdp", "kv=null"]) == RULES.override("mlp=fsdp", "kv=null")
  assert RULES.override(["mlp=fsdp", "kv=null"]).pairs[2:4] == (("mlp", ("fsdp",)),
                                                                ("kv", None))
  assert RULES.override(("heads", "tensor")).pairs[-1] == ("heads", ("tensor",))
  with pytest.raises(RulesError, match=r"logical name 'mlp=fsdp' contains '='"):
    RULES.override(("mlp=fsdp", "kv"))


@pytest.mark.parametrize("bad", [3, None, 2.5, [1, 2, 3]])
def test_override_wrong_types(bad):
  with pytest.raises(RulesTypeError, match=r"override #0 .*expected a 'name=axes' str"):
    RULES.override(bad)


def test_override_keywords_are_validated():
  with pytest.raises(RulesError, match=r"keyword\[0\].*got int 3"):
    RULES.override(mlp=3)


# -- shapes, meshes, PartitionSpecs, names ----------------------------------------------------


@pytest.mark.parametrize("shape, match", [
    ((8.5,), r"shape\[0\] is float 8\.5; a dim size is an int >= 0"),
    ((-8,), r"shape\[0\] is int -8"),
    (("a",), r"shape\[0\] is str 'a'"),
    ((True,), r"shape\[0\] is bool True"),
    (8, r"shape must be a tuple of ints, got int 8"),
    ("ab", r"shape must be a tuple of ints, got str 'ab'"),
])
def test_bad_shapes(shape, match):
  for call in (lambda: RULES.spec(("batch",), shape), lambda: RULES.resolve(("batch",), shape)):
    with pytest.raises(RulesTypeError, match=match):
      call()


def test_every_shape_problem_in_one_message_and_numpy_ints():
  with pytest.raises(RulesTypeError, match=r"(?s)logical_axes must be a tuple of names, got "
                                           r"the str 'batch'.*shape\[0\] is float.*shape\[1\]"):
    RULES.spec("batch", (8.5, -1))
  mesh = make_mesh((2, 4), ("data", "fsdp"))
  assert RULES.spec(("batch", "embed"), (np.int64(16), np.int32(8)), mesh) == RULES.spec(
      ("batch", "embed"), (16, 8), mesh) == P(("data", "fsdp"), None)


@pytest.mark.parametrize("call", [
    lambda m: RULES.spec(("batch",), (8,), m),
    lambda m: RULES.resolve(("batch",), mesh=m),
    lambda m: RULES.sharding(("batch",), m),
    lambda m: RULES.tree_specs({"a": ("batch",)}, mesh=m),
    lambda m: RULES.tree_shardings({"a": ("batch",)}, m),
    lambda m: RULES.xmap_resources(["batch"], mesh=m),
])
def test_mesh_of_wrong_type(call):
  with pytest.raises(MeshError, match=r"takes a jax.sharding.Mesh or AbstractMesh, got str "
                                      r"'mesh'\. Build one with jax.make_mesh"):
    call("mesh")


def test_partition_spec_leaves_are_checked():
  mesh = make_mesh((2, 4), ("data", "fsdp"))
  with pytest.raises(RulesError, match=r"mesh axis 'data' is used by entries 0 and 1"):
    RULES.spec(P("data", "data"))
  with pytest.raises(RulesError, match=r"entry 0: 'tensr' is not a mesh axis"):
    RULES.sharding(P("tensr"), mesh)
  with pytest.raises(RulesError, match=r"has 2 entries but the shape \(8,\) only 1"):
    RULES.spec(P("data", None), (8,))
  # A valid spec passes through, as JAX would place it.
  got = RULES.tree_shardings({"w": P("fsdp", None)}, mesh)["w"]
  assert got == NamedSharding(mesh, P("fsdp", None))
  with pytest.raises(RulesError, match=r"(?s)\* b: AxisRules.spec: the PartitionSpec .* "
                                       r"mesh axis 'fsdp' is used by entries 0 and 1"):
    RULES.tree_specs({"a": ("batch",), "b": P("fsdp", "fsdp")})


def test_xmap_resources_never_splits_a_str():
  with pytest.raises(RulesTypeError, match=r"names\) got the str 'batch'; pass a list of axis "
                                           r"names, e.g. \['batch'\]"):
    RULES.xmap_resources("batch")
  assert RULES.xmap_resources(("batch",)) == {"batch": ("data", "fsdp")}
  with pytest.raises(RulesTypeError, match=r"(?s)names\[1\] 'batch' repeats names\[0\].*"
                                           r"names\[2\] is 3.*sizes\['batch'\] is -1; a size "
                                           r"is an int >= 0"):
    RULES.xmap_resources(["batch", "batch", 3], sizes={"batch": -1})
  # An empty axis (size 0) divides over anything: it keeps its rule.
  assert RULES.xmap_resources(["batch"], sizes={"batch": 0}) == {"batch": ("data", "fsdp")}
  with pytest.raises(RulesTypeError, match=r"sizes must be a mapping"):
    RULES.xmap_resources(["batch"], sizes=[8])


def test_strict_must_be_a_bool():
  with pytest.raises(RulesTypeError, match=r"strict=...\) takes True or False, got str 'yes'"):
    RULES.spec(("batch",), strict="yes")


def test_is_axes_leaf_rejects_named_tuples():
  state = optax.EmptyState()
  assert not is_axes_leaf(state) and is_axes_leaf(()) and is_axes_leaf(["a", None])
  assert not is_axes_leaf(np.zeros(3))  # no elementwise == "" on arrays
  params = {"w": jnp.zeros((8, 4))}
  opt_state = optax.chain(optax.add_decayed_weights(1e-4), optax.sgd(0.1)).init(params)
  axes = optax.tree_map_params(optax.chain(optax.add_decayed_weights(1e-4), optax.sgd(0.1)),
                               lambda _: ("embed", "mlp"), opt_state)
  specs = RULES.tree_specs(axes)
  # Same structure as the state (EmptyState kept as a node, not read as an axes leaf).
  assert jax.tree.structure(specs, is_leaf=lambda x: isinstance(x, P)) == (
      jax.tree.structure(jax.tree.map(lambda _: 0, opt_state)))


def test_tree_errors_name_the_differing_keys():
  shapes = {"w": jax.ShapeDtypeStruct((4, 4), jnp.float32),
            "extra": jax.ShapeDtypeStruct((2,), jnp.float32)}
  with pytest.raises(RulesError, match=r"(?s)\* b: in the logical axes, not in the shapes"
                                       r".*\* extra: in the shapes, not in the logical"):
    RULES.tree_specs({"w": ("embed", "mlp"), "b": ("embed",)}, shapes)
  with pytest.raises(RulesTypeError, match=r"(?s)a dict mixes key types.*\[1, 'a'\].*str"):
    RULES.tree_specs({1: ("embed",), "a": ("mlp",)})


def test_constrain_rejects_a_rules_mesh_on_other_devices():
  small = make_mesh((4,), ("data",), AxisType.Auto, devices=jax.devices()[4:])
  full = make_mesh((8,), ("data",))
  rules = AxisRules([("batch", "data")])
  f = jax.jit(lambda x: partition.constrain(x, ("batch", None)))
  with jax.set_mesh(full), partition.axis_rules(rules, small):
    for call in (lambda: partition.constrain(jnp.ones((8, 2)), ("batch", None)),
                 lambda: f(jnp.ones((8, 2)))):
      with pytest.raises(MeshError, match=r"(?s)use different devices.*rules mesh .*data=4.*"
                                          r"jax.set_mesh mesh: mesh\(data=8.*Use one mesh"):
        call()
  # Same devices, another shape: allowed, and placed as asked.
  with jax.set_mesh(full), partition.axis_rules(rules, make_mesh((4, 2), ("data", "x"))):
    assert f(jnp.ones((8, 2))).sharding.spec == P("data")


# -- rules embedded in peers' configs (issue 8 item 3) ----------------------------------------


def _flax_pairs(raw):
  """A MaxText/T5X rules list as flax's resolver takes it: [] / None -> None."""
  return [(n, None if v in ([], None) else tuple(v) if isinstance(v, list) else v)
          for n, v in raw]


MAXTEXT_AXES = [
    ("activation_batch", "activation_length", "activation_embed"),
    ("activation_batch", "activation_length", "activation_mlp"),
    ("activation_batch", "activation_length", "activation_vocab"),
    ("embed", "mlp"), ("mlp", "embed"), ("vocab", "embed"), ("embed", "heads", "kv"),
    ("norm",), ("layers", "embed", "mlp"), ("exp", "embed", "mlp"), ("kv", "kv_head_dim"),
]


def test_maxtext_config_rules_under_key_equal_flax():
  path = DATA / "maxtext_base_excerpt.yml"
  raw = yaml.safe_load(path.read_text())["logical_axis_rules"]  # the independent reader
  rules = AxisRules.from_file(path, key="logical_axis_rules")
  assert len(rules) == len(raw) and rules.names[0] == "activation_batch"
  assert rules.pairs[-1] == ("cache_batch", None)  # [] means replicated
  for axes in MAXTEXT_AXES:
    assert rules.spec(axes) == nn.logical_to_mesh_axes(axes, _flax_pairs(raw)), axes


def test_maxtext_config_without_key_gets_one_message():
  with pytest.raises(RulesConfigError) as e:
    AxisRules.from_file(DATA / "maxtext_base_excerpt.yml")
  message = str(e.value)
  assert "did you mean key='logical_axis_rules'?" in message
  assert "(1 problem(s))" in message and message.count("\n  * ") == 1


def test_t5x_partitioner_rules_under_dotted_key():
  path = DATA / "t5x_partitioner.toml"
  rules = AxisRules.from_file(path, key="partitioner.logical_axis_rules")
  # t5x.partitioning.standard_logical_axis_rules(1, 1), as the T5X source writes it.
  t5x = [("batch", "data"), ("vocab", "model"), ("embed", None), ("mlp", "model"),
         ("heads", "model"), ("kv", None), ("joined_kv", "model"), ("relpos_buckets", None),
         ("abspos_buckets", None), ("length", None), ("layers", None), ("stack", None),
         ("mlp_activations", None)]
  assert rules == AxisRules(t5x)
  for axes in [("batch", "length", "embed"), ("embed", "mlp"), ("embed", "heads", "kv"),
               ("vocab", "embed"), ("heads", "kv", "joined_kv")]:
    assert rules.spec(axes) == nn.logical_to_mesh_axes(axes, t5x)
  assert AxisRules.from_file(path, key=["partitioner", "logical_axis_rules"]) == rules
  with pytest.raises(RulesConfigError, match=r"did you mean key='partitioner.logical_axis_rules'"):
    AxisRules.from_file(path)


def test_key_errors(tmp_path):
  path = DATA / "maxtext_base_excerpt.yml"
  with pytest.raises(RulesConfigError, match=r"(?s)no key 'logical_axis_rule' in 'the top level' "
                                        r"\(did you mean 'logical_axis_rules'\?\).*Rules lists "
                                        r"found under: 'logical_axis_rules'"):
    AxisRules.from_file(path, key="logical_axis_rule")
  with pytest.raises(RulesConfigError, match=r"'run_name' is a str, not a mapping"):
    AxisRules.from_file(path, key="run_name.rules")
  with pytest.raises(RulesConfigError, match=r"'mesh_axes' holds \['data', 'stage', .*\], not "
                                        r"\[logical_name, mesh_axes\] pairs; did you mean "
                                        r"key='logical_axis_rules'\?"):
    AxisRules.from_file(path, key="mesh_axes")
  for bad in (3, "", [""]):
    with pytest.raises(RulesConfigTypeError, match=r"key= must be a non-empty str"):
      AxisRules.from_file(path, key=bad)
  (tmp_path / "dotted.json").write_text(json.dumps({"a.b": {"rules": [["x", "y"]]}}))
  assert AxisRules.from_file(tmp_path / "dotted.json", key="a.b") == AxisRules([("x", "y")])


def test_from_dict_key_and_many_unknown_keys():
  config = {"model": {"emb": 8, "logical_axis_rules": [["batch", ["data", "fsdp"]],
                                                       ["kv", []]]}}
  assert AxisRules.from_dict(config, key="model.logical_axis_rules") == AxisRules(
      [("batch", ("data", "fsdp")), ("kv", None)])
  junk = {f"k{i}": i for i in range(50)}
  with pytest.raises(RulesError) as e:
    AxisRules.from_dict(junk)
  assert "50 unknown keys ('k0', 'k1', 'k2', ...)" in str(e.value)
  assert str(e.value).count("\n  * ") == 1


# -- docs/errors.md ---------------------------------------------------------------------------

ERRORS_MD = pathlib.Path(__file__).resolve().parents[3] / "docs" / "errors.md"
MINE = {"RulesError", "RulesTypeError", "RulesConfigError", "RulesConfigTypeError", "FileError",
        "NoRulesError", "ResolutionError", "MeshError"}


def _sections():
  text = ERRORS_MD.read_text()
  preamble = re.search(r"after:\n\n```python\n(.*?)```", text, re.S).group(1)
  found = re.findall(r"### `partition\.(\w+)`\n.*?```python\n(.*?)```\n\n```text\n(.*?)```",
                     text, re.S)
  return text, preamble, found


def test_errors_md_documents_every_error_class():
  text, _, sections = _sections()
  defined = set()
  for path in (ERRORS_MD.parents[1] / "partition").rglob("*.py"):
    defined |= set(re.findall(r"^class (\w+Error)\(", path.read_text(), re.M))
  assert defined and not [c for c in defined if f"{c}`" not in text]
  for name, _, _ in sections:
    cls = getattr(partition, name)
    assert issubclass(cls, partition.PartitionError) and issubclass(cls, (ValueError, TypeError))


def test_errors_md_examples_raise_what_they_show(tmp_path, monkeypatch):
  _, preamble, sections = _sections()
  assert len(sections) >= 20
  monkeypatch.chdir(tmp_path)
  env = {}
  exec(preamble, env)
  for name, code, shown in sections:
    with pytest.raises(getattr(partition, name)) as e:
      exec(code, dict(env))
    assert type(e.value) is getattr(partition, name)
    if name in MINE:  # the other classes' wording belongs to their modules' owners
      got = str(e.value).replace(os.getcwd(), "<cwd>")
      assert got.splitlines()[0] == shown.splitlines()[0], name


def test_special_files_are_refused(tmp_path):
  fifo = tmp_path / "pipe.yaml"
  os.mkfifo(fifo)
  with pytest.raises(RulesConfigError, match=r"pipe.yaml' : it is not a regular file|not a regular "
                                        r"file \(a pipe or a device\)"):
    AxisRules.from_file(fifo)  # would block forever in open()
  with pytest.raises(RulesConfigError, match=r"not a regular file"):
    AxisRules.from_file("/dev/zero", format="yaml")
  keep = tmp_path / "ro.json"
  keep.write_text("{}")
  keep.chmod(0o444)
  if not os.access(keep, os.W_OK):  # root may write anything
    with pytest.raises(RulesConfigError, match=r"the file is read-only\. Make it writable"):
      RULES.to_file(keep)
    assert keep.read_text() == "{}"


@pytest.mark.parametrize("x, axes, kw, cls, match", [
    (jnp.ones((8, 4)), "batch", {}, RulesTypeError,
     r"(?s)constrain\(x, 'batch'\): .*got the str 'batch'; write \('batch',\)"),
    (jnp.ones((8, 4)), ("batch", 3), {}, RulesTypeError,
     r"(?s)constrain\(x, \('batch', 3\)\): .*must be a tuple of names \(str or None\)"),
    (jnp.ones((8, 4)), ("batch",), {}, RulesError,
     r"constrain\(x, \('batch',\)\): Logical axes \('batch',\) name 1 dims but the shape "
     r"\(8, 4\) has 2"),
    ("abc", ("batch",), {}, RulesTypeError, r"x must be an array .*got str 'abc'"),
    ({"a": jnp.ones(8)}, {"b": ("batch",)}, {}, RulesError,
     r"(?s)\* b: in the logical axes, not in the shapes.*\* a: in the shapes"),
    (jnp.ones((8, 4)), ("batch", None), {"mesh": "mesh"}, MeshError,
     r"constrain\(mesh=...\) takes a jax.sharding.Mesh or AbstractMesh, got str 'mesh'"),
    (jnp.ones((8, 4)), ("batch", None), {"strict": 1}, RulesTypeError,
     r"constrain\(strict=...\) takes True or False, got 1"),
    (jnp.ones((8, 4)), P("data", "data"), {}, RulesError,
     r"mesh axis 'data' is used by entries 0 and 1"),
    (jnp.ones((8, 4)), ("batch", None), {"rules": "nope.yaml"}, RulesConfigError,
     r"Cannot read rules file 'nope.yaml': No such file"),
])
def test_constrain_bad_input(x, axes, kw, cls, match):
  mesh = make_mesh((4, 2), ("data", "model"))
  with partition.axis_rules(AxisRules([("batch", "data")]), mesh):
    with pytest.raises(cls, match=match):
      partition.constrain(x, axes, **kw)


@pytest.mark.parametrize("ext", ["yaml", "toml", "json"])
def test_odd_names_round_trip_in_every_format(tmp_path, ext):
  odd = ["😀", "a\x7fb", "tab\tx", "q'\"", "a\u2028b", "null", "~", "yes", "1", "#x", "a: b"]
  rules = AxisRules([(n, (n, SerialLoop(2))) for n in odd])
  rules.to_file(tmp_path / f"r.{ext}")
  assert AxisRules.from_file(tmp_path / f"r.{ext}") == rules
