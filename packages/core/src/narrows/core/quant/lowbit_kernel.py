"""Dequantisation of NF2/NF3/NF4 expert stacks (`lowbit.py`) as a Triton kernel (CUDA;
imported only when one runs, so narrows.core works without Triton).

Math: weight i = levels[code_i] · absmax[i // block], the product in float32, rounded once
to the output's dtype (round to nearest even, as PyTorch's cast) — `dequantize_reference`
bit for bit. The stack is read flat: experts' codes and scales lie back to back and every
expert is whole blocks, so weight i's code is bits [k·(i % 8), k·(i % 8) + k) of the k-byte
word of group i // 8, which starts at byte k·(i // 8); a code that straddles two bytes (NF3)
reads the second one too. Each program writes TILE weights.

Limits: the codes and absmax contiguous (`lowbit.dequantize` checks), the levels a float32
table of 2^k entries on the stack's device.

It sits in quant/, beside its reference, rather than in kernels/: the experts' forward
(`experts.py`) calls it, and quant/ may not import the layer above it.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from torch import Tensor

from .lowbit import LowbitStack

__all__ = ["dequantize_triton"]

_TILE = 1024


@triton.jit
def _dequantize(
    codes_ptr, absmax_ptr, levels_ptr, out_ptr, n, BITS: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr
):
    i = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    inside = i < n
    bit = BITS * (i % 8)  # where the code starts in its group's word
    byte = BITS * (i // 8) + bit // 8
    shift = bit % 8
    low = tl.load(codes_ptr + byte, mask=inside, other=0).to(tl.int32)
    high = tl.load(codes_ptr + byte + 1, mask=inside & (shift + BITS > 8), other=0).to(tl.int32)
    code = ((low | (high << 8)) >> shift) & ((1 << BITS) - 1)
    level = tl.load(levels_ptr + code, mask=inside, other=0.0)
    scale = tl.load(absmax_ptr + i // BLOCK, mask=inside, other=0.0)
    tl.store(out_ptr + i, (level * scale).to(out_ptr.dtype.element_ty), mask=inside)


def dequantize_triton(codes: Tensor, absmax: Tensor, levels: Tensor, stack: LowbitStack) -> Tensor:
    """The stack `codes` and `absmax` encode (see the module doc)."""
    out = torch.empty(stack.shape, dtype=stack.dtype, device=codes.device)
    n = out.numel()
    if n:
        with torch.cuda.device(codes.device) if codes.is_cuda else contextlib.nullcontext():
            _dequantize[(triton.cdiv(n, _TILE),)](
                codes, absmax, levels, out, n, BITS=stack.bits, BLOCK=stack.block, TILE=_TILE
            )
    return out
