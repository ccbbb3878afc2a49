"""Collectives of a compiled gradient step under the presets' rules (recipes/presets/*.yaml).

Counted in the optimized HLO (``jax.jit(...).lower(...).compile().as_text()``) against the
published figures: Megatron-LM §3 (tensor parallelism: 2 all-reduces of the layer's
activations forward and 2 backward per layer), a tied embedding whose gradient is reduced
once, and an FSDP embedding lookup that never moves the batch's tokens or activations.
"""

import math
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from layers_testlib import config
from mesh_testlib import make_mesh

import layers.linen
import partition
import partition.flax

pytestmark = pytest.mark.slow   # compiles full gradient steps

PRESETS = pathlib.Path(__file__).resolve().parents[2] / "recipes" / "presets"
LENGTH = 8


def _operand_names(name, count):
  """XLA's combiners name a combined op ``prefix/(name_0:name_1:...)``, one per operand."""
  if ":" in name and "/(" in name:
    prefix, combined = name.split("/(", 1)
    parts = combined[:-1].split(":")
    if len(parts) == count:
      return [f"{prefix}/{p}" for p in parts]
  return [name] * count


def _collectives(text):
  """``[(kind, operand shapes, op_names)]`` of every collective in optimized HLO text."""
  out = []
  for line in text.splitlines():
    line = re.sub(r"/\*.*?\*/", "", line)
    m = re.search(r"= (.*?) (all-reduce|all-gather|reduce-scatter|all-to-all|"
                  r"collective-permute)(-start)?\(", line)
    if m:
      shapes = [tuple(int(d) for d in dims.split(",") if d)
                for dims in re.findall(r"[a-z]+\d*\[([\d,]*)\]", m.group(1))]
      name = re.search(r'op_name="([^"]*)"', line)
      out.append((m.group(2), shapes, _operand_names(name.group(1) if name else "",
                                                     len(shapes))))
  return out


def _grad_step_hlo(preset, mesh_shape, axis_names, cfg, batch, pinned=False):
  """The optimized HLO of ``jit(grad(loss))``; ``pinned``: the gradients come out in the
  parameters' shardings (as an optimizer step reads them), not left to XLA."""
  mesh = make_mesh(mesh_shape, axis_names, AxisType.Auto)
  rules = partition.AxisRules.from_file(PRESETS / f"{preset}.yaml")
  model = layers.linen.Transformer(cfg)
  tokens = jax.random.randint(jax.random.key(0), (batch, LENGTH), 0, cfg.vocab_size)
  tokens = jax.device_put(tokens, NamedSharding(mesh, rules.spec(("batch", "length"),
                                                                  tokens.shape, mesh)))
  # The compiled program depends on the parameters' shapes and shardings only: lower on the
  # abstract ones init_sharded would create (no init program to compile).
  params = partition.unbox(partition.flax.abstract_init(model, jax.random.key(1), tokens,
                                                        rules=rules, mesh=mesh))

  def loss(params, tokens):
    logp = jax.nn.log_softmax(model.apply(params, tokens))
    return -jnp.mean(jnp.take_along_axis(logp, tokens[..., None], axis=-1))

  out = jax.tree.map(lambda x: x.sharding, params) if pinned else None
  with partition.axis_rules(rules, mesh):
    return jax.jit(jax.grad(loss), out_shardings=out).lower(params, tokens).compile().as_text()


def _activation_all_reduces(text, activation):
  """(forward, backward) counts of all-reduce operands of the activation's shape."""
  forward = backward = 0
  for kind, shapes, names in _collectives(text):
    for shape, name in zip(shapes, names):
      if kind == "all-reduce" and shape == activation:
        backward += "transpose(" in name      # the transposed (backward) computation
        forward += "transpose(" not in name
  return forward, backward


