"""partition.PathRules: regex tables over parameter paths, reports and errors."""

import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType
from mesh_testlib import make_mesh

import partition

TABLE = partition.PathRules([
    (r"/kernel$", ("embed", "mlp")),
    (r"/bias$", ("mlp",)),
    (r"/w$", ("embed", "mlp")),
    (r"/b$", ("mlp",)),
    (r"never_matches", None),
])


def test_linen_dict_paths_and_report():
  variables = jax.eval_shape(nn.Dense(8).init, jax.random.key(0), jnp.ones((2, 4)))
  report = TABLE.match(variables)
  assert report.axes == {"params": {"kernel": ("embed", "mlp"), "bias": ("mlp",)}}
  assert report.matched == {"params/kernel": 0, "params/bias": 1}
  assert report.unmatched == ()
  assert report.unused == (r"/w$", r"/b$", "never_matches")
  assert "unused pattern: 'never_matches'" in str(report)


def test_haiku_params_paths():
  f = hk.transform(lambda x: hk.nets.MLP([8, 4])(x))
  params = jax.eval_shape(f.init, jax.random.key(0), jnp.ones((2, 4)))
  axes = TABLE.axes(params)
  assert axes["mlp/~/linear_0"] == {"w": ("embed", "mlp"), "b": ("mlp",)}
  assert TABLE.match(params).matched["mlp/~/linear_1/w"] == 2


def test_nnx_state_paths_and_annotate():
  with nnx.use_eager_sharding(False):
    model = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.Linear(8, 4,
                                                                          rngs=nnx.Rngs(1)))
  state = nnx.state(model)
  axes = TABLE.axes(state)
  assert axes["layers"][0]["kernel"] == ("embed", "mlp")
  annotated = TABLE.annotate(state)
  assert annotated["layers"][1]["kernel"].get_metadata()["out_sharding"] == ("embed", "mlp")
  assert partition.logical_axes(annotated) == axes


def test_declared_axes_win_and_unmatched_reported():
  tree = {"a": {"kernel": partition.WithAxes(jnp.ones((2, 3)), ("x", "y"))},
          "norm": {"scale": jnp.ones(3)}}
  report = TABLE.match(tree)
  assert report.axes == {"a": {"kernel": ("x", "y")}, "norm": {"scale": None}}
  assert report.declared == ("a/kernel",)
  assert report.unmatched == ("norm/scale",)


def test_annotate_boxes_plain_leaves():
  tree = {"dense": {"kernel": np.ones((2, 3)), "other": np.ones(2)}}
  boxed = TABLE.annotate(tree)
  assert isinstance(boxed["dense"]["kernel"], partition.WithAxes)
  assert boxed["dense"]["kernel"].names == ("embed", "mlp")
  assert not isinstance(boxed["dense"]["other"], partition.WithAxes)


def test_first_match_wins_and_none_replicates():
  table = partition.PathRules([(r"special/kernel$", None), (r"kernel$", ("a", "b"))])
  tree = {"special": {"kernel": jnp.ones((2, 2))}, "plain": {"kernel": jnp.ones((2, 2))}}
  report = table.match(tree)
  assert report.axes == {"special": {"kernel": None}, "plain": {"kernel": ("a", "b")}}
  assert report.unmatched == () and report.unused == ()


def test_too_many_names_error_names_path_pattern_and_fix():
  table = partition.PathRules([(r"kernel", ("embed", "heads", "kv"))])
  tree = {"attn": {"kernel": jnp.ones((3, 2, 4))}, "dense": {"kernel": jnp.ones((2, 4))}}
  with pytest.raises(ValueError, match=r"anchor with '\$'") as e:
    table.axes(tree)
  msg = str(e.value)
  assert "dense/kernel: pattern #0 'kernel' gives ('embed', 'heads', 'kv') (3 dims) but the " \
         "parameter has shape (2, 4)" in msg
  assert "attn/kernel" not in msg
  assert isinstance(e.value, partition.PathRulesError)


def test_short_pattern_axes_are_a_prefix():
  table = partition.PathRules([(r"kernel$", ("embed", "mlp"))])
  tree = {"conv": {"kernel": jnp.ones((3, 3, 2, 4))}}
  assert table.axes(tree) == {"conv": {"kernel": ("embed", "mlp", None, None)}}


