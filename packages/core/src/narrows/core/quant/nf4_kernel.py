"""Dequantisation of a bitsandbytes NF4 weight (``Linear4bit``'s, or an NF4 expert stack) in
one Triton launch, bit for bit what bitsandbytes' `dequantize_4bit` returns (CUDA; imported
only when one runs, so narrows.core works without Triton).

bitsandbytes takes three launches and a few Python calls for a double-quantised weight: the
block scales' own dequantisation, the offset added to them, then the codes. This kernel does
the three in one. Its reference is `nf4.dequantize_nf4_reference` (PyTorch), and
bitsandbytes' own function beside it.

Math, as bitsandbytes computes it: the packed byte j holds weight 2j in its high nibble and
weight 2j + 1 in its low one; block b's scale is ``code2[absmax[b]] · nested[b // 256] +
offset`` in float32 (a product, then a sum: rounded twice, so the kernel is compiled without
fused multiply-adds) where the scales are double-quantised, else ``absmax[b]``; weight i is
``levels[code_i] · scale[i // block]`` in float32, rounded once to the output's dtype (round to
nearest even, as CUDA's conversion). Each program writes TILE weights from TILE / 2 bytes.

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

_BYTES = 1024  # bytes a program reads: 2048 weights


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
    BLOCK: tl.constexpr,
    NESTED_BLOCK: tl.constexpr,
    NESTED: tl.constexpr,
    BYTES: tl.constexpr,
):
    j = tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, BYTES)
    first = 2 * j  # the weight in the byte's high nibble
    inside = first < n
    byte = tl.load(packed_ptr + j, mask=inside, other=0).to(tl.int32)
    high = tl.load(levels_ptr + (byte >> 4), mask=inside, other=0.0)
    low = tl.load(levels_ptr + (byte & 15), mask=inside, other=0.0)
    block = first // BLOCK  # a block holds whole bytes (its size is even)
    if NESTED:
        q = tl.load(absmax_ptr + block, mask=inside, other=0).to(tl.int32)
        scale = tl.load(code2_ptr + q, mask=inside, other=0.0)
        scale = scale * tl.load(nested_ptr + block // NESTED_BLOCK, mask=inside, other=0.0)
        scale = scale + tl.load(offset_ptr)
    else:
        scale = tl.load(absmax_ptr + block, mask=inside, other=0.0)
    dtype = out_ptr.dtype.element_ty
    values = tl.interleave((high * scale).to(dtype), (low * scale).to(dtype))
    where = tl.interleave(first, first + 1)
    tl.store(out_ptr + where, values, mask=where < n)


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
    with torch.cuda.device(packed.device) if packed.is_cuda else contextlib.nullcontext():
        _dequantize_nf4[(triton.cdiv(n, 2 * _BYTES),)](
            packed,
            qs.absmax,
            code2,
            nested,
            offset,
            levels,
            out,
            n,
            BLOCK=qs.blocksize,
            NESTED_BLOCK=nested_block,
            NESTED=bool(qs.nested),
            BYTES=_BYTES,
            num_warps=4,
            enable_fp_fusion=False,
        )
    return out
