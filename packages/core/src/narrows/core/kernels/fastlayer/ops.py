"""The element-wise pieces of a fast decoder layer, each a forward and a hand-written
backward: RMSNorm, rotary embeddings, SwiGLU, and gpt-oss's clamped SwiGLU (the
reference alone, over blocks of rows).

Each op has one pure-PyTorch reference; on CUDA, Liger-Kernel's where installed and
narrows' `swiglu` for a stacked gate/up. `kernels_in_use()` says which ran;
``NARROWS_LIGER=0`` keeps the references. Statistics and derivatives in float32, one
rounding to the activation dtype per output.

why: docs/design.md#element-wise-ops
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .stacking import side_by_side

__all__ = [
    "clamped_glu",
    "clamped_glu_backward",
    "kernels_in_use",
    "rms_norm",
    "rms_norm_backward",
    "rms_norm_rows",
    "rope",
    "rope_backward",
    "rope_pair",
    "rope_pair_backward",
    "swiglu",
    "swiglu_backward",
]


def _library(module: str, accepts: Callable[[Any], bool]) -> Any:
    """``liger_kernel.ops.<module>`` where it is installed, takes what we pass (`accepts`
    says, from its signatures) and ``NARROWS_LIGER=0`` does not turn it off; else None."""
    if os.environ.get("NARROWS_LIGER") == "0":
        return None
    try:
        found = importlib.import_module(f"liger_kernel.ops.{module}")
    except Exception:  # not installed, or no Triton
        return None
    try:
        return found if accepts(found) else None
    except (AttributeError, TypeError, ValueError):  # moved or renamed
        return None


def _params(fn: Callable[..., Any]) -> list[str]:
    return list(inspect.signature(fn).parameters)


@functools.cache
def _liger():
    """Liger-Kernel's SwiGLU module."""
    return _library("swiglu", lambda m: callable(m.swiglu_forward) and callable(m.swiglu_backward))


@functools.cache
def _liger_norm():
    """Liger-Kernel's RMSNorm module (0.8.5's forward and backward)."""
    return _library(
        "rms_norm",
        lambda m: (
            _params(m.rms_norm_forward) == ["X", "W", "eps", "offset", "casting_mode", "row_mode"]
            and "needs_dw" in _params(m.rms_norm_backward)
        ),
    )


@functools.cache
def _liger_rope():
    """Liger-Kernel's RoPE module (forward and backward taking q, k, cos, sin first)."""
    return _library(
        "rope",
        lambda m: (
            _params(m.rope_forward)[:4] == ["q", "k", "cos", "sin"]
            and _params(m.rope_backward)[:4] == ["dq", "dk", "cos", "sin"]
        ),
    )


@functools.cache
def _triton_halves():
    """narrows' SwiGLU over a stacked buffer's halves (`swiglu`), or None without Triton."""
    if os.environ.get("NARROWS_LIGER") == "0":
        return None
    try:
        from . import swiglu
    except Exception:
        return None
    return swiglu


def _use_triton(t: Tensor) -> bool:
    return t.is_cuda and t.dtype != torch.float64 and _triton_halves() is not None


def _use_liger_rope(t: Tensor, cos: Tensor) -> bool:
    """Liger's RoPE for 4-D heads on CUDA with (batch or 1, seq, head_dim) tables, whose
    rotary width is the whole head (the Llama family's)."""
    return (
        t.is_cuda
        and t.dtype != torch.float64
        and t.dim() == 4
        and cos.dim() == 3
        and cos.shape[-1] == t.shape[-1]
        and _liger_rope() is not None
    )


def _use_liger(t: Tensor) -> bool:
    """Liger's SwiGLU on CUDA; float64 (the tests' reference) always takes the formula."""
    return t.is_cuda and t.dtype != torch.float64 and _liger() is not None


def _use_liger_norm(x: Tensor) -> bool:
    return (
        x.is_cuda
        and x.dim() == 2
        and x.is_contiguous()
        and x.dtype != torch.float64
        and _liger_norm() is not None
    )


def kernels_in_use(device: torch.device | str) -> dict[str, str]:
    """Which implementation each op runs on `device` ("liger" or "torch"); the Q/K norms
    run the RMSNorm's (`rms_norm_rows`)."""
    cuda = torch.device(device).type == "cuda"
    return {
        "rms_norm": "liger" if cuda and _liger_norm() is not None else "torch",
        "rope": "liger" if cuda and _liger_rope() is not None else "torch",
        "swiglu": "liger" if cuda and _liger() is not None else "torch",
        "swiglu_halves": "narrows-triton" if cuda and _triton_halves() is not None else "torch",
    }


