"""One door to a bitsandbytes NF4 weight's float copy, for the layers narrows runs itself
(the fast layer's linears, the experts' stacks): on CUDA with Triton, one launch of
`nf4_kernel` (bitsandbytes' `dequantize_4bit` bit for bit, a third of its launches and little
of its Python); elsewhere, or for FP4, bitsandbytes' own function. Both follow the math
`dequantize_nf4_reference` writes out in PyTorch.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from ..optional import is_available

__all__ = ["dequantize_nf4", "dequantize_nf4_reference"]


@functools.cache
def _kernel():
    """The Triton kernel's module (`nf4_kernel`), or None where Triton is missing or does not
    import (bitsandbytes then serves CUDA too)."""
    if not is_available("triton"):
        return None
    try:
        from . import nf4_kernel
    except Exception:
        return None
    return nf4_kernel


def _fits_kernel(packed: Tensor, qs, out: Tensor | None) -> bool:
    return (
        packed.is_cuda
        and qs.quant_type == "nf4"
        and qs.blocksize % 2 == 0
        and packed.is_contiguous()
        and qs.absmax.is_contiguous()
        and (out is None or (out.is_contiguous() and out.dtype == qs.dtype))
        and _kernel() is not None
    )


def dequantize_nf4(packed: Tensor, quant_state, out: Tensor | None = None, *, impl: str = "auto") -> Tensor:
    """The float weight bitsandbytes' `packed` codes and `quant_state` encode, of the state's
    shape and dtype, written into `out` where given: by the Triton kernel (``impl="triton"``;
    by default on CUDA where Triton imports, for NF4) or bitsandbytes' `dequantize_4bit`
    (``"bnb"``), with the same bits either way."""
    if impl == "auto":
        impl = "triton" if _fits_kernel(packed, quant_state, out) else "bnb"
    if impl == "triton":
        return _kernel().dequantize_nf4_triton(packed, quant_state, out)
    if impl != "bnb":
        raise ValueError(f"impl={impl!r}: 'auto', 'triton' or 'bnb'")
    from bitsandbytes.functional import dequantize_4bit

    if out is not None and out.is_cuda and out.dtype == quant_state.dtype:
        return dequantize_4bit(packed, quant_state, out=out)  # the CPU has no out=
    w = dequantize_4bit(packed, quant_state)
    return w if out is None else out.copy_(w)


def dequantize_nf4_reference(packed: Tensor, quant_state) -> Tensor:
    """`dequantize_nf4` in PyTorch: block scales un-nested (a float32 product, then the
    offset added), each weight its level times its block's scale in float32, rounded once."""
    qs = quant_state
    n = math.prod(qs.shape)
    scales = qs.absmax
    if qs.nested:
        s2 = qs.state2
        nested = s2.absmax.repeat_interleave(s2.blocksize)[: scales.numel()]
        scales = s2.code.to(scales.device)[scales.long()] * nested
        scales = scales + qs.offset
    flat = packed.reshape(-1)
    codes = torch.stack((flat >> 4, flat & 15), dim=-1).reshape(-1)[:n].long()
    weights = qs.code.to(flat.device)[codes] * scales.float().repeat_interleave(qs.blocksize)[:n]
    return weights.to(qs.dtype).reshape(tuple(qs.shape))
