"""Triton kernels of the DoRA composition (CUDA only; imported only when one runs).

- `compose_forward`: ``out = (g - 1)·base + g·(s·lora)`` in one pass over [M, N]
  activations, fp32 arithmetic in the eager reference's order, cast on store.
- `compose_forward_dual`: the same output plus ``inner = s·lora + base`` (in the
  activation dtype), the one tensor the training backward needs: saving it instead of
  base and lora halves what each adapted module keeps for backward.
- `compose_backward`: ``d_base = go·(g - 1)``, ``d_lora = (go·g)·s`` and the magnitude
  gradient ``d_g = Σ_rows go·base + go·(s·lora)`` in the same pass: each program writes its
  rows' partial column sums to a [row blocks, N] fp32 buffer, and a second stage sums that
  buffer in a fixed order. No atomics, so the result is deterministic.
  `compose_backward_inner` does the same from the saved ``inner`` (``d_g = Σ_rows go·inner``).
- `assemble_norm`: ``sqrt(max(base_sq + 2s·cross + s²·ba_sq, 0))`` over [d_out] fp32, with
  PyTorch's rounding (separate multiplies and adds, IEEE ``sqrt_rn``, NaN kept by the clamp).

Both are compiled with floating-point contraction off (no FMA), so each element is the
same IEEE operation sequence as the eager path: `compose_forward`, `d_base` and `d_lora`
equal it bit for bit; `d_g` differs by summation order only. Block sizes are autotuned per
device and shape class; Triton caches the choice on disk (``cache_results``).
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


@_autotune
@triton.jit
def _forward_kernel(base_ptr, lora_ptr, g_ptr, out_ptr, M, N, M_CLASS, scale,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    offs = rm[:, None].to(tl.int64) * N + rn[None, :]
    b = tl.load(base_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    lo = tl.load(lora_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + rn, mask=rn < N, other=0.0)[None, :]
    out = (g - 1.0) * b + g * (scale * lo)
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@_autotune
@triton.jit
def _backward_kernel(go_ptr, base_ptr, lora_ptr, g_ptr, dbase_ptr, dlora_ptr, partial_ptr, M, N, M_CLASS, scale,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    pid_m = tl.program_id(0)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    offs = rm[:, None].to(tl.int64) * N + rn[None, :]
    go = tl.load(go_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(base_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    lo = tl.load(lora_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + rn, mask=rn < N, other=0.0)[None, :]
    tl.store(dbase_ptr + offs, (go * (g - 1.0)).to(dbase_ptr.dtype.element_ty), mask=mask)
    tl.store(dlora_ptr + offs, (go * g * scale).to(dlora_ptr.dtype.element_ty), mask=mask)
    part = tl.sum(go * b, axis=0) + tl.sum(go * (scale * lo), axis=0)
    tl.store(partial_ptr + pid_m.to(tl.int64) * N + rn, part, mask=rn < N)


@_autotune
@triton.jit
def _dual_kernel(base_ptr, lora_ptr, g_ptr, out_ptr, inner_ptr, M, N, M_CLASS, scale,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    offs = rm[:, None].to(tl.int64) * N + rn[None, :]
    b = tl.load(base_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    lo = tl.load(lora_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + rn, mask=rn < N, other=0.0)[None, :]
    slo = scale * lo
    tl.store(out_ptr + offs, ((g - 1.0) * b + g * slo).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(inner_ptr + offs, (slo + b).to(inner_ptr.dtype.element_ty), mask=mask)


@_autotune
@triton.jit
def _backward_inner_kernel(go_ptr, inner_ptr, g_ptr, dbase_ptr, dlora_ptr, partial_ptr, M, N, M_CLASS, scale,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    pid_m = tl.program_id(0)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    offs = rm[:, None].to(tl.int64) * N + rn[None, :]
    go = tl.load(go_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    inner = tl.load(inner_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + rn, mask=rn < N, other=0.0)[None, :]
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


def compose_backward(grad: Tensor, base: Tensor, lora: Tensor, g: Tensor, scale: float,
                     outs: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """(d_base, d_lora, d_g); `grad` is made contiguous here."""
    grad = grad.contiguous()
    m, n = _shape(base)
    d_base, d_lora = outs if outs is not None else (torch.empty_like(base), torch.empty_like(lora))
    partial = _partials(m, n, base.device)
    _backward_kernel[_grid(m, n)](grad, base, lora, g, d_base, d_lora, partial, m, n, _m_class(m), float(scale),
                                  enable_fp_fusion=False)  # fmt: skip
    return d_base, d_lora, _stage_two(_backward_kernel, partial, m)


def compose_forward_dual(base: Tensor, lora: Tensor, g: Tensor, scale: float,
                         outs: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(out, inner) for training: `inner = s·lora + base` is what `compose_backward_inner` reads."""
    m, n = _shape(base)
    out, inner = outs if outs is not None else (torch.empty_like(base), torch.empty_like(base))
    _dual_kernel[_grid(m, n)](
        base, lora, g, out, inner, m, n, _m_class(m), float(scale), enable_fp_fusion=False
    )
    return out, inner


def compose_backward_inner(grad: Tensor, inner: Tensor, g: Tensor, scale: float, lora_dtype: torch.dtype,
                           outs: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """(d_base, d_lora, d_g) from the saved `inner`: d_base in its dtype, d_lora in lora's."""
    grad = grad.contiguous()
    m, n = _shape(inner)
    if outs is None:
        outs = torch.empty_like(inner), torch.empty_like(inner, dtype=lora_dtype)
    d_base, d_lora = outs
    partial = _partials(m, n, inner.device)
    _backward_inner_kernel[_grid(m, n)](grad, inner, g, d_base, d_lora, partial, m, n, _m_class(m), float(scale),
                                        enable_fp_fusion=False)  # fmt: skip
    return d_base, d_lora, _stage_two(_backward_inner_kernel, partial, m)


_NORM_BLOCK = 256  # launch-bound: one fixed size (seed 002 App. B)


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
