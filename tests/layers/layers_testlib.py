"""Shared helpers of the layers tests: build each framework's Transformer uniformly."""

import dataclasses

import haiku as hk
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType

import layers
import layers.haiku
import layers.linen
import layers.nnx
import partition
import partition.flax
import partition.haiku
import partition.nnx
from layers._canonical import canonical_name

FRAMEWORKS = ("linen", "nnx", "haiku")
VOCAB = ("batch", "length", "embed", "mlp", "heads", "kv_heads", "head_dim", "vocab",
         "layers", "expert")
CFG = layers.TransformerConfig(vocab_size=64, embed_dim=16, mlp_dim=32, num_heads=4,
                               num_kv_heads=2, head_dim=8, num_layers=2)
TOKENS = jax.random.randint(jax.random.key(1), (4, 8), 0, 64)
TARGETS = jax.random.randint(jax.random.key(2), (4, 8), 0, 64)
MESH = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
FSDP_TP = partition.AxisRules([
    ("batch", ("data", "fsdp")), ("batch", "data"), ("length", None), ("mlp", "tensor"),
    ("heads", "tensor"), ("kv_heads", "tensor"), ("vocab", "tensor"), ("embed", "fsdp"),
    ("expert", None), ("head_dim", None), ("layers", None)])


def config(**changes):
  return dataclasses.replace(CFG, **changes)


@dataclasses.dataclass
class Built:
  """A model in one framework: ``apply(params, tokens, **kw)`` and its ``params``."""

  framework: str
  apply: object
  params: object
  init: object = None   # for sharded init: the framework's init callable


def build(framework, cfg, tokens=TOKENS, seed=0):
  key = jax.random.key(seed)
  if framework == "linen":
    model = layers.linen.Transformer(cfg)
    return Built(framework, lambda p, t, **kw: model.apply(p, t, **kw),
                 model.init(key, tokens), model)
  if framework == "nnx":
    graphdef, state = nnx.split(layers.nnx.Transformer(cfg, rngs=nnx.Rngs(seed)))
    return Built(framework, lambda s, t, **kw: nnx.merge(graphdef, s)(t, **kw), state,
                 lambda: layers.nnx.Transformer(cfg, rngs=nnx.Rngs(seed)))
  f = hk.transform(lambda t, **kw: layers.haiku.Transformer(cfg)(t, **kw))
  return Built(framework, lambda p, t, **kw: f.apply(p, None, t, **kw), f.init(key, tokens),
               f)


def loss_fn(built):
  def loss(params, tokens, targets):
    logits = built.apply(params, tokens)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))
  return loss


def canonical_axes(axes_tree):
  """``{canonical name: axes}`` from a logical-axes tree; unrolled blocks get 'layers'."""
  flat = jax.tree_util.tree_flatten_with_path(
      axes_tree, is_leaf=lambda x: x is None or isinstance(x, tuple))[0]
  out = {}
  for path, axes in flat:
    parts = [q for k in path
             for q in str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
             .split("/")]
    name, index = canonical_name(parts)
    out[name] = axes if index is None or axes is None else ("layers", *axes)
  return out


def init_sharded(m, rules, mesh=MESH, tokens=TOKENS):
  """``m``'s params created sharded by its framework's adapter (NNX: the state)."""
  if m.framework == "linen":
    return partition.flax.init_sharded(m.init, jax.random.key(0), tokens, rules=rules,
                                       mesh=mesh)
  if m.framework == "nnx":
    return nnx.state(partition.nnx.init_sharded(m.init, rules=rules, mesh=mesh))
  return partition.haiku.init_sharded(m.init, jax.random.key(0), tokens, rules=rules,
                                      mesh=mesh)
