"""Triton kernels of the DoRA composition (CUDA only; imported only when one runs).

Each kernel computes its eager counterpart's formula with floating-point contraction off:
forward outputs, ``d_base`` and ``d_lora`` equal the eager path bit for bit, ``d_g`` differs
by summation order only and is deterministic (no atomics); `assemble_norm` rounds as the
PyTorch path does. `row_norm` writes nothing the size of W, U or B.

why: docs/design.md#the-triton-kernels
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = [
    "assemble_norm",
    "compose_backward",
    "compose_backward_inner",
    "compose_forward",
    "compose_forward_dual",
    "row_norm",
]

_MIN_BLOCK_M = 32  # the backward's partial-sum buffer has cdiv(M, 32) rows at most
_CONFIGS = [
    triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w)
    for bm, bn, w in [(32, 64, 4), (32, 128, 4), (32, 256, 8), (64, 64, 4), (64, 128, 8)]
]


def _autotune(fn):
    try:
        return triton.autotune(configs=_CONFIGS, key=["M_CLASS", "N"], cache_results=True)(fn)
    except TypeError:  # a Triton without the on-disk cache
        return triton.autotune(configs=_CONFIGS, key=["M_CLASS", "N"])(fn)


@triton.jit
def _tile(g_ptr, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's [BLOCK_M, BLOCK_N] tile of an [M, N] activation: its columns, mask
    and element offsets, and the magnitude scale g of its columns as a [1, BLOCK_N] row."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    offs = rm[:, None].to(tl.int64) * N + rn[None, :]
    g = tl.load(g_ptr + rn, mask=rn < N, other=0.0)[None, :]
    return rn, mask, offs, g


@_autotune
@triton.jit
def _forward_kernel(
    base_ptr, lora_ptr, g_ptr, out_ptr, M, N, M_CLASS, scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    _, mask, offs, g = _tile(g_ptr, M, N, BLOCK_M, BLOCK_N)
    b = tl.load(base_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    lo = tl.load(lora_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out = (g - 1.0) * b + g * (scale * lo)
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@_autotune
@triton.jit
def _backward_kernel(
    go_ptr,
    base_ptr,
    lora_ptr,
    g_ptr,
    dbase_ptr,
    dlora_ptr,
    partial_ptr,
    M,
    N,
    M_CLASS,
    scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    rn, mask, offs, g = _tile(g_ptr, M, N, BLOCK_M, BLOCK_N)
    go = tl.load(go_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(base_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    lo = tl.load(lora_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(dbase_ptr + offs, (go * (g - 1.0)).to(dbase_ptr.dtype.element_ty), mask=mask)
    tl.store(dlora_ptr + offs, (go * g * scale).to(dlora_ptr.dtype.element_ty), mask=mask)
    part = tl.sum(go * b, axis=0) + tl.sum(go * (scale * lo), axis=0)
    tl.store(partial_ptr + pid_m.to(tl.int64) * N + rn, part, mask=rn < N)


@_autotune
@triton.jit
def _dual_kernel(
    base_ptr,
    lora_ptr,
    g_ptr,
    out_ptr,
    inner_ptr,
    M,
    N,
    M_CLASS,
    scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    _, mask, offs, g = _tile(g_ptr, M, N, BLOCK_M, BLOCK_N)
    b = tl.load(base_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    lo = tl.load(lora_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    slo = scale * lo
    tl.store(out_ptr + offs, ((g - 1.0) * b + g * slo).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(inner_ptr + offs, (slo + b).to(inner_ptr.dtype.element_ty), mask=mask)


@_autotune
@triton.jit
def _backward_inner_kernel(
    go_ptr,
    inner_ptr,
    g_ptr,
    dbase_ptr,
    dlora_ptr,
    partial_ptr,
    M,
    N,
    M_CLASS,
    scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    rn, mask, offs, g = _tile(g_ptr, M, N, BLOCK_M, BLOCK_N)
    go = tl.load(go_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    inner = tl.load(inner_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(dbase_ptr + offs, (go * (g - 1.0)).to(dbase_ptr.dtype.element_ty), mask=mask)
    tl.store(dlora_ptr + offs, (go * g * scale).to(dlora_ptr.dtype.element_ty), mask=mask)
    tl.store(partial_ptr + pid_m.to(tl.int64) * N + rn, tl.sum(go * inner, axis=0), mask=rn < N)


@triton.jit
def _norm_kernel(base_ptr, cross_ptr, ba_ptr, out_ptr, N, two_s, s2, BLOCK: tl.constexpr):
    rn = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = rn < N
    base = tl.load(base_ptr + rn, mask=mask, other=0.0)
    cross = tl.load(cross_ptr + rn, mask=mask, other=0.0)
    ba = tl.load(ba_ptr + rn, mask=mask, other=0.0)
    total = (base + two_s * cross) + s2 * ba  # compiled without contraction: two roundings each
    total = tl.where(total < 0.0, 0.0, total)  # a NaN fails the test and stays NaN, as in clamp_min
    tl.store(out_ptr + rn, tl.sqrt_rn(total), mask=mask)


def _m_class(m: int) -> int:
    """Autotune per power-of-two row count, not per exact one."""
    return 1 << max(0, (m - 1).bit_length())


def _shape(t: Tensor) -> tuple[int, int]:
    """(rows, columns) of the activation seen as a [M, N] matrix."""
    n = t.shape[-1]
    return t.numel() // n, n


def _grid(m: int, n: int):
    return lambda meta: (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]))


def _partials(m: int, n: int, device: torch.device) -> Tensor:
    """The backward's per-row-block column sums, sized for the smallest BLOCK_M."""
    return torch.empty(triton.cdiv(m, _MIN_BLOCK_M), n, dtype=torch.float32, device=device)


