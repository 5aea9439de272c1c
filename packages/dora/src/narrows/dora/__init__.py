"""narrows.dora — DoRA with a factored row norm and fused Triton compose kernels, drop-in for PEFT.

So far, eager PyTorch only: the factored row norm (`factored_row_norm`, `base_row_norm_sq`)
with its fp64 dense reference, the stable composition (`compose`), and
`use_narrows_dora(model)`, which makes PEFT's DoRA layers use both. The Triton kernels and
the protocol-registered adapter are not written yet.
"""

from importlib.metadata import version as _version

from .compose import compose, magnitude_scale, norm_epsilon
from .norm import DEFAULT_CHUNK_BUDGET, base_row_norm_sq, dense_row_norm, factored_row_norm
from .peft import use_narrows_dora

__version__ = _version("narrows-dora")
__all__ = [
    "DEFAULT_CHUNK_BUDGET",
    "__version__",
    "base_row_norm_sq",
    "compose",
    "dense_row_norm",
    "factored_row_norm",
    "magnitude_scale",
    "norm_epsilon",
    "use_narrows_dora",
]
