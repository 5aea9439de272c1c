"""The adapters' arithmetic that `lora.LinearGroup` composes: matmuls with float32 results
(the adapters' gradients, never rounded to the activations' dtype), dropout applied with
one rounding, and a branch and a base output summed in a matmul's epilogue."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .lora import Linear

__all__ = ["adapter_then_base", "add_adapter", "dropped", "mm_f32"]


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
    """`t` through `p`'s dropout: ``t · mask / keep``, the product rounded once (`t`'s dtype),
    by dropout's own backward kernel (on CUDA one pass over `t` and the bool mask; on the
    CPU the same bits as ``(t · mask) · (1/keep)``, tested)."""
    if mask is None:
        return t
    return torch.ops.aten.native_dropout_backward(t, mask, 1.0 / (1.0 - p.dropout))


@functools.cache
def _unread(device: torch.device, dtype: torch.dtype) -> Tensor:
    """The input `addmm` with ``beta=0`` takes and does not read: made once (a new one
    each call would cost the host an allocation, or a fill's launch too)."""
    return torch.empty((), device=device, dtype=dtype)


def adapter_then_base(
    n: Tensor, w: Tensor, h: Tensor, b: Tensor, scaling: float, bias: Tensor | None = None
) -> Tensor:
    """``bias + n @ wᵀ + scaling · h @ bᵀ`` for `h` in `n`'s dtype: the adapter's product
    (with the bias) written first, rounded once, and the base matmul accumulated onto it
    in its epilogue, rounded once. Adding the adapter after the base reads and writes the
    whole output a second time: on the H100 that pass cost 0.36 ms beside a 1.57 ms gate/up
    matmul at 7B, the epilogue 0.05 ms (case `overlap_7b` of
    `benchmarks/results/h100.jsonl`)."""
    if bias is None:
        out = torch.addmm(_unread(h.device, h.dtype), h, b.t(), beta=0, alpha=scaling)
    else:
        out = torch.addmm(bias.to(h.dtype), h, b.t(), alpha=scaling)
    return out.addmm_(n, w.t())


def add_adapter(out: Tensor, h: Tensor, b: Tensor, scaling: float) -> None:
    """``out += scaling · h @ bᵀ``: in the matmul's float32 epilogue where `h` has `out`'s
    dtype; float32 LoRA adds its float32 product to `out` in float32 and rounds the sum once,
    as PEFT does."""
    if h.dtype == out.dtype:
        out.addmm_(h, b.t(), alpha=scaling)
    else:
        out.add_(h.mm(b.t()), alpha=scaling)
