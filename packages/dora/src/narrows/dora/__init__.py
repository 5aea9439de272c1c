"""narrows.dora — DoRA with a factored row norm and fused Triton compose kernels, drop-in for PEFT.

`use_narrows_dora(model)` (PEFT's DoRA layers) and `DoraLinear` (no PEFT, PEFT's adapter
format on disk through `add_dora`, `save_dora`, `load_dora`) run the same `dora_delta` and
give the same numbers; `fused_reason` says which composition path runs. Not supported:
conv and embedding layers.

why: docs/design.md#dora
"""

from narrows.core.versions import installed_version as _installed_version

from .adapter import DEFAULT_TARGETS, NarrowsDoraAdapter, add_dora, dora_layers, load_dora, save_dora
from .compose import FUSED_MIN_ELEMENTS, compose, fused_reason, magnitude_scale, norm_epsilon
from .layer import DoraLinear, dora_delta
from .norm import DEFAULT_CHUNK_BUDGET, assemble_norm, base_row_norm_sq, dense_row_norm, factored_row_norm
from .peft import use_narrows_dora

__version__ = _installed_version("narrows-dora")
__all__ = [
    "DEFAULT_CHUNK_BUDGET",
    "DEFAULT_TARGETS",
    "FUSED_MIN_ELEMENTS",
    "DoraLinear",
    "NarrowsDoraAdapter",
    "__version__",
    "add_dora",
    "assemble_norm",
    "base_row_norm_sq",
    "compose",
    "dense_row_norm",
    "dora_delta",
    "dora_layers",
    "factored_row_norm",
    "fused_reason",
    "load_dora",
    "magnitude_scale",
    "norm_epsilon",
    "save_dora",
    "use_narrows_dora",
]
