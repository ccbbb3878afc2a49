"""The documented library call, ``layers.linen.generate(model, variables, prompts, sampling,
rules=rules, mesh=mesh)`` (docs/generate.md), as a user writes it: plain ``model.init``
params, a preset's rules, a mesh of JAX's default (Explicit) axes or of Auto axes, in or out
of ``jax.set_mesh``. Each continues the prompts as one device does, and one device as
re-running the full forward pass greedily does (the independent reference); inputs that
cannot work raise a GenerateError naming the argument."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from greedy_testlib import greedy_reference
from jax.sharding import AxisType, NamedSharding, PartitionSpec
from mesh_testlib import make_mesh

import layers
import layers.linen
import layers.nnx
from layers import _decode
from partition import PartitionWarning
from recipes.config import preset_rules

CFG = layers.TransformerConfig(vocab_size=40, embed_dim=16, mlp_dim=32, num_heads=4,
                               num_kv_heads=2, head_dim=8, num_layers=2, max_len=32)
PROMPTS = [[5, 6, 7], [3], [10, 11], [8, 9, 12]]   # 4 rows: the data axis (4) divides them
SAMPLING = layers.Sampling(max_new_tokens=3)
RULES = preset_rules("fsdp_tp")


@pytest.fixture(scope="module")
def linen_model():
  model = layers.linen.Transformer(CFG)
  return model, model.init(jax.random.key(1), jnp.zeros((1, 4), jnp.int32))


@pytest.fixture(scope="module")
def one_device(linen_model):
  model, variables = linen_model
  return layers.linen.generate(model, variables, PROMPTS, SAMPLING).continuations()




def _quiet_generate(*args, **kwargs):
  """``layers.linen.generate`` failing on any PartitionWarning (a cache_length one included)."""
  with warnings.catch_warnings():
    warnings.simplefilter("error", PartitionWarning)
    return layers.linen.generate(*args, **kwargs).continuations()


def test_one_device_is_the_greedy_full_forward(linen_model, one_device):
  params = layers.linen.decode_params(linen_model[1], CFG)
  assert one_device == [greedy_reference(params, CFG, p, SAMPLING.max_new_tokens)
                        for p in PROMPTS]


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_documented_call_with_plain_params_equals_one_device(linen_model, one_device,
                                                               axis_type):
  model, variables = linen_model
  mesh = make_mesh((4, 2), ("data", "tensor"), axis_type)
  got = _quiet_generate(model, variables, PROMPTS, SAMPLING, rules=RULES, mesh=mesh)
  assert got == one_device
  with jax.set_mesh(mesh):   # the same inside the user's mesh context
    assert _quiet_generate(model, variables, PROMPTS, SAMPLING, rules=RULES,
                           mesh=mesh) == one_device


def test_params_on_one_device_numpy_or_the_explicit_mesh_are_placed(linen_model, one_device):
  model, variables = linen_model
  mesh = make_mesh((2, 2), ("data", "tensor"), AxisType.Explicit, devices=jax.devices()[4:])
  for params in (jax.device_put(variables, jax.devices()[5]),
                 jax.tree.map(np.asarray, variables),
                 jax.device_put(variables, NamedSharding(mesh, PartitionSpec()))):
    got = layers.linen.generate(model, params, PROMPTS, SAMPLING, rules=RULES, mesh=mesh)
    assert got.continuations() == one_device
  # as the rules shard them: the embedding (vocab, embed) over tensor (no fsdp axis here)
  placed = _decode.place_params(layers.linen.decode_params(variables, CFG), CFG,
                                _decode.decode_rules(RULES), _decode.auto_view(mesh))
  assert placed["embed"]["embedding"].sharding.spec == PartitionSpec("tensor", None)
  assert placed["embed"]["embedding"].sharding.mesh.axis_types == (AxisType.Auto,) * 2


def test_nnx_model_on_an_auto_mesh_equals_one_device():
  model = layers.nnx.Transformer(CFG, rngs=nnx.Rngs(2))
  want = layers.nnx.generate(model, PROMPTS[:2], SAMPLING).continuations()
  mesh = make_mesh((2, 2), ("data", "tensor"))
  got = layers.nnx.generate(model, PROMPTS[:2], SAMPLING, rules=RULES, mesh=mesh)
  assert got.continuations() == want


def test_unusable_arguments_raise_naming_them(linen_model):
  model, variables = linen_model
  mesh = make_mesh((2, 2), ("data", "tensor"), devices=jax.devices()[:4])
  with pytest.raises(layers.GenerateError,
                     match=r"(?s)mesh= was given without rules.*Pass rules="):
    layers.linen.generate(model, variables, PROMPTS, SAMPLING, mesh=mesh)
  with pytest.raises(layers.GenerateError,
                     match=r"(?s)rules= was given without a mesh.*Pass mesh="):
    layers.linen.generate(model, variables, PROMPTS, SAMPLING, rules=RULES)
  other = make_mesh((4,), ("data",), devices=jax.devices()[4:])
  elsewhere = jax.device_put(variables, NamedSharding(other, PartitionSpec()))
  with pytest.raises(layers.GenerateError,
                     match=r"(?s)layers.linen.generate: \d+ param\(s\) are sharded over other "
                           r"devices than mesh=.*devices \[4, 5, 6, 7\].*mesh= has devices "
                           r"\[0, 1, 2, 3\].*Pass the mesh the params were placed on"):
    layers.linen.generate(model, elsewhere, PROMPTS, SAMPLING, rules=RULES, mesh=mesh)


def test_cache_length_is_replicated_on_purpose_without_a_warning():
  mesh = make_mesh((4, 2), ("data", "tensor"))
  with warnings.catch_warnings():
    warnings.simplefilter("error", PartitionWarning)
    cache = layers.init_cache(CFG, 4, 16, rules=RULES, mesh=mesh)
  assert cache[0].k.sharding.spec == PartitionSpec("data", None, "tensor", None)
  # rules that do name cache_length are kept
  split = RULES.override(("cache_length", "tensor"), ("kv_heads", None))
  assert layers.init_cache(CFG, 4, 16, rules=split, mesh=mesh)[0].k.sharding.spec == \
      PartitionSpec("data", "tensor", None, None)


@pytest.mark.parametrize("framework", ["linen", "haiku", "core"])
def test_the_model_under_an_explicit_mesh_is_a_clear_error(linen_model, framework):
  """Outside generate (which decodes on the Auto view), the layers under jax.set_mesh of an
  Explicit mesh raise LayerArgumentError saying to build the mesh with Auto axes (it was a
  bare AssertionError from flax's constraint, or a ShardingTypeError from the lookup)."""
  import haiku as hk

  import layers.haiku
  model, variables = linen_model
  tokens = jnp.zeros((4, 8), jnp.int32)
  run = {"linen": lambda: model.init(jax.random.key(0), tokens),
         "haiku": lambda: hk.transform(lambda t: layers.haiku.Transformer(CFG)(t)).init(
             jax.random.key(0), tokens),
         "core": lambda: layers._model.transformer(
             layers.linen.decode_params(variables, CFG), tokens, CFG)}[framework]
  with jax.set_mesh(jax.make_mesh((4, 2), ("data", "tensor"),
                                  axis_types=(AxisType.Explicit,) * 2)):
    with pytest.raises(layers.LayerArgumentError,
                       match=r"the mesh in context has Explicit axes \['data', 'tensor'\]; the "
                             r"layers run on Auto axes[\s\S]*axis_types=\(jax.sharding.AxisType"
                             r".Auto,\) \* len\(names\)"):
      run()
