"""Old public names still work for one release, warn, and name their replacement (issue 33)."""

import typing

import pytest

import partition
import partition.internal
import partition.nnx


@pytest.mark.parametrize("old, new, target", [
    ("Annotated", "partition.WithAxes", lambda: partition.WithAxes),
    ("PipelinePlan", "partition.PipelineShape", lambda: partition.PipelineShape),
    ("did_you_mean", "partition.internal.did_you_mean", lambda: partition.internal.did_you_mean),
    ("format_message", "partition.internal.format_message",
     lambda: partition.internal.format_message),
    ("atomic_write", "partition.internal.atomic_write", lambda: partition.internal.atomic_write),
    ("axes_entry", "partition.internal.to_spec_entry", lambda: partition.internal.to_spec_entry),
    ("entry_axes", "partition.internal.entry_mesh_axes",
     lambda: partition.internal.entry_mesh_axes),
])
def test_old_top_level_names_warn_and_are_the_new_objects(old, new, target):
  with pytest.warns(DeprecationWarning) as caught:
    value = getattr(partition, old)
  assert str(caught[0].message) == (
      f"partition.{old} is deprecated and will be removed in the next release: use {new}.")
  assert caught[0].filename == __file__  # the warning points at the user's line
  assert value is target()


def test_nnx_annotate_is_declare_axes():
  with pytest.warns(DeprecationWarning, match=r"partition\.nnx\.annotate is deprecated.*"
                    r"use partition\.nnx\.declare_axes\.$"):
    assert partition.nnx.annotate is partition.nnx.declare_axes


def test_unknown_names_are_still_attribute_errors():
  with pytest.raises(AttributeError, match=r"module 'partition' has no attribute 'xmapp'"):
    partition.xmapp  # noqa: B018


def test_the_box_no_longer_shadows_typing_annotated():
  assert "Annotated" not in dir(partition) and "WithAxes" in dir(partition)
  assert partition.WithAxes is not typing.Annotated


def test_helpers_left_the_top_level():
  for name in ["did_you_mean", "format_message", "human_bytes", "atomic_write", "path_str"]:
    assert name not in vars(partition), name
    assert callable(getattr(partition.internal, name))


@pytest.mark.parametrize("old, new", [("HaikuInputError", "partition.AdapterInputError"),
                                      ("AxesTypeError", "partition.LogicalAxesError")])
def test_haiku_error_classes_are_the_shared_ones(old, new):
  import partition.haiku
  with pytest.warns(DeprecationWarning, match=rf"partition\.haiku\.{old} is deprecated.*use "
                    + new.replace(".", r"\.")):
    cls = getattr(partition.haiku, old)
  assert issubclass(cls, partition.PartitionError) and cls.__module__.startswith("partition._")
  import haiku as hk
  import jax
  import jax.numpy as jnp
  f = hk.transform(lambda x: hk.Linear(2)(x))
  bad = {"HaikuInputError": dict(param_axes=42), "AxesTypeError": dict(param_axes=[("w", "embed")])}
  with pytest.raises(cls, match=r"partition\.haiku\.eval_axes: param_axes"):  # what it raises
    partition.haiku.eval_axes(f, jax.random.key(0), jnp.ones((1, 2)), **bad[old])
