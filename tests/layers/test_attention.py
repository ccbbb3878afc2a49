"""Attention implementations (layers/_attention.py) against independent references.

The reference of every equality is a float64 numpy softmax attention written here from the
definition (query ``i`` sees key ``j`` iff causal, both real, same segment; a query with no
visible key outputs zeros), and the ``'xla'`` path checked against it. Gradients are compared
with the ``'xla'`` path's autodiff gradients (the blockwise path has its own VJP).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_testlib import numpy_attention
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from layers_testlib import FRAMEWORKS, build, config

import layers
import partition
from layers import _attention as A
from layers import _core

B, L, H, K, D = 2, 21, 4, 2, 8


def _qkv(b=B, length=L, heads=H, kv_heads=K, d=D, dtype=jnp.float32, seed=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(ks[0], (b, length, heads, d))
  k = jax.random.normal(ks[1], (b, length, kv_heads, d))
  v = jax.random.normal(ks[2], (b, length, kv_heads, d))
  return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def _masks(b=B, length=L):
  pos = np.arange(length)[None]
  valid = pos >= (np.arange(b) * 3)[:, None]           # left padding: 0 and 3 pads
  lengths = np.array([length - 4, length][:b] + [length] * max(b - 2, 0))
  seg = (pos >= 5).astype(np.int32) + (pos >= 12 + np.arange(b)[:, None])
  return {"causal": A.Mask(), "full": A.Mask(causal=False),
          "valid": A.Mask(valid=jnp.asarray(valid)),
          "lengths": A.Mask(lengths=jnp.asarray(lengths)),
          "segments": A.Mask(segment_ids=jnp.asarray(seg)),
          "valid+segments+full": A.Mask(causal=False, valid=jnp.asarray(valid),
                                        segment_ids=jnp.asarray(seg))}


def _close(got, want, rtol=1e-5, atol=1e-6):
  np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64),
                             rtol=rtol, atol=atol)


# -- forward and gradients, fp32 -------------------------------------------------------------


@pytest.mark.parametrize("kind", list(_masks()))
@pytest.mark.parametrize("implementation", ["xla", "blockwise"])
def test_forward_equals_numpy_definition(kind, implementation):
  q, k, v = _qkv()
  mask = _masks()[kind]
  # block 8 does not divide L = 21: the last K/V block is padded with keys that do not exist
  out = A.dot_product_attention(q, k, v, mask, implementation=implementation, block=8)
  _close(out, numpy_attention(q, k, v, mask))


@pytest.mark.parametrize("kind", list(_masks()))
@pytest.mark.parametrize("block", [4, 8, 64])
def test_blockwise_gradients_equal_xla(kind, block):
  q, k, v = _qkv()
  mask = _masks()[kind]
  w = jax.random.normal(jax.random.key(9), q.shape)

  def grads(implementation):
    f = lambda q, k, v: jnp.sum(w * A.dot_product_attention(
        q, k, v, mask, implementation=implementation, block=block))
    return jax.jit(jax.grad(f, argnums=(0, 1, 2)))(q, k, v)

  for got, want in zip(grads("blockwise"), grads("xla")):
    _close(got, want, atol=1e-5)


def test_padded_queries_output_zeros_and_get_no_gradient():
  q, k, v = _qkv()
  mask = _masks()["valid"]
  pads = ~np.asarray(mask.valid)
  for implementation in ("xla", "blockwise"):
    def f(q, implementation=implementation):
      return A.dot_product_attention(q, k, v, mask, implementation=implementation, block=8)
    assert np.all(np.asarray(f(q))[pads] == 0)
    dq = jax.grad(lambda q, f=f: jnp.sum(f(q) ** 2))(q)
    assert np.all(np.asarray(dq)[pads] == 0)


def test_blockwise_with_a_query_offset_is_a_slice_of_the_whole():
  """What a sequence-sharded device computes: its query block against all keys."""
  q, k, v = _qkv()
  mask = _masks()["segments"]
  whole = A.dot_product_attention(q, k, v, mask, implementation="xla")
  parts = A._parts(mask)
  parts["q_seg"] = parts["q_seg"][:, 7:14]
  part = A._blockwise_kernel(q[:, 7:14], k, v, parts, causal=True, q_offset=7, block=8)
  _close(part, whole[:, 7:14])


@pytest.mark.parametrize("kind", ["causal", "full", "lengths"])
@pytest.mark.parametrize("q_length,kv_length", [(13, 21), (21, 13)])
def test_blockwise_with_fewer_or_more_queries_than_keys_equals_xla(kind, q_length, kv_length):
  """q_length != kv_length, neither a multiple of the block (8): query i sees keys j <= i
  (both counted from 0), forward against the float64 definition, gradients against xla."""
  q = _qkv(length=q_length)[0]
  _, k, v = _qkv(length=kv_length, seed=1)
  mask = {"causal": A.Mask(), "full": A.Mask(causal=False),
          "lengths": A.Mask(lengths=jnp.array([9, 21]))}[kind]
  out = A.dot_product_attention(q, k, v, mask, implementation="blockwise", block=8)
  _close(out, numpy_attention(q, k, v, mask))
  w = jax.random.normal(jax.random.key(9), q.shape)

  def grads(implementation):
    f = lambda q, k, v: jnp.sum(w * A.dot_product_attention(
        q, k, v, mask, implementation=implementation, block=8))
    return jax.jit(jax.grad(f, argnums=(0, 1, 2)))(q, k, v)

  for got, want in zip(grads("blockwise"), grads("xla")):
    _close(got, want, atol=1e-5)


def test_causal_schedule_visits_the_blocks_at_or_below_the_diagonal():
  """Hand-worked: 21 queries and keys in blocks of 8 (blocks 0-7, 8-15, 16-20)."""
  s = A._Schedule.of(21, 21, 8, True, 0)
  assert (s.q_block, s.q_blocks, s.kv_blocks) == (8, 3, 3)
  assert s.pairs == ((0, 0), (1, 0), (1, 1), (2, 0), (2, 1), (2, 2))
  # queries at positions 7..13 (a sequence-sharded block) see keys 0..13: key blocks 0, 1
  assert A._Schedule.of(7, 21, 8, True, 7).pairs == ((0, 0), (0, 1))
  # no causal mask, or a traced offset: one query block, every key block
  assert A._Schedule.of(21, 21, 8, False, 0).pairs == ((0, 0), (0, 1), (0, 2))
  assert A._Schedule.of(21, 21, 8, True, jnp.int32(0)).q_blocks == 1


def test_blockwise_causal_skips_the_masked_blocks_in_xla_flops():
  """XLA's cost_analysis of the compiled forward + backward (scans unrolled: XLA counts a
  loop body once). With n = 8 blocks per side, a causal mask leaves n (n + 1) / 2 = 36 of
  the n^2 = 64 (query block, key block) pairs: 0.5625 of the non-causal FLOPs (matmuls and
  the per-element softmax alike), plus the causal mask's own per-element selects."""
  n, block, d = 8, 16, 64
  q = jax.ShapeDtypeStruct((1, n * block, 2, d), jnp.float32)
  kv = jax.ShapeDtypeStruct((1, n * block, 1, d), jnp.float32)

  def flops(causal):
    f = lambda q, k, v, w: jnp.sum(w * A.blockwise_attention(
        q, k, v, A.Mask(causal=causal), block=block, unroll=True))
    compiled = jax.jit(jax.grad(f, argnums=(0, 1, 2))).lower(q, kv, kv, q).compile()
    return compiled.cost_analysis()["flops"]

  causal, full = flops(True), flops(False)
  # the non-causal count includes at least the forward's two matmuls and the backward's
  # dv, dp, dq, dk (2 flops per multiply-add, per query head): 12 L^2 d heads
  assert full >= 12 * (n * block) ** 2 * d * 2
  pairs = n * (n + 1) / 2 / n ** 2
  assert pairs - 0.05 <= causal / full <= 0.6, (causal, full, causal / full)


