"""narrows.dora — DoRA with a factored row norm and fused Triton compose kernels, drop-in for PEFT.

So far: the factored row norm (`factored_row_norm`, `base_row_norm_sq`) with its fp64
dense reference; the compose kernels and the PEFT integration are not written yet.
"""

from importlib.metadata import version as _version

from .norm import DEFAULT_CHUNK_BUDGET, base_row_norm_sq, dense_row_norm, factored_row_norm

__version__ = _version("narrows-dora")
__all__ = ["DEFAULT_CHUNK_BUDGET", "__version__", "base_row_norm_sq", "dense_row_norm", "factored_row_norm"]
