"""Placement equals flax's ``nn.logical_to_mesh_axes`` on the real peer tables.

The reference is flax's own resolver, run on the same rules; its spec is compared after
dropping mesh axes of size 1 (flax does not know the mesh). Sizes of 8 per dim keep the
divisibility fallback (a documented difference, see docs/rules.md) out of the comparison.
"""

import math

import flax.linen as nn
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from mesh_testlib import make_mesh

import partition

# Excerpt of MaxText's `logical_axis_rules` (AI-Hypercomputer/maxtext,
# src/MaxText/configs/base.yml), in file order.
MAXTEXT_RULES = [
    ["activation_batch", ["data", "fsdp", "fsdp_transpose", "expert"]],
    ["activation_batch_no_exp", ["data", "fsdp", "fsdp_transpose"]],
    ["activation_embed_and_logits_batch", ["data", "stage", "fsdp", "fsdp_transpose",
                                           "expert"]],
    ["activation_heads", ["tensor", "tensor_transpose", "sequence", "tensor_sequence",
                          "autoregressive"]],
    ["activation_kv_heads", ["tensor", "tensor_transpose", "sequence", "tensor_sequence"]],
    ["activation_length", ["sequence", "context", "expert"]],
    ["activation_length", ["context", "expert"]],
    ["activation_attn_length", ["sequence", "context", "expert"]],
    ["activation_attn_length", ["context", "expert"]],
    ["activation_norm_length", ["tensor_sequence", "context", "sequence"]],
    ["activation_q_length", ["context", "expert"]],
    ["activation_kv_length", []],
    ["activation_embed", ["tensor", "tensor_transpose"]],
    ["activation_mlp", ["tensor", "tensor_transpose", "tensor_sequence"]],
    ["activation_kv", ["tensor", "tensor_transpose", "tensor_sequence"]],
    ["activation_kv_batch", ["data", "fsdp", "fsdp_transpose", "expert"]],
    ["activation_kv_head_dim", ["tensor", "tensor_transpose", "tensor_sequence"]],
    ["activation_vocab", ["tensor", "tensor_transpose", "tensor_sequence"]],
    ["activation_vocab", ["tensor", "tensor_transpose"]],
    ["activation_vocab", "tensor_sequence"],
    ["activation_vocab", ["sequence", "context"]],
    ["activation_stage", "stage"],
    ["activation_exp", ["expert"]],
    ["decode_batch", ["data", "fsdp", "fsdp_transpose", "expert"]],
    ["decode_length", ["sequence"]],
    ["mlp", ["fsdp_transpose", "tensor", "tensor_sequence", "autoregressive"]],
    ["vocab", ["tensor", "tensor_transpose", "tensor_sequence", "autoregressive"]],
    ["heads", ["tensor", "tensor_transpose", "tensor_sequence", "autoregressive"]],
    ["q_heads", ["tensor", "tensor_transpose", "tensor_sequence", "autoregressive"]],
    ["kv_heads", ["tensor", "tensor_transpose", "tensor_sequence", "autoregressive"]],
    ["embed", ["fsdp", "fsdp_transpose", "sequence", "tensor_transpose", "context", "expert"]],
    ["embed", ["fsdp", "sequence", "tensor_transpose", "context", "expert"]],
    ["embed", ["fsdp", "fsdp_transpose", "sequence", "context", "expert"]],
    ["embed", ["fsdp", "sequence", "context", "expert"]],
    ["embed_no_exp", ["fsdp", "fsdp_transpose", "sequence", "tensor_transpose", "context"]],
    ["embed_no_exp", ["fsdp", "sequence", "context"]],
    ["norm", ["tensor", "tensor_transpose"]],
    ["layers", "stage"],
    ["kv", []],
    ["kv_head_dim", []],
    ["cache_heads", ["autoregressive", "tensor", "tensor_transpose", "tensor_sequence"]],
    ["cache_heads", ["autoregressive", "tensor", "tensor_sequence"]],
    ["exp", "expert"],
]
MAXTEXT_MESH_AXES = ("data", "stage", "fsdp", "fsdp_transpose", "sequence", "context",
                     "context_autoregressive", "tensor", "tensor_transpose", "tensor_sequence",
                     "expert", "autoregressive")
