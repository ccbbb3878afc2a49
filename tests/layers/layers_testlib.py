"""Shared helpers of the layers tests: build each framework's Transformer uniformly."""

import dataclasses
import functools

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType
from mesh_testlib import make_mesh

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
MESH = make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), AxisType.Auto)
FSDP_TP = partition.AxisRules([
    ("batch", ("data", "fsdp")), ("batch", "data"), ("length", None), ("mlp", "tensor"),
    ("heads", "tensor"), ("kv_heads", "tensor"), ("vocab", "tensor"), ("embed", "fsdp"),
    ("expert", None), ("head_dim", None), ("layers", None)])


def config(**changes):
  return dataclasses.replace(CFG, **changes)


@dataclasses.dataclass(eq=False)   # hashed by identity: a key of value_and_grad's cache
class Built:
  """A model in one framework: ``apply(params, tokens, **kw)`` and its ``params``.

  ``build`` caches these: treat ``params`` as read-only (``from_canonical`` and the frameworks'
  apply return new trees)."""

  framework: str
  apply: object
  params: object
  init: object = None   # for sharded init: the framework's init callable


def _forward(fn, cfg):
  """``fn(params, tokens, **kw)``; for a scanned model under ``jax.jit``, one program per set
  of non-array keyword arguments (``return_aux=True``). Eager, ``lax.scan`` compiles the
  whole layer stack again on every call; an unrolled model runs eagerly, op by op, on small
  programs every model of the same sizes shares."""
  if not cfg.scan_layers:
    return fn
  programs = {}

  def apply(params, tokens, **kw):
    static = {k: v for k, v in kw.items() if not isinstance(v, (jax.Array, np.ndarray))}
    key = tuple(sorted(static.items()))
    if key not in programs:
      programs[key] = jax.jit(lambda p, t, **arrays: fn(p, t, **arrays, **static))
    return programs[key](params, tokens, **{k: v for k, v in kw.items() if k not in static})
  return apply


def build(framework, cfg, tokens=TOKENS, seed=0):
  """``framework``'s Transformer for ``cfg``, initialised from ``seed`` (params depend on
  ``tokens``' shape only). Cached: every test asking for the same model shares one init (and
  a scanned model one jitted forward): compiling them is most of these tests' time."""
  return _build(framework, cfg, tuple(tokens.shape), np.dtype(tokens.dtype), seed)


@functools.cache
def _build(framework, cfg, shape, dtype, seed):
  built = _init(framework, cfg, shape, dtype, seed)
  # Committed to the device, as ``from_canonical``'s outputs are: a jitted step called on both
  # (a model's own params and weights loaded into it) is then one cache entry, one compile.
  built.params = jax.device_put(built.params, jax.devices()[0])
  return built


def _init(framework, cfg, shape, dtype, seed):
  # Eager init on purpose: it compiles one small RNG program per parameter shape, shared by
  # every model with that shape; a jitted init compiles the whole model's RNG (~10 s).
  key, tokens = jax.random.key(seed), jnp.zeros(shape, dtype)
  if framework == "linen":
    model = layers.linen.Transformer(cfg)
    return Built(framework, _forward(model.apply, cfg), model.init(key, tokens), model)
  if framework == "nnx":
    new = lambda: layers.nnx.Transformer(cfg, rngs=nnx.Rngs(seed))
    graphdef, state = nnx.split(new())
    return Built(framework, _forward(lambda s, t, **kw: nnx.merge(graphdef, s)(t, **kw), cfg),
                 state, new)
  f = hk.transform(lambda t, **kw: layers.haiku.Transformer(cfg)(t, **kw))
  return Built(framework, _forward(lambda p, t, **kw: f.apply(p, None, t, **kw), cfg),
               f.init(key, tokens), f)


def loss_fn(built):
  def loss(params, tokens, targets):
    logits = built.apply(params, tokens)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))
  return loss


@functools.cache
def value_and_grad(built):
  """``jit(value_and_grad(loss_fn(built)))``, one per model: tests reusing a model reuse its
  compiled gradient step."""
  return jax.jit(jax.value_and_grad(loss_fn(built)))


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
