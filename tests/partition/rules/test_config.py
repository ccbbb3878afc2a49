"""Rules files: YAML/TOML/JSON round trips, error messages, presets, the docs' examples."""

import pathlib
import re

import pytest
import yaml
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from mesh_testlib import make_mesh

import partition
from partition import AxisRules, RulesConfigError, SerialLoop

ROOT = pathlib.Path(__file__).resolve().parents[3]
PRESETS = sorted((ROOT / "recipes" / "presets").glob("*.yaml"))

RULES = AxisRules([("batch", ("data", "fsdp")), ("batch", ("data", SerialLoop(4))),
                   ("embed", "fsdp"), ("mlp", "tensor"), ("kv", None),
                   ("microbatch", SerialLoop(4))])


@pytest.mark.parametrize("ext", ["yaml", "yml", "toml", "json"])
def test_round_trip(tmp_path, ext):
  path = tmp_path / f"rules.{ext}"
  RULES.to_file(path)
  assert AxisRules.from_file(path) == RULES
  assert AxisRules.from_file(str(path)).to_dict() == RULES.to_dict()


def test_round_trip_explicit_format(tmp_path):
  path = tmp_path / "rules.txt"
  RULES.to_file(path, format="toml")
  assert AxisRules.from_file(path, format="toml") == RULES


def test_design_md_example_and_toml_forms(tmp_path):
  (tmp_path / "r.yaml").write_text("""
rules:
  - [batch, [data, fsdp]]
  - [embed, fsdp]
  - [mlp, tensor]
  - [heads, tensor]
  - [kv, null]
  - [microbatch, {serial_loop: 4}]
""")
  rules = AxisRules.from_file(tmp_path / "r.yaml")
  assert rules.spec(("batch", "length", "embed")) == P(("data", "fsdp"), None, None)
  assert rules.pairs[-1] == ("microbatch", (SerialLoop(4),))
  (tmp_path / "r.toml").write_text("""
description = "table form"
[rules]
batch = ["data", "fsdp"]
kv = []
microbatch = { serial_loop = 4 }
""")
  assert AxisRules.from_file(tmp_path / "r.toml") == AxisRules(
      [("batch", ("data", "fsdp")), ("kv", None), ("microbatch", SerialLoop(4))])


@pytest.mark.parametrize("name, text, match", [
    ("bad.yaml", "rules:\n  - [batch, data\n", r"(?s)'.*bad\.yaml' is not valid YAML.*line \d"),
    ("bad.toml", "rules = [[\"batch\", \"data\"]\n", r"(?s)is not valid TOML.*Fix the TOML"),
    ("bad.json", '{"rules": [["batch", "data"],]}', r"(?s)not valid JSON.*line 1, column"),
    ("key.yaml", "rulez: []\n", r"(?s)unknown key 'rulez' \(did you mean 'rules'\?\)"),
    ("top.yaml", "- [batch, data]\n", "top level must be a mapping"),
    ("type.yaml", "rules:\n  - [batch, 4]\n", r"rules\[0\] \['batch', 4\]: .*got int 4"),
    ("pair.yaml", "rules:\n  - [batch]\n  - [mlp, tensor, x]\n",
     r"(?s)2 problem\(s\).*rules\[0\].*rules\[1\] .*expected a pair"),
    ("order.yaml", "rules:\n  - [batch, [{serial_loop: 4}, data]]\n",
     r"rules\[0\].*serial loop must come last"),
    ("loop.yaml", "rules:\n  - [batch, {serial_loops: 4}]\n",
     r"did you mean 'serial_loop'"),
    ("len.json", '{"rules": [["b", {"serial_loop": 0}]]}', "positive int, at most 1048576; got 0"),
    ("rules.yaml", "rules: 3\n", "must be a list of"),
    ("desc.yaml", "description: 3\nrules: []\n", "'description' must be a str"),
    ("rules.ini", "", r"(?s)Cannot tell the format.*\.yaml"),
    ("spaces.yaml", 'rules:\n  - ["batch ", data]\n  - [mlp, " tensor"]\n',
     r"(?s)rules\[0\] \['batch ', 'data'\]: the logical name 'batch ' has spaces around it: "
     r"write 'batch'.*rules\[1\] .*the mesh axis ' tensor' has spaces around it: write "
     r"'tensor'"),
])
def test_file_errors_name_file_entry_and_fix(tmp_path, name, text, match):
  path = tmp_path / name
  path.write_text(text)
  with pytest.raises(RulesConfigError, match=match) as err:
    AxisRules.from_file(path)
  assert isinstance(err.value, ValueError)
  assert name in str(err.value)
  if "rules[" in match:
    assert "Write each entry as [logical_name, mesh_axes]" in str(err.value)


