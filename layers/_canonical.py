"""Framework-independent weights: one flat ``{name: array}`` dict for every Transformer.

Canonical names drop the framework's wrapping (linen's ``params/``, Haiku's module name,
NNX's attribute paths) and always *stack* the blocks: a block parameter is one array with a
leading ``layers`` dim under ``blocks/...``, whether the model is scanned or not:

=========================================  ===========================================
``embed/embedding``                        ``(vocab, embed)``
``blocks/attn_norm/scale``                 ``(layers, embed)``
``blocks/attn/query/kernel``               ``(layers, embed, heads, head_dim)``
``blocks/attn/key/kernel``, ``value``      ``(layers, embed, kv_heads, head_dim)``
``blocks/attn/query/bias`` (``qkv_bias``)  ``(layers, heads, head_dim)``
``blocks/attn/key/bias``, ``value/bias``   ``(layers, kv_heads, head_dim)``
``blocks/attn/out/kernel``                 ``(layers, heads, head_dim, embed)``
``blocks/mlp_norm/scale``                  ``(layers, embed)``
``blocks/mlp/wi_gate/kernel``, ``wi_up``   ``(layers, embed, mlp)``
``blocks/mlp/wo/kernel``                   ``(layers, mlp, embed)``
``blocks/moe/router``                      ``(layers, embed, expert)``
``blocks/moe/wi_gate``, ``wi_up``          ``(layers, expert, embed, mlp)``
``blocks/moe/wo``                          ``(layers, expert, mlp, embed)``
``final_norm/scale``                       ``(embed,)``
``lm_head/kernel`` (untied only)           ``(embed, vocab)``
=========================================  ===========================================

**Canonical weights are unfused; framework params are fused.** The frameworks hold the
query, key and value projections as one kernel ``attn/qkv/kernel (embed, kv_heads,
q_per_kv + 2, head_dim)`` (per kv head: its ``q_per_kv`` query heads, then its key, then its
value; bias ``attn/qkv/bias (kv_heads, q_per_kv + 2, head_dim)``), the gate and up
projections as ``mlp/wi/kernel (embed, 2, mlp)`` and ``moe/wi (expert, embed, 2, mlp)``
(index 0 = gate, 1 = up): one input-gradient dot each, so tensor parallelism reduces one
operand per projection. :func:`to_canonical` splits them (query head ``h`` belongs to kv
head ``h // q_per_kv``, as in Hugging Face's GQA) and :func:`from_canonical` fuses them, so
the canonical dict keeps the table above whatever the framework layout.

Framework paths it understands: linen ``params/blocks_3/...`` (unrolled) and
``params/blocks/...`` (scanned); NNX ``blocks/3/...`` (``nnx.List``) and ``blocks/...``;
Haiku ``transformer/blocks_3/...``, ``transformer/blocks/...`` and
``transformer/blocks/block/...`` (``hk.layer_stack``).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from layers._core import split_qkv
from partition import PartitionError
from partition.internal import format_message

_UNROLLED = re.compile(r"^blocks_(\d+)$")
_WRAPPERS = ("params", "transformer")


class CanonicalError(PartitionError, ValueError):
  """Canonical weights do not match the parameters they are loaded into."""


# -- paths -----------------------------------------------------------------------------------


def _key_parts(key: Any) -> list[str]:
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr)).split("/")
  return [str(key)]


def canonical_name(parts: Iterable[str]) -> tuple[str, int | None]:
  """``(canonical name, layer index)`` of a framework path (index ``None`` when stacked or
  outside the blocks).

  >>> canonical_name(['params', 'blocks_1', 'attn', 'query', 'kernel'])
  ('blocks/attn/query/kernel', 1)
  >>> canonical_name(['transformer', 'blocks', 'block', 'mlp_norm', 'scale'])
  ('blocks/mlp_norm/scale', None)
  """
  parts = [p for p in parts if p not in ("~", "")]
  if parts and parts[0] in _WRAPPERS:
    parts = parts[1:]
  if parts and (m := _UNROLLED.match(parts[0])):
    return "/".join(["blocks", *parts[1:]]), int(m.group(1))
  if parts[:1] == ["blocks"] and len(parts) > 1:
    if parts[1].isdigit():
      return "/".join(["blocks", *parts[2:]]), int(parts[1])
    if parts[1] == "block":
      return "/".join(["blocks", *parts[2:]]), None
  return "/".join(parts), None


# -- framework trees -------------------------------------------------------------------------


def _is_box(x: Any) -> bool:
  """A linen ``AxisMetadata`` box or an NNX ``Variable``: a leaf here."""
  module = type(x).__module__
  return module.startswith("flax.") and (hasattr(x, "unbox") or hasattr(x, "get_value"))


def _value(leaf: Any) -> Any:
  if hasattr(leaf, "get_value"):
    return leaf.get_value()
  return leaf.unbox(apply_constraint=False) if hasattr(leaf, "unbox") else leaf


def _rebox(leaf: Any, value: Any) -> Any:
  if hasattr(leaf, "get_value"):
    return leaf.copy(value)
  return leaf.replace_boxed(value) if hasattr(leaf, "replace_boxed") else value


def _nnx_state(params: Any) -> tuple[Any, Any]:
  """``(graphdef, params state)`` of an NNX module, else ``(None, params)``."""
  if type(params).__module__.startswith("flax.nnx"):
    from flax import nnx
    if isinstance(params, nnx.Module):
      graphdef, state, rest = nnx.split(params, nnx.Param, ...)
      return (graphdef, rest), state
  return None, params


def _leaves(tree: Any) -> list[tuple[list[str], Any]]:
  flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_box)[0]
  return [([q for k in path for q in _key_parts(k)], leaf) for path, leaf in flat]


# -- fused framework layout <-> unfused canonical names --------------------------------------


def _fuse_qkv(q: Any, k: Any, v: Any) -> Any:
  heads, kv_heads = q.shape[-2], k.shape[-2]
  if k.shape != v.shape or heads % kv_heads or q.shape[:-2] != k.shape[:-2] or (
      q.shape[-1] != k.shape[-1]):
    raise ValueError(f"query {tuple(q.shape)}, key {tuple(k.shape)} and value "
                     f"{tuple(v.shape)} do not form grouped-query heads")
  q = jnp.reshape(q, (*q.shape[:-2], kv_heads, heads // kv_heads, q.shape[-1]))
  return jnp.concatenate([q, jnp.asarray(k)[..., None, :], jnp.asarray(v)[..., None, :]],
                         axis=-2)


def _split_pair(fused: Any) -> tuple[Any, Any]:
  return fused[..., 0, :], fused[..., 1, :]


def _fuse_pair(gate: Any, up: Any) -> Any:
  if gate.shape != up.shape:
    raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape")
  return jnp.stack([jnp.asarray(gate), jnp.asarray(up)], axis=-2)


# framework name -> (canonical names, split, fuse)
FUSED: dict[str, tuple[tuple[str, ...], Any, Any]] = {
    "blocks/attn/qkv/kernel": (("blocks/attn/query/kernel", "blocks/attn/key/kernel",
                                "blocks/attn/value/kernel"), split_qkv, _fuse_qkv),
    "blocks/attn/qkv/bias": (("blocks/attn/query/bias", "blocks/attn/key/bias",
                              "blocks/attn/value/bias"), split_qkv, _fuse_qkv),
    "blocks/mlp/wi/kernel": (("blocks/mlp/wi_gate/kernel", "blocks/mlp/wi_up/kernel"),
                             _split_pair, _fuse_pair),
    "blocks/moe/wi": (("blocks/moe/wi_gate", "blocks/moe/wi_up"), _split_pair, _fuse_pair),
}


def _unfuse(flat: dict[str, Any]) -> dict[str, Any]:
  out = {}
  for name, value in flat.items():
    if name in FUSED:
      names, split, _ = FUSED[name]
      out.update(zip(names, split(value)))
    else:
      out[name] = value
  return out


def part_shapes(name: str, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
  """The canonical shapes that the parts of the parameter ``name`` of ``shape`` must have:
  ``[shape]`` for an unfused one, its split parts' shapes for a fused one.

  >>> part_shapes('blocks/attn/qkv/kernel', (16, 2, 4, 8))   # 2 kv heads, 2 queries each
  [(16, 4, 8), (16, 2, 8), (16, 2, 8)]
  """
  if name not in FUSED:
    return [tuple(shape)]
  parts = jax.eval_shape(FUSED[name][1], jax.ShapeDtypeStruct(shape, jnp.float32))
  return [tuple(p.shape) for p in parts]


# -- to / from -------------------------------------------------------------------------------


def _stack(per_layer: dict[str, dict[int, Any]]) -> tuple[dict[str, Any], list[str]]:
  out, problems = {}, []
  for name, layers in per_layer.items():
    if sorted(layers) != list(range(len(layers))):
      problems.append(f"{name}: layers {sorted(layers)} are not 0..{len(layers) - 1}")
      continue
    out[name] = jnp.stack([layers[i] for i in range(len(layers))])
  return out, problems


def to_canonical(params: Any) -> dict[str, jax.Array]:
  """Flat canonical weights of a ``layers`` Transformer from any framework.

  Args:
    params: linen variables (``{'params': ...}``, boxed or not), a Haiku params dict, an
      NNX ``Transformer`` or its ``nnx.state``.

  Returns:
    ``{canonical name: array}``, blocks stacked on a leading ``layers`` dim.

  Example:
    >>> import jax, jax.numpy as jnp, layers, layers.linen
    >>> cfg = layers.TransformerConfig(num_layers=3)
    >>> v = layers.linen.Transformer(cfg).init(jax.random.key(0), jnp.zeros((1, 4), int))
    >>> layers.to_canonical(v)['blocks/attn/query/kernel'].shape   # unfused
    (3, 32, 4, 8)
  """
  _, tree = _nnx_state(params)
  flat, per_layer = {}, {}
  for parts, leaf in _leaves(tree):
    name, index = canonical_name(parts)
    if index is None:
      flat[name] = _value(leaf)
    else:
      per_layer.setdefault(name, {})[index] = _value(leaf)
  stacked, problems = _stack(per_layer)
  if problems:
    raise CanonicalError(format_message(
        "to_canonical: the unrolled blocks are not numbered 0..n-1.", bullets=problems,
        fix="Pass the params of a layers.{linen,nnx,haiku}.Transformer."))
  return _unfuse({**flat, **stacked})


def _target(leaf: Any) -> tuple[tuple[int, ...], Any, Any]:
  value = _value(leaf)
  return tuple(value.shape), value.dtype, getattr(value, "sharding", None)


def _pick(weights: dict, name: str, index: int | None, leaf: Any, problems: list[str],
          where: str) -> Any:
  """The value of the parameter ``name`` (layer ``index``) from the canonical ``weights``.

  Each canonical part is checked against the shape the parameter implies *before* a fused
  parameter is assembled, so a mis-shaped weight is reported under the user's own key."""
  shape, dtype, sharding = _target(leaf)
  names = FUSED[name][0] if name in FUSED else (name,)
  missing = [n for n in names if n not in weights]
  if missing:
    problems.append(f"{where}: no weight {', '.join(map(repr, missing))} in the canonical "
                    "dict")
    return _value(leaf)
  parts = []
  for part, want in zip(names, part_shapes(name, shape)):
    full = tuple(np.shape(weights[part]))
    if index is not None and (not full or index >= full[0]):
      problems.append(f"{where}: layer index {index} is out of range for "
                      f"{full[0] if full else 0} layers in {part!r}")
      continue
    got = full if index is None else full[1:]
    if got != want:
      layer = "" if index is None else f" (layer {index} of {full})"
      into = f" (fused with {len(names) - 1} more into {shape})" if name in FUSED else ""
      problems.append(f"{where}: {part!r}{layer} has shape {got}, the config expects "
                      f"{want}{into}{_unfusable(weights, names, name, index)}")
      continue
    parts.append(weights[part] if index is None else weights[part][index])
  if len(parts) < len(names):
    return _value(leaf)
  # the parts have the shapes the split of this parameter gives: they fuse into it
  value = jnp.asarray(FUSED[name][2](*parts) if name in FUSED else parts[0], dtype)
  return value if sharding is None else jax.device_put(value, sharding)


