"""Grouped matmuls over the rows of each expert (the slots of an MoE step sorted by
expert, `ends` where each expert's rows end), each beside its reference: torch's
``grouped_mm`` where it takes the operands, a loop over the experts elsewhere (float64,
unaligned widths, pre-Ampere GPUs). Both write their output in the operands' dtype.

why: docs/design.md#the-moe-layer
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

__all__ = ["grouped_mm", "grouped_mm_k", "grouped_mm_k_reference", "grouped_mm_reference", "native"]


def grouped_mm_reference(x: Tensor, w: Tensor, ends: Tensor) -> Tensor:
    """``x[rows of e] @ w[e]`` for each expert e, whose rows end at ``ends[e]``."""
    out = x.new_empty(x.shape[0], w.shape[-1])
    start = 0
    for e, end in enumerate(ends.tolist()):
        out[start:end] = x[start:end] @ w[e]
        start = end
    return out


def grouped_mm_k_reference(x: Tensor, y: Tensor, ends: Tensor) -> Tensor:
    """``x[rows of e]ᵀ @ y[rows of e]`` for each expert e, [E, x's columns, y's columns], in
    the operands' dtype (an expert without rows gets zeros)."""
    out = x.new_empty(len(ends), x.shape[1], y.shape[1])
    start = 0
    for e, end in enumerate(ends.tolist()):
        torch.mm(x[start:end].t(), y[start:end], out=out[e])
        start = end
    return out


def native(x: Tensor, w: Tensor) -> bool:
    """Whether torch's grouped matmul takes these operands: rows 16-byte aligned, and on
    CUDA bf16 on compute capability 8.0 or newer."""
    if not hasattr(F, "grouped_mm") or x.dtype != w.dtype:
        return False
    size = x.element_size()
    aligned = all((d * size) % 16 == 0 for d in (x.shape[-1], w.shape[-1], w.shape[-2]))
    if x.is_cuda:
        return aligned and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (8, 0)
    return aligned and x.dtype in (torch.float32, torch.bfloat16)


def grouped_mm(x: Tensor, w: Tensor, ends: Tensor) -> Tensor:
    """(S, K) rows sorted by expert times each expert's (K, N) matrix of `w` [E, K, N]:
    torch's grouped matmul where it runs, else the reference."""
    if native(x, w):
        return F.grouped_mm(x, w, offs=ends)
    return grouped_mm_reference(x, w, ends)


def grouped_mm_k(x: Tensor, y: Tensor, ends: Tensor) -> Tensor:
    """(S, M) and (S, N) rows sorted by expert: each expert's ``x[rows]ᵀ @ y[rows]``,
    [E, M, N] in their dtype (torch's grouped matmul over K where it runs, else the
    reference): an expert adapter's weight gradient."""
    if native(x, y.unsqueeze(0)):
        return F.grouped_mm(x.t(), y, offs=ends)
    return grouped_mm_k_reference(x, y, ends)
