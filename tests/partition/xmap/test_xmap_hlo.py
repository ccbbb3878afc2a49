"""What xmap compiles to: collectives in the optimised HLO (``lower(...).compile().as_text()``).

* a ``psum`` over a mesh-sharded axis is exactly one all-reduce;
* ``Sum`` over ``('x', SerialLoop(4))`` is a while loop that accumulates locally (no
  collective in its body) followed by exactly one all-reduce.

Inputs are given both as abstract ``ShapeDtypeStruct``s / uncommitted arrays and as arrays
already committed to the planned sharding, on Auto and Explicit meshes.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from mesh_testlib import make_mesh

from partition import Mean, SerialLoop, Sum, xmap

AXIS_TYPES = [AxisType.Auto, AxisType.Explicit]
COLLECTIVE = re.compile(
    r"\s(all-reduce|all-reduce-start|all-gather|all-gather-start|reduce-scatter|all-to-all|"
    r"collective-permute|collective-permute-start)\(")
ALL_REDUCE = re.compile(r"\s(all-reduce|all-reduce-start)\(")
CALLED = re.compile(
    r"\b(?:calls|to_apply|body|condition|branch_computations)=\{?(%[\w.\-]+(?:,\s*%[\w.\-]+)*)")


def computations(hlo: str) -> dict[str, str]:
  """``{computation name: its text}`` of an HLO module dump; the entry is also 'ENTRY'."""
  comps, name, lines = {}, None, []
  for line in hlo.splitlines():
    m = re.match(r"^(ENTRY\s+)?(%[\w.\-]+)\s*\(", line)
    if m and line.rstrip().endswith("{"):
      name, lines = m.group(2), []
      if m.group(1):
        comps["ENTRY"] = name
      continue
    if name is not None and line.startswith("}"):
      comps[name] = "\n".join(lines)
      name = None
      continue
    if name is not None:
      lines.append(line)
  return comps


def reachable(comps: dict[str, str], root: str) -> set[str]:
  seen, todo = set(), [root]
  while todo:
    c = todo.pop()
    if c in seen or c not in comps:
      continue
    seen.add(c)
    for group in CALLED.findall(comps[c]):
      todo.extend(n.strip() for n in group.split(","))
  return seen


def while_bodies(comps: dict[str, str]) -> list[str]:
  return [m.group(1) for text in comps.values()
          for m in re.finditer(r"while\(.*?body=(%[\w.\-]+)", text)]


def _count(pattern, comps, names) -> int:
  return sum(len(pattern.findall(" " + comps[n])) for n in names)


def _input(shape, mesh, spec, how):
  x = np.random.default_rng(0).normal(size=shape).astype(np.float32)
  if how == "abstract":
    return jax.ShapeDtypeStruct(shape, jnp.float32)
  if how == "uncommitted":
    return jnp.asarray(x)
  return jax.device_put(x, NamedSharding(mesh, spec))  # committed to the planned sharding


INPUTS = ["abstract", "uncommitted", "committed"]
PSUM_MESHES = {
    "1d": ((8,), ("x",), "x"),
    "2d_tuple": ((4, 2), ("x", "y"), ("x", "y")),
}


@pytest.mark.parametrize("how", INPUTS)
@pytest.mark.parametrize("mesh_kind", list(PSUM_MESHES))
@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=lambda t: t.name)
def test_psum_over_sharded_axis_is_one_all_reduce(axis_type, mesh_kind, how):
  shape, names, resources = PSUM_MESHES[mesh_kind]
  mesh = make_mesh(shape, names, axis_type)
  f = xmap(lambda x: x / lax.psum(jnp.sum(x * x), "b"), ["b", ...], ["b", ...],
           axis_resources={"b": resources}, mesh=mesh)
  x = _input((32, 16), mesh, P(resources), how)
  with jax.set_mesh(mesh):
    hlo = f.lower(x).compile().as_text()
  comps = computations(hlo)
  everything = reachable(comps, comps["ENTRY"])
  assert _count(ALL_REDUCE, comps, everything) == 1, hlo
  assert _count(COLLECTIVE, comps, everything) == 1, hlo


@pytest.mark.parametrize("out_axes", [Sum("b"), Mean("b")], ids=["Sum", "Mean"])
@pytest.mark.parametrize("how", INPUTS)
@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=lambda t: t.name)
def test_sum_over_mesh_and_loop_accumulates_locally(axis_type, how, out_axes):
  mesh = make_mesh((8,), ("x",), axis_type)
  f = xmap(lambda w, x: jnp.sin(w * x), ([...], ["b", ...]), out_axes,
           axis_resources={"b": ("x", SerialLoop(4))}, mesh=mesh)
  w = _input((16,), mesh, P(), how)
  x = _input((64, 16), mesh, P("x"), how)
  with jax.set_mesh(mesh):
    hlo = f.lower(w, x).compile().as_text()
  comps = computations(hlo)
  everything = reachable(comps, comps["ENTRY"])
  bodies = while_bodies(comps)
  assert len(bodies) == 1, f"expected one while loop, found {bodies}\n{hlo}"
  in_loop = reachable(comps, bodies[0])
  assert _count(COLLECTIVE, comps, in_loop) == 0, \
      f"collective inside the loop body {bodies[0]}:\n{hlo}"
  assert _count(ALL_REDUCE, comps, everything - in_loop) == 1, hlo
  assert _count(COLLECTIVE, comps, everything) == 1, hlo


def test_hlo_parser_sees_while_body_collectives():
  """The parser must find a collective placed inside a loop body (guards the test above)."""
  mesh = make_mesh((8,), ("x",), AxisType.Auto)

  def f(x):
    def step(c, xi):
      return jnp.sin(c * lax.psum(xi, "b")), None  # non-linear: XLA cannot hoist it
    return lax.scan(step, jnp.zeros(x.shape[1:]), x)[0]

  g = jax.jit(jax.vmap(f, in_axes=1, out_axes=0, axis_name="b", spmd_axis_name="x"),
              in_shardings=NamedSharding(mesh, P(None, "x")))
  with jax.set_mesh(mesh):
    hlo = g.lower(jax.ShapeDtypeStruct((4, 8, 16), jnp.float32)).compile().as_text()
  comps = computations(hlo)
  bodies = while_bodies(comps)
  assert bodies
  assert sum(_count(COLLECTIVE, comps, reachable(comps, b)) for b in bodies) >= 1, hlo
