"""narrows.dora — DoRA with a factored row norm and fused Triton compose kernels, drop-in for PEFT.

The factored row norm (`factored_row_norm`, `base_row_norm_sq`) with its fp64 dense
reference; the stable composition `compose`, a `torch.library` custom op with Triton
forward/backward kernels on CUDA above a measured crossover (the fused backward also
reduces the magnitude gradient, deterministically) and the eager formula everywhere else
(`fused_reason` says which runs; training on CUDA saves one
activation per module, ``inner``, instead of two); `assemble_norm`, the norm's last step
(a Triton kernel on CUDA); QDoRA: a bitsandbytes NF4 base is read a few dequantised rows at
a time; `use_narrows_dora(model)`, which makes PEFT's DoRA layers use all of it, with
||W||²_row cached per frozen weight. Not yet: a DoRA layer of narrows' own registered
through the core adapter protocol, conv and embedding layers.
"""

from importlib.metadata import version as _version

from .compose import FUSED_MIN_ELEMENTS, compose, fused_reason, magnitude_scale, norm_epsilon
from .norm import DEFAULT_CHUNK_BUDGET, assemble_norm, base_row_norm_sq, dense_row_norm, factored_row_norm
from .peft import use_narrows_dora

__version__ = _version("narrows-dora")
__all__ = [
    "DEFAULT_CHUNK_BUDGET",
    "FUSED_MIN_ELEMENTS",
    "__version__",
    "assemble_norm",
    "base_row_norm_sq",
    "compose",
    "dense_row_norm",
    "factored_row_norm",
    "fused_reason",
    "magnitude_scale",
    "norm_epsilon",
    "use_narrows_dora",
]