def test_missing_file():
  with pytest.raises(RulesConfigError, match=r"(?s)Cannot read rules file 'nope\.yaml'.*path"):
    AxisRules.from_file("nope.yaml")


def test_from_dict_errors():
  with pytest.raises(ValueError, match="missing key 'rules'"):
    AxisRules.from_dict({})
  with pytest.raises(ValueError, match=r"rules\[1\]"):
    AxisRules.from_dict({"rules": [["a", "x"], ["b", [None]]]})


def test_axis_rules_context_takes_a_path(tmp_path):
  path = tmp_path / "r.json"
  RULES.to_file(path)
  with partition.axis_rules(path) as rules:
    assert rules == RULES and partition.current_rules() == RULES


# -- presets --------------------------------------------------------------------------------


def test_presets_exist():
  assert {p.stem for p in PRESETS} >= {"data_parallel", "fsdp", "fsdp_tp", "microbatch"}


def _preset_mesh(rules):
  """A mesh over the mesh axes a preset names, in order: (8,), (2, 4) or (2, 2, 2)."""
  names = list(dict.fromkeys(a for _, v in rules.pairs for a in v or () if isinstance(a, str)))
  shape = {1: (8,), 2: (2, 4), 3: (2, 2, 2)}[len(names)]
  return make_mesh(shape, tuple(names), AxisType.Explicit)


# Every logical name of the layers/ vocabulary, with dims every preset's mesh divides.
LAYER_AXES = [(("batch", "length", "embed"), (16, 16, 32)), (("embed", "mlp"), (32, 64)),
              (("embed", "heads", "head_dim"), (32, 8, 16)),
              (("embed", "kv_heads", "head_dim"), (32, 8, 16)), (("vocab", "embed"), (128, 32)),
              (("expert", "embed", "mlp"), (8, 32, 64)), (("layers", "embed", "mlp"), (8, 32, 64))]


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_presets_load_and_resolve_strictly(path):
  rules = AxisRules.from_file(path)
  assert yaml.safe_load(path.read_text())["description"]
  mesh = _preset_mesh(rules)
  for axes, shape in LAYER_AXES:
    spec = rules.spec(axes, shape, mesh, strict=True)
    assert len(spec) == len(axes)


def test_preset_placements():
  load = lambda n: AxisRules.from_file(ROOT / "recipes" / "presets" / f"{n}.yaml")
  mesh = make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), AxisType.Explicit)
  assert load("data_parallel").spec(("batch", "embed"), (8, 4), mesh) == P("data", None)
  fsdp = load("fsdp")
  assert fsdp.spec(("embed", "mlp"), (32, 64), mesh) == P("fsdp", None)
  assert fsdp.spec(("embed", "mlp"), (3, 64), mesh) == P(None, "fsdp")  # fallback to mlp
  assert fsdp.spec(("batch", "length", "embed"), (2, 4, 8), mesh) == P("data", None, "fsdp")
  tp = load("fsdp_tp")
  assert tp.spec(("embed", "mlp"), (32, 64), mesh) == P("fsdp", "tensor")
  assert tp.spec(("batch", "length", "mlp"), (8, 4, 64), mesh) == P(
      ("data", "fsdp"), None, "tensor")
  mb = load("microbatch")
  assert mb.xmap_resources(["batch"], mesh=mesh, sizes={"batch": 16}) == {
      "batch": ("data", SerialLoop(4))}
  assert mb.xmap_resources(["batch"], mesh=mesh, sizes={"batch": 6}) == {"batch": ("data",)}


# -- docs/rules.md (its Python examples: tests/test_docs.py) -----------------------------------

DOC = ROOT / "docs" / "rules.md"


def _blocks(lang):
  return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), flags=re.S)


def test_doc_yaml_and_toml_examples_load(tmp_path):
  yamls, tomls = _blocks("yaml"), _blocks("toml")
  assert yamls and tomls
  for i, text in enumerate(yamls + tomls):
    path = tmp_path / (f"{i}.yaml" if i < len(yamls) else f"{i}.toml")
    path.write_text(text)
    assert len(AxisRules.from_file(path)) > 0
