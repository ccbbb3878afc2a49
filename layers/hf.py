"""Hugging Face checkpoints (Llama, Mistral, Qwen2/3, Mixtral) <-> canonical weights, no torch.

:func:`from_hf` reads a local ``transformers`` directory (``config.json`` and ``*.safetensors``,
one file or several with ``model.safetensors.index.json``) into canonical weights (see
``layers._canonical``) and a :class:`~layers.TransformerConfig`; :func:`to_hf` writes them
back as a directory ``transformers.AutoModelForCausalLM.from_pretrained`` loads.

Tensor layout. A ``torch.nn.Linear`` weight is ``(out, in)``; the canonical kernel is
``(*in_dims, *out_dims)``, so a projection is transposed and its merged ``heads * head_dim``
dim split (row-major: head-major, as ``transformers`` views it). Both sides use the
*rotate-half* RoPE convention (dim ``i`` pairs with dim ``i + head_dim / 2``, see
``layers._core.rope``): ``transformers``' Llama checkpoints are already permuted into it
from Meta's interleaved layout (``convert_llama_weights_to_hf.permute``), so no permutation
is needed here. Query head ``h`` uses kv head ``h // (heads / kv_heads)`` in both (GQA).

=============================================  ============================================
Hugging Face (per layer ``i``)                  canonical
=============================================  ============================================
``model.embed_tokens.weight (vocab, embed)``   ``embed/embedding (vocab, embed)``
``lm_head.weight (vocab, embed)``              ``lm_head/kernel (embed, vocab)`` (untied)
``model.layers.i.input_layernorm.weight``      ``blocks/attn_norm/scale[i]``
``self_attn.q_proj.weight (h*d, embed)``       ``blocks/attn/query/kernel[i] (embed, h, d)``
``self_attn.{k,v}_proj.weight (kv*d, embed)``  ``blocks/attn/{key,value}/kernel[i]``
``self_attn.{q,k,v}_proj.bias`` (Qwen2)        ``blocks/attn/{query,key,value}/bias[i]``
``self_attn.{q,k}_norm.weight (d,)`` (Qwen3)   ``blocks/attn/{query,key}_norm/scale[i]``
``self_attn.o_proj.weight (embed, h*d)``       ``blocks/attn/out/kernel[i] (h, d, embed)``
``post_attention_layernorm.weight``            ``blocks/mlp_norm/scale[i]``
``mlp.{gate,up}_proj.weight (mlp, embed)``     ``blocks/mlp/{wi_gate,wi_up}/kernel[i]``
``mlp.down_proj.weight (embed, mlp)``          ``blocks/mlp/wo/kernel[i] (mlp, embed)``
``model.norm.weight``                          ``final_norm/scale``
=============================================  ============================================

Mixtral's sparse MoE (``model.layers.i.block_sparse_moe.``, expert ``j``) replaces the MLP:

=============================================  ============================================
``gate.weight (expert, embed)``                ``blocks/moe/router[i] (embed, expert)``
``experts.j.w1.weight (mlp, embed)`` (gate)    ``blocks/moe/wi_gate[i, j] (embed, mlp)``
``experts.j.w3.weight (mlp, embed)`` (up)      ``blocks/moe/wi_up[i, j]``
``experts.j.w2.weight (embed, mlp)``           ``blocks/moe/wo[i, j] (mlp, embed)``
=============================================  ============================================

Its router is ``layers``' (softmax over all experts in fp32, top-``k``, the ``k``
probabilities renormalised to sum to one) and ``from_hf`` sets ``capacity_factor =
num_experts / experts_per_token``: every expert has a slot for every token of a sequence, so
nothing is dropped, as in ``transformers`` (which has no capacity).

RoPE: ``rope_type`` ``default``, ``linear`` and ``llama3`` (Llama 3.1/3.2/3.3) become
``TransformerConfig.rope_theta`` and ``rope_scaling`` (``layers.RopeScaling``), read from
``rope_parameters`` (``transformers`` 5) or ``rope_scaling`` + ``rope_theta`` (4.x).

Loading for a mesh (``mesh=``, ``rules=``) builds each weight with
``jax.make_array_from_callback`` on the ``NamedSharding`` its logical axes get from the
rules; the callback reads only that device's block of each layer's tensor with safetensors'
``get_slice`` (a device block is read once even when several devices hold it), so no host
holds a whole sharded tensor.

Example:
  >>> import layers
  >>> layers.from_hf('no/such/dir')  # doctest: +ELLIPSIS
  Traceback (most recent call last):
  ...
  layers.hf.HFError: from_hf: 'no/such/dir' has no config.json. Pass a local directory ...
"""