def test_tensor_parallel_layer_does_two_all_reduces_forward_and_two_backward():
  counts = {}
  for n in (1, 2):
    cfg = config(num_layers=n)
    text = _grad_step_hlo("tensor_parallel", (4, 2), ("data", "tensor"), cfg, batch=16)
    counts[n] = _activation_all_reduces(text, (16 // 4, LENGTH, cfg.embed_dim))
  per_layer = tuple(b - a for a, b in zip(counts[1], counts[2]))
  assert per_layer == (2, 2), counts
  # Outside the blocks, as in Megatron: the vocabulary-parallel lookup's all-reduce
  # (forward) and the tied output projection's input gradient (backward).
  assert counts[2] == (2 * 2 + 1, 2 * 2 + 1), counts


def test_tied_embedding_gradient_is_reduced_once():
  cfg = config()
  text = _grad_step_hlo("data_parallel", (8,), ("data",), cfg, batch=16)
  table = (cfg.vocab_size, cfg.embed_dim)
  reduced = [shapes.count(table) for kind, shapes, _ in _collectives(text)
             if kind in ("all-reduce", "reduce-scatter")]
  assert sum(reduced) == 1, reduced


@pytest.mark.parametrize("preset,mesh_shape,axis_names", [
    ("fsdp", (2, 4), ("data", "fsdp")),
    ("fsdp_tp", (2, 2, 2), ("data", "fsdp", "tensor")),
    ("tensor_parallel", (4, 2), ("data", "tensor"))])
def test_embedding_lookup_never_gathers_the_batch(preset, mesh_shape, axis_names, capfd):
  batch = 24        # a leading dim no weight has: a gathered batch would show as 24
  text = _grad_step_hlo(preset, mesh_shape, axis_names, config(), batch=batch)
  for kind, shapes, names in _collectives(text):
    assert kind != "all-to-all", names
    if kind == "all-gather":
      assert all(s[:2] != (batch, LENGTH) for s in shapes), (shapes, names)
  assert "Involuntary full rematerialization" not in capfd.readouterr().err


def _stats(preset, mesh_shape, axis_names, cfg, batch):
  mesh = make_mesh(mesh_shape, axis_names, AxisType.Auto)
  text = _grad_step_hlo(preset, mesh_shape, axis_names, cfg, batch, pinned=True)
  return partition.collective_stats(text, mesh), text


def test_fsdp_weight_is_gathered_once_per_step():
  # ZeRO-3 keeps the gathered weight for the backward pass: one all-gather per FSDP-sharded
  # weight (per layer: 2 norms, qkv, out, wi, wo; the final norm; the tied table), never a
  # second one for the input gradient.
  cfg = config(num_layers=2)
  stats, _ = _stats("fsdp_tp", (2, 2, 2), ("data", "fsdp", "tensor"), cfg, batch=16)
  assert stats.count("all-gather", "fsdp") == 6 * 2 + 1 + 1, stats
  assert stats.count("all-gather") == stats.count("all-gather", "fsdp"), stats


def _weight_matrix_shapes(cfg):
  """The weights with 2+ dims (the tied table, per layer qkv, out, wi, wo)."""
  from layers._params import transformer_params
  specs = jax.tree.leaves(transformer_params(cfg), is_leaf=lambda s: hasattr(s, "axes"))
  return [s.shape for s in specs if len(s.shape) >= 2]


def test_sequence_parallel_weight_gradients_are_reduced_once_over_data_x_sequence():
  # Every weight matrix's gradient (per layer qkv, out, wi, wo; the tied table) in one
  # all-reduce over both token axes: no stage over 'sequence' then over 'data' for them
  # (what is left over one axis alone: the norm scales and scalars, under 1 KiB here).
  cfg = config(num_layers=2)
  stats, _ = _stats("sequence_parallel", (2, 4), ("data", "sequence"), cfg, batch=4)
  weights = 4 * sum(math.prod(s) for s in _weight_matrix_shapes(cfg))
  assert stats.bytes("all-reduce", ("data", "sequence")) >= 2 * weights * 7 / 8, stats
  for axes in (("data",), ("sequence",)):
    assert stats.bytes("all-reduce", axes) < 1024, stats


def test_expert_parallel_step_is_four_all_to_alls_per_moe_layer():
  # GShard §2.2: dispatch and combine forward, their transposes backward; no all-gather of
  # the dispatched tokens, the activations or the expert weights. What is gathered: the
  # router kernel and the router's probabilities for top_k (last dim: the experts).
  cfg = config(num_layers=2, num_experts=4, embed_dim=64, mlp_dim=256)
  stats, text = _stats("expert_parallel", (2, 4), ("data", "expert"), cfg, batch=16)
  assert stats.count("all-to-all") == 4 * 2, stats
  gathered = [s for kind, shapes, _ in _collectives(text) if kind == "all-gather"
              for s in shapes]
  assert all(s[-1] == cfg.num_experts for s in gathered), (gathered, stats)




def _partitioned_hlo(tmp_path, preset, mesh_shape, axis_names, batch, **cfg):
  """The gradient step's HLO right after XLA's SPMD partitioner, dumped by a subprocess.
  Its collectives carry the program's dtypes; XLA:CPU then promotes bf16 collectives to
  fp32 (its float normalization, for lack of bf16 reductions), which GPUs and TPUs do not,
  so the final CPU HLO cannot show a bf16 all-gather."""
  here = pathlib.Path(__file__).resolve().parent
  script = (f"import sys; sys.path[:0] = [{str(here)!r}, {str(here.parent)!r}]\n"
            "import jax; jax.config.update('jax_num_cpu_devices', 8)\n"
            "import test_layers_collectives as t\n"
            f"t._stats({preset!r}, {mesh_shape!r}, {axis_names!r}, t.config(**{cfg!r}), "
            f"batch={batch})\n")
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=(
      f"--xla_dump_to={tmp_path} --xla_dump_hlo_pass_re=spmd-partitioning"))
  subprocess.run([sys.executable, "-c", script], env=env, check=True, capture_output=True)
  dumps = sorted(tmp_path.glob("*jit_loss*after_spmd-partitioning*.txt"))
  assert len(dumps) == 1, [d.name for d in tmp_path.iterdir()]
  return dumps[0].read_text()


def _gathered_dtypes(text):
  """``{result shape: element types}`` of the all-gathers in HLO text."""
  out = {}
  for line in text.splitlines():
    m = re.search(r"= (.*?) all-gather(-start)?\(", re.sub(r"/\*.*?\*/", "", line))
    for dtype, dims in re.findall(r"([a-z]+\d*)\[([\d,]*)\]", m.group(1)) if m else ():
      out.setdefault(tuple(int(d) for d in dims.split(",") if d), set()).add(dtype)
  return out


@pytest.mark.parametrize("num_experts", [0, 4], ids=["dense", "moe"])
def test_fsdp_gathers_weights_in_the_compute_dtype(num_experts, tmp_path):
  # ZeRO-3 gathers the 16-bit working copy of a weight, not its fp32 master copy (ZeRO §5:
  # 2 bytes per parameter). The block's matrices and the tied table are cast while still
  # sharded, so a bf16 model with fp32 parameters sends half the bytes (XLA's partitioner
  # gathered the parameter and cast the gathered copy); the norm scales and the router,
  # which the model reads in fp32, are gathered as they are.
  from layers._params import transformer_params
  changes = dict(num_layers=2, dtype="bfloat16", param_dtype="float32", scan_layers=True,
                 num_experts=num_experts)
  gathered = _gathered_dtypes(_partitioned_hlo(tmp_path, "fsdp", (2, 4), ("data", "fsdp"),
                                               16, **changes))
  specs = jax.tree_util.tree_leaves_with_path(transformer_params(config(**changes)),
                                              is_leaf=lambda s: hasattr(s, "axes"))
  for path, spec in specs:
    name = jax.tree_util.keystr(path)
    one_layer = spec.shape[1:] if spec.axes[0] == "layers" else spec.shape
    want = "f32" if "norm" in name or "router" in name else "bf16"
    assert gathered.get(one_layer, gathered.get((1, *one_layer))) == {want}, (
        name, one_layer, gathered)
