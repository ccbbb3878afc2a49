"""What ``generate`` is given: weights of another config, prompts that are not token ids, a
``pad_id`` outside the vocabulary, settings of the wrong type. Each once decoded silently
wrong (a dropped layer, NaN rows, text read as ids) or failed in Python's or JAX's words; the
reference for the right answer is the same call with the right input."""

import re

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import layers
import layers.haiku
import layers.linen
import layers.nnx
from layers import _decode

SAMPLING = layers.Sampling(max_new_tokens=4)


def _config(**kw):
  return layers.TransformerConfig(**{**dict(vocab_size=32, embed_dim=16, mlp_dim=32,
                                            num_heads=2, num_kv_heads=1, head_dim=8,
                                            num_layers=2, max_len=16), **kw})


@pytest.fixture(scope="module")
def two_layers():
  cfg = _config()
  model = layers.linen.Transformer(cfg)
  return model, model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))


def _problems(e):
  return [line[4:] for line in str(e.value).splitlines() if line.startswith("  * ")]


def test_weights_of_more_layers_than_the_config_are_an_error_not_a_dropped_layer(two_layers):
  model, variables = two_layers
  want = layers.linen.generate(model, variables, [[1, 2, 3]], SAMPLING).continuations()
  one_layer = layers.linen.Transformer(_config(num_layers=1))
  with pytest.raises(_decode.GenerateError) as e:
    layers.linen.generate(one_layer, variables, [[1, 2, 3]], SAMPLING)
  assert str(e.value).startswith("layers.linen.generate: the params are not the model of "
                                 "this config (1 problem(s)).")
  assert _problems(e) == ["blocks: the params hold 2 layer(s), the config has num_layers=1"]
  assert "layers.from_canonical(weights, like=<the model's own params>)" in str(e.value)
  # the same check in Haiku, where the config is its own argument
  f = hk.transform(lambda t: layers.haiku.Transformer(_config())(t))
  hk_params = layers.from_canonical(layers.to_canonical(variables),
                                    like=f.init(jax.random.key(1), jnp.zeros((1, 4), jnp.int32)))
  assert layers.haiku.generate(_config(), hk_params, [[1, 2, 3]], SAMPLING).continuations() \
      == want
  with pytest.raises(_decode.GenerateError, match=r"the params hold 2 layer\(s\), the config "
                     r"has num_layers=1"):
    layers.haiku.generate(_config(num_layers=1), hk_params, [[1, 2, 3]], SAMPLING)


@pytest.mark.parametrize("change, problem", [
    (dict(vocab_size=64), "embed/embedding: shape (32, 16), but the config makes (64, 16)"),
    (dict(tie_embeddings=False), "lm_head/kernel: missing (the config has it, shape (16, 32))"),
    (dict(num_layers=3), "blocks: the params hold 2 layer(s), the config has num_layers=3"),
])
def test_weights_of_another_config_name_the_first_leaf_that_differs(two_layers, change,
                                                                    problem):
  """A bigger vocab_size let id 40 through to a NaN embedding; the others were KeyErrors."""
  _, variables = two_layers
  with pytest.raises(_decode.GenerateError) as e:
    layers.linen.generate(layers.linen.Transformer(_config(**change)), variables, [[1, 2]],
                          SAMPLING)
  assert problem in _problems(e), str(e.value)


def test_canonical_weights_say_to_convert_them(two_layers):
  model, variables = two_layers
  canonical = layers.to_canonical(variables)
  with pytest.raises(_decode.GenerateError, match=re.escape(
      "canonical weights (layers.from_hf, layers.to_canonical) go through "
      "layers.from_canonical(weights, like=<the model's own params>) first.")):
    layers.linen.generate(model, canonical, [[1, 2]], SAMPLING)
  back = layers.from_canonical(canonical, like=variables)
  assert layers.linen.generate(model, back, [[1, 2]], SAMPLING).continuations() == \
      layers.linen.generate(model, variables, [[1, 2]], SAMPLING).continuations()
  with pytest.raises(layers.CanonicalError, match=r"like= is a Transformer, not the params "
                     r"to imitate"):
    layers.from_canonical(canonical, like=model)