from __future__ import annotations

import itertools
import json
import math
import pathlib
import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from layers._config import RopeScaling, TransformerConfig
from partition import PartitionError
from partition.internal import atomic_write, format_message, needs_extra

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mixtral": "MixtralForCausalLM"}
#: architectures whose sliding window becomes max_len (see config_from_hf)
WINDOWED = ("mistral", "mixtral")
INDEX = "model.safetensors.index.json"
#: what each family's ``transformers`` config class assumes for a key config.json leaves
#: out (``MixtralConfig``: rope_theta=1e6, rms_norm_eps=1e-5; ``MistralConfig``:
#: sliding_window=4096; the others' as ``LlamaConfig``'s)
FAMILY_DEFAULTS = {
    arch: {"rope_theta": 10_000.0, "rms_norm_eps": 1e-6, "sliding_window": None,
           **({"rope_theta": 1e6, "rms_norm_eps": 1e-5} if arch == "mixtral" else {}),
           **({"sliding_window": 4096} if arch == "mistral" else {})}
    for arch in ARCHITECTURES}


class HFError(PartitionError, ValueError):
  """A Hugging Face checkpoint that is missing, malformed, or not supported by ``layers``."""


def read_json(path: pathlib.Path, api: str) -> Any:
  """A checkpoint's JSON file; a truncated or hand-broken one is an :class:`HFError` naming
  the file and the place (a download or a save cut short)."""
  try:
    return json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise HFError(f"{api}: {str(path)!r} is not valid JSON (line {e.lineno}, column "
                  f"{e.colno}: {e.msg}). A download or save_pretrained cut short leaves it "
                  "truncated: fetch or save the checkpoint again.") from None


# -- config.json <-> TransformerConfig -------------------------------------------------------


def _architecture(hf: Mapping[str, Any], where: str) -> str:
  names = {v: k for k, v in ARCHITECTURES.items()}
  for arch in hf.get("architectures") or ():
    if arch in names:
      return names[arch]
  # model_type decides only where no architecture is named: a named one that layers does not
  # know (a GPT-2 head on a qwen2 model_type) is another model, not a qwen2
  if not hf.get("architectures") and hf.get("model_type") in ARCHITECTURES:
    return hf["model_type"]
  raise HFError(
      f"from_hf: {where} has architectures={hf.get('architectures')!r}, model_type="
      f"{hf.get('model_type')!r}; layers supports {sorted(ARCHITECTURES.values())} "
      f"(model_type {', '.join(ARCHITECTURES)}). Convert another family yourself into canonical "
      "weights (layers.from_canonical).")


def _rope(hf: Mapping[str, Any], problems: list[str], default_theta: float = 10_000.0
          ) -> tuple[float, RopeScaling | None]:
  """``(rope_theta, rope_scaling)`` from ``rope_parameters`` (transformers 5) or
  ``rope_scaling`` and a top-level ``rope_theta`` (4.x); a RoPE layers does not compute is
  added to ``problems``."""
  params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
  field = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
  if any(isinstance(v, Mapping) for v in params.values()):
    problems.append(f"{field} is nested per layer type ({sorted(params)}): layers uses one "
                    "RoPE for every layer")
    return 10_000.0, None
  theta = float(params.get("rope_theta", hf.get("rope_theta", default_theta)))
  partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
  if partial not in (None, 1, 1.0):
    problems.append(f"partial_rotary_factor={partial!r}: layers rotates the whole head_dim")
  kind = params.get("rope_type", params.get("type", "default"))
  if kind == "default":
    return theta, None
  if kind not in ("linear", "llama3"):
    problems.append(f"{field}.rope_type={kind!r}: layers computes rope_type 'default', "
                    "'linear' and 'llama3' only")
    return theta, None
  needed = ("factor",) + (("low_freq_factor", "high_freq_factor") if kind == "llama3" else ())
  needed += ("original_max_position_embeddings",) if kind == "llama3" and hf.get(
      "original_max_position_embeddings") is None else ()
  missing = [k for k in needed if params.get(k) is None]
  if missing:
    problems.append(f"{field}.rope_type={kind!r} lacks {missing}")
    return theta, None
  extra = {}
  if kind == "llama3":
    original = params.get("original_max_position_embeddings",
                          hf.get("original_max_position_embeddings"))
    extra = dict(low_freq_factor=float(params["low_freq_factor"]),
                 high_freq_factor=float(params["high_freq_factor"]),
                 original_max_len=int(original))
  scaling = RopeScaling(kind, float(params["factor"]), **extra)
  problems.extend(f"{field}: {p}" for p in scaling.problems())
  return theta, scaling


