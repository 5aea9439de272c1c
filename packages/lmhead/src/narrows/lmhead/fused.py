"""Optional dispatch of the chunked loss to an installed fused kernel library.

Liger-Kernel's fused linear cross-entropy and Cut Cross-Entropy (its gradient filter off)
each compute the head's matmul, the log-sum-exp and the gradient with their own kernels,
exact up to summation order; they run on CUDA with a resident head without bias in
bf16/fp16 and no logit scaling. ``fused="auto"`` takes the first of them that runs
(`AUTO_ORDER`); where none does, or none is installed, the `chunked` tiles run.
Liger's chunks sum in a fixed order (the same bits run to run); Cut Cross-Entropy's
backward is not promised run-to-run deterministic. ``fused="off"`` keeps the tiles.

why: docs/design.md#fused-kernels
"""

from __future__ import annotations

import torch
from torch import Tensor

from narrows.core import HeadSource, ResidentHead
from narrows.core.optional import is_available, require

from .chunked import DEFAULT_TILE_BYTES

__all__ = ["AUTO_ORDER", "FUSED_CHOICES", "fused_cross_entropy", "fused_library", "fused_reason"]

FUSED_CHOICES = ("off", "auto", "liger", "cce")
IGNORED = -100  # the target of a row the loss leaves out
AUTO_ORDER = ("liger", "cce")  # fastest first (benchmarks/lmhead_memory.py)
_MODULES = {"liger": ("liger_kernel", "liger-kernel"), "cce": ("cut_cross_entropy", "cut-cross-entropy")}


def fused_reason(hidden: Tensor, source: HeadSource, library: str = "cce") -> str | None:
    """Why fused `library` ("liger" or "cce") cannot run here, or None when it can."""
    module, package = _MODULES[library]
    if not is_available(module):
        return f"{package} is not installed (pip install {package})"
    if hidden.device.type != "cuda":
        return "it runs on CUDA only"
    if not isinstance(source, ResidentHead) or source.bias is not None:
        return "it needs the head resident on the device and without bias"
    if hidden.dtype not in (torch.bfloat16, torch.float16) or source.dtype != hidden.dtype:
        return "it needs bf16/fp16 hidden states and head"
    if source.math.multiply is not None or source.math.divide is not None:
        return "it has no logit scaling (this architecture scales its logits)"
    return None


def fused_library(hidden: Tensor, source: HeadSource, fused: str) -> tuple[str | None, str | None]:
    """The library `fused` ("auto", "liger", "cce") runs here, or None and why not."""
    reasons = []
    for library in AUTO_ORDER if fused == "auto" else (fused,):
        why = fused_reason(hidden, source, library)
        if why is None:
            return library, None
        reasons.append(f"{library}: {why}")
    return None, "; ".join(reasons)


def fused_cross_entropy(
    hidden: Tensor,
    targets: Tensor,
    source: ResidentHead,
    token_weights: Tensor,
    library: str = "cce",
    tile_bytes: int = DEFAULT_TILE_BYTES,
    *,
    scale: Tensor | None = None,
) -> Tensor:
    """``sum_i w_i * CE(head(hidden_i), targets_i)`` through `library`'s kernels; Liger's
    logits chunks are sized to about `tile_bytes`, as the tiles' are.

    `scale`: the one weight every row with a nonzero weight has (rows weighing 0 count
    for nothing). Liger then sums its losses (those rows ignored) and the sum is scaled:
    its forward computes the input's gradient as it goes, chunk by chunk, and its backward
    scales that. With weights per row (``reduction="none"``) its backward runs the head's
    matmul over every chunk again, to weigh each row's logits' gradient."""
    if library == "liger":
        require("liger_kernel", "fused cross-entropy (fused='liger')")
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        # Liger bounds a chunk's logits to chunk_mem_const × tokens × hidden elements
        per_unit = hidden.shape[0] * hidden.shape[1] * hidden.element_size()
        mem_const = max(1, tile_bytes // max(1, per_unit))
        if scale is not None:
            ignored = torch.where(token_weights > 0, targets, IGNORED)
            total = liger_fused_linear_cross_entropy(
                hidden,
                source.weight,
                ignored,
                ignore_index=IGNORED,
                reduction="sum",
                softcap=source.math.softcap,
                chunk_mem_const=mem_const,
            )
            return total.float() * scale
        nll = liger_fused_linear_cross_entropy(
            hidden,
            source.weight,
            targets,
            reduction="none",
            softcap=source.math.softcap,
            chunk_mem_const=mem_const,
        )
    else:
        cce = require("cut_cross_entropy", "fused cross-entropy (fused='cce')")
        nll = cce.linear_cross_entropy(
            hidden, source.weight, targets, softcap=source.math.softcap, reduction="none", filter_eps=None
        )
    return (nll.float() * token_weights).sum()
