"""Layer library: Flax linen, Flax NNX and Haiku layers that declare logical axes.

Framework modules are imported explicitly: ``import layers.linen``, ``layers.nnx``,
``layers.haiku``.
"""

from layers._attention import AttentionError as AttentionError
from layers._attention import Mask as Mask
from layers._attention import blockwise_attention as blockwise_attention
from layers._attention import dot_product_attention as dot_product_attention
from layers._attention import choice_for as attention_choice
from layers._config import ConfigError as ConfigError
from layers._config import RopeScaling as RopeScaling
from layers._config import TransformerConfig as TransformerConfig
from layers._canonical import CanonicalError as CanonicalError
from layers._decode import Generation as Generation
from layers._decode import GenerateError as GenerateError
from layers._decode import KVCache as KVCache
from layers._decode import cache_bytes_per_device as cache_bytes_per_device
from layers._decode import init_cache as init_cache
from layers._decode import Sampling as Sampling
from layers._loss import chunked_cross_entropy as chunked_cross_entropy
from layers._loss import cross_entropy as cross_entropy
from layers._moe import capacity as expert_capacity
from layers._params import LayerArgumentError as LayerArgumentError
from layers._params import gathered_in_compute_dtype as gathered_in_compute_dtype
from layers._canonical import from_canonical as from_canonical
from layers._canonical import to_canonical as to_canonical
from layers.hf import HFError as HFError
from layers.hf import from_hf as from_hf
from layers.hf import to_hf as to_hf
