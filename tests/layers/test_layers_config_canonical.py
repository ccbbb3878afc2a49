"""TransformerConfig validation, layer argument errors, canonical weights round trips."""

import dataclasses
import doctest
import importlib
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from layers_testlib import FRAMEWORKS, TOKENS, build, config
from mesh_testlib import make_mesh

import layers
import layers.linen
import layers.nnx
import partition
import partition.flax
from layers._params import LayerArgumentError

try:
  import tomllib
except ImportError:  # Python 3.10
  import tomli as tomllib


def test_config_defaults_are_valid_and_frozen():
  cfg = layers.TransformerConfig()
  assert cfg.num_heads % cfg.num_kv_heads == 0
  assert cfg.dtype == np.dtype("float32")
  with pytest.raises(AttributeError):
    cfg.num_layers = 3


def test_config_rejects_heads_not_divisible_by_kv_heads():
  with pytest.raises(layers.ConfigError,
                     match=r"num_heads=6 is not a multiple of num_kv_heads=4.*use a divisor"):
    layers.TransformerConfig(num_heads=6, num_kv_heads=4)


def test_config_collects_every_problem_in_one_message():
  with pytest.raises(ValueError) as info:
    layers.TransformerConfig(embed_dim=0, head_dim=7, num_experts=2, experts_per_token=3,
                             remat="sometimes", dtype="int32")
  message = str(info.value)
  assert isinstance(info.value, partition.PartitionError)
  assert "5 invalid field(s)" in message
  for text in ("embed_dim=0 must be a positive int", "head_dim=7 must be even",
               "experts_per_token=3 must be between 1 and num_experts=2",
               "remat='sometimes' is not a remat policy; use one of",
               "dtype='int32' must be a floating dtype", "dataclasses.replace"):
    assert text in message


def test_dense_with_axes_of_the_wrong_rank_says_how_to_fix():
  with pytest.raises(LayerArgumentError,
                     match=r"out_axes=\('mlp',\) names 1 dims but features=\(4, 8\)"
                           r"[\s\S]*one logical name \(or None\) per"):
    layers.linen.Dense((4, 8), ("embed",), ("mlp",)).init(jax.random.key(0), jnp.ones((2, 3)))


@pytest.mark.parametrize("source,scan", [("linen", False), ("nnx", True), ("nnx", False),
                                         ("haiku", True)])
@pytest.mark.slow
def test_canonical_round_trip_is_exact(source, scan):
  m = build(source, config(scan_layers=scan, num_experts=2, experts_per_token=1))
  weights = layers.to_canonical(m.params)
  assert weights["blocks/attn/query/kernel"].shape == (2, 16, 4, 8)
  assert weights["blocks/moe/wo"].shape == (2, 2, 32, 16)
  back = layers.to_canonical(layers.from_canonical(weights, like=m.params))
  for name, value in weights.items():
    np.testing.assert_array_equal(np.asarray(back[name]), np.asarray(value))