# Logical axes used by MaxText's layers (simple_layer.py, linears.py, attentions.py,
# embeddings.py, moe.py, normalizations.py).
MAXTEXT_AXES = [
    ("activation_batch", "activation_norm_length", "activation_embed"),
    ("activation_batch", "activation_norm_length", "activation_mlp"),
    ("activation_batch", "activation_length", "activation_embed"),
    ("activation_batch", "activation_length", "activation_heads", "activation_kv"),
    ("activation_kv_batch", "activation_length", "activation_kv_heads", "activation_kv"),
    ("activation_batch", "activation_attn_length", "activation_heads", "activation_kv"),
    ("activation_batch", "activation_q_length", "activation_heads", "activation_kv"),
    ("activation_kv_batch", "activation_kv_length", "activation_kv_heads",
     "activation_kv_head_dim"),
    ("activation_embed_and_logits_batch", "activation_length", "activation_vocab"),
    ("activation_batch_no_exp", "activation_length", "activation_embed"),
    ("activation_exp", "activation_batch_no_exp", None, "activation_embed"),
    ("decode_batch", "decode_length", "activation_embed"),
    ("embed", "mlp"), ("mlp", "embed"), ("embed", "layers", "mlp"), ("mlp", "layers", "embed"),
    ("embed", "q_heads", "kv"), ("embed", "kv_heads", "kv_head_dim"), ("heads", "kv", "embed"),
    ("vocab", "embed"), ("norm",), ("norm", "layers"), ("exp", "embed_no_exp", "mlp"),
    ("exp", "mlp", "embed_no_exp"), ("embed", None), ("cache_heads", "kv", None),
]
MAXTEXT_MESHES = [
    {"context": 2, "tensor": 2, "fsdp": 2},
    {"fsdp": 8},
    {"data": 2, "fsdp": 2, "tensor": 2},
    {"expert": 2, "fsdp": 4},
    {"sequence": 2, "tensor": 4},
    {"fsdp_transpose": 2, "tensor_sequence": 2, "autoregressive": 2},
    {"stage": 2, "context": 4},
]

# T5X's `standard_logical_axis_rules` (google-research/t5x, t5x/partitioning.py): the four
# (activation_partitioning_dims, parameter_partitioning_dims) variants, then the replicated
# rules it always appends.
T5X_REPLICATED = [("relpos_buckets", None), ("abspos_buckets", None), ("length", None),
                  ("layers", None), ("stack", None), ("mlp_activations", None)]
T5X_RULES = {
    (1, 1): [("batch", "data"), ("vocab", "model"), ("embed", None), ("mlp", "model"),
             ("heads", "model"), ("kv", None), ("joined_kv", "model")],
    (2, 1): [("batch", "data"), ("vocab", "model"), ("mlp", "model"), ("heads", "model"),
             ("kv", None), ("joined_kv", "model"), ("embed", "model")],
    (1, 2): [("batch", "data"), ("vocab", "model"), ("mlp", "model"), ("heads", "model"),
             ("kv", None), ("joined_kv", "model"), ("embed", "data")],
    (2, 2): [("batch", "data"), ("vocab", "model"), ("mlp", "model"), ("heads", "model"),
             ("kv", None), ("joined_kv", "model"), ("embed", "model"), ("embed", "data")],
}
# Logical axes of T5X / flaxformer's decoder-only and encoder-decoder layers.
T5X_AXES = [
    ("batch", "length", "embed"), ("batch", "length", "mlp"), ("batch", "length", "vocab"),
    ("batch", "length", "heads", "kv"), ("batch", "length", "joined_kv"),
    ("embed", "mlp"), ("mlp", "embed"), ("vocab", "embed"), ("embed", "joined_kv"),
    ("joined_kv", "embed"), ("embed", "heads", "kv"), ("heads", "kv", "embed"), ("embed",),
    ("relpos_buckets", "heads"), ("embed", "mlp_activations", "mlp"),
    ("layers", "embed", "mlp"), ("embed", "layers", "heads", "kv"),
]


def as_flax(pairs):
  return [(n, None if v is None or v == [] else v if isinstance(v, str) else tuple(v))
          for n, v in pairs]


def drop_size_one(spec, sizes):
  """Flax's spec with mesh axes of size 1 (or absent from the mesh) removed."""
  out = []
  for entry in spec:
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    kept = tuple(a for a in names if sizes.get(a, 1) > 1)
    out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
  return P(*out)