def _unsupported(hf: Mapping[str, Any], arch: str, problems: list[str]) -> None:
  if hf.get("hidden_act", "silu") != "silu":
    problems.append(f"hidden_act={hf['hidden_act']!r}: layers' MLP is SwiGLU (silu)")
  if hf.get("attention_bias"):
    problems.append(f"attention_bias=True: {ARCHITECTURES[arch]}'s flag also adds a bias to "
                    "o_proj, which layers does not have (only Qwen2-style q/k/v biases)")
  if hf.get("mlp_bias"):
    problems.append("mlp_bias=True: layers' MLP has no biases")
  if arch in ("qwen2", "qwen3") and hf.get("use_sliding_window"):
    problems.append("use_sliding_window=True: sliding-window attention is not supported")
  if arch == "mixtral" and hf.get("router_jitter_noise"):
    problems.append(f"router_jitter_noise={hf['router_jitter_noise']!r}: layers' router "
                    "has no jitter (set it to 0.0)")
  layer_types = set(hf.get("layer_types") or ()) - {"full_attention"}
  if layer_types and arch not in WINDOWED:
    problems.append(f"layer_types contains {sorted(layer_types)}: only full attention is "
                    "supported")
  if hf.get("quantization_config"):
    problems.append("quantization_config is set: quantized checkpoints are not supported")


def config_from_hf(hf: Mapping[str, Any], *, dtype: Any = "float32", where: str = "config.json"
                   ) -> tuple[TransformerConfig, str]:
  """``(TransformerConfig, architecture)`` of a ``transformers`` config dict.

  Mistral's and Mixtral's ``sliding_window`` becomes ``max_len = min(max_position_embeddings,
  sliding_window)``: on sequences no longer than the window, sliding-window attention is
  causal attention, and longer ones are rejected by the model's length check. Mixtral's
  ``num_local_experts`` / ``num_experts_per_tok`` become ``num_experts`` /
  ``experts_per_token`` with ``capacity_factor = num_experts / experts_per_token`` (no token
  is ever dropped); Qwen3 gets ``qk_norm=True``.

  >>> cfg, arch = config_from_hf({'model_type': 'mistral', 'vocab_size': 8,
  ...     'hidden_size': 8, 'intermediate_size': 16, 'num_hidden_layers': 1,
  ...     'num_attention_heads': 2, 'max_position_embeddings': 4096, 'sliding_window': 512})
  >>> arch, cfg.max_len, cfg.num_kv_heads, cfg.head_dim
  ('mistral', 512, 2, 4)

  Raises:
    HFError: naming every unsupported field and value, or a missing required one.
  """
  arch = _architecture(hf, where)
  required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads") + (
                  ("num_local_experts", "num_experts_per_tok") if arch == "mixtral" else ())
  missing = [k for k in required if hf.get(k) is None]
  if missing:
    raise HFError(f"from_hf: {where} lacks {missing}; is it a {ARCHITECTURES[arch]} config?")
  problems: list[str] = []
  defaults = FAMILY_DEFAULTS[arch]
  theta, scaling = _rope(hf, problems, defaults["rope_theta"])
  _unsupported(hf, arch, problems)
  if problems:
    raise HFError(format_message(f"from_hf: {where} ({ARCHITECTURES[arch]}) uses "
                                 f"{len(problems)} unsupported setting(s).", bullets=problems,
                                 fix="layers would compute something else; use a checkpoint "
                                     "without these settings."))
  dropouts = {k: hf[k] for k in ("attention_dropout", "hidden_dropout", "resid_pdrop",
                                  "embd_pdrop") if hf.get(k)}
  if dropouts:
    warnings.warn(f"from_hf: {where} sets {dropouts}; layers has no dropout: the logits equal "
                  "transformers' eval mode (inference is exact), and a fine-tune from it trains "
                  "without dropout.", UserWarning, stacklevel=3)
  heads = hf["num_attention_heads"]
  max_len = hf.get("max_position_embeddings") or 2048
  window = hf.get("sliding_window", defaults["sliding_window"])
  if arch in WINDOWED and window:
    max_len = min(max_len, window)
  moe = {}
  if arch == "mixtral":
    experts, k = hf["num_local_experts"], hf["num_experts_per_tok"]
    moe = dict(num_experts=experts, experts_per_token=k,
               capacity_factor=experts / k if 0 < k <= experts else 1.0)
  config = TransformerConfig(
      vocab_size=hf["vocab_size"], embed_dim=hf["hidden_size"],
      mlp_dim=hf["intermediate_size"], num_heads=heads,
      num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
      num_layers=hf["num_hidden_layers"], max_len=max_len, param_dtype=dtype,
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)), rope_theta=theta,
      rope_scaling=scaling, norm_eps=float(hf.get("rms_norm_eps", defaults["rms_norm_eps"])),
      qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3", **moe)
  return config, arch