def _wide(t: Tensor) -> Tensor:
    """`t` in float32 at least (float64 stays)."""
    return t if t.dtype == torch.float64 else t.float()


# RMSNorm ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _LigerNormState:
    rstd: Tensor
    block: int
    warps: int
    mode: int


# what a norm's backward needs: the reciprocal rms (and Liger's settings)
NormState = Tensor | _LigerNormState


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, NormState]:
    """``weight * (x / rms(x))`` over the last dim, and what the backward needs (the
    reciprocal rms, float32). The normalised value is rounded to `x`'s dtype before the
    weight multiplies it, as Llama's own norm does."""
    if _use_liger_norm(x) and weight.dtype == x.dtype:
        y, _, rstd, block, warps, mode = _liger_norm().rms_norm_forward(x, weight, eps, 0.0, "llama", False)
        return y, _LigerNormState(rstd, block, warps, mode)
    x32 = _wide(x)
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (x32 * rstd).to(x.dtype), rstd


def rms_norm_rows(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor, NormState]:
    """`rms_norm` of a view whose rows are not contiguous (the Q/K norms' inputs: column
    blocks of the stacked Q/K/V output): the normalised value in `x`'s shape, the input the
    backward reads, and its state. Where Liger-Kernel's norm runs, the rows are copied into
    one contiguous (rows, width) tensor first — that copy is the input the backward reads —
    so Liger's kernel runs, not the reference's float32 passes."""
    if x.is_cuda and x.dtype != torch.float64 and weight.dtype == x.dtype and _liger_norm() is not None:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        y, state = rms_norm(rows, weight, eps)
        return y.view(x.shape), rows, state
    y, state = rms_norm(x, weight, eps)
    return y, x, state


def rms_norm_backward(grad: Tensor, x: Tensor, weight: Tensor, rstd: NormState) -> Tensor:
    """The gradient of `x` (the weight is frozen): ``rstd * (g - y * mean(g * y))`` with
    ``g = grad * weight`` and ``y = x * rstd``, all in float32."""
    if isinstance(rstd, _LigerNormState):
        st = rstd
        d_x, _ = _liger_norm().rms_norm_backward(
            grad.contiguous(),
            x,
            weight,
            st.rstd,
            0.0,
            st.mode,
            st.block,
            st.warps,
            False,
            False,
            needs_dw=False,
        )
        return d_x
    y = _wide(x) * rstd
    g = _wide(grad) * weight.to(y.dtype)
    return (rstd * (g - y * (g * y).mean(-1, keepdim=True))).to(x.dtype)


