"""Independent tests of ``partition.xmap``'s validation (DESIGN.md §2 and the original xmap).

Every error condition must raise a ``partition.PartitionError`` that is also a
``ValueError`` or ``TypeError``, with a message naming the offending leaf (keypath) or axis
and saying how to fix it. Each test pins the exception class and the message text.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType
from mesh_testlib import make_mesh

import partition
from partition import Mean, SerialLoop, Sum, xmap


def ident(x):
  return x


@pytest.fixture(scope="module")
def mesh8():
  return make_mesh((8,), ("x",), AxisType.Auto)


@pytest.fixture(scope="module")
def mesh42():
  return make_mesh((4, 2), ("x", "y"), AxisType.Auto)


def _raises(base, match):
  """``pytest.raises`` for a PartitionError that is also ``base`` (ValueError/TypeError)."""
  return pytest.raises(base, match=match)


def _check_type(excinfo, base):
  err = excinfo.value
  assert isinstance(err, base), type(err).__mro__
  assert isinstance(err, partition.PartitionError), type(err).__mro__


# ---------------------------------------------------------------------------- spec types


def test_bad_leaf_type_in_in_axes():
  with _raises(TypeError, r"in_axes\[0\].*invalid axis specification: 3(?s:.*)\{0: 'batch'\}") as e:
    xmap(ident, (3,), ["i", ...])(jnp.ones(8))
  _check_type(e, TypeError)


def test_bad_leaf_type_names_nested_keypath():
  with _raises(TypeError, r"in_axes\[0\]\['w'\].*invalid axis specification") as e:
    xmap(ident, ({"w": 3},), ["i", ...])({"w": jnp.ones(8)})
  _check_type(e, TypeError)


def test_bad_leaf_type_in_out_axes():
  with _raises(TypeError, r"out_axes.*invalid axis specification: 3") as e:
    xmap(ident, (["i", ...],), 3)(jnp.ones(8))
  _check_type(e, TypeError)


def test_non_str_axis_name_in_dict_spec():
  with _raises(TypeError, r"in_axes\[0\].*axis names must be str, got 1") as e:
    xmap(ident, ({0: 1},), ["i", ...])(jnp.ones(8))
  _check_type(e, TypeError)


def test_non_str_axis_name_in_list_spec():
  # [1, ...] is a list spec with a bad name; the message must point at the entry 1 and the
  # valid spec forms, not only say that in_axes has the wrong structure.
  with _raises(TypeError, r"(?s)in_axes\[0\].*1.*(name|str)") as e:
    xmap(ident, ([1, ...],), ["i", ...])(jnp.ones((8, 3)))
  _check_type(e, TypeError)


def test_ellipsis_not_last():
  with _raises(TypeError, r"in_axes\[0\].*'\.\.\.' before its end(?s:.*)\['batch', \.\.\.\]") as e:
    xmap(ident, (["i", ..., None],), ["i", ...])(jnp.ones((8, 2)))
  _check_type(e, TypeError)


# ------------------------------------------------------------------- duplicates / negatives


@pytest.mark.parametrize("spec", [["i", "i"], {0: "i", 1: "i"}], ids=["list", "dict"])
def test_duplicate_name_in_one_in_spec(spec):
  with _raises(ValueError, r"in_axes\[0\].*names axis 'i' more than once(?s:.*)distinct") as e:
    xmap(ident, (spec,), ["i", ...])(jnp.ones((2, 2)))
  _check_type(e, ValueError)


def test_duplicate_name_in_one_out_spec():
  with pytest.raises((ValueError, TypeError),
                     match=r"out_axes.*names axis 'i' more than once(?s:.*)distinct") as e:
    xmap(ident, (["i", "j"],), ["i", "i"])(jnp.ones((2, 2)))
  assert isinstance(e.value, partition.PartitionError)


def test_duplicate_name_in_reduction():
  with _raises(ValueError, r"Sum\('i', 'i'\) names axis 'i' twice\. Name each axis to "
                           r"reduce once: Sum\('i'\)") as e:
    Sum("i", "i")
  _check_type(e, ValueError)
  with _raises(ValueError, r"Mean\('i', 'j', 'i'\) names axis 'i' twice\. Name each axis "
                           r"to reduce once: Mean\('i', 'j'\)"):
    partition.Mean("i", "j", "i")


def test_reduction_both_reduces_and_keeps():
  with _raises(ValueError, r"both reduces and keeps axes \['i'\]") as e:
    Mean("i", axes=["i", ...])
  _check_type(e, ValueError)


def test_negative_dim():
  # A ValueError, as in the original xmap (it is also a SpecError, a TypeError).
  with _raises(ValueError, r"in_axes\[0\].*negative dim -1(?s:.*)from 0") as e:
    xmap(ident, ({-1: "i"},), ["i", ...])(jnp.ones(8))
  _check_type(e, ValueError)
  assert isinstance(e.value, partition.NegativeDimError)


def test_negative_dim_in_out_axes():
  with _raises(ValueError, r"out_axes.*negative dim -1") as e:
    xmap(ident, (["i", ...],), {-1: "i"})(jnp.ones(8))
  _check_type(e, ValueError)


# -------------------------------------------------------------------------------- ranks


def test_list_spec_without_ellipsis_asserts_input_rank():
  with _raises(ValueError, r"argument\[0\] has shape \(8, 3, 2\) \(rank 3\).*asserts rank 2"
                           r"(?s:.*)end a list with \.\.\.") as e:
    xmap(ident, (["i", None],), ["i", ...])(jnp.ones((8, 3, 2)))
  _check_type(e, ValueError)


def test_dict_spec_dim_beyond_input_rank():
  with _raises(ValueError, r"argument\[0\]\['a'\] has shape \(8, 3\).*names dim 2") as e:
    xmap(ident, ({"a": {2: "i"}},), ["i", ...])({"a": jnp.ones((8, 3))})
  _check_type(e, ValueError)


def test_out_axes_rank_mismatch():
  with _raises(ValueError, r"output.*out_axes \['i'\] asserts rank 1, but the result has rank 2"
                           r"(?s:.*)end a list with \.\.\.") as e:
    xmap(ident, (["i", ...],), ["i"])(jnp.ones((8, 3)))
  _check_type(e, ValueError)


def test_out_axes_dim_beyond_output_rank():
  with _raises(ValueError, r"out_axes \{3: 'i'\} places an axis at dim 3") as e:
    xmap(ident, (["i", ...],), {3: "i"})(jnp.ones((8, 3)))
  _check_type(e, ValueError)


def test_out_axes_rank_mismatch_names_output_keypath():
  with _raises(ValueError, r"output\[1\].*asserts rank 1") as e:
    xmap(lambda x: (x, x), (["i", ...],), (["i", ...], ["i"]))(jnp.ones((8, 3)))
  _check_type(e, ValueError)


# -------------------------------------------------------------------------------- sizes


def test_size_mismatch_between_two_inputs():
  with _raises(ValueError, r"inconsistent sizes(?s:.*)argument\[1\] has size 4 along axis 'i'"
                           r".*argument\[0\].*gives size 8(?s:.*)same size") as e:
    xmap(lambda a, b: a + b, (["i", ...], ["i", ...]), ["i", ...])(jnp.ones(8), jnp.ones(4))
  _check_type(e, ValueError)


def test_size_mismatch_with_axis_sizes():
  with _raises(ValueError, r"argument\[0\] has size 8 along axis 'i'.*axis_sizes\['i'\] gives "
                           r"size 4") as e:
    xmap(ident, (["i", ...],), ["i", ...], axis_sizes={"i": 4})(jnp.ones(8))
  _check_type(e, ValueError)


def test_axis_only_in_out_axes_is_undefined():
  with _raises(ValueError,
               r"out_axes names axes \['j'\] that are not defined(?s:.*)axis_sizes") as e:
    xmap(ident, (["i", ...],), ["i", "j", ...])(jnp.ones(8))
  _check_type(e, ValueError)


def test_size_not_inferable_from_empty_container():
  # 'i' is named in in_axes, but only on an empty container: its size cannot be inferred.
  # The original said "Failed to infer size of axes: i ... via axis_sizes"; the message must
  # say the size is unknown (not that 'i' is undefined) and suggest axis_sizes.
  f = xmap(lambda a, b: b, ({"a": ["i", ...]}, [...]), ["i", ...])
  with _raises(ValueError, r"(?s)infer the size of axes \['i'\].*axis_sizes=\{'i': ") as e:
    f({"a": []}, jnp.ones(3))
  _check_type(e, ValueError)


def test_axis_sizes_must_be_non_negative_int():
  with _raises(ValueError, r"axis_sizes\['k'\] must be a non-negative int, got -1") as e:
    xmap(ident, (["i", ...],), ["i", ...], axis_sizes={"k": -1})(jnp.ones(8))
  _check_type(e, ValueError)


# ---------------------------------------------------------------------------- divisibility


def test_indivisible_size_from_axis_sizes(mesh8):
  f = xmap(lambda x: x + lax.axis_index("j"), (["i", ...],), ["i", "j", ...],
           axis_sizes={"j": 6}, axis_resources={"j": "x"}, mesh=mesh8)
  with _raises(ValueError, r"axis 'j' has size 6 \(from axis_sizes\['j'\]\), not divisible by "
                           r"the 8 slices(?s:.*)Pad the inputs") as e:
    f(jnp.ones(8))
  _check_type(e, ValueError)


def test_indivisible_size_inferred_from_input(mesh8):
  # The original hit a bare AssertionError here.
  f = xmap(ident, (["i", ...],), ["i", ...], axis_resources={"i": "x"}, mesh=mesh8)
  with _raises(ValueError, r"axis 'i' has size 6 \(from argument\[0\] \(dim 0 of shape \(6,\)\)\)"
                           r", not divisible by the 8 slices of its resources \('x',\)") as e:
    f(jnp.ones(6))
  _check_type(e, ValueError)


def test_indivisible_size_on_2d_mesh_tuple(mesh42):
  f = xmap(ident, (["i", ...],), ["i", ...], axis_resources={"i": ("x", "y")}, mesh=mesh42)
  with _raises(ValueError, r"axis 'i' has size 12.*not divisible by the 8 slices") as e:
    f(jnp.ones(12))
  _check_type(e, ValueError)


def test_indivisible_by_serial_loop_length():
  f = xmap(ident, (["i", ...],), ["i", ...], axis_resources={"i": SerialLoop(4)})
  with _raises(ValueError, r"axis 'i' has size 6.*not divisible by the 4 slices of its resources "
                           r"\(SerialLoop\(4\),\)") as e:
    f(jnp.ones(6))
  _check_type(e, ValueError)


def test_indivisible_by_mesh_times_loop(mesh42):
  f = xmap(ident, (["i", ...],), ["i", ...], axis_resources={"i": ("x", SerialLoop(2))},
           mesh=mesh42)
  with _raises(ValueError, r"axis 'i' has size 12.*8 slices.*\('x', SerialLoop\(2\)\)") as e:
    f(jnp.ones(12))
  _check_type(e, ValueError)


def test_indivisible_by_named_serial_loop():
  with partition.serial_loop("l", 4):
    f = xmap(ident, (["i", ...],), ["i", ...], axis_resources={"i": "l"})
    with _raises(ValueError, r"axis 'i' has size 6.*4 slices.*\('?l'?,\)") as e:
      f(jnp.ones(6))
  _check_type(e, ValueError)


# ------------------------------------------------------------------------------- resources


def test_repeated_mesh_axis_in_one_axis(mesh42):
  f = xmap(ident, (["i", ...],), ["i", ...], axis_resources={"i": ("x", "x")}, mesh=mesh42)
  with _raises(ValueError, r"axis_resources\['i'\] = \('x', 'x'\) repeats a resource") as e:
    f(jnp.ones(16))
  _check_type(e, ValueError)


def test_repeated_named_loop_in_one_axis():
  with partition.serial_loop("l", 2):
    f = xmap(ident, (["i", ...],), ["i", ...], axis_resources={"i": ("l", "l")})
    with _raises(ValueError, r"axis_resources\['i'\].*repeats a resource") as e:
      f(jnp.ones(16))
  _check_type(e, ValueError)


def test_resources_for_undefined_axis(mesh8):
  f = xmap(ident, (["i", ...],), ["i", ...], axis_resources={"k": "x"}, mesh=mesh8)
  with _raises(ValueError, r"assigns resources to axes that this xmap does not define: \['k'\]"
                           r"(?s:.*)define them through in_axes or axis_sizes") as e:
    f(jnp.ones(8))
  _check_type(e, ValueError)


def test_resource_of_wrong_type():
  f = xmap(ident, (["i", ...],), ["i", ...], axis_resources={"i": 3})
  with _raises(ValueError, r"axis_resources\['i'\] contains 3, which is not a resource"
                           r"(?s:.*)SerialLoop\(n\)") as e:
    f(jnp.ones(8))
  _check_type(e, ValueError)


def test_serial_loop_length_must_be_positive():
  with _raises(ValueError, r"SerialLoop\(length\) takes a positive int, got 0") as e:
    SerialLoop(0)
  _check_type(e, ValueError)


@pytest.mark.parametrize("spec", [["k", ...], Sum("k"), Mean("i", axes=["k", ...])],
                         ids=["list", "Sum", "Mean-axes"])
def test_out_axes_names_not_defined(spec):
  with _raises(ValueError, r"out_axes names axes \['k'\] that are not defined"
                           r"(?s:.*)in_axes or axis_sizes") as e:
    xmap(ident, (["i", ...],), spec)(jnp.ones((8, 2)))
  _check_type(e, ValueError)


def test_missing_mesh_axis(mesh8):
  f = xmap(ident, (["i", ...],), ["i", ...], axis_resources={"i": "z"}, mesh=mesh8)
  with _raises(ValueError, r"mesh axes \['z'\] that the mesh does not have(?s:.*)x=8"
                           r"(?s:.*)mesh's axis names") as e:
    f(jnp.ones(8))
  _check_type(e, ValueError)


def test_mesh_axes_without_any_mesh():
  f = xmap(ident, (["i", ...],), ["i", ...], axis_resources={"i": "x"})
  with _raises(ValueError, r"uses mesh axes \['x'\], but there is no mesh(?s:.*)mesh=jax\.make_mesh"
                           r"(?s:.*)jax\.set_mesh") as e:
    f(jnp.ones(8))
  _check_type(e, ValueError)


def test_missing_mesh_axis_in_set_mesh_context(mesh8):
  f = xmap(ident, (["i", ...],), ["i", ...], axis_resources={"i": "y"})
  with jax.set_mesh(mesh8):
    with _raises(ValueError, r"mesh axes \['y'\] that the mesh does not have") as e:
      f(jnp.ones(8))
  _check_type(e, ValueError)


def test_loop_before_mesh_axis(mesh8):
  f = xmap(ident, (["i", ...],), ["i", ...], axis_resources={"i": (SerialLoop(2), "x")},
           mesh=mesh8)
  with _raises(ValueError, r"axis 'i' lists mesh axis 'x' after a serial loop"
                           r"(?s:.*)mesh axes first, then loops") as e:
    f(jnp.ones(16))
  _check_type(e, ValueError)


# ------------------------------------------------------------------------------- nesting


def test_inner_xmap_shadows_outer_axis():
  inner = xmap(ident, (["i", ...],), ["i", ...])
  outer = xmap(lambda a: inner(a), (["i", ...],), ["i", ...])
  with _raises(ValueError, r"axis names \['i'\] are already bound by an enclosing"
                           r"(?s:.*)Rename the inner axes") as e:
    outer(jnp.ones((4, 4)))
  _check_type(e, ValueError)


def test_inner_xmap_shadows_outer_axis_direct_nesting():
  # xmap(xmap(f, ...), ...): the inner XMapped object passed directly as the function.
  inner = xmap(ident, (["i", ...],), ["i", ...])
  outer = xmap(inner, (["i", ...],), ["i", ...])
  with _raises(ValueError, r"axis names \['i'\] are already bound by an enclosing"
                           r"(?s:.*)Rename the inner axes") as e:
    outer(jnp.ones((4, 4)))
  _check_type(e, ValueError)


def test_inner_xmap_shadows_outer_axis_under_jit():
  inner = xmap(ident, (["i", ...],), ["i", ...])
  outer = jax.jit(xmap(lambda a: inner(a), (["i", ...],), ["i", ...]))
  with _raises(ValueError, r"\['i'\] are already bound") as e:
    outer(jnp.ones((4, 4)))
  _check_type(e, ValueError)


def test_inner_xmap_shadows_vmap_axis_name():
  inner = xmap(ident, (["i", ...],), ["i", ...])
  with _raises(ValueError, r"\['i'\] are already bound") as e:
    jax.vmap(inner, axis_name="i")(jnp.ones((4, 4)))
  _check_type(e, ValueError)


def test_inner_xmap_shadows_loop_mapped_outer_axis():
  # The outer 'i' runs as a serial loop; the inner xmap reuses the name 'i'. This is still
  # name shadowing by nesting (an error in the original and in DESIGN.md §2).
  inner = xmap(ident, (["i", ...],), ["i", ...])
  outer = xmap(lambda a: inner(a), (["i", ...],), ["i", ...],
               axis_resources={"i": SerialLoop(2)})
  with _raises(ValueError, r"'i'.*(already bound|shadow)") as e:
    outer(jnp.ones((4, 4)))
  _check_type(e, ValueError)


# --------------------------------------------------------------------------- co-occurrence


def test_two_axes_on_one_mesh_axis_in_one_input(mesh42):
  f = xmap(ident, (["i", "j", ...],), ["i", ...], axis_resources={"i": "x", "j": "x"},
           mesh=mesh42)
  with _raises(ValueError, r"argument\[0\] carries axes 'i' and 'j', both on resource 'x'"
                           r"(?s:.*)different mesh axes") as e:
    f(jnp.ones((4, 4)))
  _check_type(e, ValueError)


def test_two_axes_on_one_mesh_axis_in_one_output(mesh42):
  f = xmap(lambda a, b: a + b, (["i", ...], ["j", ...]), ["i", "j", ...],
           axis_resources={"i": "x", "j": "x"}, mesh=mesh42)
  with _raises(ValueError, r"out_axes entry \['i', 'j', \.\.\.\] carries axes 'i' and 'j', both "
                           r"on resource 'x'") as e:
    f(jnp.ones(4), jnp.ones(4))
  _check_type(e, ValueError)


def test_two_axes_on_one_named_loop_in_one_input():
  with partition.serial_loop("l", 2):
    f = xmap(ident, (["i", "j"],), ["i", "j"], axis_resources={"i": "l", "j": "l"})
    with _raises(ValueError, r"argument\[0\] carries axes 'i' and 'j', both on resource 'l'") as e:
      f(jnp.ones((4, 4)))
  _check_type(e, ValueError)


# ------------------------------------------------------------------ outputs vs out_axes


@pytest.mark.parametrize("resources", [None, {"i": SerialLoop(2)}, {"i": "x"}],
                         ids=["vector", "loop", "mesh"])
def test_output_varies_along_unplaced_axis(resources, mesh8):
  f = xmap(ident, (["i", ...],), [...], axis_resources=resources, mesh=mesh8)
  with _raises(ValueError, r"output varies along axis 'i', but its out_axes \[\.\.\.\] does not "
                           r"place it(?s:.*)partition\.Sum\('i'\)") as e:
    f(jnp.arange(8.0))
  _check_type(e, ValueError)


def test_output_varies_names_output_keypath():
  f = xmap(lambda a: (a, a * 2), (["i", ...],), (["i", ...], [...]))
  with _raises(ValueError, r"output\[1\] varies along axis 'i'") as e:
    f(jnp.arange(8.0))
  _check_type(e, ValueError)


def test_output_varies_hint_keeps_the_axes_already_placed():
  f = xmap(lambda a, b: a[:, None] * b, (["batch", ...], ["classes", ...]), ["batch", ...])
  with _raises(ValueError, r"Add 'classes' to that output's out_axes \(e\.g\. \['batch', "
                           r"'classes', \.\.\.\]\)") as e:
    f(jnp.ones((4, 3)), jnp.ones((5, 3)))
  _check_type(e, ValueError)
  g = xmap(lambda a, b: a[:, None] * b, (["batch", ...], ["classes", ...]), {1: "batch"})
  with _raises(ValueError, r"\(e\.g\. \{1: 'batch', 0: 'classes'\}\)"):
    g(jnp.ones((4, 3)), jnp.ones((5, 3)))


def test_output_varies_error_does_not_leak_private_names():
  f = xmap(ident, (["i", ...],), [...], axis_resources={"i": SerialLoop(2)})
  with pytest.raises(ValueError) as e:
    f(jnp.arange(8.0))
  assert "__xmap" not in str(e.value)


# ------------------------------------------------------------ collectives over loop axes


LOOP_COLLECTIVES = {
    "psum": (lambda a: lax.psum(a, "i"), [...]),
    "pmean": (lambda a: lax.pmean(a, "i"), [...]),
    "axis_index": (lambda a: a + lax.axis_index("i"), ["i", ...]),
    "all_gather": (lambda a: lax.all_gather(a, "i"), [...]),
    "psum_size": (lambda a: a * lax.psum(1, "i"), ["i", ...]),
}


@pytest.mark.parametrize("name", sorted(LOOP_COLLECTIVES))
def test_collective_over_loop_axis(name):
  fun, out = LOOP_COLLECTIVES[name]
  f = xmap(fun, (["i", ...],), out, axis_resources={"i": SerialLoop(2)})
  with _raises(ValueError, r"collective.*refers to axis 'i', which is mapped to a serial loop"
                           r"(?s:.*)partition\.Sum\('i'\).*partition\.Mean\('i'\)") as e:
    f(jnp.arange(8.0))
  _check_type(e, ValueError)
  assert not isinstance(e.value, NameError)


def test_collective_over_mesh_plus_loop_axis(mesh8):
  f = xmap(lambda a: lax.psum(a, "i"), (["i", ...],), [...],
           axis_resources={"i": ("x", SerialLoop(2))}, mesh=mesh8)
  with _raises(ValueError, r"refers to axis 'i'.*serial loop \('x', SerialLoop\(2\)\)") as e:
    f(jnp.arange(16.0))
  _check_type(e, ValueError)


def test_collective_over_tuple_with_loop_axis():
  f = xmap(lambda a: lax.psum(a, ("i", "j")), (["i", "j"],), [...],
           axis_resources={"j": SerialLoop(2)})
  with _raises(ValueError, r"refers to axis 'j'.*serial loop") as e:
    f(jnp.ones((4, 4)))
  _check_type(e, ValueError)


def test_collective_over_named_loop_axis_under_jit():
  with partition.serial_loop("l", 2):
    f = jax.jit(xmap(lambda a: lax.psum(a, "i"), (["i", ...],), [...],
                     axis_resources={"i": "l"}))
    with _raises(ValueError, r"refers to axis 'i'.*serial loop") as e:
      f(jnp.arange(8.0))
  _check_type(e, ValueError)


def test_collective_over_an_unbound_name():
  f = xmap(lambda a: lax.psum(a, "batchh"), ["batch", ...], ["batch", ...])
  with _raises(ValueError, r"refers to axis 'batchh', which no enclosing xmap or vmap binds "
                           r"\(did you mean 'batch'\?\)\.(?s:.*)"
                           r"axes of this xmap: \['batch'\]") as e:
    f(jnp.ones(4))
  _check_type(e, ValueError)
  assert isinstance(e.value, partition.AxisNameError)


def test_nested_xmap_reusing_an_outer_mesh_axis(mesh42):
  def outer_body(x):
    inner = xmap(jnp.sin, ["j", ...], ["j", ...], axis_resources={"j": "x"})
    return inner(x)

  f = xmap(outer_body, ["i", ...], ["i", ...], axis_resources={"i": "x"}, mesh=mesh42)
  with _raises(ValueError, r"nested xmap reuses mesh axes(?s:.*)axis 'j' is placed on mesh "
                           r"axis 'x', which the enclosing xmap uses for its axis 'i'"
                           r"(?s:.*)other mesh axes") as e:
    f(jnp.ones((4, 8)))
  _check_type(e, ValueError)
  # on another mesh axis it is fine, and equals the positional program
  ok = xmap(lambda x: xmap(jnp.sin, ["j", ...], ["j", ...], axis_resources={"j": "y"})(x),
            ["i", ...], ["i", ...], axis_resources={"i": "x"}, mesh=mesh42)
  assert jnp.allclose(ok(jnp.ones((4, 8))), jnp.sin(jnp.ones((4, 8))))


def test_ppermute_over_several_axes():
  cycle = [(0, 1), (1, 2), (2, 3), (3, 0)]
  f = xmap(lambda a: lax.ppermute(a, ("i", "j"), perm=cycle), ["i", "j", ...], ["i", "j", ...])
  with _raises(ValueError, r"ppermute over several named axes at once(?s:.*)once per axis") as e:
    f(jnp.ones((2, 2)))
  _check_type(e, ValueError)


@pytest.mark.parametrize("nested", [False, True])
def test_ppermute_over_several_axes_whose_perm_fits_one_axis(nested):
  # A permutation as long as one axis passes JAX's vmap rule, which then permutes along
  # that axis alone (plain nested jax.vmap gives [[2, 3], [0, 1]]): silently wrong, so
  # xmap looks for it, also across nested xmaps and inside a scan.
  swap = [(0, 1), (1, 0)]

  def body(v):
    return lax.scan(lambda c, _: (lax.ppermute(c, ("i", "j"), perm=swap), None), v, None,
                    length=1)[0]
  if nested:
    f = xmap(lambda a: xmap(body, ["j", ...], ["j", ...])(a), ["i", ...], ["i", ...])
  else:
    f = xmap(body, ["i", "j", ...], ["i", "j", ...])
  with _raises(ValueError, r"ppermute over several named axes at once, axis_name=\('i', 'j'\)"
               r"(?s:.*)the result would be wrong(?s:.*)once per axis"):
    f(jnp.arange(4.0).reshape(2, 2))
  one_axis = xmap(lambda v: lax.ppermute(v, "i", perm=swap), ["i", "j", ...], ["i", "j", ...])
  np.testing.assert_array_equal(one_axis(jnp.arange(4.0).reshape(2, 2)), [[2, 3], [0, 1]])


def test_auto_mesh_argument_inside_explicit_set_mesh():
  auto = make_mesh((8,), ("x",), AxisType.Auto)
  explicit = make_mesh((8,), ("x",), AxisType.Explicit)
  f = xmap(jnp.sin, ["i", ...], ["i", ...], axis_resources={"i": "x"}, mesh=auto)
  with jax.set_mesh(explicit):
    with _raises(ValueError, r"mesh= and the mesh in context \(jax.set_mesh\) differ(?s:.*)"
                             r"x=8 Auto(?s:.*)x=8 Explicit(?s:.*)Pass the same mesh") as e:
      f(jnp.ones(8))
  _check_type(e, ValueError)


@pytest.mark.parametrize("donate, args, match", [
    ((3,), 1, r"donate_argnums \[3\] is out of range for a call with 1 positional"),
    ("0", 1, r"donate_argnums must be non-negative ints"),
    ((-1,), 1, r"donate_argnums must be non-negative ints"),
])
def test_donate_argnums(donate, args, match):
  with _raises(TypeError, match) as e:
    xmap(ident, ["i", ...], ["i", ...], donate_argnums=donate)(*[jnp.ones(4)] * args)
  _check_type(e, TypeError)


@pytest.mark.parametrize("sizes, match", [
    ({1: 4}, r"key 1 is not an axis name"),
    ({"i": 10**20}, r"does not fit JAX's int32 dims"),
    ("ab", r"axis_sizes must be a dict"),
])
def test_axis_sizes_types(sizes, match):
  with _raises(ValueError, match) as e:
    xmap(ident, ["i", ...], ["i", ...], axis_sizes=sizes)
  _check_type(e, ValueError)


@pytest.mark.parametrize("call, match", [
    (lambda f: f(a=jnp.ones(4)), r"positional arguments only(?s:.*)\['a'\]"),
    (lambda f: f("abc"), r"arguments must be arrays(?s:.*)argument\[0\] is str 'abc'"),
])
def test_bad_call_arguments(call, match):
  f = xmap(ident, ["i", ...], ["i", ...])
  with _raises(TypeError, match) as e:
    call(f)
  _check_type(e, TypeError)


def test_unbound_name_is_not_blamed_on_a_loop_axis():
  # A collective over a name that no map binds ('q') must not be reported as a collective
  # over the loop axis 'n' just because the letter n occurs in JAX's message text.
  f = xmap(lambda a: lax.psum(a, "q"), (["n", ...],), ["n", ...],
           axis_resources={"n": SerialLoop(2)})
  with pytest.raises(Exception) as e:
    f(jnp.ones(4))
  assert "q" in str(e.value), str(e.value)
  assert "serial loop" not in str(e.value), str(e.value)


def test_user_name_error_is_not_blamed_on_a_loop_axis():
  def fun(a):
    return a + undefined_variable  # noqa: F821

  f = xmap(fun, (["e", ...],), ["e", ...], axis_resources={"e": SerialLoop(2)})
  with pytest.raises(NameError, match="undefined_variable"):
    f(jnp.ones(4))


# --------------------------------------------------------------------- structure & misc


def test_in_axes_not_a_prefix_of_args():
  f = xmap(lambda a, b: a, (["i", ...],), ["i", ...])
  with _raises(TypeError, r"in_axes is not a pytree prefix of the arguments(?s:.*)one entry per "
                          r"argument") as e:
    f(jnp.ones(8), jnp.ones(8))
  _check_type(e, TypeError)
  # The arguments appear as dtype and shape, never as their values (JAX prints them all).
  with _raises(TypeError, r"details: Tuple arity mismatch: 2 != 1; tuple: \(f32\[8,100\], "
                          r"f32\[8,100\]\)\.") as e:
    f(jnp.full((8, 100), 7.0), jnp.full((8, 100), 7.0))
  assert "7." not in str(e.value)


def test_in_axes_dict_keys_mismatch():
  f = xmap(ident, ({"w": ["i", ...], "v": ["i", ...]},), ["i", ...])
  with _raises(TypeError, r"in_axes is not a pytree prefix(?s:.*)'v'") as e:
    f({"w": jnp.ones(8)})
  _check_type(e, TypeError)


def test_out_axes_not_a_prefix_of_outputs():
  f = xmap(lambda a: (a, a, a), (["i", ...],), (["i", ...], ["i", ...]))
  with _raises(TypeError, r"out_axes is not a pytree prefix of the outputs") as e:
    f(jnp.ones(8))
  _check_type(e, TypeError)


def test_out_axes_empty_tuple():
  with pytest.raises((ValueError, TypeError), match=r"out_axes=\(\).*must return something") as e:
    xmap(ident, (["i", ...],), ())
  assert isinstance(e.value, partition.PartitionError)


@pytest.mark.parametrize("red", [Sum("i"), Mean("i")], ids=["Sum", "Mean"])
def test_reduction_in_in_axes(red):
  # Like the original xmap, specs are checked when xmap is called, before any argument.
  with _raises(TypeError, r"in_axes\[0\] = (Sum|Mean)\('i'\).*only make sense in out_axes") as e:
    xmap(ident, (red,), ["i", ...])
  _check_type(e, TypeError)


def test_reduction_needs_names():
  with _raises(TypeError, r"Sum\(\) needs at least one axis name") as e:
    Sum()
  _check_type(e, TypeError)


def test_non_callable_fun():
  with _raises(TypeError, r"xmap expects a callable.*got 3") as e:
    xmap(3, (["i", ...],), ["i", ...])
  _check_type(e, TypeError)


def test_bad_mesh_argument():
  # raised by xmap(...) itself, naming it
  with _raises(ValueError, r"xmap\(ident\): mesh= must be a jax\.sharding\.Mesh(?s:.*)"
                           r"jax\.make_mesh") as e:
    xmap(ident, (["i", ...],), ["i", ...], mesh="x")
  _check_type(e, ValueError)


def test_error_names_the_user_function():
  def my_model(a):
    return a

  f = xmap(my_model, (["i", ...],), ["i", ...], axis_resources={"i": SerialLoop(4)})
  with pytest.raises(ValueError, match=re.escape("xmap(") + r".*my_model"):
    f(jnp.ones(6))


def test_abstract_mesh_without_a_context_mesh_is_a_mesh_error():
  """JAX would raise a RuntimeError ("requires a non-empty mesh in context")."""
  mesh = make_mesh((4, 2), ("data", "model"), AxisType.Explicit)
  f = xmap(jnp.sin, ["b", ...], ["b", ...], axis_resources={"b": "data"},
           mesh=mesh.abstract_mesh)
  with pytest.raises(partition.MeshError) as info:
    f(jnp.ones((8, 4)))
  message = str(info.value)
  assert "xmap(sin): mesh= is an AbstractMesh, which has no devices to run on." in message
  assert "mesh=: mesh(data=4 Explicit, model=2 Explicit)" in message
  assert "Pass a concrete mesh" in message
  with jax.set_mesh(mesh):  # a concrete mesh of the same shape in context: runs there
    out = f(jnp.ones((8, 4)))
  assert out.shape == (8, 4)


def test_wrong_typed_argument_names_the_argument_and_leaf():
  f = xmap(lambda a, b: a * b["k"], (["i", ...], {"k": ["i", ...]}), ["i", ...])
  with _raises(TypeError, r"(?s)arguments must be arrays.*1 leaf\(s\) are not:\n"
                          r"  \* argument\[0\] is str 'abc'\nConvert them") as e:
    f("abc", {"k": jnp.ones(4)})
  _check_type(e, TypeError)
  with _raises(TypeError, r"  \* argument\[1\]\['k'\] is str 'abc'"):
    f(jnp.ones(4), {"k": "abc"})