# -- bfloat16 --------------------------------------------------------------------------------


def test_blockwise_bf16_is_within_bf16_rounding_of_the_truth():
  """Both paths in bfloat16 against the float64 truth on the same (bf16-rounded) inputs.

  Tolerance: bf16 keeps 8 significant bits (unit roundoff 2^-9); the output is a convex
  combination of values, so its rounding (and the bf16 weights fed to the p @ v product)
  stays within a few units of 2^-8 of max|v|. The xla path additionally rounds its logits to
  bf16 (an absolute error ~2^-9 |s| in each exponent); the blockwise path keeps fp32 logits, so
  it must be at least as accurate as the reference path, up to one bf16 unit.
  """
  q, k, v = _qkv(dtype=jnp.bfloat16)
  mask = _masks()["valid+segments+full"]
  truth = numpy_attention(q, k, v, mask)
  scale = float(np.abs(np.asarray(v, np.float32)).max())
  err = {impl: float(np.abs(np.asarray(A.dot_product_attention(
      q, k, v, mask, implementation=impl, block=8), np.float64) - truth).max())
      for impl in ("xla", "blockwise")}
  unit = 2.0 ** -8 * scale
  assert err["xla"] < 4 * unit, err
  assert err["blockwise"] <= err["xla"] + unit, err