def config_to_hf(config: TransformerConfig, architecture: str, dtype: str) -> dict[str, Any]:
  """The ``config.json`` dict of ``config`` as a ``transformers`` ``architecture``."""
  hf = {"architectures": [ARCHITECTURES[architecture]], "model_type": architecture,
        "vocab_size": config.vocab_size, "hidden_size": config.embed_dim,
        "intermediate_size": config.mlp_dim, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
        "hidden_act": "silu", "max_position_embeddings": config.max_len,
        "rms_norm_eps": config.norm_eps, "tie_word_embeddings": config.tie_embeddings,
        "rope_theta": config.rope_theta, "dtype": dtype, "torch_dtype": dtype}
  # both spellings: transformers 5 reads rope_parameters, 4.x rope_theta and rope_scaling
  rope = {"rope_type": "default", "rope_theta": config.rope_theta}
  if config.rope_scaling is not None:
    r = config.rope_scaling
    scaling = {"rope_type": r.kind, "factor": r.factor}
    if r.kind == "llama3":
      scaling.update(low_freq_factor=r.low_freq_factor, high_freq_factor=r.high_freq_factor,
                     original_max_position_embeddings=r.original_max_len)
    rope.update(scaling)
    hf["rope_scaling"] = scaling
  hf["rope_parameters"] = rope
  if architecture in ("llama", "qwen3"):
    hf.update(attention_bias=False)
  if architecture == "llama":
    hf.update(mlp_bias=False)
  if architecture in WINDOWED:
    hf["sliding_window"] = None      # layers computes full causal attention
  if architecture in ("qwen2", "qwen3"):
    hf.update(use_sliding_window=False, sliding_window=None)
  if architecture == "mixtral":
    hf.update(num_local_experts=config.num_experts,
              num_experts_per_tok=config.experts_per_token, router_jitter_noise=0.0)
  return hf


# -- tensor layouts --------------------------------------------------------------------------


class Layout(NamedTuple):
  """How one canonical weight is stored by ``transformers``.

  ``hf``: the tensor name, with ``{i}`` (layer) and ``{j}`` (expert) standing for the
  canonical weight's leading *stacked* dims, one HF tensor each; ``groups``: for each HF dim,
  the canonical dims after the stacked ones merged into it (row-major); ``axes``: the
  canonical weight's logical axes.
  """

  hf: str
  groups: tuple[tuple[int, ...], ...]
  axes: tuple[str, ...]

  @property
  def stacked(self) -> int:
    """How many leading canonical dims index HF tensors (0, 1 = layer, 2 = layer, expert)."""
    return ("{i}" in self.hf) + ("{j}" in self.hf)

  @property
  def per_layer(self) -> bool:
    return self.stacked > 0

  def key(self, *index: int) -> str:
    """The HF tensor name of the stacked ``index`` (layer, then expert)."""
    return self.hf.format(**dict(zip("ij", index)))

  def keys(self, shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], str]]:
    """``(stacked index, HF name)`` of every tensor of a canonical weight of ``shape``."""
    ranges = (range(n) for n in shape[:self.stacked])
    return [(ids, self.key(*ids)) for ids in itertools.product(*ranges)]


