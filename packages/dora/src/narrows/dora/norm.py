"""DoRA's row norm ||W + s·B·A||_row without the dense B·A (seed 002 §2, Algorithm 1).

    ||W + sBA||²_row = ||W||²_row + 2s·<W, BA>_row + s²·||BA||²_row
                     = base_sq     + 2s·rowsum(B ⊙ (W Aᵀ)) + s²·rowsum((B G) ⊙ B),  G = A Aᵀ

A float W is read in column chunks of at most `chunk_budget` bytes (fp32), so the largest
intermediates are one [d_out, chunk] slice of W, U_c = W_c A_cᵀ [d_out, r] and G [r, r].
A 4-bit W (narrows.core's `NF4Rows`: a bitsandbytes weight dequantised a few rows at a
time) is read in row chunks of the same budget, so its full-size float copy never exists.
Everything accumulates in fp32 with autocast off, under no_grad: DoRA treats the norm as
a constant. The three per-row terms meet in `assemble_norm` (a Triton kernel on CUDA with
PyTorch's rounding). `dense_row_norm` is the fp64 reference the factored one is tested against.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from narrows.core import NF4Rows
from narrows.core._env import is_available

__all__ = ["DEFAULT_CHUNK_BUDGET", "assemble_norm", "base_row_norm_sq", "dense_row_norm", "factored_row_norm"]

Weight = Tensor | NF4Rows

DEFAULT_CHUNK_BUDGET = 32 * 2**20


def _mm_fp32(x: Tensor, y: Tensor) -> Tensor:
    """x @ y with fp32 accumulation and output. bf16/fp16 inputs on CUDA go to the tensor
    cores as they are (each product of two half-precision values is exact in fp32, and the
    sum accumulates in fp32), with no fp32 copy of the chunk; any other pairing (an fp32
    adapter, the CPU) upcasts both."""
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and y.dtype == x.dtype:
        return torch.mm(x, y, out_dtype=torch.float32)
    return x.float() @ y.float()


def _chunk(d_out: int, d_in: int, budget: int) -> int:
    cs = max(1, budget // (d_out * 4))
    if cs >= 64:
        cs -= cs % 64  # whole tensor-core tiles
    return min(d_in, cs)


def _row_chunk(d_in: int, budget: int) -> int:
    return max(1, budget // (d_in * 4))


def assemble_norm(base_sq: Tensor, cross: Tensor, ba_sq: Tensor, scale: float) -> Tensor:
    """sqrt(max(base_sq + 2s·cross + s²·ba_sq, 0)) over fp32 [d_out] (seed 002 eq. 5): the
    Triton kernel on CUDA, this expression elsewhere; the two round identically (2s and s²
    are Python floats in both, the kernel is compiled without FMA contraction and uses the
    IEEE square root), so which one ran never shows in the result."""
    if base_sq.is_cuda and is_available("triton") and os.environ.get("NARROWS_DORA_FUSED") != "0":
        from .kernels import assemble_norm as kernel

        return kernel(base_sq.contiguous(), cross.contiguous(), ba_sq.contiguous(), scale)
    return (base_sq + 2 * scale * cross + scale * scale * ba_sq).clamp_min(0).sqrt()


@torch.no_grad()
def base_row_norm_sq(weight: Weight, *, chunk_budget: int = DEFAULT_CHUNK_BUDGET) -> Tensor:
    """||W||²_row in fp32: the frozen part, worth computing once per module."""
    if isinstance(weight, NF4Rows):
        d_out, d_in = weight.shape
        out = torch.empty(d_out, dtype=torch.float32, device=weight.packed.device)
        rs = _row_chunk(d_in, chunk_budget)
        for r0 in range(0, d_out, rs):
            out[r0 : r0 + rs] = weight.rows(r0, r0 + rs).float().square().sum(dim=1)
        return out
    d_out, d_in = weight.shape
    out = torch.zeros(d_out, dtype=torch.float32, device=weight.device)
    cs = _chunk(d_out, d_in, chunk_budget)
    with torch.autocast(weight.device.type, enabled=False):
        for c in range(0, d_in, cs):
            out += weight[:, c : c + cs].float().square().sum(dim=1)
    return out


@torch.no_grad()
def factored_row_norm(
    weight: Weight,
    lora_a: Tensor,
    lora_b: Tensor,
    scale: float,
    *,
    base_sq: Tensor | None = None,
    chunk_budget: int = DEFAULT_CHUNK_BUDGET,
) -> Tensor:
    """||W + scale·B·A||_row as fp32 [d_out], never forming B·A.

    `weight` [d_out, d_in] (a float base, or a 4-bit one as `NF4Rows`), `lora_a` [r, d_in],
    `lora_b` [d_out, r]. `base_sq` is a cached ||W||²_row (see `base_row_norm_sq`); with
    scale 0 only it is used.
    """
    d_out, d_in = weight.shape
    device = lora_a.device
    with torch.autocast(device.type, enabled=False):
        if scale == 0:
            return (
                base_sq if base_sq is not None else base_row_norm_sq(weight, chunk_budget=chunk_budget)
            ).sqrt()
        r = lora_a.shape[0]
        b = lora_b.float()
        need_base = base_sq is None  # then ||W||² is summed in the same pass over W, not a second one
        if need_base:
            base_sq = torch.zeros(d_out, dtype=torch.float32, device=device)
        cross = torch.zeros(d_out, dtype=torch.float32, device=device)
        gram = torch.zeros(r, r, dtype=torch.float32, device=device)
        if isinstance(weight, NF4Rows):
            gram += _mm_fp32(lora_a, lora_a.t())
            rs = _row_chunk(d_in, chunk_budget)
            for r0 in range(0, d_out, rs):
                w_r = weight.rows(r0, r0 + rs)
                if need_base:
                    base_sq[r0 : r0 + rs] = w_r.float().square().sum(dim=1)
                cross[r0 : r0 + rs] = (b[r0 : r0 + rs] * _mm_fp32(w_r, lora_a.t())).sum(dim=1)
        else:
            cs = _chunk(d_out, d_in, chunk_budget)
            for c in range(0, d_in, cs):
                w_c, a_c = weight[:, c : c + cs], lora_a[:, c : c + cs]
                if need_base:
                    base_sq += w_c.float().square().sum(dim=1)
                gram += _mm_fp32(a_c, a_c.t())
                cross += (b * _mm_fp32(w_c, a_c.t())).sum(dim=1)
        ba_sq = ((b @ gram) * b).sum(dim=1)
        return assemble_norm(base_sq, cross, ba_sq, scale)


def dense_row_norm(weight: Tensor, lora_a: Tensor, lora_b: Tensor, scale: float) -> Tensor:
    """The reference: the dense composed weight in fp64."""
    w = weight.double() + scale * (lora_b.double() @ lora_a.double())
    return w.norm(dim=1)
