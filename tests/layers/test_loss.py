"""Chunked cross-entropy (``layers._loss``, ``TransformerConfig.loss_chunk``) equals the loss
from full logits (optax over ``(batch, length, vocab)``): values, argmax and gradients, in
all three frameworks, tied and untied, sharded on 8 devices; and its compiled temp memory is
a fraction of the full logits' size."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from layers_testlib import FRAMEWORKS, FSDP_TP, MESH, TARGETS, TOKENS, build, config, init_sharded
from marks_testlib import everyday

import layers
import partition
from layers import chunked_cross_entropy
from layers._params import LayerArgumentError


def _close(got, want, name=""):
  """rtol 1e-5; atol 1e-5 of the largest entry (a sum of O(max) terms in another order
  carries an absolute error of ~eps * max, also on its entries near zero)."""
  want = np.asarray(want)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5,
                             atol=1e-5 * float(np.abs(want).max()), err_msg=name)


def _full_logits(h, w, tied):
  return jnp.einsum("ble,ve->blv" if tied else "ble,ev->blv", h, w)


def _optax_ce(logits, targets):
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)


# -- the function itself ----------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("chunk", [1, 3, 4, 10, 16])   # length 10: 3 and 4 leave a remainder
def test_chunked_equals_full_logits_values_and_gradients(tied, chunk):
  kh, kw, kt, kg = jax.random.split(jax.random.key(0), 4)
  h = jax.random.normal(kh, (3, 10, 8))
  w = jax.random.normal(kw, (37, 8) if tied else (8, 37))
  # Every other token's target is its argmax: `correct` then holds both values.
  targets = jnp.where(jnp.arange(10) % 2, jax.random.randint(kt, (3, 10), 0, 37),
                      _full_logits(h, w, tied).argmax(-1))
  g = jax.random.normal(kg, (3, 10))    # a cotangent that weighs every token differently

  ce, correct = jax.jit(lambda h, w: chunked_cross_entropy(h, w, targets, chunk=chunk,
                                                           tied=tied))(h, w)
  logits = _full_logits(h, w, tied)
  _close(ce, _optax_ce(logits, targets))
  np.testing.assert_array_equal(correct, logits.argmax(-1) == targets)
  assert correct.dtype == bool and 0 < int(correct.sum()) < correct.size   # not trivial

  chunked = lambda h, w: jnp.sum(chunked_cross_entropy(h, w, targets, chunk=chunk,
                                                       tied=tied)[0] * g)
  full = lambda h, w: jnp.sum(_optax_ce(_full_logits(h, w, tied), targets) * g)
  got = jax.jit(jax.grad(chunked, (0, 1)))(h, w)
  want = jax.grad(full, (0, 1))(h, w)
  _close(got[0], want[0], "dh")
  _close(got[1], want[1], "dw")


def test_chunk_must_be_a_positive_int():
  h, w, t = jnp.zeros((1, 4, 2)), jnp.zeros((5, 2)), jnp.zeros((1, 4), int)
  with pytest.raises(ValueError, match="chunk=0 must be a positive int"):
    chunked_cross_entropy(h, w, t, chunk=0, tied=True)


# -- the models -------------------------------------------------------------------------------


def _loss_and_grads(m, params, g, **kw):
  """jit: the per-token (ce, correct) and the gradient of sum(ce * g) w.r.t. the params."""
  def loss(p):
    ce, correct = m.apply(p, TOKENS, **kw)
    return jnp.sum(ce * g), (ce, correct)
  (_, (ce, correct)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  return ce, correct, grads


def _reference(m, params, g):
  """Full logits, optax's cross-entropy, plain autodiff: the model as it ran before."""
  def loss(p):
    logits = m.apply(p, TOKENS)
    ce = _optax_ce(logits, TARGETS)
    return jnp.sum(ce * g), (ce, logits.argmax(-1) == TARGETS)
  (_, (ce, correct)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  return ce, correct, grads


def _close_grads(got, want):
  got, want = layers.to_canonical(got), layers.to_canonical(want)
  assert sorted(got) == sorted(want)
  for name in want:
    _close(got[name], want[name], name)


G = jax.random.normal(jax.random.key(5), TOKENS.shape)


@pytest.mark.parametrize("framework", everyday(FRAMEWORKS, "linen"))
@pytest.mark.parametrize("tied", [True, False])
def test_model_chunked_loss_equals_full_logits(framework, tied):
  # length 8 in chunks of at most 3: 3 steps of 3 tokens, one padded token per row.
  full = build(framework, config(tie_embeddings=tied))
  chunked = build(framework, config(tie_embeddings=tied, loss_chunk=3))
  want_ce, want_correct, want_grads = _reference(full, full.params, G)
  # The same weights in both (loss_chunk changes no parameter).
  ce, correct, grads = _loss_and_grads(chunked, full.params, G, targets=TARGETS)
  _close(ce, want_ce, "ce")
  np.testing.assert_array_equal(correct, want_correct)
  _close_grads(grads, want_grads)
  # loss_chunk=0 with targets: the loss from the full logits, in the model.
  ce0, correct0, grads0 = _loss_and_grads(full, full.params, G, targets=TARGETS)
  _close(ce0, want_ce, "ce, loss_chunk=0")
  np.testing.assert_array_equal(correct0, want_correct)
  _close_grads(grads0, want_grads)


def test_model_chunked_loss_with_aux_and_scan():
  cfg = config(scan_layers=True, num_experts=4, experts_per_token=2)
  full = build("linen", cfg)
  chunked = build("linen", dataclasses.replace(cfg, loss_chunk=5))
  logits, want_aux = full.apply(full.params, TOKENS, return_aux=True)
  (ce, correct), aux = chunked.apply(full.params, TOKENS, targets=TARGETS, return_aux=True)
  _close(ce, _optax_ce(logits, TARGETS))
  np.testing.assert_array_equal(correct, logits.argmax(-1) == TARGETS)
  for k in want_aux:
    _close(aux[k], want_aux[k], k)


def test_loss_chunk_is_validated():
  for bad in (-1, 1.5, True, "8"):
    with pytest.raises(layers.ConfigError, match=f"loss_chunk={bad!r} must be an int >= 0"):
      config(loss_chunk=bad)


def test_bad_targets_are_named():
  m = build("linen", config(loss_chunk=4))
  with pytest.raises(LayerArgumentError, match=r"bad targets(.|\n)*shape \(4, 7\)"):
    m.apply(m.params, TOKENS, targets=TARGETS[:, :7])
  with pytest.raises(LayerArgumentError, match="expected integer token ids"):
    m.apply(m.params, TOKENS, targets=TARGETS.astype(jnp.float32))


# -- sharded ----------------------------------------------------------------------------------


@pytest.mark.parametrize("framework,tied,scan", [("linen", True, False),
                                                 ("nnx", False, True)])
def test_sharded_chunked_loss_equals_single_device_full_logits(framework, tied, scan):
  """FSDP + TP (vocab over 'tensor', batch over data x fsdp, embed over fsdp) on (2, 2, 2):
  the chunked loss and its gradients equal one device's full-logits loss, and the
  backward pass reduces the weight gradient after the chunk loop, not in it."""
  cfg = config(tie_embeddings=tied, scan_layers=scan)
  full = build(framework, cfg, seed=3)
  want_ce, want_correct, want_grads = _reference(full, full.params, G)
  chunked = build(framework, dataclasses.replace(cfg, loss_chunk=3), seed=3)
  params = layers.from_canonical(layers.to_canonical(full.params),
                                 like=init_sharded(chunked, FSDP_TP))
  batch = NamedSharding(MESH, P(("data", "fsdp")))
  tokens, targets, g = (jax.device_put(x, batch) for x in (TOKENS, TARGETS, G))

  def loss(p, tokens, targets, g):
    ce, correct = chunked.apply(p, tokens, targets=targets)
    return jnp.sum(ce * g), (ce, correct)
  with partition.axis_rules(FSDP_TP, MESH):
    compiled = jax.jit(jax.value_and_grad(loss, has_aux=True)).lower(
        params, tokens, targets, g).compile()
  (_, (ce, correct)), grads = compiled(params, tokens, targets, g)
  _close(ce, want_ce, "ce")
  np.testing.assert_array_equal(correct, want_correct)
  _close_grads(grads, want_grads)
  # The output projection's gradient ((64, 16); vocab over tensor: 32 rows per device, embed
  # gathered) is reduced over the batch's devices after the chunk loop: no collective of its
  # shape inside a while loop's body (without the per-device partial sums, XLA all-reduces
  # it once per chunk there). The bodies do hold the per-chunk all-reduces of dh over vocab.
  hlo = compiled.as_text()
  names = set(re.findall(r"body=%?([\w.\-]+)", hlo))
  bodies = [c for c in hlo.split("\n\n") if c.strip() and c.split()[0].lstrip("%") in names]
  collectives = [line for c in bodies for line in c.splitlines()
                 if "all-reduce(" in line or "reduce-scatter(" in line]
  assert bodies and collectives
  shape = r"f32\[(\d+,)*32,16\]" if tied else r"f32\[(\d+,)*16,32\]"
  assert not [line for line in collectives if re.search(shape, line)]


# -- memory -----------------------------------------------------------------------------------


def _temp_bytes(fn, *args):
  return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_chunked_loss_needs_a_fraction_of_the_full_logits_memory():
  batch, length, embed, vocab, chunk = 2, 256, 64, 32768, 8
  h = jax.ShapeDtypeStruct((batch, length, embed), jnp.float32)
  w = jax.ShapeDtypeStruct((vocab, embed), jnp.float32)
  t = jax.ShapeDtypeStruct((batch, length), jnp.int32)

  def full(h, w, t):
    return jnp.mean(_optax_ce(_full_logits(h, w, True), t))

  def chunked(h, w, t):
    return jnp.mean(chunked_cross_entropy(h, w, t, chunk=chunk, tied=True)[0])

  logits_bytes = batch * length * vocab * 4                      # 64 MiB
  full_temp = _temp_bytes(jax.value_and_grad(full, (0, 1)), h, w, t)
  chunked_temp = _temp_bytes(jax.value_and_grad(chunked, (0, 1)), h, w, t)
  assert full_temp >= logits_bytes
  assert chunked_temp < logits_bytes / 4, (chunked_temp, logits_bytes)
  # What the chunked pass holds: the fp32 weight-gradient accumulator (vocab x embed, 8 MiB)
  # and a few chunks of fp32 logits (batch x chunk x vocab, 2 MiB each; XLA keeps two).
  accumulator, one_chunk = vocab * embed * 4, batch * chunk * vocab * 4
  assert chunked_temp < accumulator + 3 * one_chunk, (chunked_temp, accumulator, one_chunk)