@pytest.mark.slow
def test_from_canonical_into_an_nnx_module_returns_a_module():
  m = build("linen", config())
  model = layers.nnx.Transformer(config(), rngs=nnx.Rngs(5))
  loaded = layers.from_canonical(layers.to_canonical(m.params), like=model)
  assert isinstance(loaded, layers.nnx.Transformer)
  np.testing.assert_allclose(np.asarray(loaded(TOKENS)), np.asarray(m.apply(m.params, TOKENS)),
                             rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_from_canonical_keeps_shardings_and_boxes():
  mesh = make_mesh((4, 2), ("fsdp", "tensor"), AxisType.Auto)
  rules = partition.AxisRules([("embed", "fsdp"), ("heads", "tensor"), ("mlp", "tensor"),
                               ("kv_heads", "tensor"), ("vocab", "tensor")])
  m = build("linen", config(scan_layers=True))
  sharded = partition.flax.init_sharded(layers.linen.Transformer(config(scan_layers=True)),
                                        jax.random.key(0), TOKENS, rules=rules, mesh=mesh)
  loaded = layers.from_canonical(layers.to_canonical(m.params), like=sharded)
  box = loaded["params"]["blocks"]["attn"]["qkv"]["kernel"]
  assert box.names == ("layers", "embed", "kv_heads", None, "head_dim")
  assert box.value.sharding == NamedSharding(mesh, P(None, "fsdp", "tensor", None, None))
  np.testing.assert_array_equal(
      np.asarray(box.value), np.asarray(m.params["params"]["blocks"]["attn"]["qkv"]
                                        ["kernel"].value))


@pytest.mark.slow
def test_from_canonical_lists_missing_misshaped_and_unused_weights():
  m = build("haiku", config())
  weights = dict(layers.to_canonical(m.params))
  del weights["final_norm/scale"]
  weights["embed/embedding"] = jnp.zeros((10, 16))
  weights["blocks/extra/kernel"] = jnp.zeros((2, 3))
  with pytest.raises(layers.CanonicalError) as info:
    layers.from_canonical(weights, like=m.params)
  message = str(info.value)
  assert "3 weight(s) do not fit" in message
  assert "transformer/final_norm/scale: no weight 'final_norm/scale'" in message
  assert "'embed/embedding' has shape (10, 16), the config expects (64, 16)" in message
  assert "'blocks/extra/kernel' ((2, 3)) matches no parameter" in message
  assert "same TransformerConfig" in message


@pytest.mark.parametrize("framework, scan", [("linen", False), ("nnx", True)])
def test_from_canonical_names_the_users_misshaped_key(framework, scan):
  """A query with 2 heads where the config has 4 is reported under the user's key with both
  shapes (not as the fused qkv parameter the wrong query would have been fused into)."""
  m = build(framework, config(scan_layers=scan))
  weights = dict(layers.to_canonical(m.params))
  weights["blocks/attn/query/kernel"] = weights["blocks/attn/query/kernel"][:, :, :2]
  with pytest.raises(layers.CanonicalError) as info:
    layers.from_canonical(weights, like=m.params)
  message = str(info.value)
  if scan:
    assert ("'blocks/attn/query/kernel' has shape (2, 16, 2, 8), the config expects "
            "(2, 16, 4, 8) (fused with 2 more into (2, 16, 2, 4, 8))") in message
  else:
    assert ("params/blocks_1/attn/qkv/kernel: 'blocks/attn/query/kernel' (layer 1 of "
            "(2, 16, 2, 8)) has shape (16, 2, 8), the config expects (16, 4, 8)") in message
  assert "'blocks/attn/qkv" not in message    # no key the user never gave


@pytest.mark.slow
def test_from_canonical_reports_a_stack_with_too_few_layers():
  weights = layers.to_canonical(build("linen", config()).params)
  three = build("nnx", config(num_layers=3))
  with pytest.raises(layers.CanonicalError, match=r"layer index 2 is out of range for 2 layers"):
    layers.from_canonical(weights, like=three.params)


@pytest.mark.parametrize("module", ["_config", "_core", "_model", "_moe", "_params", "_canonical",
                                    "linen", "nnx", "haiku"])
def test_every_module_has_docstring_examples_that_the_suite_runs(module):
  # The suite runs them (pyproject: --doctest-modules over testpaths with layers/); running
  # them here too compiled every example twice.
  found = doctest.DocTestFinder().find(importlib.import_module(f"layers.{module}"))
  assert sum(len(test.examples) for test in found) > 0
  options = tomllib.loads((pathlib.Path(__file__).parents[2] / "pyproject.toml").read_text())
  pytest_options = options["tool"]["pytest"]["ini_options"]
  assert "layers" in pytest_options["testpaths"]
  assert "--doctest-modules" in pytest_options["addopts"].split()


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_transformer_rejects_bad_tokens_with_the_fix(framework):
  m = build(framework, config(max_len=8))
  with pytest.raises(LayerArgumentError,
                     match=r"length 9 > config.max_len=8[\s\S]*raise max_len"):
    m.apply(m.params, jnp.zeros((2, 9), jnp.int32))
  with pytest.raises(LayerArgumentError, match=r"dtype float32; expected integer token ids"):
    m.apply(m.params, jnp.zeros((2, 4), jnp.float32))
  with pytest.raises(LayerArgumentError, match=r"shape \(8,\); expected \(batch, length\)"):
    m.apply(m.params, jnp.zeros((8,), jnp.int32))


def test_rope_scaling_is_validated_hashable_and_read_from_a_mapping():
  scaling = layers.RopeScaling("llama3", 8.0, original_max_len=8192)
  cfg = layers.TransformerConfig(rope_scaling={"kind": "llama3", "factor": 8.0})
  assert cfg.rope_scaling == scaling and hash(cfg) == hash(layers.TransformerConfig(
      rope_scaling=scaling))
  with pytest.raises(layers.ConfigError, match=r"rope_scaling.kind='yarn' must be one of "
                                               r"\['linear', 'llama3'\][\s\S]*"
                                               r"rope_scaling.factor=-1.0 must be a positive"):
    layers.TransformerConfig(rope_scaling=layers.RopeScaling("yarn", -1.0))
  with pytest.raises(layers.ConfigError, match=r"rope_scaling=\{'factor': 2.0\} needs kind "
                                               r"and factor"):
    layers.TransformerConfig(rope_scaling={"factor": 2.0})
  with pytest.raises(layers.ConfigError, match=r"capacity_factor=0 must be a positive number"):
    layers.TransformerConfig(num_experts=2, capacity_factor=0)


def test_a_misspelled_field_names_the_field_meant():
  """It was Python's "__init__() got an unexpected keyword argument 'vocab_sise'"."""
  with pytest.raises(layers.ConfigError, match=re.escape(
      "TransformerConfig: 1 unknown field(s).\n  * 'vocab_sise' (did you mean 'vocab_size'?)")):
    layers.TransformerConfig(vocab_sise=10)
  cfg = layers.TransformerConfig(vocab_size=10)
  assert dataclasses.replace(cfg, num_layers=3).num_layers == 3   # replace still works
