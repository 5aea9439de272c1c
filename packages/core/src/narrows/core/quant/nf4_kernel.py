"""Dequantisation of a bitsandbytes NF4 weight (``Linear4bit``'s, or an NF4 expert stack) in
one Triton launch, bit for bit what bitsandbytes' `dequantize_4bit` returns (CUDA; imported
only when one runs, so narrows.core works without Triton).

bitsandbytes takes three launches and a few Python calls for a double-quantised weight: the
block scales' own dequantisation, the offset added to them, then the codes. This kernel does
the three in one. Its reference is `dequantize.dequantize_nf4_reference` (PyTorch), and
bitsandbytes' own function beside it.

Math, as bitsandbytes computes it: the packed byte j holds weight 2j in its high nibble and
weight 2j + 1 in its low one; block b's scale is ``code2[absmax[b]] · nested[b // 256] +
offset`` in float32 (a product, then a sum: rounded twice, so the kernel is compiled without
fused multiply-adds) where the scales are double-quantised, else ``absmax[b]``; weight i is
``levels[code_i] · scale[i // block]`` in float32, rounded once to the output's dtype (round to
nearest even, as CUDA's conversion).

Layout: a program takes ROWS scale blocks whole, as a [ROWS, BLOCK / 2] tile of packed
bytes, so each block's scale is decoded once and broadcast over its row, and every load and
store runs along contiguous memory; a 16-bit output is written a byte's pair of weights at a
time, as one 32-bit word (the first weight in its low half), where it is a whole number of
words.

Limits: the packed codes, the scales and the output contiguous; the levels a float32 table
of 16 entries on the weight's device (bitsandbytes' ``quant_state.code``).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["dequantize_nf4_triton"]

_BYTES = 1024  # bytes a program reads (at most; whole scale blocks): 2048 weights
_WARPS = 4
_PAIRS = {torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def _dequantize_nf4(
    packed_ptr,
    absmax_ptr,
    code2_ptr,
    nested_ptr,
    offset_ptr,
    levels_ptr,
    out_ptr,
    n,
    blocks,
    HALF: tl.constexpr,
    ROWS: tl.constexpr,
    NESTED_BLOCK: tl.constexpr,
    NESTED: tl.constexpr,
    PAIRS: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # scale blocks
    j = rows[:, None] * HALF + tl.arange(0, HALF)[None, :]  # bytes: [ROWS, HALF]
    inside = 2 * j < n  # the byte's first weight (the last block may be short)
    whole = rows < blocks
    if NESTED:
        q = tl.load(absmax_ptr + rows, mask=whole, other=0).to(tl.int32)
        scale = tl.load(code2_ptr + q, mask=whole, other=0.0)
        scale = scale * tl.load(nested_ptr + rows // NESTED_BLOCK, mask=whole, other=0.0)
        scale = scale + tl.load(offset_ptr)
    else:
        scale = tl.load(absmax_ptr + rows, mask=whole, other=0.0)
    scale = scale[:, None]
    byte = tl.load(packed_ptr + j, mask=inside, other=0).to(tl.int32)
    high = tl.load(levels_ptr + (byte >> 4)) * scale
    low = tl.load(levels_ptr + (byte & 15)) * scale
    if PAIRS:  # a 16-bit output: the byte's two weights as one 32-bit word, the first low
        dtype = tl.bfloat16 if PAIRS == 1 else tl.float16
        first_bits = high.to(dtype).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        second_bits = low.to(dtype).to(tl.int16, bitcast=True).to(tl.int32)
        tl.store(out_ptr + j, first_bits | (second_bits << 16), mask=inside)
    else:
        dtype = out_ptr.dtype.element_ty
        values = tl.reshape(tl.join(high.to(dtype), low.to(dtype)), (ROWS, 2 * HALF))
        k = rows[:, None] * (2 * HALF) + tl.arange(0, 2 * HALF)[None, :]
        tl.store(out_ptr + k, values, mask=k < n)


def dequantize_nf4_triton(packed: Tensor, quant_state, out: Tensor | None = None) -> Tensor:
    """The weight `packed` and bitsandbytes' `quant_state` encode, into `out` if given (of
    the state's shape and dtype, contiguous) — see the module doc."""
    qs = quant_state
    if out is None:
        out = torch.empty(tuple(qs.shape), dtype=qs.dtype, device=packed.device)
    n = out.numel()
    if not n:
        return out
    levels = qs.code if qs.code.device == packed.device else qs.code.to(packed.device)
    if qs.nested:
        s2 = qs.state2
        code2 = s2.code if s2.code.device == packed.device else s2.code.to(packed.device)
        nested, offset, nested_block = s2.absmax, qs.offset, s2.blocksize
        if not isinstance(offset, Tensor):  # a state read back from a dict may hold a float
            offset = torch.tensor(float(offset), dtype=torch.float32, device=packed.device)
    else:
        code2 = nested = offset = qs.absmax  # unread
        nested_block = 1
    # 16-bit weights in pairs, one 32-bit store each, where the output is whole words
    pairs = _PAIRS.get(out.dtype, 0) if n % 2 == 0 and out.data_ptr() % 4 == 0 else 0
    half = qs.blocksize // 2
    rows = max(1, _BYTES // half)
    blocks = -(-n // qs.blocksize)
    elsewhere = packed.is_cuda and packed.device.index != torch.cuda.current_device()
    with torch.cuda.device(packed.device) if elsewhere else contextlib.nullcontext():
        _dequantize_nf4[(triton.cdiv(blocks, rows),)](
            packed,
            qs.absmax,
            code2,
            nested,
            offset,
            levels,
            out.reshape(-1).view(torch.int32) if pairs else out,
            n,
            blocks,
            HALF=half,
            ROWS=rows,
            NESTED_BLOCK=nested_block,
            NESTED=bool(qs.nested),
            PAIRS=pairs,
            num_warps=_WARPS,
            enable_fp_fusion=False,
        )
    return out
