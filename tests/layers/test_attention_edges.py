"""Edge cases of the attention implementations (layers/_attention.py), tested adversarially.

Complements tests/layers/test_attention.py: shapes at the block edges (one token, shorter than
the block, block 1, batch 1), GQA with 1, 3 and 4 query heads per kv head and MQA, rows with no
real token, padding as ``lengths`` and as ``valid``, traced query offsets (what a
sequence-sharded device computes), jit + vmap, bf16 gradients, second-order gradients, the
sequence- and tensor-parallel paths with sizes that do not divide, the shard_map wrapper of
the fused kernels inside a pipeline stage, KV-cache decoding, every preset in all three
frameworks and the training CLI with every implementation.

The references are independent of the code under test: a float64 numpy softmax attention
written here from the definition (forward), and the ``'xla'`` path's autodiff (gradients).
"""

import contextlib
import functools
import io
import json

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_testlib import numpy_attention
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from layers_testlib import FRAMEWORKS, build, config
from mesh_testlib import make_mesh

import layers
import layers.haiku
import layers.linen
import layers.nnx
import partition
from layers import _attention as A
from layers import _core, _decode


def _qkv(b, length, heads, kv_heads, d, kv_length=None, dtype=jnp.float32, seed=0):
  kv_length = length if kv_length is None else kv_length
  ks = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(ks[0], (b, length, heads, d))
  k = jax.random.normal(ks[1], (b, kv_length, kv_heads, d))
  v = jax.random.normal(ks[2], (b, kv_length, kv_heads, d))
  return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def _close(got, want, rtol=1e-5, atol=1e-6):
  np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64),
                             rtol=rtol, atol=atol)


def _attend(implementation, mask, block):
  return lambda q, k, v: layers.dot_product_attention(q, k, v, mask, implementation=implementation,
                                                 block=block)


def _grads(f, q, k, v, seed=9):
  w = jax.random.normal(jax.random.key(seed), q.shape)
  return jax.jit(jax.grad(lambda q, k, v: jnp.sum(w * f(q, k, v)), argnums=(0, 1, 2)))(q, k, v)


def _assert_finite(*arrays):
  for a in arrays:
    bad = int(np.sum(~np.isfinite(np.asarray(a, np.float32))))
    assert bad == 0, f"{bad} NaN or inf values"


# -- shapes at the block edges, every mask feature at once -----------------------------------

SHAPES = {  # (batch, length, heads, kv_heads, head_dim, block)
    "one token": (1, 1, 2, 1, 4, 4),
    "shorter than the block": (1, 5, 2, 2, 4, 8),
    "MQA, 3 heads, block 3 does not divide 7": (1, 7, 3, 1, 4, 3),
    "3 heads per kv head, 3 rows": (3, 9, 6, 2, 4, 4),
    "block 1, 4 heads per kv head": (2, 6, 4, 1, 4, 1),
    "length = block, groups 1": (1, 8, 4, 4, 8, 8),
    "one past the block": (2, 9, 4, 1, 8, 8),
}


