"""PEFT's LoRA linears with the adapter branch as one autograd node, and one cast of a
shared input: the same bits as PEFT, fewer nodes, less saved memory.

`fuse_lora(model)` covers PEFT's ``lora.Linear`` and bitsandbytes ``lora.Linear4bit``; a call
it does not cover goes to PEFT's forward unchanged. The shared cast trusts PyTorch's
version counters: an input changed in place through ``.data`` between two linears that
read it reaches the second with the first's cast.

why: docs/design.md#lora-branches
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch import Tensor, nn

__all__ = ["LoraBranch", "fuse_lora", "lora_branch_reference", "unfuse_lora"]


def lora_branch_reference(
    result: Tensor, x: Tensor, a: Tensor, b: Tensor, scaling: float, promote: bool
) -> Tensor:
    """What PEFT computes (the oracle): `promote` adds in the promoted dtype, then casts
    back (``lora.Linear``); otherwise the branch is cast to the result's dtype first
    (``lora.Linear4bit``)."""
    lora = nn.functional.linear(nn.functional.linear(x.to(a.dtype), a), b) * scaling
    if promote:
        return (result + lora).to(result.dtype)
    return result + lora.to(result.dtype)


class LoraBranch(torch.autograd.Function):
    """``lora_branch_reference(result, x, a, b, scaling, promote)`` as one node, where
    `xa` is `x` in the adapter's dtype (`x` itself when they agree), computed outside
    and not differentiated: the gradient of `x` is this node's."""

    @staticmethod
    def forward(ctx, result, x, xa, a, b, scaling, promote):  # type: ignore[override]
        h2 = xa.reshape(-1, xa.shape[-1]).mm(a.t())  # (tokens, r)
        lora = h2.mm(b.t()).view(*xa.shape[:-1], b.shape[0]) * scaling  # (..., out)
        out = (result + lora).to(result.dtype) if promote else result + lora.to(result.dtype)
        # what PEFT's matmuls keep: an input only where its weight trains; the weights as views
        need = ctx.needs_input_grad
        ctx.save_for_backward(xa if need[3] else None, h2 if need[4] else None, a.t(), b.t())
        ctx.scaling, ctx.promote, ctx.x_shape = scaling, promote, xa.shape
        ctx.dtypes = (result.dtype, x.dtype, lora.dtype, torch.promote_types(result.dtype, lora.dtype))
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        xa, h2, a_t, b_t = ctx.saved_tensors
        a, b = a_t.t(), b_t.t()
        result_dtype, x_dtype, lora_dtype, sum_dtype = ctx.dtypes
        if ctx.promote:  # out = (result + lora).to(result dtype)
            g_sum = grad.to(sum_dtype)
            g_result, g_lora = g_sum.to(result_dtype), g_sum.to(lora_dtype)
        else:  # out = result + lora.to(result dtype)
            g_result, g_lora = grad, grad.to(lora_dtype)
        g2 = (g_lora * ctx.scaling).reshape(-1, g_lora.shape[-1])  # (tokens, out)
        gh = g2.mm(b)  # (tokens, r)
        need = ctx.needs_input_grad
        g_b = g2.t().mm(h2) if need[4] else None
        g_x = gh.mm(a).view(ctx.x_shape).to(x_dtype) if need[1] else None
        g_a = gh.t().mm(xa.reshape(-1, xa.shape[-1])) if need[3] else None
        return (g_result if need[0] else None), g_x, None, g_a, g_b, None, None


_local = threading.local()  # per thread (a checkpoint's recompute runs in autograd's): the last cast


def _cast_once(x: Tensor, dtype: torch.dtype) -> Tensor:
    """`x` in `dtype`, the same tensor for every call on the same `x` (unchanged since)
    while the first cast is alive — so linears that share an input save one copy."""
    if x.dtype == dtype:
        return x
    if x.is_inference():  # no version counter to trust: cast per call
        return x.to(dtype)
    # a cast made outside a CUDA graph's capture is not in the graph: a replay would read
    # it stale, so one made eagerly never serves a capture (and the reverse)
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    key = (x._version, dtype, capturing)
    last = getattr(_local, "last", None)  # (weak x, key, weak cast)
    if last is not None:
        x_ref, last_key, cast_ref = last
        cast = cast_ref()
        if x_ref() is x and last_key == key and cast is not None:
            return cast
    with torch.no_grad():
        cast = x.to(dtype)
    _local.last = (weakref.ref(x), key, weakref.ref(cast))
    return cast


