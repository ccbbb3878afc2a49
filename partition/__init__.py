"""named-partition: shard JAX programs by name."""

# --- xmap: named axes, placed on mesh axes and serial loops ---
from partition._base.resources import SerialLoop as SerialLoop
from partition._base.resources import serial_loop as serial_loop
from partition._base.errors import AxisNameError as AxisNameError
from partition._base.errors import AxisSizeError as AxisSizeError
from partition._base.errors import LoopCollectiveError as LoopCollectiveError
from partition._base.errors import MeshError as MeshError
from partition._base.errors import NegativeDimError as NegativeDimError
from partition._base.errors import OutputAxesError as OutputAxesError
from partition._base.errors import PartitionError as PartitionError
from partition._base.errors import ResourceError as ResourceError
from partition._base.errors import SpecError as SpecError
from partition._xmap.specs import Mean as Mean
from partition._xmap.specs import Sum as Sum
from partition._xmap.specs import Logical as Logical
from partition._xmap.api import xmap as xmap

# --- training through xmap ---
from partition._training.grad import GradSpecError as GradSpecError
from partition._training.grad import value_and_grad as value_and_grad

# --- logical axis rules ---
from partition._rules.errors import RulesConfigError as RulesConfigError
from partition._rules.errors import RulesError as RulesError
from partition._rules.errors import RulesTypeError as RulesTypeError
from partition._rules.errors import RulesConfigTypeError as RulesConfigTypeError
from partition._base.io import FileError as FileError
from partition._rules.constrain import NoRulesError as NoRulesError
from partition._rules.constrain import constrain as constrain
from partition._rules.context import axis_rules as axis_rules
from partition._rules.context import current_rules as current_rules
from partition._rules.context import current_rules_mesh as current_rules_mesh
from partition._rules.explain import ExplainReport as ExplainReport
from partition._rules.explain import explain as explain
from partition._rules.resolve import Resolution as Resolution
from partition._rules.resolve import ResolutionError as ResolutionError
from partition._rules.table import AxisRules as AxisRules

# --- parameters: declared axes, path tables, placement ---
from partition._base.logical_axes import WithAxes as WithAxes
from partition._base.logical_axes import LogicalAxesError as LogicalAxesError
from partition._base.logical_axes import logical_axes as logical_axes
from partition._base.logical_axes import unbox as unbox
from partition._params.path_rules import PathMatch as PathMatch
from partition._params.path_rules import PathRules as PathRules
from partition._params.path_rules import PathRulesError as PathRulesError
from partition._base.errors import PlacementError as PlacementError
from partition._params.audit import ReplicatedWarning as ReplicatedWarning
from partition._params.adapt import AdapterInputError as AdapterInputError
from partition._params.optim import OptimizerStateError as OptimizerStateError
from partition._params.optim import optimizer_axes as optimizer_axes
from partition._params.optim import optimizer_init as optimizer_init
from partition._base.hlo import collective_stats as collective_stats
from partition._rules.fallbacks import PartitionWarning as PartitionWarning

# --- pipeline parallelism ---
from partition._training.pipeline import LayerCountError as LayerCountError
from partition._training.pipeline import MicrobatchError as MicrobatchError
from partition._training.pipeline import PipelineError as PipelineError
from partition._training.pipeline import PipelineShape as PipelineShape
from partition._training.pipeline import StageAxisError as StageAxisError
from partition._training.pipeline import pipeline as pipeline
from partition._training.pipeline import pipeline_bubble as pipeline_bubble
from partition._training.pipeline import pipeline_iterations as pipeline_iterations
from partition._training.pipeline import stage_axis as stage_axis

# --- old names, kept for one release (a DeprecationWarning names the new one) ---
from partition._renamed import module_getattr as __getattr__

# --- wiring: partition.axis_rules also sets flax's nn.logical_axis_rules (when flax is used) ---
from partition._rules.flax_hook import FLAX_RULES_HOOK as _FLAX_RULES_HOOK
from partition._rules.scope import register_rules_hook as _register_rules_hook

_register_rules_hook(_FLAX_RULES_HOOK)