def _stage_two(kernel, partial: Tensor, m: int) -> Tensor:
    """Sum the row blocks the tuned launch wrote, in a fixed order: the deterministic d_g."""
    return partial[: triton.cdiv(m, kernel.best_config.kwargs["BLOCK_M"])].sum(dim=0)


def compose_forward(base: Tensor, lora: Tensor, g: Tensor, scale: float, out: Tensor | None = None) -> Tensor:
    """`base`, `lora` contiguous [..., N] of one dtype, `g` fp32 [N]."""
    m, n = _shape(base)
    out = torch.empty_like(base) if out is None else out
    _forward_kernel[_grid(m, n)](base, lora, g, out, m, n, _m_class(m), float(scale), enable_fp_fusion=False)
    return out


def compose_backward(
    grad: Tensor,
    base: Tensor,
    lora: Tensor,
    g: Tensor,
    scale: float,
    outs: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(d_base, d_lora, d_g); `grad` is made contiguous here."""
    grad = grad.contiguous()
    m, n = _shape(base)
    d_base, d_lora = outs if outs is not None else (torch.empty_like(base), torch.empty_like(lora))
    partial = _partials(m, n, base.device)
    _backward_kernel[_grid(m, n)](
        grad, base, lora, g, d_base, d_lora, partial, m, n, _m_class(m), float(scale), enable_fp_fusion=False
    )
    return d_base, d_lora, _stage_two(_backward_kernel, partial, m)


def compose_forward_dual(
    base: Tensor, lora: Tensor, g: Tensor, scale: float, outs: tuple[Tensor, Tensor] | None = None
) -> tuple[Tensor, Tensor]:
    """(out, inner) for training: `inner = s·lora + base` is what `compose_backward_inner` reads."""
    m, n = _shape(base)
    out, inner = outs if outs is not None else (torch.empty_like(base), torch.empty_like(base))
    _dual_kernel[_grid(m, n)](
        base, lora, g, out, inner, m, n, _m_class(m), float(scale), enable_fp_fusion=False
    )
    return out, inner


def compose_backward_inner(
    grad: Tensor,
    inner: Tensor,
    g: Tensor,
    scale: float,
    lora_dtype: torch.dtype,
    outs: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(d_base, d_lora, d_g) from the saved `inner`: d_base in its dtype, d_lora in lora's."""
    grad = grad.contiguous()
    m, n = _shape(inner)
    if outs is None:
        outs = torch.empty_like(inner), torch.empty_like(inner, dtype=lora_dtype)
    d_base, d_lora = outs
    partial = _partials(m, n, inner.device)
    _backward_inner_kernel[_grid(m, n)](
        grad, inner, g, d_base, d_lora, partial, m, n, _m_class(m), float(scale), enable_fp_fusion=False
    )
    return d_base, d_lora, _stage_two(_backward_inner_kernel, partial, m)


_NORM_BLOCK = 256  # launch-bound: one fixed size (Scaling DoRA, arXiv:2603.22276, App. B)


def assemble_norm(
    base_sq: Tensor, cross: Tensor, ba_sq: Tensor, scale: float, out: Tensor | None = None
) -> Tensor:
    """The row norm from its three fp32 [d_out] terms; 2s and s² are formed in fp64 (Python)."""
    n = base_sq.numel()
    out = torch.empty_like(base_sq) if out is None else out
    _norm_kernel[(triton.cdiv(n, _NORM_BLOCK),)](
        base_sq, cross, ba_sq, out, n, 2 * scale, scale * scale, BLOCK=_NORM_BLOCK, enable_fp_fusion=False
    )
    return out


_ROW_NORM_CONFIGS = [
    triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
    for bm, bn, bk, w, st in [
        (64, 128, 64, 4, 3),
        (128, 128, 64, 8, 3),
        (64, 64, 64, 4, 4),
        (32, 128, 64, 4, 3),
        (128, 256, 32, 8, 3),
    ]
]


def _autotune_norm(fn):
    key = ["D_OUT_CLASS", "D_IN", "R"]
    try:
        return triton.autotune(configs=_ROW_NORM_CONFIGS, key=key, cache_results=True)(fn)
    except TypeError:
        return triton.autotune(configs=_ROW_NORM_CONFIGS, key=key)(fn)


@_autotune_norm
@triton.jit
def _row_norm_kernel(
    w_ptr,
    a_ptr,
    b_ptr,
    gram_ptr,
    base_ptr,
    out_ptr,
    D_OUT,
    D_IN,
    R,
    D_OUT_CLASS,
    stride_w,
    two_s,
    s2,
    SPLIT: tl.constexpr,
    NEED_BASE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rm < D_OUT
    rows64 = rm.to(tl.int64)
    cross = tl.zeros([BLOCK_M], dtype=tl.float32)
    ba = tl.zeros([BLOCK_M], dtype=tl.float32)
    if NEED_BASE:  # its own pass over W's rows: a test inside the pipelined dot loop below miscompiles
        base = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, D_IN, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(
                w_ptr + rows64[:, None] * stride_w + rk[None, :],
                mask=row_ok[:, None] & (rk[None, :] < D_IN),
                other=0.0,
            ).to(tl.float32)
            base += tl.sum(w * w, axis=1)
    else:
        base = tl.load(base_ptr + rm, mask=row_ok, other=0.0)
    for n0 in range(0, R, BLOCK_N):
        rn = n0 + tl.arange(0, BLOCK_N)
        n_ok = rn < R
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, D_IN, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            k_ok = rk < D_IN
            w = tl.load(
                w_ptr + rows64[:, None] * stride_w + rk[None, :],
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            a_offs = rn[None, :].to(tl.int64) * D_IN + rk[:, None]
            a_mask = k_ok[:, None] & n_ok[None, :]
            if SPLIT:  # fp32 A given as hi, mid, lo bf16 blocks of R rows each: three tensor-core products
                lo = tl.load(a_ptr + 2 * R * D_IN + a_offs, mask=a_mask, other=0.0)
                acc = tl.dot(w, lo, acc)
                mid = tl.load(a_ptr + R * D_IN + a_offs, mask=a_mask, other=0.0)
                acc = tl.dot(w, mid, acc)
            hi = tl.load(a_ptr + a_offs, mask=a_mask, other=0.0)
            acc = tl.dot(w, hi, acc)
        b = tl.load(
            b_ptr + rows64[:, None] * R + rn[None, :], mask=row_ok[:, None] & n_ok[None, :], other=0.0
        )
        cross += tl.sum(acc * b.to(tl.float32), axis=1)
    for n0 in range(0, R, BLOCK_N):  # ||BA||²_row = rowsum((B G) ⊙ B), G = A Aᵀ [R, R] fp32
        rn = n0 + tl.arange(0, BLOCK_N)
        n_ok = rn < R
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, R, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            k_ok = rk < R
            bk = tl.load(
                b_ptr + rows64[:, None] * R + rk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
            )
            gk = tl.load(
                gram_ptr + rk[:, None] * R + rn[None, :], mask=k_ok[:, None] & n_ok[None, :], other=0.0
            )
            acc = tl.dot(bk.to(tl.float32), gk, acc, input_precision="ieee")
        b = tl.load(
            b_ptr + rows64[:, None] * R + rn[None, :], mask=row_ok[:, None] & n_ok[None, :], other=0.0
        )
        ba += tl.sum(acc * b.to(tl.float32), axis=1)
    total = (base + two_s * cross) + s2 * ba  # compiled without contraction, as in `assemble_norm`
    total = tl.where(total < 0.0, 0.0, total)
    tl.store(out_ptr + rm, tl.sqrt_rn(total), mask=row_ok)


def row_norm(
    weight: Tensor,
    a_parts: Tensor,
    lora_b: Tensor,
    gram: Tensor,
    scale: float,
    base_sq: Tensor | None,
    out: Tensor,
) -> Tensor:
    """||W + s·B·A||_row of `weight`'s rows into `out` (fp32). `weight` [rows, d_in] bf16/fp16
    with unit column stride; `a_parts` A in W's dtype, [r, d_in], or an fp32 A split for a
    bf16 W (`narrows.dora.norm.split_bf16x3`, [3r, d_in]); `lora_b` [rows, r] contiguous;
    `gram` = A Aᵀ fp32 [r, r]; `base_sq` [rows] or None (then the kernel sums ||W||² itself)."""
    d_out, d_in = weight.shape
    r = lora_b.shape[1]
    grid = lambda meta: (triton.cdiv(d_out, meta["BLOCK_M"]),)  # noqa: E731
    _row_norm_kernel[grid](
        weight,
        a_parts,
        lora_b,
        gram,
        out if base_sq is None else base_sq,
        out,
        d_out,
        d_in,
        r,
        _m_class(d_out),
        weight.stride(0),
        2 * scale,
        scale * scale,
        SPLIT=a_parts.shape[0] == 3 * r,
        NEED_BASE=base_sq is None,
        enable_fp_fusion=False,
    )
    return out