# -- the model in every framework ------------------------------------------------------------


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_transformer_blockwise_equals_xla_with_padding_and_packing(framework):
  tokens = jax.random.randint(jax.random.key(1), (4, 8), 0, 64)
  valid = jnp.arange(8)[None] >= jnp.array([[0], [2], [1], [0]])
  seg = (jnp.arange(8)[None] >= jnp.array([[3], [5], [8], [4]])).astype(jnp.int32)
  targets = jax.random.randint(jax.random.key(2), (4, 8), 0, 64)
  m_ref = build(framework, config(attention="xla"))
  m_blk = build(framework, config(attention="blockwise", attention_block=8))

  def loss(m):
    def f(params):
      logits = m.apply(params, tokens, valid=valid, segment_ids=seg)
      logp = jax.nn.log_softmax(logits)
      return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1)), logits
    return jax.jit(jax.value_and_grad(f, has_aux=True))(m_ref.params)   # the same weights

  (l_ref, lg_ref), g_ref = loss(m_ref)
  (l_blk, lg_blk), g_blk = loss(m_blk)
  _close(lg_blk, lg_ref, atol=1e-5)
  _close(l_blk, l_ref)
  for a, b in zip(jax.tree.leaves(g_blk), jax.tree.leaves(g_ref)):
    _close(a, b, atol=1e-5)


@pytest.mark.slow  # a decode loop / several models: runs in the full suite
def test_packed_rows_equal_separate_rows():
  """Packing is exact: two sequences packed in one row give each one's logits alone."""
  m = build("linen", config(attention="blockwise", attention_block=4))
  a = jax.random.randint(jax.random.key(3), (1, 5), 0, 64)
  b = jax.random.randint(jax.random.key(4), (1, 3), 0, 64)
  packed = m.apply(m.params, jnp.concatenate([a, b], 1),
                   segment_ids=jnp.array([[0] * 5 + [1] * 3]))
  _close(packed[:, :5], m.apply(m.params, a), atol=1e-5)
  _close(packed[:, 5:], m.apply(m.params, b), atol=1e-5)


def test_right_padding_as_lengths_equals_valid():
  m = build("linen", config(attention="blockwise", attention_block=4))
  tokens = jax.random.randint(jax.random.key(5), (4, 8), 0, 64)
  lengths = jnp.array([8, 5, 3, 7])
  valid = jnp.arange(8)[None] < lengths[:, None]
  _close(m.apply(m.params, tokens, valid=lengths), m.apply(m.params, tokens, valid=valid))


# -- choosing, and errors --------------------------------------------------------------------