def layouts(config: TransformerConfig) -> dict[str, Layout]:
  """``{canonical name: Layout}`` of every weight of ``config``'s model.

  >>> out = layouts(TransformerConfig())['blocks/attn/out/kernel']
  >>> out.hf, out.groups       # HF (embed, heads * head_dim) <- canonical (heads, head_dim, embed)
  ('model.layers.{i}.self_attn.o_proj.weight', ((2,), (0, 1)))
  """
  a, m = "model.layers.{i}.self_attn.", "model.layers.{i}.mlp."
  out = {
      "embed/embedding": Layout("model.embed_tokens.weight", ((0,), (1,)), ("vocab", "embed")),
      "blocks/attn_norm/scale": Layout("model.layers.{i}.input_layernorm.weight", ((0,),),
                                       ("layers", "embed")),
      "blocks/attn/query/kernel": Layout(a + "q_proj.weight", ((1, 2), (0,)),
                                         ("layers", "embed", "heads", "head_dim")),
      "blocks/attn/key/kernel": Layout(a + "k_proj.weight", ((1, 2), (0,)),
                                       ("layers", "embed", "kv_heads", "head_dim")),
      "blocks/attn/value/kernel": Layout(a + "v_proj.weight", ((1, 2), (0,)),
                                         ("layers", "embed", "kv_heads", "head_dim")),
      "blocks/attn/out/kernel": Layout(a + "o_proj.weight", ((2,), (0, 1)),
                                       ("layers", "heads", "head_dim", "embed")),
      "blocks/mlp_norm/scale": Layout("model.layers.{i}.post_attention_layernorm.weight",
                                      ((0,),), ("layers", "embed")),
      "final_norm/scale": Layout("model.norm.weight", ((0,),), ("embed",)),
  }
  if config.num_experts:
    e = "model.layers.{i}.block_sparse_moe."
    out.update({
        "blocks/moe/router": Layout(e + "gate.weight", ((1,), (0,)),
                                    ("layers", "embed", "expert")),
        "blocks/moe/wi_gate": Layout(e + "experts.{j}.w1.weight", ((1,), (0,)),
                                     ("layers", "expert", "embed", "mlp")),
        "blocks/moe/wi_up": Layout(e + "experts.{j}.w3.weight", ((1,), (0,)),
                                   ("layers", "expert", "embed", "mlp")),
        "blocks/moe/wo": Layout(e + "experts.{j}.w2.weight", ((1,), (0,)),
                                ("layers", "expert", "mlp", "embed"))})
  else:
    out.update({
        "blocks/mlp/wi_gate/kernel": Layout(m + "gate_proj.weight", ((1,), (0,)),
                                            ("layers", "embed", "mlp")),
        "blocks/mlp/wi_up/kernel": Layout(m + "up_proj.weight", ((1,), (0,)),
                                          ("layers", "embed", "mlp")),
        "blocks/mlp/wo/kernel": Layout(m + "down_proj.weight", ((1,), (0,)),
                                       ("layers", "mlp", "embed"))})
  if not config.tie_embeddings:
    out["lm_head/kernel"] = Layout("lm_head.weight", ((1,), (0,)), ("embed", "vocab"))
  if config.qkv_bias:
    for name, proj, heads in (("query", "q", "heads"), ("key", "k", "kv_heads"),
                              ("value", "v", "kv_heads")):
      out[f"blocks/attn/{name}/bias"] = Layout(a + f"{proj}_proj.bias", ((0, 1),),
                                               ("layers", heads, "head_dim"))
  if config.qk_norm:
    for name, proj in (("query", "q"), ("key", "k")):
      out[f"blocks/attn/{name}_norm/scale"] = Layout(a + f"{proj}_norm.weight", ((0,),),
                                                     ("layers", "head_dim"))
  return out


def canonical_shapes(config: TransformerConfig) -> dict[str, tuple[int, ...]]:
  """``{canonical name: shape}`` of ``config``'s weights (blocks stacked on ``layers``)."""
  sizes = {"vocab": config.vocab_size, "embed": config.embed_dim, "mlp": config.mlp_dim,
           "heads": config.num_heads, "kv_heads": config.num_kv_heads,
           "head_dim": config.head_dim, "layers": config.num_layers,
           "expert": config.num_experts}
  return {name: tuple(sizes[a] for a in lay.axes) for name, lay in layouts(config).items()}


def _hf_shape(lay: Layout, shape: tuple[int, ...]) -> tuple[int, ...]:
  return tuple(math.prod(shape[d] for d in g) for g in lay.groups)


