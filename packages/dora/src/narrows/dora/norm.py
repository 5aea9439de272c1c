"""DoRA's row norm ||W + s·B·A||_row without the dense B·A (Scaling DoRA, arXiv:2603.22276).

    ||W + sBA||²_row = base_sq + 2s·rowsum(B ⊙ (W Aᵀ)) + s²·rowsum((B G) ⊙ B),  G = A Aᵀ

fp32 accumulation with autocast off, under no_grad (the norm is a constant to DoRA); no
intermediate is larger than a slice of W's rows; both paths round as `assemble_norm` does.
`dense_row_norm` is the fp64 reference.

why: docs/design.md#the-factored-row-norm
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from narrows.core import NF4Rows
from narrows.core.optional import is_available

__all__ = [
    "DEFAULT_CHUNK_BUDGET",
    "assemble_norm",
    "base_row_norm_sq",
    "dense_row_norm",
    "factored_row_norm",
    "sqrt_rn",
]

Weight = Tensor | NF4Rows

DEFAULT_CHUNK_BUDGET = 64 * 2**20


def _rows(weight: Weight, start: int, stop: int) -> Tensor:
    return weight.rows(start, stop) if isinstance(weight, NF4Rows) else weight[start:stop]


def _row_chunk(d_in: int, budget: int, *, r: int = 0, parts: int = 1, w_copies: int = 1) -> int:
    """Rows per chunk so the chunk's intermediates fit `budget` bytes: `w_copies` fp32 rows
    of W (a cast, its square, a dequantised NF4 row) and, per adapter, U's `parts`·r fp32
    columns plus four [rows, r] fp32 products with B."""
    per_row = 4 * d_in * w_copies + 4 * r * (parts + 4)
    return max(1, budget // per_row)


def _tensor_core_ready(w: Tensor) -> bool:
    return w.is_cuda and w.dtype in (torch.bfloat16, torch.float16)


def _right_operand(lora_a: Tensor, w: Tensor) -> tuple[Tensor, int]:
    """Aᵀ for U = W Aᵀ, and in how many parts it was split.

    A of W's half-precision dtype on CUDA is used as it is; an fp32 A with a bf16 W on CUDA
    becomes three bf16 parts with hi + mid + lo = A exactly, stacked [3r, d_in]; anything else
    is upcast to fp32.

    why: docs/design.md#the-factored-row-norm
    """
    if _tensor_core_ready(w) and lora_a.dtype == w.dtype:
        return lora_a.t(), 1
    if _tensor_core_ready(w) and w.dtype == torch.bfloat16 and lora_a.dtype == torch.float32:
        return split_bf16x3(lora_a).t(), 3
    return lora_a.float().t(), 1


def split_bf16x3(a: Tensor) -> Tensor:
    """fp32 [r, n] -> bf16 [3r, n] stacked hi, mid, lo with hi + mid + lo == a exactly
    (for normal fp32 values): written in place, no fp32 temporaries but one residual."""
    r = a.shape[0]
    parts = torch.empty(3 * r, *a.shape[1:], dtype=torch.bfloat16, device=a.device)
    parts[:r] = a  # round to nearest
    rest = a - parts[:r]  # exact in fp32
    parts[r : 2 * r] = rest
    rest -= parts[r : 2 * r]  # exact again; what is left has at most 8 significant bits
    parts[2 * r :] = rest
    return parts


def _u_rows(w_rows: Tensor, a_t: Tensor, parts: int) -> Tensor:
    """U_rows = W_rows Aᵀ in fp32 from `_right_operand`'s Aᵀ."""
    if a_t.dtype == torch.float32:
        return w_rows.float() @ a_t
    u = torch.mm(w_rows, a_t, out_dtype=torch.float32)
    if parts == 1:
        return u
    r = u.shape[1] // parts
    return (u[:, 2 * r :] + u[:, r : 2 * r]) + u[:, :r]  # the small parts first


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_KERNEL_PAIRS = {
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.float32),
}


def _kernel_reason(w_dtype: torch.dtype, lora_a: Tensor, lora_b: Tensor) -> str | None:
    """Why `factored_row_norm` does not run the one-launch Triton kernel, or None when it does."""
    if os.environ.get("NARROWS_DORA_FUSED") == "0":
        return "turned off by NARROWS_DORA_FUSED=0"
    if not lora_a.is_cuda:
        return "not on CUDA"
    if not is_available("triton"):
        return "Triton is not installed"
    if (w_dtype, lora_a.dtype) not in _KERNEL_PAIRS or lora_b.dtype not in _FLOATS:
        return f"W {w_dtype} with A {lora_a.dtype}"
    if not (lora_a.is_contiguous() and lora_b.is_contiguous()):
        return "non-contiguous adapter weights"
    return None


_NF4_MIN_SLICE_ROWS = 8192  # 128 blocks of 64 rows: about one per SM of an H100


def _norm_by_kernel(
    weight: Weight, lora_a: Tensor, lora_b: Tensor, scale: float, base_sq: Tensor | None, chunk_budget: int
) -> Tensor:
    """The Triton path: one launch for a float W; for a 4-bit W one per dequantised row slice
    (the slice, in the compute dtype, is then the largest intermediate: still well under
    PEFT's full fp32 copy of W plus its dense B·A)."""
    from .kernels import row_norm

    d_out, d_in = weight.shape
    gram = _gram(lora_a)
    a_parts = split_bf16x3(lora_a) if lora_a.dtype == torch.float32 else lora_a
    out = torch.empty(d_out, dtype=torch.float32, device=lora_a.device)
    if not isinstance(weight, NF4Rows):
        w = weight if weight.stride(1) == 1 else weight.contiguous()
        return row_norm(w, a_parts, lora_b, gram, scale, base_sq, out)
    # slices of at least _NF4_MIN_SLICE_ROWS rows: fewer rows leave most of the GPU idle
    rs = max(_row_chunk(d_in, chunk_budget, w_copies=1), _NF4_MIN_SLICE_ROWS)
    for r0 in range(0, d_out, rs):
        sub = None if base_sq is None else base_sq[r0 : r0 + rs]
        row_norm(weight.rows(r0, r0 + rs), a_parts, lora_b[r0 : r0 + rs], gram, scale, sub, out[r0 : r0 + rs])
    return out