def _edge_masks(b, length):
  """Two masks that use every feature: holes in the padding (not only left/right), rows with
  no real token (b > 1), a length of 0 (b > 1) and one past the end (b > 2), two packed
  sequences."""
  pos = np.arange(length)[None]
  valid = np.ones((b, length), bool)
  valid[:, ::3] = False                 # holes, position 0 among them
  valid[1:] = False                     # every later row is all padding
  lengths = np.array([max(length - 2, 1), 0, length + 3][:b])
  seg = np.repeat((pos >= (length + 1) // 2).astype(np.int32), b, 0)
  return {"causal+valid+segments": layers.Mask(valid=jnp.asarray(valid),
                                               segment_ids=jnp.asarray(seg)),
          "full+lengths+segments": layers.Mask(causal=False, lengths=jnp.asarray(lengths),
                                               segment_ids=jnp.asarray(seg))}


@pytest.mark.parametrize("mask_kind", ["causal+valid+segments", "full+lengths+segments"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_blockwise_at_the_block_edges_equals_the_definition(shape, mask_kind):
  b, length, heads, kv_heads, d, block = SHAPES[shape]
  q, k, v = _qkv(b, length, heads, kv_heads, d)
  mask = _edge_masks(b, length)[mask_kind]
  blockwise = _attend("blockwise", mask, block)
  _close(jax.jit(blockwise)(q, k, v), numpy_attention(q, k, v, mask))
  got, want = _grads(blockwise, q, k, v), _grads(_attend("xla", mask, block), q, k, v)
  _assert_finite(*got)
  for a, b_ in zip(got, want):
    _close(a, b_, atol=1e-5)


@pytest.mark.parametrize("padding", ["valid", "lengths"])
@pytest.mark.parametrize("implementation", ["xla", "blockwise"])
def test_padding_gives_zero_outputs_and_zero_gradients_without_nan(implementation, padding):
  """Padded queries output zeros and get zero dq; padded keys and values get zero dk, dv; a
  row that is all padding is all zeros (no NaN from a softmax over nothing)."""
  b, length = 3, 10
  q, k, v = _qkv(b, length, 4, 2, 8)
  real = np.arange(length)[None] < np.array([[7], [0], [10]])    # row 1: no real token
  mask = (layers.Mask(valid=jnp.asarray(real)) if padding == "valid"
          else layers.Mask(lengths=jnp.array([7, 0, 10])))
  f = _attend(implementation, mask, 4)
  out = np.asarray(f(q, k, v))
  assert np.all(out[~real] == 0)
  dq, dk, dv = _grads(f, q, k, v)
  _assert_finite(out, dq, dk, dv)
  for g in (dq, dk, dv):
    assert np.all(np.asarray(g)[~real] == 0)
  _close(out, numpy_attention(q, k, v, mask))


def test_lengths_equal_the_same_padding_as_valid_forward_and_gradients():
  q, k, v = _qkv(3, 11, 4, 2, 8)
  lengths = jnp.array([11, 4, 16])            # 16 > 11: every token is real
  valid = jnp.arange(11)[None] < lengths[:, None]
  for causal in (True, False):
    as_lengths = _attend("blockwise", layers.Mask(causal=causal, lengths=lengths), 4)
    as_valid = _attend("blockwise", layers.Mask(causal=causal, valid=valid), 4)
    _close(as_lengths(q, k, v), as_valid(q, k, v))
    for a, b in zip(_grads(as_lengths, q, k, v), _grads(as_valid, q, k, v)):
      _close(a, b, atol=1e-6)


# -- transformations -------------------------------------------------------------------------


def test_jit_and_vmap_over_inputs_and_masks_equal_xla():
  """vmap over a leading dim of q, k, v and of the mask's arrays (a Mask is a pytree)."""
  q, k, v = _qkv(2, 11, 4, 2, 8)
  qs, ks, vs = (jnp.stack([a, -0.5 * a]) for a in (q, k, v))
  valid = jnp.stack([jnp.arange(11)[None] >= jnp.array([[0], [3]]),
                     jnp.arange(11)[None] % 4 != 1 + jnp.zeros((2, 1), int)])
  seg = jnp.stack([jnp.zeros((2, 11), jnp.int32), (jnp.arange(11)[None] > 5).repeat(2, 0)])
  masks = layers.Mask(valid=valid, segment_ids=seg.astype(jnp.int32))

  def batched(implementation):
    return jax.jit(jax.vmap(lambda q, k, v, m: layers.dot_product_attention(
        q, k, v, m, implementation=implementation, block=4)))

  out = batched("blockwise")(qs, ks, vs, masks)
  for i in range(2):
    mask_i = layers.Mask(valid=valid[i], segment_ids=seg[i].astype(jnp.int32))
    _close(out[i], numpy_attention(qs[i], ks[i], vs[i], mask_i))
  w = jax.random.normal(jax.random.key(4), qs.shape)
  grads = lambda f: jax.grad(lambda q, k, v: jnp.sum(w * f(q, k, v, masks)),
                             argnums=(0, 1, 2))(qs, ks, vs)
  for a, b in zip(grads(batched("blockwise")), grads(batched("xla"))):
    _close(a, b, atol=1e-5)


@pytest.mark.parametrize("traced", [False, True])
def test_a_query_block_at_an_offset_equals_that_slice_forward_and_gradients(traced):
  """What a sequence-sharded device computes (queries 5..12 of 17 against all keys, with
  segments and lengths), with the offset static (causal block schedule) or traced (one query
  block): forward and the gradients of that slice's output."""
  q, k, v = _qkv(2, 17, 4, 2, 8)
  seg = jnp.asarray(np.repeat((np.arange(17)[None] >= 9).astype(np.int32), 2, 0))
  mask = layers.Mask(lengths=jnp.array([14, 17]), segment_ids=seg)
  lo, hi = 5, 13
  w = jax.random.normal(jax.random.key(2), (2, hi - lo, 4, 8))
  parts = A._parts(mask)
  parts["q_seg"] = parts["q_seg"][:, lo:hi]

  def part(q, k, v, offset):
    return A._blockwise_kernel(q, k, v, parts, causal=True, q_offset=offset, block=4)

  run = (jax.jit(part) if traced else jax.jit(part, static_argnums=3))
  offset = jnp.int32(lo) if traced else lo
  _close(run(q[:, lo:hi], k, v, offset), numpy_attention(q, k, v, mask)[:, lo:hi])
  got = jax.grad(lambda q, k, v: jnp.sum(w * run(q, k, v, offset)),
                 argnums=(0, 1, 2))(q[:, lo:hi], k, v)
  whole = lambda q, k, v: layers.dot_product_attention(q, k, v, mask, implementation="xla")
  want = jax.grad(lambda q, k, v: jnp.sum(w * whole(q, k, v)[:, lo:hi]),
                  argnums=(0, 1, 2))(q, k, v)
  _close(got[0], want[0][:, lo:hi], atol=1e-5)
  _close(got[1], want[1], atol=1e-5)
  _close(got[2], want[2], atol=1e-5)


def _second_order(implementation, mask, q, k, v):
  inner = lambda q: jnp.sum(layers.dot_product_attention(
      q, k, v, mask, implementation=implementation, block=4) ** 2)
  return jax.jit(jax.grad(lambda q: jnp.sum(jax.grad(inner)(q) ** 2)))(q)


@pytest.mark.parametrize("kind", ["causal", "full"])
def test_second_order_gradients_equal_xla_without_padding(kind):
  q, k, v = _qkv(2, 11, 4, 2, 8)
  mask = layers.Mask(causal=kind == "causal")
  got, want = _second_order("blockwise", mask, q, k, v), _second_order("xla", mask, q, k, v)
  _close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["valid", "lengths", "segments"])
def test_second_order_gradients_with_padding_or_packing_equal_xla(kind):
  q, k, v = _qkv(2, 11, 4, 2, 8)
  mask = {"valid": layers.Mask(valid=jnp.arange(11)[None] >= jnp.array([[0], [3]])),
          "lengths": layers.Mask(lengths=jnp.array([11, 7])),
          "segments": layers.Mask(segment_ids=(jnp.arange(11)[None] >= 5).astype(jnp.int32)
                             .repeat(2, 0))}[kind]
  got, want = _second_order("blockwise", mask, q, k, v), _second_order("xla", mask, q, k, v)
  _assert_finite(got)
  _close(got, want, rtol=1e-4, atol=1e-4)


def test_blockwise_bf16_gradients_are_within_bf16_rounding_of_the_truth():
  """dq, dk, dv of both paths in bf16 against the float32 gradients of the same (bf16-rounded)
  inputs: within 2^-6 of the gradient's scale (bf16 keeps 8 bits; a few roundings add up), and
  the blockwise path no further from the truth than the reference path plus 2^-8."""
  q, k, v = _qkv(2, 19, 4, 2, 8, dtype=jnp.bfloat16)
  pos = np.arange(19)[None]
  mask = layers.Mask(valid=jnp.asarray(pos >= np.array([[0], [4]])),
                segment_ids=jnp.asarray(np.repeat((pos >= 9).astype(np.int32), 2, 0)))
  w = jax.random.normal(jax.random.key(10), q.shape)

  def grads(implementation, dtype):
    f = lambda q, k, v: jnp.sum(w * layers.dot_product_attention(
        q, k, v, mask, implementation=implementation, block=4).astype(jnp.float32))
    return jax.grad(f, argnums=(0, 1, 2))(*(a.astype(dtype) for a in (q, k, v)))

  truth = grads("xla", jnp.float32)
  for got, ref, want in zip(grads("blockwise", jnp.bfloat16), grads("xla", jnp.bfloat16), truth):
    assert got.dtype == jnp.bfloat16
    scale = float(jnp.abs(want).max())
    err = float(jnp.abs(got.astype(jnp.float32) - want).max()) / scale
    err_ref = float(jnp.abs(ref.astype(jnp.float32) - want).max()) / scale
    assert err < 2.0 ** -6, (err, err_ref)
    assert err <= err_ref + 2.0 ** -8, (err, err_ref)


@pytest.mark.parametrize("logits", ["std 100", "shifted by 1e4"])
@pytest.mark.parametrize("implementation", ["xla", "blockwise"])
def test_bf16_attention_keeps_large_logits_in_fp32(implementation, logits):
  """In bf16 both paths are within bf16 rounding (2^-7 of the output's scale: the output and
  the weights given to the values are rounded to 8 bits) of float64 attention of the same
  bf16 inputs, also when the logits are large. The xla path rounded its logits to bf16
  before the fp32 softmax: relative error 0.13 at logit std 100, 0.30 when every logit is
  shifted by 1e4 (which the softmax should not see: bf16's spacing there is 64)."""
  rng = np.random.default_rng(0)
  b, length, heads, kv_heads, d = 2, 16, 4, 2, 16
  q, k, v = (rng.normal(size=(b, length, h, d)) for h in (heads, kv_heads, kv_heads))
  if logits == "std 100":
    q, k = q * 10, k * 10   # q.k / sqrt(d): std 100 sqrt(d) / sqrt(d) = 100
  else:                      # q[0] k[0] / sqrt(d) = 1e4 on every logit, the rest O(1)
    q[..., 0] = k[..., 0] = np.sqrt(1e4 * np.sqrt(d))
  q, k, v = (jnp.asarray(a, jnp.bfloat16) for a in (q, k, v))
  mask = layers.Mask(causal=True, lengths=jnp.array([16, 11]))
  got = jax.jit(_attend(implementation, mask, 4))(q, k, v)
  want = numpy_attention(*(np.asarray(a.astype(jnp.float32)) for a in (q, k, v)), mask)
  scale = np.abs(want).max()
  assert got.dtype == jnp.bfloat16
  assert np.abs(np.asarray(got, np.float64) - want).max() <= 2.0 ** -7 * scale


# -- sharded: sequence and tensor parallelism with sizes that do not divide -------------------

SEQUENCE = [("batch", "data"), ("length", "sequence"), ("heads", None), ("kv_heads", None),
            ("head_dim", None)]
TENSOR = [("batch", "data"), ("heads", "tensor"), ("kv_heads", "tensor"), ("length", None),
          ("head_dim", None)]
SHARDED_CASES = {  # rules, mesh, (batch, length, heads, kv_heads), block, mask kind
    "sequence: 3 queries per device, block 8": (SEQUENCE, {"data": 2, "sequence": 4},
                                                (2, 12, 4, 2), 8, "lengths"),
    "sequence: 10 tokens do not split over 4": (SEQUENCE, {"data": 2, "sequence": 4},
                                                (2, 10, 4, 2), 4, "valid+segments"),
    "sequence: batch 1 over 8 devices": (
        [("batch", None), ("length", "sequence"), ("heads", None), ("kv_heads", None),
         ("head_dim", None)], {"sequence": 8}, (1, 16, 4, 1), 4, "valid+segments"),
    "tensor: MQA": (TENSOR, {"data": 4, "tensor": 2}, (4, 9, 4, 1), 4, "valid+segments"),
    "tensor: 8 heads over 8, 2 kv heads not sharded": (
        [("batch", None), ("heads", "tensor"), ("kv_heads", None), ("length", None),
         ("head_dim", None)], {"tensor": 8}, (2, 9, 8, 2), 4, "valid+segments"),
    "tensor: 3 kv heads do not split over 2": (TENSOR, {"data": 4, "tensor": 2}, (4, 9, 6, 3),
                                               4, "lengths"),
}


def _sharded_mask(kind, b, length):
  pos = np.arange(length)[None]
  if kind == "lengths":
    return layers.Mask(lengths=jnp.asarray(length - np.arange(b) % 4))
  return layers.Mask(valid=jnp.asarray(pos >= (np.arange(b) % 3)[:, None]),
                segment_ids=jnp.asarray((pos >= 3 + np.arange(b)[:, None] % 4).astype(np.int32)))


@pytest.mark.parametrize("via", ["dispatch", "shard_mapped"])
@pytest.mark.parametrize("case", list(SHARDED_CASES))
def test_sharded_blockwise_equals_the_definition(case, via):
  """The blockwise path as the model calls it (``dot_product_attention`` under the rules: XLA
  partitions it) and inside the fused kernels' shard_map wrapper (traced per-device offsets,
  kv heads sliced per device): forward against the definition, gradients against xla on one
  device."""
  table, mesh_shape, (b, length, heads, kv_heads), block, kind = SHARDED_CASES[case]
  mesh = make_mesh(tuple(mesh_shape.values()), tuple(mesh_shape))
  rules = partition.AxisRules(table)
  q, k, v = _qkv(b, length, heads, kv_heads, 8)
  mask = _sharded_mask(kind, b, length)
  if via == "dispatch":
    f = _attend("blockwise", mask, block)
  else:
    kernel = functools.partial(A._blockwise_kernel, block=block)
    f = lambda q, k, v: A.shard_mapped(kernel, q, k, v, mask)
  want = _grads(_attend("xla", mask, block), q, k, v)
  put = lambda a, axes: jax.device_put(a, NamedSharding(mesh, rules.spec(axes, a.shape, mesh)))
  qs, ks, vs = put(q, _core.QUERY), put(k, _core.KEY_VALUE), put(v, _core.KEY_VALUE)
  with partition.axis_rules(rules, mesh):
    out = jax.jit(f)(qs, ks, vs)
    got = _grads(f, qs, ks, vs)
  _close(out, numpy_attention(q, k, v, mask))
  for a, b_ in zip(got, want):
    _close(a, b_, atol=1e-5)


def _flops_share(causal, monkeypatch):
  """Per-device FLOPs of the blockwise forward + backward under sequence parallelism (data 2 x
  sequence 4) over those of the same program on one device: each device's share of a step,
  1/8 when both the batch and the queries are split. The block scans are unrolled, since
  XLA's cost analysis counts a loop body once and the two schedules differ (one device skips
  the causally masked pairs; a device with a traced query offset visits every key block)."""
  monkeypatch.setattr(A, "_blockwise_kernel",
                      functools.partial(A._blockwise_kernel, unroll=True))
  mesh = make_mesh((2, 4), ("data", "sequence"))
  rules = partition.AxisRules(SEQUENCE)
  f = _attend("blockwise", layers.Mask(causal=causal), 16)
  step = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) ** 2), argnums=(0, 1, 2)))
  shapes = [(2, 64, 2, 8), (2, 64, 1, 8), (2, 64, 1, 8)]
  plain = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
  placed = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(
      mesh, rules.spec(axes, s, mesh))) for s, axes in zip(shapes, (_core.QUERY,
                                                                   _core.KEY_VALUE,
                                                                   _core.KEY_VALUE))]
  one = step.lower(*plain).compile().cost_analysis()["flops"]
  with partition.axis_rules(rules, mesh):
    sharded = step.lower(*placed).compile().cost_analysis()["flops"]
  return sharded / one