def _read_block(tensor: Any, lay: Layout, shape: tuple[int, ...],
                index: tuple[slice, ...]) -> np.ndarray:
  """The canonical block ``index`` (per-layer dims) of one HF tensor, read with
  ``get_slice``: each HF dim reads the rows of its first canonical dim's range (the
  others of its group whole), then the block is cut, reshaped and transposed."""
  hf_index, block_shape, cuts = [], [], []
  for group in lay.groups:
    first, rest = index[group[0]], group[1:]
    inner = math.prod(shape[d] for d in rest)
    hf_index.append(slice(first.start * inner, first.stop * inner))
    block_shape += [first.stop - first.start, *(shape[d] for d in rest)]
    cuts += [slice(None), *(index[d] for d in rest)]
  block = np.asarray(tensor[tuple(hf_index)]).reshape(block_shape)[tuple(cuts)]
  order = [d for g in lay.groups for d in g]
  return block.transpose(np.argsort(order))


def _to_hf_tensor(value: np.ndarray, lay: Layout) -> np.ndarray:
  """A canonical per-layer array as the HF tensor (inverse of :func:`_read_block`)."""
  order = [d for g in lay.groups for d in g]
  return np.ascontiguousarray(value.transpose(order).reshape(_hf_shape(lay, value.shape)))


# -- files -----------------------------------------------------------------------------------


class _Files:
  """The safetensors files of a checkpoint: which file holds each tensor, opened lazily."""

  def __init__(self, directory: pathlib.Path):
    with needs_extra("recipes", by="layers.hf"):
      import safetensors
    self.directory, self._open, self._handles = directory, safetensors.safe_open, {}
    index = directory / INDEX
    if index.is_file():
      self.where = {k: directory / v for k, v in read_json(index, "from_hf")
                    ["weight_map"].items()}
    else:
      files = sorted(directory.glob("*.safetensors"))
      if not files:
        raise HFError(f"from_hf: {str(directory)!r} has no *.safetensors files. Save the "
                      "model with save_pretrained(..., safe_serialization=True); .bin "
                      "(pickle) checkpoints are not read.")
      self.where = {k: f for f in files for k in self.handle(f, "numpy").keys()}

  def handle(self, file: pathlib.Path, framework: str) -> Any:
    if (file, framework) not in self._handles:
      if not file.is_file():
        raise HFError(f"from_hf: {INDEX} in {str(self.directory)!r} names {file.name!r}, "
                      "which does not exist. Copy the whole checkpoint directory.")
      try:
        self._handles[file, framework] = self._open(str(file), framework=framework)
      except Exception as e:  # noqa: BLE001  (safetensors raises its own SafetensorError)
        raise HFError(f"from_hf: {str(file)!r} cannot be read as safetensors ({e}). The "
                      "file is truncated or is not a safetensors file: download or copy it "
                      "again.") from e
    return self._handles[file, framework]

  def slice(self, name: str) -> Any:
    """safetensors' lazy slice of ``name`` (numpy; jax for bfloat16/float8, which numpy
    lacks)."""
    lazy = self.handle(self.where[name], "numpy").get_slice(name)
    if lazy.get_dtype() in ("BF16", "F8_E4M3", "F8_E5M2"):
      lazy = self.handle(self.where[name], "flax").get_slice(name)
    return lazy


def _check_tensors(files: _Files, config: TransformerConfig, where: str) -> None:
  problems = []
  shapes = canonical_shapes(config)
  for name, lay in layouts(config).items():
    want = _hf_shape(lay, shapes[name][lay.stacked:])
    for _, key in lay.keys(shapes[name]):
      if key not in files.where:
        problems.append(f"{key}: missing (needed for {name})")
        continue
      got = tuple(files.slice(key).get_shape())
      if got != want:
        problems.append(f"{key}: shape {got}, config.json implies {want}")
  if problems:
    raise HFError(format_message(
        f"from_hf: {where}: {len(problems)} tensor(s) do not match config.json.",
        bullets=problems[:20] + ([f"... {len(problems) - 20} more"] if len(problems) > 20
                                 else []),
        fix="Use the config.json saved with these weights (or re-save the model)."))


# -- from_hf / to_hf -------------------------------------------------------------------------


def _normalize(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
  return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))