def test_override_replaces_declared_axes_only_when_asked():
  tree = {"a": {"kernel": partition.WithAxes(jnp.ones((2, 3)), ("x", "y"))},
          "b": {"kernel": jnp.ones((2, 3))}}
  pairs = [(r"kernel$", ("embed", "mlp"))]
  assert partition.PathRules(pairs).axes(tree)["a"]["kernel"] == ("x", "y")
  table = partition.PathRules(pairs, override=True)
  report = table.match(tree)
  assert report.axes == {"a": {"kernel": ("embed", "mlp")}, "b": {"kernel": ("embed", "mlp")}}
  assert report.overridden == ("a/kernel",) and report.declared == ()
  assert "1 overridden" in str(report)
  assert table.annotate(tree)["a"]["kernel"].names == ("embed", "mlp")
  assert repr(table) == "PathRules([('kernel$', ('embed', 'mlp'))], override=True)"
  assert (table + [(r"bias$", None)]).override
  with pytest.raises(TypeError, match="takes True or False"):
    partition.PathRules(pairs, override="yes")


def test_str_axes_is_an_error_not_letters():
  with pytest.raises(TypeError, match=r"write \('em',\) for one dim") as e:
    partition.PathRules([(r"kernel$", "em")])
  assert isinstance(e.value, partition.PathRulesError)


def test_strict_raises_on_unmatched_and_unused():
  table = partition.PathRules([(r"/w$", ("a", "b")), (r"typo$", None)])
  tree = {"l": {"w": jnp.ones((2, 2)), "b": jnp.ones(2)}}
  assert table.axes(tree) == {"l": {"w": ("a", "b"), "b": None}}
  with pytest.raises(ValueError, match="use None as axes to replicate it") as e:
    table.axes(tree, strict=True)
  assert "no pattern matches l/b" in str(e.value)
  assert "pattern 'typo$' matches no parameter" in str(e.value)


def test_construction_errors_collected():
  with pytest.raises(TypeError, match=r"\(r'\.\*/kernel\$', \('embed', 'mlp'\)\)") as e:
    partition.PathRules([("(", ("a",)), ("ok", "embed"), ("x",)])
  msg = str(e.value)
  assert "entry #0 '(': invalid regex" in msg
  assert "entry #1 'ok': logical axes 'embed' is a str; write ('embed',)" in msg
  assert "entry #2 ('x',): expected a (regex, logical_axes) pair" in msg
  with pytest.raises(TypeError, match="list of"):
    partition.PathRules("kernel")


def test_mapping_and_repr_and_concat():
  table = partition.PathRules({"k$": ["a", None]}) + [("b$", None)]
  assert table.pairs == (("k$", ("a", None)), ("b$", None))
  assert repr(table) == "PathRules([('k$', ('a', None)), ('b$', None)])"
  assert len(table) == 2


def test_a_shadowed_pattern_says_it_is_shadowed_and_by_which_pattern():
  # '/b$' matches linear/b, but '.*' (earlier) claims every parameter first: it is not a
  # pattern that matches nothing, and the message says which pattern to move it before.
  table = partition.PathRules([(r".*", None), (r"/b$", ("mlp",)), (r"^typo$", None)])
  params = {"linear": {"w": jnp.zeros((4, 8)), "b": jnp.zeros(8)}}
  report = table.match(params)
  assert report.unused == ("/b$", "^typo$")
  assert report.shadowed == {"/b$": (".*", "linear/b")}
  assert "unused pattern: '/b$' (shadowed by '.*')" in str(report)
  with pytest.raises(partition.PathRulesError) as e:
    table.axes(params, strict=True)
  message = str(e.value)
  assert ("pattern '/b$' is shadowed: every parameter it matches is claimed first by the "
          "earlier pattern '.*' (e.g. linear/b); move it before that one") in message
  assert "pattern '/b$' matches no parameter" not in message
  assert "pattern '^typo$' matches no parameter" in message


def test_init_sharded_reports_a_shadowed_pattern_not_as_matching_nothing():
  import partition.flax

  class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(4)(x)

  mesh = make_mesh((8,), ("data",), AxisType.Explicit)
  with pytest.raises(partition.PlacementError) as e:
    partition.flax.init_sharded(Mlp(), jax.random.key(0), jnp.ones((2, 3)),
                                rules=[("mlp", "data")], mesh=mesh,
                                param_axes=[(r"Dense_0/", None), (r"/bias$", ("mlp",))])
  message = str(e.value)
  assert ("path pattern '/bias$' is shadowed: every parameter it matches is claimed first "
          "by the earlier pattern 'Dense_0/' (e.g. params/Dense_0/bias)") in message
  assert "put a shadowed pattern before the one that claims its parameters" in message