def test_sequence_parallel_blockwise_splits_the_work_without_a_causal_mask(monkeypatch):
  assert _flops_share(False, monkeypatch) <= 1 / 8 * 1.2


def test_sequence_parallel_causal_blockwise_splits_the_work(monkeypatch):
  # One device runs 10 of the 16 (query block, key block) pairs; a sequence shard all 4 of
  # its query block's: 1/2 (batch) x 4/10 = 0.2 of the one-device step.
  assert _flops_share(True, monkeypatch) <= 0.2 * 1.2


def _in_pipeline_stage(attention, mesh_shape, rules):
  """``attention`` of each stage's own q, k, v inside a shard_map over 'stage' (as
  partition.pipeline runs a stage: manual over the stage axis, the rules on the abstract
  mesh inside), under ``rules`` (logical name -> the other mesh axes)."""
  mesh = make_mesh(tuple(mesh_shape.values()), tuple(mesh_shape))
  names = ("batch", "length", "heads", "kv_heads", "head_dim")
  rules = partition.AxisRules([(n, dict(rules).get(n)) for n in names])

  def body(q, k, v):
    with partition.axis_rules(None, mesh=jax.sharding.get_abstract_mesh()):
      return attention(q[0], k[0], v[0])[None]

  run = jax.shard_map(body, mesh=mesh, axis_names={"stage"}, in_specs=(P("stage"),) * 3,
                      out_specs=P("stage"))
  return rules, mesh, run