@pytest.mark.parametrize("pad_id", [32, 1000, -1, 1.0])
def test_a_pad_id_outside_the_vocabulary_is_an_error_not_nan_rows(two_layers, pad_id):
  """pad_id=32 (vocab 32) turned the shorter row's continuation into [0, 0, 0, 0]: the
  padding's embedding was NaN, and 0 x NaN reached the real tokens."""
  model, variables = two_layers
  alone = layers.linen.generate(model, variables, [[4]], SAMPLING).continuations()
  batched = layers.linen.generate(model, variables, [[1, 2, 3], [4]], SAMPLING, pad_id=31)
  assert batched.continuations()[1] == alone[0]
  with pytest.raises(_decode.GenerateError, match=re.escape(
      f"layers.linen.generate: pad_id={pad_id!r} is not a token id of the vocabulary 0..31")):
    layers.linen.generate(model, variables, [[1, 2, 3], [4]], SAMPLING, pad_id=pad_id)


@pytest.mark.parametrize("prompts, message", [
    (["123"], "prompts[0] is a str ('123'), not a list of ids (text goes through a tokenizer "
              "first)"),
    ("12", "prompts='12' is a str, not a batch of token ids"),
    ([[1.9, 2.9]], "prompts[0] has ids that are not ints: [1.9, 2.9]"),
    ([1, 2, 3], "prompts[0] is the int 1: prompts is one list of ids, not a batch of them.\n"
                "Wrap it: [[1, 2, 3]] for one prompt."),
    (np.array([1, 2, 3]), "Wrap it: [[1, 2, 3]] for one prompt."),
])
def test_prompts_that_are_not_token_ids_are_errors_not_reinterpreted(two_layers, prompts,
                                                                     message):
  """["123"] was read as the ids [1, 2, 3], "12" as two prompts, floats were truncated, and a
  flat list raised "TypeError: 'int' object is not iterable"."""
  model, variables = two_layers
  with pytest.raises(_decode.GenerateError) as e:
    layers.linen.generate(model, variables, prompts, SAMPLING)
  assert message in str(e.value)
  assert "list of lists of int token ids" in str(e.value) or "Wrap it" in str(e.value)


def test_arrays_and_numpy_ids_are_prompts(two_layers):
  model, variables = two_layers
  want = layers.linen.generate(model, variables, [[1, 2, 3], [4, 5, 6]], SAMPLING)
  for prompts in (np.array([[1, 2, 3], [4, 5, 6]]), jnp.array([[1, 2, 3], [4, 5, 6]]),
                  [np.array([1, 2, 3]), (4, 5, 6)]):
    got = layers.linen.generate(model, variables, prompts, SAMPLING)
    assert got.continuations() == want.continuations()


def test_one_int_stop_token_is_one_stop_token_and_other_types_are_errors():
  """Sampling(stop_tokens=2), as a Hugging Face eos_token_id may be, raised a TypeError."""
  assert layers.Sampling(stop_tokens=2).stop_tokens == (2,)
  assert layers.Sampling(stop_tokens=np.int32(2)).stop_tokens == (2,)
  assert layers.Sampling(stop_tokens=[2, 3]).stop_tokens == (2, 3)
  with pytest.raises(_decode.GenerateError, match=re.escape(
      "stop_tokens='2' must be token ids: an int or a sequence of ints, e.g. "
      "stop_tokens=(2,)")):
    layers.Sampling(stop_tokens="2")


def test_sampling_and_model_of_the_wrong_type_say_what_to_pass(two_layers):
  model, variables = two_layers
  with pytest.raises(_decode.GenerateError, match=re.escape(
      "sampling is a dict, not a layers.Sampling.\nPass layers.Sampling(...), e.g. "
      "layers.Sampling(**{'max_new_tokens': 2}).")):
    layers.linen.generate(model, variables, [[1]], {"max_new_tokens": 2})
  nnx_model = layers.nnx.Transformer(_config(), rngs=nnx.Rngs(0))
  with pytest.raises(_decode.GenerateError, match=re.escape(
      "layers.nnx.generate: model is a list, not a layers.nnx.Transformer. Call it as "
      "layers.nnx.generate(model, prompts, sampling).")):
    layers.nnx.generate([[1, 2]], nnx_model)
