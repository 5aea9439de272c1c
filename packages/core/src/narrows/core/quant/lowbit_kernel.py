"""Dequantisation of NF2/NF3/NF4 and MXFP4 expert stacks (`lowbit.py`) as a Triton kernel
(CUDA; imported only when one runs, so narrows.core works without Triton).

Math: weight i = levels[code_i] · absmax[i // block], the product in float32, rounded once
to the output's dtype (round to nearest even, as PyTorch's cast) — `dequantize_reference`
bit for bit. MXFP4 has a kernel of its own: its absmax bytes are E8M0 exponents, read as
2^(s - 127), and its codes run over the stack transposed — code (e, r, c) of [E, out, in] is
weight [e, c, r] of the output [E, in, out] — so it works on 2-D tiles, read along the codes'
rows and written along the stack's. The stack is read flat: experts' codes and scales lie back to back and every
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
# an MXFP4 tile: 32 of the codes' rows by 64 of their columns, 4 warps (on an H200, of 64 x 64,
# 32 x 128, 64 x 128, 128 x 32/64/128 and 32 x 64 with 4 or 8 warps, the fastest)
_ROWS, _COLS = 32, 64


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


@triton.jit
def _dequantize_mxfp4(
    codes_ptr, scales_ptr, levels_ptr, out_ptr, rows, cols, ROWS: tl.constexpr, COLS: tl.constexpr
):
    """One [ROWS, COLS] tile of expert program_id(2)'s codes [out, in], stored transposed:
    read along ``in``, written along ``out`` (Triton moves the tile through shared memory so
    both sides are coalesced)."""
    expert = tl.program_id(2).to(tl.int64) * rows * cols
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
    c = tl.program_id(1) * COLS + tl.arange(0, COLS)[None, :]
    inside = (r < rows) & (c < cols)
    i = expert + r * cols + c  # the weight's place in the codes' order
    byte = tl.load(codes_ptr + i // 2, mask=inside, other=0).to(tl.int32)
    code = (byte >> (4 * (c % 2))) & 15  # the even weight in the low nibble
    level = tl.load(levels_ptr + code, mask=inside, other=0.0)
    exponent = tl.load(scales_ptr + i // 32, mask=inside, other=0).to(tl.int32)
    power = (exponent << 23).to(tl.float32, bitcast=True)  # 2^(s - 127) for s >= 1
    scale = tl.where(exponent == 0, 5.877471754111438e-39, power)  # s = 0: 2^-127, a subnormal
    tl.store(out_ptr + expert + c * rows + r, (level * scale).to(out_ptr.dtype.element_ty), mask=inside)


def dequantize_triton(codes: Tensor, absmax: Tensor, levels: Tensor, stack: LowbitStack) -> Tensor:
    """The stack `codes` and `absmax` encode (see the module doc)."""
    out = torch.empty(stack.shape, dtype=stack.dtype, device=codes.device)
    n = out.numel()
    if n and stack.mxfp4:
        experts, rows, cols = stack.shape[0], *stack.stored_shape[-2:]
        with torch.cuda.device(codes.device) if codes.is_cuda else contextlib.nullcontext():
            grid = (triton.cdiv(rows, _ROWS), triton.cdiv(cols, _COLS), experts)
            _dequantize_mxfp4[grid](
                codes, absmax, levels, out, rows, cols, ROWS=_ROWS, COLS=_COLS, num_warps=4
            )
    elif n:
        with torch.cuda.device(codes.device) if codes.is_cuda else contextlib.nullcontext():
            _dequantize[(triton.cdiv(n, _TILE),)](
                codes, absmax, levels, out, n, BITS=stack.bits, BLOCK=stack.block, TILE=_TILE
            )
    return out