def _stage_qkv(heads=2, kv_heads=1, length=6, head_dim=8):
  ks = jax.random.split(jax.random.key(0), 3)
  return (jax.random.normal(ks[0], (4, 2, length, heads, head_dim)),
          jax.random.normal(ks[1], (4, 2, length, kv_heads, head_dim)),
          jax.random.normal(ks[2], (4, 2, length, kv_heads, head_dim)))


STAGE_CASES = {  # case: (mesh without 'stage', rules, heads, kv heads, kernel)
    "batch": ({"data": 2}, [("batch", "data")], 2, 1, A._xla_kernel),
    # kv heads gathered, each device slices its query heads' kv head: dk summed over 'tensor'
    "heads, kv sliced": ({"tensor": 2}, [("heads", "tensor")], 4, 2, A._xla_kernel),
    "heads, kv sharded": ({"tensor": 2}, [("heads", "tensor"), ("kv_heads", "tensor")], 4, 2,
                          A._xla_kernel),
    # queries sharded, keys and values gathered: each device at its offset, dk summed
    "sequence": ({"sequence": 2}, [("length", "sequence")], 2, 1,
                 functools.partial(A._blockwise_kernel, block=2)),
}


@pytest.mark.parametrize("case", list(STAGE_CASES))
def test_shard_mapped_kernel_inside_a_pipeline_stage_forward_and_gradients(case):
  """The fused kernels' shard_map wrapper nested in a pipeline stage's shard_map: forward
  against numpy, the gradients of q, k and v against each stage's own xla autodiff."""
  mesh_shape, rules, heads, kv_heads, kernel = STAGE_CASES[case]
  mask = layers.Mask(lengths=jnp.array([6, 4]))
  q, k, v = _stage_qkv(heads, kv_heads)
  _check_in_stage(kernel, q, k, v, mask, {**mesh_shape, "stage": 4}, rules, atol=1e-6,
                  grad_atol=1e-5)