def test_auto_picks_from_static_facts():
  c = lambda backend, **kw: A.choose("auto", backend=backend, **{
      "dtype": jnp.bfloat16, "head_dim": 128, "q_length": 2048, "mask": A.Mask(), **kw})
  assert c("gpu").implementation == "cudnn"
  assert c("tpu").implementation == "pallas"
  assert c("cpu").implementation == "blockwise"
  assert c("cpu", q_length=512).implementation == "xla"
  seg = A.Mask(segment_ids=jnp.zeros((1, 2048), jnp.int32))
  packed = c("gpu", mask=seg)      # cuDNN has no segment ids: another implementation
  assert packed.implementation == "blockwise" and "segment ids" in packed.reason
  assert c("gpu", dtype=jnp.float32).implementation == "blockwise"
  assert c("gpu", sequence_sharded=True).implementation == "blockwise"
  assert c("tpu", head_dim=64).implementation == "blockwise"


@pytest.mark.parametrize("requested,kw,constraint", [
    ("cudnn", {}, "cuDNN needs an NVIDIA GPU; the backend is 'cpu'"),
    ("cudnn", {"backend": "gpu", "dtype": jnp.float32}, "bfloat16/float16 only"),
    ("cudnn", {"backend": "gpu", "head_dim": 12}, "multiple of 8 and <= 256; head_dim=12"),
    ("cudnn", {"backend": "gpu", "mask": A.Mask(segment_ids=jnp.zeros((1, 256)))},
     "no segment ids"),
    ("cudnn", {"backend": "gpu", "mask": A.Mask(valid=jnp.ones((1, 256), bool))},
     "padding only as sequence lengths"),
    ("pallas", {}, "needs a TPU; the backend is 'cpu'"),
    ("pallas", {"backend": "tpu", "q_length": 200}, "multiple of 128"),
    ("pallas", {"backend": "tpu", "head_dim": 64}, "head_dim a multiple of 128"),
])
def test_an_explicit_choice_that_cannot_run_names_the_constraint(requested, kw, constraint):
  args = {"backend": "cpu", "dtype": jnp.bfloat16, "head_dim": 128, "q_length": 256,
          "mask": A.Mask(), **kw}
  with pytest.raises(A.AttentionError, match="Use attention='auto'") as e:
    A.choose(requested, **args)
  assert constraint in str(e.value)


def test_a_dense_mask_array_is_xla_only():
  q, k, v = _qkv()
  with pytest.raises(A.AttentionError, match="cannot take a dense mask array"):
    A.dot_product_attention(q, k, v, _core.causal_mask(L), implementation="blockwise")
  _close(A.dot_product_attention(q, k, v, _core.causal_mask(L)),
         numpy_attention(q, k, v, A.Mask()))


def test_cudnn_on_cpu_is_an_error_from_the_model():
  m = build("linen", config())
  with pytest.raises(A.AttentionError, match="cuDNN needs an NVIDIA GPU"):
    layers.linen.Transformer(config(attention="cudnn")).apply(m.params, jnp.zeros((1, 8), int))


def test_config_validates_the_attention_fields():
  with pytest.raises(layers.ConfigError, match=r"attention='blokwise'.*did you mean 'blockwise'"):
    config(attention="blokwise")
  with pytest.raises(layers.ConfigError, match="attention_block=0 must be a positive int"):
    config(attention_block=0)


# -- the wrappers of the fused kernels, with stand-ins where the hardware is missing ---------


@pytest.mark.parametrize("kind", ["causal", "full", "lengths"])
def test_cudnn_wrapper_with_jax_xla_standing_in(kind):
  """Our cuDNN call (is_causal, sequence lengths, GQA layout, zeroed padded queries) run by
  jax.nn.dot_product_attention's XLA implementation: the same arguments, another backend."""
  q, k, v = _qkv()
  mask = _masks()[kind]
  out = A._cudnn_kernel(q, k, v, A._parts(mask), causal=mask.causal, q_offset=0,
                        implementation="xla")
  _close(out, numpy_attention(q, k, v, mask))


