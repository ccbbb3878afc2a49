"""Section 4: rules resolution for a 1,000-parameter tree vs flax linen's resolver.

The tree is a 125-layer transformer's parameters (8 per layer: attention query / key /
value / out kernels, the gated MLP's three kernels and a norm scale), with the logical axes
``layers`` declares, resolved through ``recipes/presets/fsdp_tp.yaml`` on a (2, 2, 2) mesh.

* ``AxisRules.tree_shardings(axes, mesh)`` vs ``flax.linen.logical_to_mesh_sharding(specs,
  mesh, rules)``: the same job (names -> ``NamedSharding``), checked equal leaf by leaf.
* ``AxisRules.tree_shardings(axes, mesh, shapes=...)``: shape-aware resolution (a candidate
  that does not divide its dim is skipped), which flax does not do: informational.
"""

from __future__ import annotations

from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import partition
from benchmarks.common import STEADY_TARGET, Check, Row, Section, auto_mesh, interleaved, log

NAME = "rules_resolution"
TITLE = "4. rules resolution, 1,000-parameter tree vs flax logical_to_mesh_sharding"
PRESET = Path(__file__).resolve().parents[1] / "recipes" / "presets" / "fsdp_tp.yaml"
SLOW_NOTE = (
    "AxisRules.resolve builds a full Resolution (a reason string per dim and skipped rule) "
    "and re-validates the axes for every leaf, with no memo: the tree has 8 distinct axes "
    "tuples; memoising resolve on (rules, axes, shape, mesh) measured 0.95x flax "
    "(requested in partition/_rules/table.py); absolute cost ~40 us/param, once per init")
LAYER = {  # name: (logical axes, shape) of one block's parameters
    "query": (("embed", "heads", "head_dim"), (64, 4, 16)),
    "key": (("embed", "kv_heads", "head_dim"), (64, 2, 16)),
    "value": (("embed", "kv_heads", "head_dim"), (64, 2, 16)),
    "out": (("heads", "head_dim", "embed"), (4, 16, 64)),
    "wi_gate": (("embed", "mlp"), (64, 256)),
    "wi_up": (("embed", "mlp"), (64, 256)),
    "wo": (("mlp", "embed"), (256, 64)),
    "norm": (("embed",), (64,)),
}


def param_tree(layers: int) -> tuple[dict, dict]:
  """``(axes tree, ShapeDtypeStruct tree)`` of ``layers`` blocks."""
  axes = {f"block_{i}": {k: a for k, (a, _) in LAYER.items()} for i in range(layers)}
  shapes = {f"block_{i}": {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, (_, s) in
                           LAYER.items()} for i in range(layers)}
  return axes, shapes


def flax_rules(rules: partition.AxisRules) -> tuple:
  """The table as flax's ``LogicalRules`` (no serial loops in this preset)."""
  return tuple((n, None if not v else v[0] if len(v) == 1 else tuple(v)) for n, v in rules.pairs)


def run(quick: bool) -> Section:
  section = Section(NAME, TITLE)
  layers = 125  # 1,000 parameters, in quick mode too: it is cheap
  rules = partition.AxisRules.from_file(PRESET)
  mesh = auto_mesh((2, 2, 2), ("data", "fsdp", "tensor"))
  axes, shapes = param_tree(layers)
  logical_specs = jax.tree.map(lambda a: P(*a), axes, is_leaf=lambda x: isinstance(x, tuple))
  table = flax_rules(rules)
  n = len(jax.tree.leaves(shapes))
  log(f"  {n} parameters, rules {PRESET.name}, mesh (2,2,2)")

  ours = lambda: rules.tree_shardings(axes, mesh)
  theirs = lambda: nn.logical_to_mesh_sharding(logical_specs, mesh, table)
  with_shapes = lambda: rules.tree_shardings(axes, mesh, shapes=shapes)
  to_specs = lambda t: [s.spec for s in jax.tree.leaves(t)]
  same = to_specs(ours()) == to_specs(theirs()) == to_specs(with_shapes())
  section.checks.append(Check(NAME, f"{n} params: specs equal flax's",
                              0.0 if same else float("inf"), 0.0, 0.0, same))
  t_ours, t_flax, t_shapes = interleaved([ours, theirs, with_shapes], 7 if quick else 31)
  workload = f"{n} params"
  section.rows.append(Row(NAME, workload, "tree_shardings vs logical_to_mesh_sharding", t_ours,
                          t_flax, "s", STEADY_TARGET,
                          SLOW_NOTE if t_ours / t_flax > STEADY_TARGET else "",
                          baseline_label="flax linen"))
  section.rows.append(Row(NAME, workload, "shape-aware tree_shardings vs flax", t_shapes,
                          t_flax, "s", None, baseline_label="flax linen",
                          note="informational: also checks divisibility (flax cannot)"))
  return section