def _check_in_stage(kernel, q, k, v, mask, mesh_shape, rules, atol, grad_atol):
  """``shard_mapped(kernel)`` in a 4-stage pipeline: each stage's output equals numpy's, its
  q, k, v gradients the stage's own xla autodiff."""
  rules, mesh, run = _in_pipeline_stage(
      lambda q, k, v: A.shard_mapped(kernel, q, k, v, mask), mesh_shape, rules)
  loss = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)))
  with partition.axis_rules(rules, mesh):
    out = jax.jit(run)(q, k, v)
    grads = jax.jit(jax.grad(loss(run), argnums=(0, 1, 2)))(q, k, v)
  plain = lambda q, k, v: A._xla_kernel(q, k, v, A._parts(mask), causal=True, q_offset=0)
  for s in range(4):
    _close(out[s], numpy_attention(q[s], k[s], v[s], mask), atol=atol)
    want = jax.grad(loss(plain), argnums=(0, 1, 2))(q[s], k[s], v[s])
    for got, w in zip(grads, want):
      _close(got[s], w, atol=grad_atol)


def test_the_pallas_kernel_built_in_one_jit_runs_in_the_next():
  """The splash kernel is cached per shape; built inside a jit, its mask tables must not be
  that trace's tracers (the train step and the eval step are two jits of one shape)."""
  A._splash.cache_clear()
  q, k, v = _stage_qkv(length=128, head_dim=32)
  run = lambda q, k, v: A._pallas_kernel(q, k, v, {}, causal=True, q_offset=0, block=128,
                                         interpret=True)
  first = jax.jit(run)(q[0], k[0], v[0])
  second = jax.jit(lambda q, k, v: run(q, k, v) * 1.0)(q[1], k[1], v[1])
  _close(first, numpy_attention(q[0], k[0], v[0], layers.Mask()), atol=1e-5)
  _close(second, numpy_attention(q[1], k[1], v[1], layers.Mask()), atol=1e-5)