@pytest.mark.parametrize("kind", ["causal", "valid+segments+full", "lengths"])
def test_pallas_splash_wrapper_in_interpret_mode(kind):
  """The TPU splash kernel (GQA as per-kv-head MQA calls, padding folded into segment ids),
  forward and gradients, run by Pallas' interpreter on CPU."""
  q, k, v = _qkv(b=2, length=128, d=32)
  mask = _masks(2, 128)[kind]
  parts = A._parts(mask)
  run = lambda impl: lambda q, k, v: impl(q, k, v, parts, causal=mask.causal, q_offset=0)
  pallas = run(lambda *a, **kw: A._pallas_kernel(*a, **kw, block=128, interpret=True))
  _close(pallas(q, k, v), numpy_attention(q, k, v, mask), atol=1e-5)
  w = jax.random.normal(jax.random.key(7), q.shape)
  grads = lambda f: jax.grad(lambda *a: jnp.sum(w * f(*a)), argnums=(0, 1, 2))(q, k, v)
  for got, want in zip(grads(pallas), grads(run(A._xla_kernel))):
    _close(got, want, atol=1e-4)


MESH_CASES = {  # preset-like rules: what shard_mapped must keep sharded
    "batch": ([("batch", "data"), ("heads", None), ("kv_heads", None), ("length", None)],
              (8,), ("data",)),
    "batch+heads": ([("batch", "data"), ("heads", "tensor"), ("kv_heads", "tensor"),
                     ("length", None)], (4, 2), ("data", "tensor")),
    # 4 query heads over 4 devices, 2 kv heads not sharded: each device slices its kv head
    "heads over more devices than kv heads": (
        [("batch", "data"), ("heads", "tensor"), ("kv_heads", None), ("length", None)],
        (2, 4), ("data", "tensor")),
    "sequence": ([("batch", "data"), ("length", "sequence"), ("heads", None),
                  ("kv_heads", None)], (2, 4), ("data", "sequence")),
}


@pytest.mark.parametrize("case", list(MESH_CASES))
@pytest.mark.parametrize("inner", ["xla", "blockwise"])
def test_shard_mapped_kernel_equals_one_device(case, inner):
  """The shard_map wrapper of the fused kernels, with the XLA or blockwise kernel inside
  (a custom call cannot run here): forward and gradients equal the unsharded computation."""
  table, shape, names = MESH_CASES[case]
  mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))
  rules = partition.AxisRules(table)
  q, k, v = _qkv(b=8, length=16)
  mask = _masks(8, 16)["valid+segments+full"]
  mask = dataclasses.replace(mask, causal=True)
  kernel = {"xla": A._xla_kernel,
            "blockwise": lambda *a, **kw: A._blockwise_kernel(*a, **kw, block=4)}[inner]
  w = jax.random.normal(jax.random.key(8), q.shape)
  f = lambda q, k, v: jnp.sum(w * A.shard_mapped(kernel, q, k, v, mask))
  want_out = numpy_attention(q, k, v, mask)
  want_grads = jax.grad(lambda q, k, v: jnp.sum(w * A.dot_product_attention(
      q, k, v, mask, implementation="xla")), argnums=(0, 1, 2))(q, k, v)
  put = lambda a, axes: jax.device_put(a, NamedSharding(mesh, rules.spec(axes, a.shape, mesh)))
  qs, ks, vs = put(q, _core.QUERY), put(k, _core.KEY_VALUE), put(v, _core.KEY_VALUE)
  with partition.axis_rules(rules, mesh):
    out = jax.jit(lambda q, k, v: A.shard_mapped(kernel, q, k, v, mask))(qs, ks, vs)
    grads = jax.jit(jax.grad(f, argnums=(0, 1, 2)))(qs, ks, vs)
    hlo = jax.jit(lambda q, k, v: A.shard_mapped(kernel, q, k, v, mask)).lower(
        qs, ks, vs).as_text()
  _close(out, want_out, atol=1e-5)
  for got, want in zip(grads, want_grads):
    _close(got, want, atol=1e-5)
  assert "shard_map" in hlo or "sdy.manual_computation" in hlo or "custom_call" in hlo
  assert out.sharding.spec[0] is not None   # the batch stayed sharded


# -- memory: the point of the blockwise path --------------------------------------------------


