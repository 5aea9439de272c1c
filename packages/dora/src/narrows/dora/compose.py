"""The DoRA composition, eager PyTorch: the reference every other path must match.

    out = (g - 1) ⊙ base + g ⊙ (s · lora),   g = m / max(||W + sBA||_row, ε)

in this order (the stable form of Scaling DoRA §3.1: the small correction g - 1 stays
explicit) with fp32 intermediates, cast to the activation dtype at the end. `base` has the
bias already removed (the caller adds it back). The eager formula here is the reference;
`kernels.py` holds the Triton versions, dispatched through one custom op.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from narrows.core.optional import is_available

__all__ = [
    "FUSED_MIN_ELEMENTS",
    "backward_eager",
    "backward_inner_eager",
    "compose",
    "formula",
    "formula_dual",
    "fused_reason",
    "magnitude_scale",
    "norm_epsilon",
]


def norm_epsilon(dtype: torch.dtype) -> float:
    """The floor for the row norm: a norm below it is treated as it (no division blow-up)."""
    return 1e-12 if dtype in (torch.float32, torch.float64) else 1e-6


def magnitude_scale(magnitude: Tensor, norm: Tensor, dtype: torch.dtype) -> Tensor:
    """g = m / max(norm, ε), in fp32; the gradient reaches m, not the (detached) norm."""
    return magnitude.float() / norm.detach().float().clamp_min(norm_epsilon(dtype))


# --- the eager reference -----------------------------------------------------------------


def formula(base: Tensor, lora: Tensor, g: Tensor, scale: float) -> Tensor:
    """The DoRA output ``(g - 1)·base + g·s·lora`` in fp32: the reference the kernels match."""
    b, lo = base.float(), lora.float()
    return ((g - 1) * b + g * (scale * lo)).to(base.dtype)


def formula_dual(base: Tensor, lora: Tensor, g: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """The training forward of tier 1: the output and ``inner = s·lora + base``, the one
    activation-sized tensor its backward reads (in the activation dtype)."""
    b, slo = base.float(), scale * lora.float()
    return ((g - 1) * b + g * slo).to(base.dtype), (slo + b).to(base.dtype)


def backward_inner_eager(
    grad: Tensor, inner: Tensor, g: Tensor, scale: float, lora_dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    go = grad.float()
    dims = tuple(range(go.dim() - 1))
    return (go * (g - 1)).to(inner.dtype), (go * g * scale).to(lora_dtype), (go * inner.float()).sum(dims)


def backward_eager(
    grad: Tensor, base: Tensor, lora: Tensor, g: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    go = grad.float()
    d_base = (go * (g - 1)).to(base.dtype)
    d_lora = (go * g * scale).to(lora.dtype)
    dims = tuple(range(go.dim() - 1))
    d_g = (go * base.float()).sum(dims) + (go * (scale * lora.float())).sum(dims)
    return d_base, d_lora, d_g


# --- dispatch ---------------------------------------------------------------------------

# the crossover measured on the H100 (benchmarks/dora_kernels.py, bf16): the forward kernel
# wins from about 1M elements, the backward one from 2048 x 4096 (at 2048 x 2048 it was 0.85x)
FUSED_MIN_ELEMENTS = {"forward": 1 << 20, "backward": 1 << 23}


def fused_reason(base: Tensor, lora: Tensor, g: Tensor, which: str = "forward") -> str | None:
    """Why the Triton path does not run for these tensors, or None when it does.

    Tier 1/2 (fused backward for training, fused forward for inference) need CUDA, Triton,
    contiguous activations of one dtype, a magnitude that broadcasts along the last
    dimension only, and at least the crossover size; everything else is tier 3 (eager).
    ``NARROWS_DORA_FUSED=0`` turns the kernels off, ``=1`` ignores the size crossover.
    """
    forced = os.environ.get("NARROWS_DORA_FUSED")
    if forced == "0":
        return "turned off by NARROWS_DORA_FUSED=0"
    if not base.is_cuda:
        return "not on CUDA"
    if not is_available("triton"):
        return "Triton is not installed"
    if base.shape != lora.shape:
        return "base and lora differ in shape"
    if base.dtype not in _FUSED_DTYPES or lora.dtype not in _FUSED_DTYPES:
        return "an activation dtype other than fp32/bf16/fp16"
    if not (base.is_contiguous() and lora.is_contiguous()):
        return "non-contiguous activations"
    if g.dim() != 1 or g.shape[0] != base.shape[-1] or g.dtype != torch.float32:
        return "the magnitude does not broadcast along the last dimension only"
    if forced != "1" and base.numel() < FUSED_MIN_ELEMENTS[which]:
        return "below the measured crossover size"
    return None


_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _compose_impl(base: Tensor, lora: Tensor, g: Tensor, scale: float) -> Tensor:
    if fused_reason(base, lora, g, "forward") is None:
        from .kernels import compose_forward

        return compose_forward(base, lora, g.contiguous(), scale)
    return formula(base, lora, g, scale)


_compose_op = torch.library.custom_op("narrows_dora::compose", mutates_args=())(_compose_impl)


@_compose_op.register_fake
def _(base: Tensor, lora: Tensor, g: Tensor, scale: float) -> Tensor:
    return torch.empty_like(base)


def _compose_backward_impl(
    grad: Tensor, base: Tensor, lora: Tensor, g: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    if fused_reason(base, lora, g, "backward") is None:
        from .kernels import compose_backward

        return compose_backward(grad, base, lora, g.contiguous(), scale)
    return backward_eager(grad, base, lora, g, scale)


_compose_backward_op = torch.library.custom_op("narrows_dora::compose_backward", mutates_args=())(
    _compose_backward_impl
)


@_compose_backward_op.register_fake
def _(grad: Tensor, base: Tensor, lora: Tensor, g: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(base), torch.empty_like(lora), torch.empty_like(g)


def _setup_context(ctx, inputs, output) -> None:
    base, lora, g, scale = inputs
    # the activations are saved in their own dtype: autograd of the fp32 formula would keep
    # fp32 copies of base and lora for every adapted module until backward
    ctx.save_for_backward(base, lora, g)
    ctx.scale = scale


def _backward(ctx, grad: Tensor):
    base, lora, g = ctx.saved_tensors
    d_base, d_lora, d_g = torch.ops.narrows_dora.compose_backward(grad, base, lora, g, ctx.scale)
    return d_base, d_lora, d_g, None


_compose_op.register_autograd(_backward, setup_context=_setup_context)


# --- tier 1: training on CUDA above the crossover, saving `inner` only ---------------------


def _compose_train_impl(base: Tensor, lora: Tensor, g: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    if fused_reason(base, lora, g, "backward") is None:
        from .kernels import compose_forward_dual

        return compose_forward_dual(base, lora, g.contiguous(), scale)
    return formula_dual(base, lora, g, scale)


_compose_train_op = torch.library.custom_op("narrows_dora::compose_train", mutates_args=())(
    _compose_train_impl
)


@_compose_train_op.register_fake
def _(base: Tensor, lora: Tensor, g: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    return torch.empty_like(base), torch.empty_like(base)


def _compose_train_backward_impl(
    grad: Tensor, inner: Tensor, g: Tensor, scale: float, lora_dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    if fused_reason(inner, inner, g, "backward") is None:
        from .kernels import compose_backward_inner

        return compose_backward_inner(grad, inner, g.contiguous(), scale, lora_dtype)
    return backward_inner_eager(grad, inner, g, scale, lora_dtype)


_compose_train_backward_op = torch.library.custom_op("narrows_dora::compose_train_backward", mutates_args=())(
    _compose_train_backward_impl
)


@_compose_train_backward_op.register_fake
def _(
    grad: Tensor, inner: Tensor, g: Tensor, scale: float, lora_dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(inner), torch.empty_like(inner, dtype=lora_dtype), torch.empty_like(g)


def _setup_train_context(ctx, inputs, output) -> None:
    _, lora, g, scale = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(output[1], g)
    ctx.scale = scale
    ctx.lora_dtype = lora.dtype


def _train_backward(ctx, grad: Tensor, _grad_inner: Tensor | None):
    inner, g = ctx.saved_tensors
    d_base, d_lora, d_g = torch.ops.narrows_dora.compose_train_backward(
        grad, inner, g, ctx.scale, ctx.lora_dtype
    )
    return d_base, d_lora, d_g, None


_compose_train_op.register_autograd(_train_backward, setup_context=_setup_train_context)


class _Compose(torch.autograd.Function):
    """Eager twin of ``narrows_dora::compose`` (same implementations, none of the custom-op
    dispatch overhead, which is paid per adapted module twice a step)."""

    @staticmethod
    def forward(ctx, base: Tensor, lora: Tensor, g: Tensor, scale: float) -> Tensor:
        ctx.save_for_backward(base, lora, g)
        ctx.scale = scale
        return _compose_impl(base, lora, g, scale)

    @staticmethod
    def backward(ctx, grad: Tensor):
        base, lora, g = ctx.saved_tensors
        return (*_compose_backward_impl(grad, base, lora, g, ctx.scale), None)


class _ComposeTrain(torch.autograd.Function):
    """Eager twin of ``narrows_dora::compose_train``, used only once `compose` has found the
    kernels apply: it calls them without asking `fused_reason` again in each direction."""

    @staticmethod
    def forward(ctx, base: Tensor, lora: Tensor, g: Tensor, scale: float) -> Tensor:
        from .kernels import compose_forward_dual

        g = g.contiguous()
        out, inner = compose_forward_dual(base, lora, g, scale)
        ctx.save_for_backward(inner, g)
        ctx.scale, ctx.lora_dtype = scale, lora.dtype
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        from .kernels import compose_backward_inner

        inner, g = ctx.saved_tensors
        return (*compose_backward_inner(grad, inner, g, ctx.scale, ctx.lora_dtype), None)


def compose(base: Tensor, lora: Tensor, g: Tensor, scale: float) -> Tensor:
    """(g - 1)·base + g·(scale·lora), broadcasting g [d_out] over the last dimension.

    The output equals the eager formula on every path. Training on CUDA above the crossover
    (`fused_reason`) saves one activation, ``inner = s·lora + base``, so its magnitude gradient
    differs from the eager one by the rounding of ``inner`` to the activation dtype. Under
    `torch.compile` it is a custom op (``torch.ops.narrows_dora.*``): the graph does not break.

    why: docs/design.md#the-composition-and-its-three-paths
    """
    scale = float(scale)
    train = (
        base.is_cuda
        and torch.is_grad_enabled()
        and g.requires_grad
        and fused_reason(base, lora, g, "backward") is None
    )
    if torch.compiler.is_compiling():
        return _compose_train_op(base, lora, g, scale)[0] if train else _compose_op(base, lora, g, scale)
    return _ComposeTrain.apply(base, lora, g, scale) if train else _Compose.apply(base, lora, g, scale)