def test_the_pallas_kernel_inside_a_pipeline_stage_in_interpret_mode():
  """The splash kernel's wrapper (segment ids from lengths, GQA) in a stage, batch over
  'data': forward and the gradients of q, k, v equal each stage's own xla autodiff."""
  mask = layers.Mask(lengths=jnp.array([128, 100]))
  q, k, v = _stage_qkv(length=128, head_dim=32)
  kernel = functools.partial(A._pallas_kernel, block=128, interpret=True)
  _check_in_stage(kernel, q, k, v, mask, {"data": 2, "stage": 4}, [("batch", "data")],
                  atol=1e-5, grad_atol=1e-4)


def test_an_explicit_fused_kernel_trains_inside_a_pipeline_stage(monkeypatch):
  """attention='cudnn' through the dispatch, inside a stage (the custom call stood in for by
  jax.nn.dot_product_attention's XLA version): gradients equal each stage's own."""
  _cudnn_standing_in(monkeypatch)
  mask = layers.Mask(lengths=jnp.array([6, 4]))
  q, k, v = (a.astype(jnp.bfloat16) for a in _stage_qkv())
  rules, mesh, run = _in_pipeline_stage(
      lambda q, k, v: layers.dot_product_attention(q, k, v, mask, implementation="cudnn"),
      {"data": 2, "stage": 4}, [("batch", "data")])
  loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) ** 2)
  with partition.axis_rules(rules, mesh):
    got = jax.jit(jax.grad(loss(run)))(q, k, v)
  plain = lambda q, k, v: A._cudnn_kernel(q, k, v, A._parts(mask), causal=True, q_offset=0)
  for s in range(4):
    want = jax.grad(loss(plain))(q[s], k[s], v[s])
    _close(got[s].astype(jnp.float32), want.astype(jnp.float32))


@pytest.mark.parametrize("requested,kw,constraint", [
    ("cudnn", {"backend": "gpu", "sequence_sharded": True}, "sequence-sharded query block"),
    ("pallas", {"backend": "tpu", "sequence_sharded": True}, "sequence-sharded query block"),
    ("pallas", {"backend": "tpu", "q_length": 256, "kv_length": 200}, "multiple of 128"),
    ("pallas", {"backend": "tpu", "q_length": 640, "block": 512}, "block size (512)"),
])
def test_more_explicit_choices_that_cannot_run_name_the_constraint(requested, kw, constraint):
  args = {"dtype": jnp.bfloat16, "head_dim": 128, "q_length": 256, "mask": layers.Mask(), **kw}
  with pytest.raises(A.AttentionError, match="Use attention='auto'") as e:
    A.choose(requested, **args)
  assert constraint in str(e.value)


@pytest.mark.parametrize("implementation", ["cudnn", "pallas"])
def test_the_dispatch_refuses_a_fused_kernel_on_cpu_never_falling_back(implementation):
  q, k, v = _qkv(1, 8, 2, 1, 8)
  with pytest.raises(A.AttentionError, match="cannot run here"):
    layers.dot_product_attention(q, k, v, layers.Mask(), implementation=implementation)
  with pytest.raises(A.AttentionError, match="cannot run here"):
    jax.jit(_attend(implementation, layers.Mask(), 512))(q, k, v)


@pytest.mark.parametrize("framework", ["nnx", "haiku"])
@pytest.mark.parametrize("implementation", ["cudnn", "pallas"])
def test_fused_kernels_on_cpu_are_an_error_from_nnx_and_haiku(framework, implementation):
  cfg = config(attention=implementation)
  tokens = jnp.zeros((1, 8), jnp.int32)
  what = "cuDNN needs an NVIDIA GPU" if implementation == "cudnn" else "needs a TPU"
  with pytest.raises(A.AttentionError, match=what):
    if framework == "nnx":
      layers.nnx.Transformer(cfg, rngs=nnx.Rngs(0))(tokens)
    else:
      hk.transform(lambda t: layers.haiku.Transformer(cfg)(t)).init(jax.random.key(0), tokens)


def test_attention_choice_says_what_runs_under_sequence_parallel_rules():
  mesh = make_mesh((2, 4), ("data", "sequence"))
  rules = partition.AxisRules(SEQUENCE)
  cfg = layers.TransformerConfig(attention="blockwise")
  assert str(layers.attention_choice(cfg, batch=2, length=16, rules=rules, mesh=mesh)) == \
      "blockwise (requested)"
  auto = layers.attention_choice(layers.TransformerConfig(), batch=2, length=4096, rules=rules,
                                 mesh=mesh)
  assert auto.implementation == "blockwise" and "4096 >= 2048" in auto.reason


# -- the models (slow: each compiles Transformers) --------------------------------------------

