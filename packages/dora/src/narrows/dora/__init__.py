"""narrows.dora — DoRA with a factored row norm and fused Triton compose kernels, drop-in for PEFT.

The factored row norm (`factored_row_norm`, `base_row_norm_sq`) with its fp64 dense
reference; the stable composition `compose`, a `torch.library` custom op with Triton
forward/backward kernels on CUDA above a measured crossover (the fused backward also
reduces the magnitude gradient, deterministically) and the eager formula everywhere else
(`fused_reason` says which runs; training on CUDA saves one
activation per module, ``inner``, instead of two); `assemble_norm`, the norm's last step
(a Triton kernel on CUDA); QDoRA: a bitsandbytes NF4 base is read a few dequantised rows at
a time; `use_narrows_dora(model)`, which makes PEFT's DoRA layers use all of it, with
||W||²_row cached per frozen weight. Without PEFT: `DoraLinear`, narrows' own DoRA layer
(`add_dora`, `save_dora` and `load_dora` read and write PEFT's adapter format), registered
with the core adapter protocol so narrows-stream streams it like PEFT's layers. Both
routes run the same `dora_delta` and give the same numbers. Not supported: conv and
embedding layers.
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
