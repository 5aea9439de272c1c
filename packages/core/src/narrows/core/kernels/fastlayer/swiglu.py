"""SwiGLU over the two halves of one (tokens, 2·I) buffer — a stacked gate/up matmul's
output — as Triton kernels (CUDA only; imported when one runs).

The backward writes the gate's and up's gradients over the two halves in place.
Arithmetic as `ops.swiglu`'s reference: float32, one rounding per output.

why: docs/design.md#element-wise-ops
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["swiglu_halves", "swiglu_halves_backward"]

_BLOCK = 1024


@triton.jit
def _forward(x_ptr, out_ptr, n_cols, x_stride, out_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0).to(tl.float32)
    u = tl.load(x_ptr + row * x_stride + n_cols + cols, mask=mask, other=0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _backward(grad_ptr, x_ptr, n_cols, x_stride, grad_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate_ptrs = x_ptr + row * x_stride + cols
    g = tl.load(gate_ptrs, mask=mask, other=0).to(tl.float32)
    u = tl.load(gate_ptrs + n_cols, mask=mask, other=0).to(tl.float32)
    d = tl.load(grad_ptr + row * grad_stride + cols, mask=mask, other=0).to(tl.float32)
    sig = tl.sigmoid(g)
    d_up = d * (g * sig)
    d_gate = d * u * sig * (1 + g * (1 - sig))
    tl.store(gate_ptrs, d_gate.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(gate_ptrs + n_cols, d_up.to(x_ptr.dtype.element_ty), mask=mask)


def _on(x: Tensor):
    """`x`'s CUDA device made current (Triton launches on the current one); nothing to do
    elsewhere (Triton's CPU interpreter, which the tests run)."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def _grid(rows: int, cols: int) -> tuple[int, int]:
    return rows, triton.cdiv(cols, _BLOCK)


def swiglu_halves(x: Tensor) -> Tensor:
    """``silu(x[:, :I]) · x[:, I:]`` for `x` of (tokens, 2·I), rows of unit column stride."""
    rows, width = x.shape
    cols = width // 2
    out = torch.empty(rows, cols, dtype=x.dtype, device=x.device)
    if rows:
        with _on(x):
            _forward[_grid(rows, cols)](x, out, cols, x.stride(0), out.stride(0), BLOCK=_BLOCK)
    return out


def swiglu_halves_backward(grad: Tensor, x: Tensor) -> None:
    """Overwrite `x`'s halves with the gradients of gate and up, given the output's."""
    rows, width = x.shape
    cols = width // 2
    if rows:
        grad = grad if grad.stride(-1) == 1 else grad.contiguous()
        with _on(x):
            _backward[_grid(rows, cols)](grad, x, cols, x.stride(0), grad.stride(0), BLOCK=_BLOCK)