# rotary embeddings --------------------------------------------------------------------


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x * cos + rotate_half(x) * sin`` (the Llama family's rotary embedding); `cos`
    and `sin` broadcast over the heads dim."""
    return x * cos + _rotate_half(x) * sin


def rope_backward(grad: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """rotate_half is antisymmetric, so its transpose is its negation."""
    return grad * cos - _rotate_half(grad * sin)


def rope_pair(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Queries (batch, heads, seq, head_dim) and keys (batch, kv_heads, ...) rotated, with
    `cos`/`sin` of (batch or 1, seq, head_dim) as the model's rotary embedding gives them
    (the family's tables: both halves alike, ``cat(freqs, freqs)``, RoPE scaling included —
    Liger's kernel reads the first half only). On CUDA Liger-Kernel's kernel does both in
    one pass, writing over `q` and `k` (or over their contiguous copies); elsewhere the
    reference. Tables narrower than a head (partial rotary, GLM-4's) turn each head's first
    channels and pass the rest."""
    rot = cos.shape[-1]
    if rot < q.shape[-1]:
        qr, kr = rope_pair(q[..., :rot].contiguous(), k[..., :rot].contiguous(), cos, sin)
        return torch.cat([qr, q[..., rot:]], dim=-1), torch.cat([kr, k[..., rot:]], dim=-1)
    if _use_liger_rope(q, cos):
        q, k, _, _ = _liger_rope().rope_forward(q, k, cos, sin)
        return q, k
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return rope(q, c, s), rope(k, c, s)


def rope_pair_backward(gq: Tensor, gk: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """The gradients of `rope_pair`'s inputs (Liger's writes them over `gq` and `gk`)."""
    rot = cos.shape[-1]
    if rot < gq.shape[-1]:
        gqr, gkr = rope_pair_backward(gq[..., :rot].contiguous(), gk[..., :rot].contiguous(), cos, sin)
        return torch.cat([gqr, gq[..., rot:]], dim=-1), torch.cat([gkr, gk[..., rot:]], dim=-1)
    if _use_liger_rope(gq, cos):
        gq, gk = _liger_rope().rope_backward(gq, gk, cos, sin)[:2]
        return gq, gk
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return rope_backward(gq, c, s), rope_backward(gk, c, s)


# SwiGLU -------------------------------------------------------------------------------


def _halves(gate: Tensor, up: Tensor) -> Tensor | None:
    """The one (tokens, 2·I) buffer whose halves `gate` and `up` are (a stacked gate/up
    matmul's output), or None."""
    if gate.dim() != 2 or gate.shape != up.shape:
        return None
    return side_by_side([gate, up], dim=1)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up``, computed in float32 and rounded once."""
    joint = _halves(gate, up)
    if joint is not None and _use_triton(gate):
        return _triton_halves().swiglu_halves(joint)
    if _use_liger(gate) and gate.is_contiguous() and up.is_contiguous():
        return _liger().swiglu_forward(gate, up)[2]
    g = _wide(gate)
    return (g * torch.sigmoid(g) * _wide(up)).to(gate.dtype)


def swiglu_backward(
    grad: Tensor, gate: Tensor, up: Tensor, *, inplace: bool = False
) -> tuple[Tensor, Tensor]:
    """Gradients of `gate` and `up`. With `inplace` the inputs' storage may be reused for
    them (Liger writes them there; halves of one buffer get theirs written over them, so
    the buffer is the stacked gradient), so neither may be read afterwards."""
    joint = _halves(gate, up) if inplace else None
    if joint is not None and _use_triton(gate):
        _triton_halves().swiglu_halves_backward(grad, joint)
        return gate, up
    if _use_liger(gate) and gate.is_contiguous() and up.is_contiguous():
        if not inplace:
            gate, up = gate.clone(), up.clone()
        d_gate, d_up = _liger().swiglu_backward(gate, up, grad.contiguous())
        return d_gate, d_up
    g, u, d = _wide(gate), _wide(up), _wide(grad)
    sig = torch.sigmoid(g)
    silu = g * sig
    d_up = (d * silu).to(up.dtype)
    d_gate = (d * u * sig * (1 + g * (1 - sig))).to(gate.dtype)
    if joint is not None:  # as the kernel leaves them: over the halves
        gate.copy_(d_gate)
        up.copy_(d_up)
        return gate, up
    return d_gate, d_up


# gpt-oss's SwiGLU --------------------------------------------------------------------

_GLU_PARTS = 8  # row blocks of the clamped SwiGLU: its float32 temporaries stay within the planner's price


def _row_blocks(rows: int) -> list[slice]:
    step = max(1, -(-rows // _GLU_PARTS))
    return [slice(r, min(r + step, rows)) for r in range(0, rows, step)]


def clamped_glu(gate: Tensor, up: Tensor, alpha: float, limit: float) -> Tensor:
    """gpt-oss's SwiGLU: ``(clamp(up, ±limit) + 1) · g · sigmoid(alpha · g)`` with
    ``g = min(gate, limit)``, computed in float32 and rounded once, an eighth of the rows
    at a time (an eighth of the float32 temporaries)."""
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    for b in _row_blocks(gate.shape[0]):
        g = gate[b].float().clamp(max=limit)
        u = up[b].float().clamp(min=-limit, max=limit)
        out[b] = (u + 1) * g * torch.sigmoid(alpha * g)
    return out


def clamped_glu_backward(grad: Tensor, gate: Tensor, up: Tensor, alpha: float, limit: float) -> None:
    """`clamped_glu`'s input gradients, written over `gate` and `up` (zero where a clamp
    held its input: torch's clamp passes the gradient where the input lies within the
    bounds, ends included), an eighth of the rows at a time."""
    for b in _row_blocks(gate.shape[0]):
        d, g_raw, u_raw = grad[b].float(), gate[b].float(), up[b].float()
        g, u = g_raw.clamp(max=limit), u_raw.clamp(min=-limit, max=limit)
        sig = torch.sigmoid(alpha * g)
        gate[b] = d * (u + 1) * sig * (1 + alpha * g * (1 - sig)) * (g_raw <= limit)
        up[b] = d * g * sig * ((u_raw >= -limit) & (u_raw <= limit))
