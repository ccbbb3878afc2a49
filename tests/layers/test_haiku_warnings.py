"""layers.haiku: a missing rule warns once per cause, not once per parameter it touches."""
import warnings

import haiku as hk
import jax
import jax.numpy as jnp
import pytest

import layers
import layers.haiku
import partition


def _stacked_transformer():
  """A scanned two-layer Haiku Transformer, its params, tokens and a data x tensor mesh."""
  cfg = layers.TransformerConfig(vocab_size=32, embed_dim=16, mlp_dim=32, num_heads=2,
                                 num_kv_heads=1, head_dim=8, num_layers=2, scan_layers=True)
  f = hk.transform(lambda t: layers.haiku.Transformer(cfg)(t))
  tokens = jnp.zeros((8, 4), jnp.int32)
  mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  return f, f.init(jax.random.key(0), tokens), tokens, mesh


def test_missing_rules_warn_once_per_cause_not_once_per_parameter():
  f, params, tokens, mesh = _stacked_transformer()
  rules = partition.AxisRules([("batch", "data"), ("embed", None), ("mlp", "tensor"),
                               ("heads", "tensor"), ("kv_heads", None), ("vocab", None),
                               ("length", None)])   # no rule for 'layers' or 'head_dim'
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with partition.axis_rules(rules, mesh):
      jax.eval_shape(f.apply, params, None, tokens)
  texts = [str(w.message) for w in caught if issubclass(w.category, partition.PartitionWarning)]
  params_warnings = [t for t in texts if t.startswith("partition.haiku.get_parameter")]
  # 'layers' is missing on the 6 stacked kernels and scales, 'head_dim' on qkv and out
  assert len(params_warnings) == 2, texts
  layers_w, = (t for t in params_warnings if "'layers' has no rule" in t)
  head_w, = (t for t in params_warnings if "'head_dim' has no rule" in t)
  assert "(and 5 more parameter(s) for the same reason)." in layers_w
  assert "(and 1 more parameter(s) for the same reason)." in head_w
  assert "Add a rule for 'layers'" in layers_w    # the fix survives the rewording


def test_complete_rules_declare_quietly():
  f, params, tokens, mesh = _stacked_transformer()
  rules = partition.AxisRules([("batch", "data"), ("embed", None), ("mlp", "tensor"),
                               ("heads", "tensor"), ("kv_heads", None), ("vocab", None),
                               ("length", None), ("layers", None), ("head_dim", None)])
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    with partition.axis_rules(rules, mesh):
      jax.eval_shape(f.apply, params, None, tokens)


def test_an_error_filter_still_raises():
  f = hk.transform(lambda x: layers.haiku.Dense(8, in_axes=("embed",), out_axes=("mpl",))(x))
  x = jnp.ones((4, 16))
  params = f.init(jax.random.key(0), x)
  mesh = jax.make_mesh((8,), ("tensor",), axis_types=(jax.sharding.AxisType.Auto,))
  with warnings.catch_warnings():
    warnings.simplefilter("error", partition.PartitionWarning)
    with partition.axis_rules(partition.AxisRules([("mlp", "tensor"), ("embed", None)]), mesh):
      with pytest.raises(partition.PartitionWarning, match="did you mean 'mlp'"):
        jax.eval_shape(f.apply, params, None, x)