def test_blockwise_compiled_temp_memory_is_a_fraction_of_xla_at_8192():
  """XLA's own memory_analysis of the compiled forward+backward (deterministic, not timed):
  the (L, L) logits the xla path holds (L^2 x 4 B per head: 256 MiB here) against
  O(L x block) for the blockwise path. The curve over L is in benchmarks/accelerator.py."""
  shape = jax.ShapeDtypeStruct((1, 8192, 1, 16), jnp.float32)

  def temp(implementation):
    f = lambda q, k, v: jnp.sum(A.dot_product_attention(
        q, k, v, A.Mask(), implementation=implementation, block=512))
    compiled = jax.jit(jax.grad(f, argnums=(0, 1, 2))).lower(shape, shape, shape).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  xla, blockwise = temp("xla"), temp("blockwise")
  assert xla >= 8192 * 8192 * 4        # at least one fp32 (L, L) buffer
  assert blockwise * 8 <= xla, (blockwise, xla)


# -- every preset equals one device ----------------------------------------------------------

PRESET_CASES = [  # (preset, mesh, framework, config changes)
    ("data_parallel", {"data": 8}, "linen", {}),
    ("fsdp", {"data": 2, "fsdp": 4}, "nnx", {}),
    ("fsdp_tp", {"data": 2, "fsdp": 2, "tensor": 2}, "haiku", {}),
    ("tensor_parallel", {"data": 4, "tensor": 2}, "linen", {"scan_layers": True}),
    ("sequence_parallel", {"data": 2, "sequence": 4}, "nnx", {}),
    ("expert_parallel", {"data": 2, "expert": 4}, "haiku",
     {"num_experts": 4, "experts_per_token": 2}),
    ("pipeline_parallel", {"data": 2, "stage": 4}, "linen",
     {"scan_layers": True, "num_layers": 4, "pipeline_microbatches": 4}),
]


@pytest.mark.parametrize("preset,mesh_shape,framework,changes", PRESET_CASES,
                         ids=[c[0] for c in PRESET_CASES])
@pytest.mark.slow
def test_blockwise_under_every_preset_equals_xla_on_one_device(preset, mesh_shape, framework,
                                                               changes):
  from recipes.config import preset_rules
  tokens = jax.random.randint(jax.random.key(1), (8, 16), 0, 64)
  valid = jnp.arange(16)[None] >= (jnp.arange(8) % 3)[:, None]
  seg = (jnp.arange(16)[None] >= 6 + jnp.arange(8)[:, None] % 4).astype(jnp.int32)
  ref = build(framework, config(attention="xla", **changes), tokens)

  def step(m):
    def loss(params):
      logits = m.apply(params, tokens, valid=valid, segment_ids=seg)
      return jnp.mean(jax.nn.log_softmax(logits)[..., 0] * valid), logits
    return jax.jit(jax.value_and_grad(loss, has_aux=True))

  (want_loss, want), want_grads = step(ref)(ref.params)
  mesh = jax.make_mesh(tuple(mesh_shape.values()), tuple(mesh_shape),
                       axis_types=(AxisType.Auto,) * len(mesh_shape))
  blockwise = build(framework, config(attention="blockwise", attention_block=8, **changes),
                    tokens)
  params = jax.device_put(ref.params, NamedSharding(mesh, P()))  # placement: not the point
  with partition.axis_rules(preset_rules(preset), mesh):
    (loss, got), grads = step(blockwise)(params)
  _close(got, want, atol=2e-5)
  _close(loss, want_loss, atol=1e-6)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    _close(a, b, atol=2e-5)


def test_explain_says_which_attention_runs_and_why():
  from recipes import explain
  from recipes.config import load_config
  cfg = load_config(overrides=["model.num_layers=1", "model.attention=blockwise"])
  choice = explain.explain_config(cfg, compile=False).to_dict()["attention"]
  assert choice == {"implementation": "blockwise", "reason": "requested"}
  cfg = load_config(overrides=["model.num_layers=1", "seq_len=16"])
  p = explain.explain_config(cfg, compile=False)
  assert p.to_dict()["attention"]["implementation"] == "xla"
  assert "length 16 < 2048; no fused kernel on cpu" in p.to_dict()["attention"]["reason"]
  out = __import__("io").StringIO()
  explain.render(p, out)
  assert "attention: xla (auto: length 16 < 2048" in out.getvalue()
