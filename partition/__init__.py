"""named-partition: shard JAX programs by name."""

# --- xmap: named axes, placed on mesh axes and serial loops ---
from partition._resources import SerialLoop as SerialLoop
from partition._resources import serial_loop as serial_loop
from partition._errors import AxisNameError as AxisNameError
from partition._errors import AxisSizeError as AxisSizeError
from partition._errors import LoopCollectiveError as LoopCollectiveError
from partition._errors import MeshError as MeshError
from partition._errors import NegativeDimError as NegativeDimError
from partition._errors import OutputAxesError as OutputAxesError
from partition._errors import PartitionError as PartitionError
from partition._errors import ResourceError as ResourceError
from partition._errors import SpecError as SpecError
from partition._specs import Mean as Mean
from partition._specs import Sum as Sum
from partition._specs import Logical as Logical
from partition._xmap import xmap as xmap

# --- training through xmap ---
from partition._grad import GradSpecError as GradSpecError
from partition._grad import value_and_grad as value_and_grad

# --- logical axis rules ---
from partition._config import RulesConfigError as RulesConfigError
from partition._config import RulesError as RulesError
from partition._config import RulesTypeError as RulesTypeError
from partition._config import RulesConfigTypeError as RulesConfigTypeError
from partition._io import FileError as FileError
from partition._constrain import NoRulesError as NoRulesError
from partition._constrain import constrain as constrain
from partition._context import axis_rules as axis_rules
from partition._context import current_rules as current_rules
from partition._context import current_rules_mesh as current_rules_mesh
from partition._explain import ExplainReport as ExplainReport
from partition._explain import explain as explain
from partition._resolve import Resolution as Resolution
from partition._resolve import ResolutionError as ResolutionError
from partition._rules import AxisRules as AxisRules

# --- parameters: declared axes, path tables, placement ---
from partition._logical_axes import Annotated as Annotated
from partition._logical_axes import LogicalAxesError as LogicalAxesError
from partition._logical_axes import logical_axes as logical_axes
from partition._logical_axes import unbox as unbox
from partition._path_rules import PathMatch as PathMatch
from partition._path_rules import PathRules as PathRules
from partition._path_rules import PathRulesError as PathRulesError
from partition._audit import PlacementError as PlacementError
from partition._audit import ReplicatedWarning as ReplicatedWarning
from partition._optim import OptimizerStateError as OptimizerStateError
from partition._optim import optimizer_axes as optimizer_axes
from partition._optim import optimizer_init as optimizer_init
from partition._hlo import collective_stats as collective_stats
from partition._warnings import PartitionWarning as PartitionWarning

# --- pipeline parallelism ---
from partition._pipeline import LayerCountError as LayerCountError
from partition._pipeline import MicrobatchError as MicrobatchError
from partition._pipeline import PipelineError as PipelineError
from partition._pipeline import PipelinePlan as PipelinePlan
from partition._pipeline import StageAxisError as StageAxisError
from partition._pipeline import pipeline as pipeline
from partition._pipeline import pipeline_bubble as pipeline_bubble
from partition._pipeline import stage_axis as stage_axis

# --- helpers for packages built on partition (layers/, recipes/): one message layout ---
from partition._errors import did_you_mean as did_you_mean
from partition._errors import format_message as format_message
from partition._explain import human_bytes as human_bytes
from partition._io import atomic_write as atomic_write
from partition._logical_axes import path_str as path_str
from partition._mesh import axes_entry as axes_entry
from partition._mesh import entry_axes as entry_axes

# --- wiring: partition.axis_rules also sets flax's nn.logical_axis_rules (when flax is used) ---
from partition._flax_hook import FLAX_RULES_HOOK as _FLAX_RULES_HOOK
from partition._scope import register_rules_hook as _register_rules_hook

_register_rules_hook(_FLAX_RULES_HOOK)