def _kinds() -> dict[type, bool]:
    """The covered PEFT classes, each with whether it adds in the promoted dtype."""
    from peft.tuners.lora.layer import Linear

    kinds = {Linear: True}
    try:
        from peft.tuners.lora.bnb import Linear4bit
    except ImportError:  # no bitsandbytes
        return kinds
    kinds[Linear4bit] = False
    return kinds


def _plain(module: nn.Module) -> bool:
    """No hooks and no replaced forward (accelerate's offload hooks replace it): the node
    would skip them."""
    return not (
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
        or "forward" in module.__dict__
    )


def _no_global_hooks() -> bool:
    m = nn.modules.module
    return not (
        m._global_forward_hooks
        or m._global_forward_pre_hooks
        or m._global_backward_hooks
        or m._global_backward_pre_hooks
    )


def _covered(self: nn.Module, x: Tensor, args: tuple, kwargs: dict) -> str | None:
    """The active adapter when the node computes this call as PEFT would; else None."""
    if args or kwargs or self.disable_adapters or self.merged or len(self.active_adapters) != 1:
        return None
    name = self.active_adapters[0]
    if name not in self.lora_A or name in self.lora_variant or torch.is_autocast_enabled(x.device.type):
        return None
    a, b, dropout = self.lora_A[name], self.lora_B[name], self.lora_dropout[name]
    if type(a) is not nn.Linear or type(b) is not nn.Linear or a.bias is not None or b.bias is not None:
        return None
    if type(dropout) is not nn.Identity or not all(map(_plain, (a, b, dropout))) or not _no_global_hooks():
        return None
    if x.dim() < 2 or not x.is_contiguous() or b.weight.dtype != a.weight.dtype:
        return None
    if x.dtype != a.weight.dtype and not getattr(self, "cast_input_dtype_enabled", True):
        return None
    return name


class _FusedForward:
    """A fused module's ``forward``: a callable object rather than a bound function, so a
    pickled model (``torch.save(model)``) loads back; it holds its module weakly, so the
    model is freed when its last reference goes (no cycle left for the collector)."""

    def __init__(self, module: nn.Module, promote: bool):
        self.module = weakref.ref(module)
        self.promote = promote  # PEFT's lora.Linear adds in the promoted dtype; Linear4bit casts first

    def __reduce__(self):
        return _FusedForward, (self.module(), self.promote)

    def __call__(self, x: Tensor, *args, **kwargs) -> Tensor:
        module = self.module()
        name = _covered(module, x, args, kwargs)
        if name is None:
            return type(module).forward(module, x, *args, **kwargs)
        promote = self.promote
        result = module.base_layer(x)
        if not promote:
            result = result.clone()  # as PEFT's Linear4bit does
        a, b = module.lora_A[name].weight, module.lora_B[name].weight
        return LoraBranch.apply(result, x, _cast_once(x, a.dtype), a, b, module.scaling[name], promote)


def fuse_lora(model: nn.Module) -> int:
    """Run `model`'s PEFT LoRA linears through `LoraBranch` where it computes what PEFT
    would (the rest of the calls go to PEFT unchanged). Patches the instances, not the
    classes, and leaves alone a linear whose forward something else replaced (accelerate's
    hooks); returns how many linears it covers. `unfuse_lora` undoes it."""
    kinds = _kinds()
    count = 0
    for module in model.modules():
        promote = kinds.get(type(module))
        if promote is None:
            continue
        forward = module.__dict__.get("forward")
        if forward is not None and not isinstance(forward, _FusedForward):
            continue
        module.forward = _FusedForward(module, promote)
        count += 1
    return count


def unfuse_lora(model: nn.Module) -> int:
    """Back to PEFT's forwards; returns how many linears were fused."""
    count = 0
    for module in model.modules():
        if isinstance(module.__dict__.get("forward"), _FusedForward):
            del module.forward
            count += 1
    return count
