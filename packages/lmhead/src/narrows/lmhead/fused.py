"""Optional dispatch of the chunked loss to an installed fused kernel library.

Cut Cross-Entropy runs with its gradient filter off (exact up to summation order), only on
CUDA with a resident head without bias in bf16/fp16; everywhere else, or uninstalled, the
`chunked` tiles run. Its backward is not promised run-to-run deterministic;
``fused="off"`` keeps the tiles, which are.

why: docs/design.md#fused-kernels
"""

from __future__ import annotations

import torch
from torch import Tensor

from narrows.core import HeadSource, ResidentHead
from narrows.core.optional import is_available, require

__all__ = ["FUSED_CHOICES", "fused_cross_entropy", "fused_reason"]

FUSED_CHOICES = ("off", "auto", "cce")


def fused_reason(hidden: Tensor, source: HeadSource) -> str | None:
    """Why the fused library cannot run here, or None when it can."""
    if not is_available("cut_cross_entropy"):
        return "cut-cross-entropy is not installed (pip install cut-cross-entropy)"
    if hidden.device.type != "cuda":
        return "it runs on CUDA only"
    if not isinstance(source, ResidentHead) or source.bias is not None:
        return "it needs the head resident on the device and without bias"
    if hidden.dtype not in (torch.bfloat16, torch.float16) or source.dtype != hidden.dtype:
        return "it needs bf16/fp16 hidden states and head"
    if source.math.multiply is not None or source.math.divide is not None:
        return "it has no logit scaling (this architecture scales its logits)"
    return None


def fused_cross_entropy(
    hidden: Tensor, targets: Tensor, source: ResidentHead, token_weights: Tensor
) -> Tensor:
    """``sum_i w_i * CE(head(hidden_i), targets_i)`` through Cut Cross-Entropy's kernels."""
    cce = require("cut_cross_entropy", "fused cross-entropy (fused='cce')")
    nll = cce.linear_cross_entropy(
        hidden, source.weight, targets, softcap=source.math.softcap, reduction="none", filter_eps=None
    )
    return (nll.float() * token_weights).sum()