def sized_mesh(sizes: dict, names):
  """A mesh with axes ``names``, of the sizes in ``sizes`` (1 for a name missing there)."""
  return make_mesh([sizes.get(n, 1) for n in names], names, AxisType.Explicit)


def check(pairs, axes, mesh):
  sizes = dict(mesh.shape)
  ours = partition.AxisRules(pairs).spec(axes, (8,) * len(axes), mesh)
  theirs = drop_size_one(nn.logical_to_mesh_axes(axes, as_flax(pairs)), sizes)
  assert ours == theirs, (axes, ours, theirs)


@pytest.mark.parametrize("sizes", MAXTEXT_MESHES, ids=str)
@pytest.mark.parametrize("form", ["all axes", "only the axes > 1"])
def test_maxtext_rules_and_layer_axes_match_flax(sizes, form):
  # MaxText's own mesh has all 12 axes (most of size 1); a user's mesh may have only the
  # axes it uses. Both place like flax: a mesh that lacks an axis acts as size 1.
  names = MAXTEXT_MESH_AXES if form == "all axes" else tuple(sizes)
  mesh = sized_mesh(sizes, names)
  for axes in MAXTEXT_AXES:
    check(MAXTEXT_RULES, axes, mesh)


def test_maxtext_activation_length_is_not_put_on_context_when_expert_is_taken():
  # activation_batch claims 'expert' (size 1 here): flax then skips both activation_length
  # candidates, which also name 'expert'. Dropping size-1 axes first would shard on context.
  mesh = sized_mesh({"context": 2, "tensor": 2, "fsdp": 2}, MAXTEXT_MESH_AXES)
  axes = ("activation_batch", "activation_length", "activation_embed")
  res = partition.AxisRules(MAXTEXT_RULES).resolve(axes, (8, 8, 8), mesh)
  assert res.spec == P("fsdp", None, "tensor")
  assert [a.outcome for a in res.dims[1].attempts] == ["mesh axis already used"] * 2
  assert "'expert' is used by dim 0" in str(res)


@pytest.mark.parametrize("names", [("data", "tensor"), ("data",)], ids=str)
def test_size_one_or_absent_only_rule_fires_like_flax(names):
  mesh = sized_mesh({"data": 8}, names)
  rules = partition.AxisRules([("mlp", "tensor"), ("mlp", "data")])
  assert nn.logical_to_mesh_axes(("mlp",), as_flax(rules.to_dict()["rules"])) == P("tensor")
  res = rules.resolve(("mlp",), (8,), mesh)
  assert res.spec == P(None)
  assert [a.outcome for a in res.dims[0].attempts] == ["fired"]
  why = "has size 1, dropped" if "tensor" in names else "is not a mesh axis, dropped"
  assert f"'tensor' {why}" in str(res)


@pytest.mark.parametrize("variant", sorted(T5X_RULES), ids=str)
@pytest.mark.parametrize("shape", [(4, 2), (2, 4), (8, 1), (1, 8)], ids=str)
def test_t5x_standard_rules_match_flax(variant, shape):
  mesh = sized_mesh(dict(zip(("data", "model"), shape)), ("data", "model"))
  for axes in T5X_AXES:
    check(T5X_RULES[variant] + T5X_REPLICATED, axes, mesh)


MESH_AXES = ("x", "y", "z", "w")
NAMES = ("a", "b", "c", "d")
values = st.one_of(st.none(), st.lists(st.sampled_from(MESH_AXES), max_size=3, unique=True))
rule_tables = st.lists(st.tuples(st.sampled_from(NAMES), values), max_size=8)
axes_tuples = st.lists(st.sampled_from(NAMES + (None,)), min_size=1, max_size=4).filter(
    lambda t: len([n for n in t if n]) == len({n for n in t if n}))
# 0 = the mesh lacks the axis, 1 = size 1, 2 = size 2
mesh_sizes = st.lists(st.sampled_from((0, 1, 2)), min_size=4, max_size=4).filter(
    lambda s: math.prod(max(n, 1) for n in s) <= 8 and any(s))


@settings(max_examples=200, deadline=None)
@given(rule_tables, axes_tuples, mesh_sizes)
def test_random_tables_match_flax_after_dropping_size_one(pairs, axes, sizes):
  present = {a: n for a, n in zip(MESH_AXES, sizes) if n}
  mesh = sized_mesh(present, tuple(present))
  check([(n, v) for n, v in pairs], tuple(axes), mesh)
