"""The adapters' arithmetic that `lora.LinearGroup` composes: matmuls with float32 results
(the adapters' gradients, never rounded to the activations' dtype), dropout applied with
one rounding, and a branch added onto a base output in the matmul's epilogue."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .lora import Linear

__all__ = ["add_adapter", "dropped", "mm_f32"]


def mm_f32(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` with a float32 result (float64 for float64 inputs): 16-bit inputs on CUDA
    go to tensor cores with a float32 output; elsewhere they are cast to float32 first
    (what a CPU matmul of 16-bit inputs accumulates in anyway)."""
    if a.dtype in (torch.float32, torch.float64):
        return a.mm(b.to(a.dtype))
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float().mm(b.float())


def dropped(t: Tensor, mask: Tensor | None, p: Linear) -> Tensor:
    """`t` through `p`'s dropout: ``t · mask / keep``, the product rounded once (`t`'s dtype)."""
    if mask is None:
        return t
    return (t * mask).mul_(1.0 / (1.0 - p.dropout))


def add_adapter(out: Tensor, h: Tensor, b: Tensor, scaling: float) -> None:
    """``out += scaling · h @ bᵀ``: in the matmul's float32 epilogue where `h` has `out`'s
    dtype; float32 LoRA adds its float32 product to `out` in float32 and rounds the sum once,
    as PEFT does."""
    if h.dtype == out.dtype:
        out.addmm_(h, b.t(), alpha=scaling)
    else:
        out.add_(h.mm(b.t()), alpha=scaling)