PRESETS = {  # preset: (mesh, config changes)
    "data_parallel": ({"data": 8}, {}),
    "fsdp": ({"data": 2, "fsdp": 4}, {}),
    "fsdp_tp": ({"data": 2, "fsdp": 2, "tensor": 2}, {}),
    "tensor_parallel": ({"data": 4, "tensor": 2}, {}),
    "sequence_parallel": ({"data": 2, "sequence": 4}, {}),
    "expert_parallel": ({"data": 2, "expert": 4}, {"num_experts": 4, "experts_per_token": 2}),
    "pipeline_parallel": ({"data": 2, "stage": 4},
                          {"scan_layers": True, "num_layers": 4, "pipeline_microbatches": 4}),
    "fsdp_pp": ({"fsdp": 2, "stage": 4},
                {"scan_layers": True, "num_layers": 4, "pipeline_microbatches": 4}),
    "microbatch": ({"data": 8}, {}),
}
TOKENS = jax.random.randint(jax.random.key(1), (8, 12), 0, 64)
LENGTHS = jnp.asarray(12 - np.arange(8) % 5, jnp.int32)
SEGMENTS = (jnp.arange(12)[None] >= 5 + jnp.arange(8)[:, None] % 4).astype(jnp.int32)


def _loss_step(m, valid, segment_ids):
  def loss(params):
    logits = m.apply(params, TOKENS, valid=valid, segment_ids=segment_ids)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 0]), logits
  return jax.jit(jax.value_and_grad(loss, has_aux=True))


def _on_preset(preset, framework, attention, valid, segment_ids, **changes):
  """``(loss, logits), grads`` of ``attention`` under ``preset`` and of xla on one device,
  from the same weights."""
  mesh_shape, preset_changes = PRESETS[preset]
  changes = {**preset_changes, **changes}
  from recipes.config import preset_rules
  ref = build(framework, config(attention="xla", **changes), TOKENS)
  want = _loss_step(ref, valid, segment_ids)(ref.params)
  mesh = make_mesh(tuple(mesh_shape.values()), tuple(mesh_shape))
  model = build(framework, config(attention=attention, **changes), TOKENS)
  params = jax.device_put(ref.params, NamedSharding(mesh, P()))
  with partition.axis_rules(preset_rules(preset), mesh):
    got = _loss_step(model, valid, segment_ids)(params)
  return got, want


@pytest.mark.slow
@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("preset", list(PRESETS))
def test_blockwise_with_lengths_and_packing_under_every_preset_in_every_framework(preset,
                                                                                   framework):
  """Right padding as lengths plus packing, block 5 (divides neither the length nor a
  shard): the preset's sharded step equals xla on one device (test_attention.py covers one
  framework per preset with valid + segments)."""
  ((loss, got), grads), ((want_loss, want), want_grads) = _on_preset(
      preset, framework, "blockwise", LENGTHS, SEGMENTS, attention_block=5)
  _close(got, want, atol=2e-5)
  _close(loss, want_loss, atol=1e-6)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    _close(a, b, atol=2e-5)


def _cudnn_standing_in(monkeypatch):
  """The cudnn path on CPU: its constraints waived and jax.nn.dot_product_attention's XLA
  implementation in the custom call's place (the same wrapper, shard_map and arguments)."""
  monkeypatch.setattr(A, "_cudnn_problems", lambda *a, **kw: [])
  monkeypatch.setattr(A, "_cudnn_kernel",
                      functools.partial(A._cudnn_kernel, implementation="xla"))


@pytest.mark.slow
@pytest.mark.parametrize("preset", [
    "data_parallel", "fsdp_tp", "tensor_parallel", "expert_parallel", "microbatch",
    "pipeline_parallel", "fsdp_pp"])