def _unfusable(weights: dict, names: tuple[str, ...], name: str, index: int | None) -> str:
  """``'; <why>'`` when the user's own parts of a fused parameter could not be fused into
  any parameter (e.g. query heads that are no multiple of the key's heads), else ``''``."""
  if name not in FUSED or any(n not in weights for n in names):
    return ""
  shapes = [tuple(np.shape(weights[n]))[0 if index is None else 1:] for n in names]
  try:
    jax.eval_shape(FUSED[name][2], *(jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes))
  except ValueError as e:
    return f"; {e}"
  return ""


def from_canonical(weights: dict[str, Any], like: Any) -> Any:
  """Canonical weights as the params of ``like``'s framework and scan setting.

  Args:
    weights: ``{canonical name: array}`` (from :func:`to_canonical`, any framework).
    like: the params to imitate: linen variables, Haiku params, an NNX module or state.
      Its structure, boxes/metadata, dtypes and shardings are kept (each weight is
      ``jax.device_put`` onto the sharding of the leaf it replaces).

  Returns:
    A tree like ``like`` (for an NNX module, a new module) holding ``weights``.

  Raises:
    CanonicalError: listing every missing, unused or mis-shaped weight.
  """
  linen = sys.modules.get("flax.linen")
  if linen is not None and isinstance(like, linen.Module):  # the module, not its variables
    raise CanonicalError(format_message(
        f"from_canonical: like= is a {type(like).__name__}, not the params to imitate.",
        fix="Pass the model's params: linen variables (module.init(...) output), Haiku "
            "params (f.init(...)), or an NNX module / nnx.state(module)."))
  graph, tree = _nnx_state(like)
  problems, used = [], set()

  def one(path, leaf):
    parts = [q for k in path for q in _key_parts(k)]
    name, index = canonical_name(parts)
    used.update(FUSED[name][0] if name in FUSED else (name,))
    return _rebox(leaf, _pick(weights, name, index, leaf, problems, "/".join(parts)))

  out = jax.tree_util.tree_map_with_path(one, tree, is_leaf=_is_box)
  problems += [f"{name!r} ({np.shape(weights[name])}) matches no parameter"
               for name in sorted(set(weights) - used)]
  if problems:
    raise CanonicalError(format_message(
        f"from_canonical: {len(problems)} weight(s) do not fit the target parameters.",
        bullets=problems,
        fix="Build `like` from the same TransformerConfig as the weights (same sizes, "
            "num_experts and num_layers)."))
  if graph is None:
    return out
  from flax import nnx
  return nnx.merge(graph[0], out, graph[1])