def _load_one(files: _Files, lay: Layout, shape: tuple[int, ...], dtype: Any,
              sharding: Any) -> jax.Array:
  blocks: dict[tuple, np.ndarray] = {}

  def read(index: tuple[slice, ...]) -> np.ndarray:
    index = _normalize(index, shape)
    key = tuple((s.start, s.stop) for s in index)
    if key not in blocks:         # devices holding the same block share one read
      k = lay.stacked             # one HF tensor per (layer[, expert]) in the block
      lead = [range(s.start, s.stop) for s in index[:k]]
      parts = [_read_block(files.slice(lay.key(*ids)), lay, shape[k:], index[k:])
               for ids in itertools.product(*lead)]
      blocks[key] = np.stack(parts).reshape(*map(len, lead), *parts[0].shape).astype(dtype)
    return blocks[key]

  if sharding is None:
    return jnp.asarray(read(tuple(slice(None) for _ in shape)))
  return jax.make_array_from_callback(shape, sharding, read)


def from_hf(path: str | pathlib.Path, *, mesh: jax.sharding.Mesh | None = None,
            rules: Any = None, dtype: Any = "float32"
            ) -> tuple[dict[str, jax.Array], TransformerConfig]:
  """Canonical weights and config of a local Hugging Face checkpoint (``ARCHITECTURES``).

  Args:
    path: a directory with ``config.json`` and ``*.safetensors`` (one file, several, or
      shards listed by ``model.safetensors.index.json``), as ``save_pretrained`` writes.
    mesh: place each weight on this mesh, each device reading only its block.
    rules: the ``partition.AxisRules`` (or a rules table) giving each weight's sharding
      from its logical axes (``Layout.axes``); required with ``mesh``.
    dtype: the weights' dtype and the config's ``param_dtype``.

  Returns:
    ``(weights, config)``: ``{canonical name: jax.Array}`` with blocks stacked on a leading
    ``layers`` dim (feed to ``layers.from_canonical``), and the ``TransformerConfig``.

  Raises:
    HFError: a missing directory/config/tensor, a tensor whose shape disagrees with
      ``config.json``, or an unsupported architecture or setting (named with its value).
  """
  directory = pathlib.Path(path)
  config_file = directory / "config.json"
  if not config_file.is_file():
    raise HFError(f"from_hf: {str(path)!r} has no config.json. Pass a local directory "
                  "written by transformers' save_pretrained (config.json + *.safetensors).")
  config, _ = config_from_hf(read_json(config_file, "from_hf"), dtype=dtype,
                             where=str(config_file))
  if mesh is not None and rules is None:
    raise HFError("from_hf: mesh= needs rules= (e.g. partition.AxisRules.from_file("
                  "'recipes/presets/fsdp_tp.yaml')) to place the weights by their logical "
                  "axes.")
  if mesh is not None:
    import partition
    rules = partition.current_rules(rules)
  files = _Files(directory)
  _check_tensors(files, config, str(directory))
  weights = {}
  for name, shape in canonical_shapes(config).items():
    lay = layouts(config)[name]
    sharding = None if mesh is None else rules.sharding(lay.axes, mesh, shape)
    weights[name] = _load_one(files, lay, shape, config.param_dtype, sharding)
  return weights, config