def test_the_cudnn_wrapper_under_every_preset_with_a_stand_in_kernel(preset, monkeypatch):
  _cudnn_standing_in(monkeypatch)
  ((loss, got), grads), ((want_loss, want), want_grads) = _on_preset(
      preset, "linen", "cudnn", LENGTHS, None)
  _close(got, want, atol=2e-5)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    _close(a, b, atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_bf16_models_are_within_bf16_noise_of_the_fp32_truth(framework):
  """dtype=bfloat16, the same weights: the logits and every gradient of the blockwise and the
  xla model are within 2^-4 of the float32 model's, in root mean square (RMS). Measured: the RMS
  error is at most 0.035 over 4 seeds, 3 frameworks and every leaf; dropping the segment ids
  (a wrong mask) gives 0.5 to 1.0.

  This is a bound, not a comparison of the two models. Which kernel runs only reorders the
  rounding of a bf16 model. Over seeds, one kernel's RMS error minus the other's is
  -0.008 to +0.011 of the scale, and either sign comes up. Whether blockwise is as accurate
  as XLA is checked on the kernel alone, where that noise is absent
  (test_blockwise_bf16_gradients_are_within_bf16_rounding_of_the_truth). The earlier
  version of this test compared the two models and passed only while the xla path rounded
  its logits to bf16."""
  tokens = jax.random.randint(jax.random.key(1), (4, 8), 0, 64)
  valid = jnp.arange(8)[None] >= jnp.array([[0], [2], [1], [0]])
  seg = (jnp.arange(8)[None] >= jnp.array([[3], [5], [8], [4]])).astype(jnp.int32)
  truth = build(framework, config(attention="xla"), tokens)

  def step(m):
    def loss(params):
      logits = m.apply(params, tokens, valid=valid, segment_ids=seg).astype(jnp.float32)
      return jnp.mean(jax.nn.log_softmax(logits)[..., 0]), logits
    return jax.jit(jax.value_and_grad(loss, has_aux=True))(truth.params)

  rms = lambda x: float(jnp.sqrt(jnp.mean(jnp.square(x.astype(jnp.float32)))))
  (_, want), want_grads = step(truth)
  for attention in ("xla", "blockwise"):
    (_, logits), grads = step(build(framework, config(attention=attention, attention_block=3,
                                                      dtype="bfloat16"), tokens))
    assert rms(logits - want) <= 2.0 ** -4 * rms(want), attention
    for (path, w), g in zip(jax.tree_util.tree_leaves_with_path(want_grads),
                            jax.tree.leaves(grads)):
      assert g.dtype == w.dtype   # params stay fp32 under dtype=bfloat16
      assert rms(g - w) <= 2.0 ** -4 * rms(w), (attention, jax.tree_util.keystr(path))


@pytest.mark.slow
@pytest.mark.parametrize("changes", [{}, {"num_kv_heads": 1, "scan_layers": True}],
                         ids=["gqa", "mqa-scanned"])
def test_blockwise_prefill_and_decode_equal_the_full_forward(changes):
  """The prefill runs the blockwise path (block 3 does not divide the 5-token prompt), the
  decode steps attend the cache: teacher-forced logits equal the full forward pass, and
  greedy generation gives the xla model's tokens."""
  base = dict(vocab_size=40, embed_dim=16, mlp_dim=32, num_heads=4, num_kv_heads=2,
              head_dim=8, num_layers=2, max_len=32)
  cfg = lambda **kw: layers.TransformerConfig(**{**base, **changes, **kw})
  tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, 40)
  model = layers.linen.Transformer(cfg(attention="xla"))
  variables = model.init(jax.random.key(1), tokens)
  full = model.apply(variables, tokens)
  blockwise = cfg(attention="blockwise", attention_block=3)
  params = layers.linen.decode_params(variables, blockwise)
  cache = _decode.init_cache(blockwise, 2, 9)
  logits, cache = _decode.prefill(params, tokens[:, :5], cache, blockwise)
  out = [logits]
  for i in range(5, 9):
    logits, cache = _decode.decode_step(params, tokens[:, i:i + 1], jnp.full((2, 1), i),
                                        cache, blockwise)
    out.append(logits)
  _close(jnp.concatenate(out, 1), full, atol=1e-5)
  prompts = [[3, 4, 5, 6, 7], [8, 9]]
  sampling = _decode.Sampling(max_new_tokens=5)
  want = _decode.generate(params, cfg(attention="xla"), prompts, sampling)
  got = _decode.generate(params, blockwise, prompts, sampling)
  np.testing.assert_array_equal(got.tokens, want.tokens)


# tests/recipes/job_testlib.py's tiny run (not importable from here)
TINY = ["model.embed_dim=16", "model.mlp_dim=32", "model.num_heads=2", "model.num_kv_heads=1",
        "model.head_dim=8", "model.num_layers=1", "batch_size=32", "seq_len=8", "steps=3",
        "eval_every=3", "eval_batches=1", "checkpoint_every=0", "plot=false", "log_every=1"]


def _losses(out_dir):
  lines = (out_dir / "metrics.jsonl").read_text().splitlines()
  return [json.loads(line)["loss"] for line in lines]


@pytest.mark.slow
def test_train_cli_runs_every_implementation_or_says_why_not(tmp_path):
  """``python -m recipes.train model.attention=<impl>`` (its ``main``): auto, xla and blockwise
  train on CPU with the same losses (same weights, same function); cudnn and pallas exit 2
  naming the constraint, with no traceback and no run written."""
  from recipes import train
  runs = {}
  for implementation in ("auto", "xla", "blockwise", "cudnn", "pallas"):
    out_dir = tmp_path / implementation
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
      rc = train.main(TINY + [f"model.attention={implementation}", "model.attention_block=3",
                              f"out_dir={out_dir}"])
    runs[implementation] = (rc, err.getvalue(), out_dir)
  for implementation in ("auto", "xla", "blockwise"):
    assert runs[implementation][0] == 0, runs[implementation][1]
  want = _losses(runs["xla"][2])
  for implementation in ("auto", "blockwise"):
    np.testing.assert_allclose(_losses(runs[implementation][2]), want, rtol=1e-5)
  for implementation, what in (("cudnn", "cuDNN needs an NVIDIA GPU"),
                               ("pallas", "splash-attention kernel needs a TPU")):
    rc, err, out_dir = runs[implementation]
    assert rc == 2 and err.startswith("error: ") and "Traceback" not in err, err
    assert f"attention={implementation!r} cannot run here" in err and what in err, err
