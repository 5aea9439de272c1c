"""narrows.core — the hallway every narrows package talks through.

- anatomy: where a causal LM keeps its layers, embedding, final norm and head
- adapter protocol: which module is an adapter layer, what trains, what it wraps
- frozen slots and slabs: every frozen tensor (NF4 quantisation state included) as a
  re-pointable reference, and the packed layout that moves a layer in one copy
- NF4 quantisation through bitsandbytes (optional extra ``narrows-core[nf4]``)
- the LM-head hook: the head's weight served in vocabulary chunks, resident or streamed
- memory measurement and byte sizes
"""

from importlib.metadata import version as _version

# adapter protocol
from .adapters import (
    AdapterType,
    AdapterView,
    PeftLoraAdapter,
    adapter_type_of,
    adapter_view,
    adapter_views,
    register_adapter_type,
    registered_adapter_types,
)

# anatomy
from .anatomy import (
    Anatomy,
    ArchitectureSpec,
    anatomy_of,
    register_architecture,
    supported_architectures,
    unwrap_model,
)

# errors
from .errors import MissingDependencyError, NarrowsError, SlotMismatchError, UnsupportedArchitectureError

# LM-head hook
from .head import (
    DEFAULT_HEAD_ROWS,
    HeadSource,
    ResidentHead,
    attach_head_source,
    chunked_logits,
    head_source,
    loss_working_set,
    set_loss_working_set,
)

# memory
from .memory import MemoryPeaks, format_bytes, measure_peaks, parse_bytes, read_peaks, reset_peaks

# NF4
from .nf4 import NF4Rows, disable_cpu_repacking, is_nf4_linear, nf4_rows, quantize_nf4

# frozen storage
from .slab import SLAB_ALIGNMENT, SlabEntry, SlabLayout
from .slots import FrozenSlot, assign, copies, frozen_slots, pointed_at, snapshot, trainable_parameters

__version__ = _version("narrows-core")

__all__ = [
    "DEFAULT_HEAD_ROWS",
    "SLAB_ALIGNMENT",
    "AdapterType",
    "AdapterView",
    "Anatomy",
    "ArchitectureSpec",
    "FrozenSlot",
    "HeadSource",
    "MemoryPeaks",
    "MissingDependencyError",
    "NF4Rows",
    "NarrowsError",
    "PeftLoraAdapter",
    "ResidentHead",
    "SlabEntry",
    "SlabLayout",
    "SlotMismatchError",
    "UnsupportedArchitectureError",
    "__version__",
    "adapter_type_of",
    "adapter_view",
    "adapter_views",
    "anatomy_of",
    "assign",
    "attach_head_source",
    "chunked_logits",
    "copies",
    "disable_cpu_repacking",
    "format_bytes",
    "frozen_slots",
    "head_source",
    "is_nf4_linear",
    "loss_working_set",
    "measure_peaks",
    "nf4_rows",
    "parse_bytes",
    "pointed_at",
    "quantize_nf4",
    "read_peaks",
    "register_adapter_type",
    "register_architecture",
    "registered_adapter_types",
    "reset_peaks",
    "set_loss_working_set",
    "snapshot",
    "supported_architectures",
    "trainable_parameters",
    "unwrap_model",
]
