"""The DoRA composition, eager PyTorch: the reference every other path must match.

    out = (g - 1) ⊙ base + g ⊙ (s · lora),   g = m / max(||W + sBA||_row, ε)

in this order (the stable form of seed 002 §3.1: the small correction g - 1 stays
explicit) with fp32 intermediates, cast to the activation dtype at the end. `base` has the
bias already removed (the caller adds it back).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["compose", "magnitude_scale", "norm_epsilon"]


def norm_epsilon(dtype: torch.dtype) -> float:
    """The floor for the row norm: a norm below it is treated as it (no division blow-up)."""
    return 1e-12 if dtype in (torch.float32, torch.float64) else 1e-6


def magnitude_scale(magnitude: Tensor, norm: Tensor, dtype: torch.dtype) -> Tensor:
    """g = m / max(norm, ε), in fp32; the gradient reaches m, not the (detached) norm."""
    return magnitude.float() / norm.detach().float().clamp_min(norm_epsilon(dtype))


def compose(base: Tensor, lora: Tensor, g: Tensor, scale: float) -> Tensor:
    """(g - 1)·base + g·(scale·lora), broadcasting g over the last dimension."""
    b, lo = base.float(), lora.float()
    return ((g - 1) * b + g * (scale * lo)).to(base.dtype)