def _gram(a: Tensor) -> Tensor:
    """G = A Aᵀ in fp32 ([r, r], the only whole intermediate)."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(a, a.t(), out_dtype=torch.float32)
    a = a.float()
    return a @ a.t()


def _rowdot(x: Tensor, y: Tensor) -> Tensor:
    return (x * y).sum(dim=1)


def sqrt_rn(x: Tensor) -> Tensor:
    """√x of an fp32 tensor, correctly rounded (IEEE 754's and Triton's ``sqrt_rn``) on every CPU.

    PyTorch's fp32 ``sqrt`` is not correctly rounded on some CPUs: on an AVX2 AMD EPYC it
    gives √4.75 = 0x1.16f832p+1 where IEEE gives 0x1.16f834p+1 (and it errs on about one
    random value in six there). So the root is taken in fp64 and rounded once to fp32. That
    double rounding is innocuous: the square root of an fp32 value lies more than 4 fp64 ulps
    from any midpoint between two fp32 values, so even an fp64 sqrt off by an ulp (PyTorch's
    is, on that CPU) rounds to the right fp32 value. NaN stays NaN."""
    return x.double().sqrt().float()


def assemble_norm(base_sq: Tensor, cross: Tensor, ba_sq: Tensor, scale: float) -> Tensor:
    """sqrt(max(base_sq + 2s·cross + s²·ba_sq, 0)) over fp32 [d_out] (Scaling DoRA eq. 5): the
    Triton kernel on CUDA, this expression elsewhere; the two round identically (2s and s²
    are Python floats in both, the sum is fp32 in both, the kernel is compiled without FMA
    contraction, and both take the IEEE square root: the kernel's ``sqrt_rn``, `sqrt_rn`
    here), so which one ran, or on which CPU, never shows in the result."""
    if base_sq.is_cuda and is_available("triton") and os.environ.get("NARROWS_DORA_FUSED") != "0":
        from .kernels import assemble_norm as kernel

        return kernel(base_sq.contiguous(), cross.contiguous(), ba_sq.contiguous(), scale)
    return sqrt_rn((base_sq + 2 * scale * cross + scale * scale * ba_sq).clamp_min(0))


@torch.no_grad()
def base_row_norm_sq(weight: Weight, *, chunk_budget: int = DEFAULT_CHUNK_BUDGET) -> Tensor:
    """||W||²_row in fp32: the frozen part, worth computing once per module."""
    d_out, d_in = weight.shape
    device = weight.packed.device if isinstance(weight, NF4Rows) else weight.device
    out = torch.empty(d_out, dtype=torch.float32, device=device)
    rs = _row_chunk(d_in, chunk_budget, w_copies=2 + isinstance(weight, NF4Rows))
    with torch.autocast(device.type, enabled=False):
        for r0 in range(0, d_out, rs):
            out[r0 : r0 + rs] = _rows(weight, r0, r0 + rs).float().square().sum(dim=1)
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
    scale 0 only it is used. Runs the Triton kernel where `_kernel_reason` allows it
    (``NARROWS_DORA_FUSED=0`` forces the PyTorch path).
    """
    d_out, d_in = weight.shape
    device = lora_a.device
    with torch.autocast(device.type, enabled=False):
        if scale == 0:
            return sqrt_rn(
                base_sq if base_sq is not None else base_row_norm_sq(weight, chunk_budget=chunk_budget)
            )
        if _kernel_reason(weight.dtype, lora_a, lora_b) is None:
            return _norm_by_kernel(weight, lora_a, lora_b, scale, base_sq, chunk_budget)
        need_base = base_sq is None  # then ||W||² is summed in the same pass over W, not a second one
        if need_base:
            base_sq = torch.empty(d_out, dtype=torch.float32, device=device)
        cross = torch.empty(d_out, dtype=torch.float32, device=device)
        ba_sq = torch.empty(d_out, dtype=torch.float32, device=device)
        gram = _gram(lora_a)
        r = lora_a.shape[0]
        # the operand's form depends on the rows' dtype (an NF4 weight dequantises to its own)
        a_t, parts = _right_operand(lora_a, _rows(weight, 0, 1))
        nf4 = isinstance(weight, NF4Rows)
        w_copies = 2 * need_base + (a_t.dtype == torch.float32 and weight.dtype != torch.float32) + nf4
        rs = _row_chunk(d_in, chunk_budget, r=r, parts=parts, w_copies=w_copies)
        for r0 in range(0, d_out, rs):
            w_r = _rows(weight, r0, r0 + rs)
            b_r = lora_b[r0 : r0 + rs].float()
            if need_base:
                base_sq[r0 : r0 + rs] = w_r.float().square().sum(dim=1)
            cross[r0 : r0 + rs] = _rowdot(b_r, _u_rows(w_r, a_t, parts))
            ba_sq[r0 : r0 + rs] = _rowdot(b_r @ gram, b_r)
        return assemble_norm(base_sq, cross, ba_sq, scale)


def dense_row_norm(weight: Tensor, lora_a: Tensor, lora_b: Tensor, scale: float) -> Tensor:
    """The reference: the dense composed weight in fp64."""
    w = weight.double() + scale * (lora_b.double() @ lora_a.double())
    return w.norm(dim=1)