def to_hf(weights: Mapping[str, Any], config: TransformerConfig, path: str | pathlib.Path,
          *, architecture: str | None = None, max_shard_bytes: int | None = None,
          token_ids: Mapping[str, Any] | None = None) -> list[str]:
  """Writes canonical weights as a ``transformers`` checkpoint directory.

  Args:
    weights: ``{canonical name: array}`` (``layers.to_canonical`` or :func:`from_hf`).
    config: their ``TransformerConfig`` (an MoE one as Mixtral, whose ``transformers``
      model never drops a token whatever ``capacity_factor`` says).
    path: the directory (created); ``config.json`` and ``model.safetensors`` go there, or
      ``model-0000k-of-0000n.safetensors`` + ``model.safetensors.index.json`` when the
      tensors exceed ``max_shard_bytes``.
    architecture: a key of ``ARCHITECTURES``; default ``'qwen2'`` with ``qkv_bias``,
      ``'qwen3'`` with ``qk_norm``, ``'mixtral'`` with experts, else ``'llama'``.
    token_ids: ``config.json``'s special token ids to write (``bos_token_id``,
      ``eos_token_id``, ``pad_token_id``; :func:`token_ids` picks them from a source
      checkpoint's config): without ``eos_token_id``, generation from the export never stops early.

  Returns:
    The names of the files written. Arrays are gathered to the host one at a time.

  Raises:
    HFError: an architecture that cannot express ``config``, weights missing, extra, or of
      the wrong shape, or a ``path`` (or a folder above it) that is a file.
  """
  directory = pathlib.Path(path)
  if (file := next((p for p in (directory, *directory.parents)
                    if p.exists() and not p.is_dir()), None)) is not None:
    what = "is a file" if file == directory else f"is under {str(file)!r}, which is a file"
    raise HFError(f"to_hf: path {str(path)!r} {what}; it must be a directory "
                  "(created if missing) to hold config.json and the .safetensors. Pass "
                  "another path, or move the file away.")
  architecture = architecture or ("qwen2" if config.qkv_bias else "qwen3" if config.qk_norm
                                  else "mixtral" if config.num_experts else "llama")
  problems = []
  if architecture not in ARCHITECTURES:
    problems.append(f"architecture={architecture!r} is not one of {sorted(ARCHITECTURES)}")
  else:
    for field, value, arch in (("qkv_bias", config.qkv_bias, "qwen2"),
                               ("qk_norm", config.qk_norm, "qwen3"),
                               ("num_experts", config.num_experts, "mixtral")):
      if bool(value) != (architecture == arch):
        problems.append(f"{field}={value} but architecture={architecture!r}: only {arch} "
                        f"has {'experts' if field == 'num_experts' else field} (and always "
                        "has them)")
  shapes = canonical_shapes(config)
  for name in sorted(set(shapes) | set(weights)):
    if name not in weights:
      problems.append(f"{name}: missing from the weights")
    elif name not in shapes:
      problems.append(f"{name}: not a weight of this config (shape {np.shape(weights[name])})")
    elif tuple(np.shape(weights[name])) != shapes[name]:
      problems.append(f"{name}: shape {tuple(np.shape(weights[name]))}, config implies "
                      f"{shapes[name]}")
  if problems:
    raise HFError(format_message(f"to_hf: cannot write {str(path)!r}.", bullets=problems,
                                 fix="Pass the weights with the TransformerConfig they were "
                                     "trained with (untied or tied as built), and the "
                                     "architecture that has its features."))
  tensors = {}
  for name, lay in layouts(config).items():
    value = np.asarray(jax.device_get(weights[name]))
    for ids, key in lay.keys(value.shape):
      tensors[key] = _to_hf_tensor(value[ids], lay)
  directory.mkdir(parents=True, exist_ok=True)
  for old in directory.glob("*.safetensors"):
    old.unlink()
  (directory / INDEX).unlink(missing_ok=True)
  dtype = str(next(iter(tensors.values())).dtype)
  written = _write_tensors(directory, tensors, max_shard_bytes)
  unknown = sorted(set(token_ids or {}) - set(TOKEN_ID_KEYS))
  if unknown:
    raise HFError(f"to_hf: token_ids has {unknown}, which are not special token ids; give "
                  f"only {list(TOKEN_ID_KEYS)}.")
  hf = {**config_to_hf(config, architecture, dtype), **(token_ids or {})}
  atomic_write(directory / "config.json", json.dumps(hf, indent=2) + "\n")
  return [*written, "config.json"]


TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
"""The special token ids of ``config.json`` (the weights do not hold them)."""


def token_ids(hf: Mapping[str, Any]) -> dict[str, Any]:
  """The special token ids of a checkpoint's ``config.json`` dict, for :func:`to_hf` to carry
  into an export of a model fine-tuned from it."""
  return {k: hf[k] for k in TOKEN_ID_KEYS if hf.get(k) is not None}


def _write_tensors(directory: pathlib.Path, tensors: dict[str, np.ndarray],
                   max_shard_bytes: int | None) -> list[str]:
  with needs_extra("recipes", by="layers.hf"):
    import safetensors.numpy

  shards, size = [{}], 0
  for key in sorted(tensors):
    if max_shard_bytes and shards[-1] and size + tensors[key].nbytes > max_shard_bytes:
      shards.append({})
      size = 0
    shards[-1][key] = tensors[key]
    size += tensors[key].nbytes
  if len(shards) == 1:
    names = ["model.safetensors"]
  else:
    names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
  for name, shard in zip(names, shards):
    atomic_write(directory / name, safetensors.numpy.save(shard, metadata={"format": "pt"}))
  if len(shards) > 1:
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
             "weight_map": {k: n for n, s in zip(names, shards) for k in s}}
    atomic_write(directory / INDEX, json.dumps(index, indent=2, sort_keys=True) + "\n")
    return [*names, INDEX]
  return names

