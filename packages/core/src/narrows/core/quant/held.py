"""NF4 weights dequantised once and held for a run of calls.

A layer that runs many times in a row — step mode runs each layer for every micro-batch
of a step, forward then recompute-and-backward — dequantises each 4-bit weight on every
call: bitsandbytes computes a 4-bit linear of more than a few tokens as "dequantise the
whole weight, then one plain matmul", in the forward (``F.linear`` on the fresh weight)
and again in the backward (the input gradient as ``grad @ W``). `HeldWeights.hold(layer)`
dequantises the layer's weights once into a device buffer and, while it is held, runs
those same two matmuls on the held copy: the same kernels on the same values, so the same
bits. Only calls bitsandbytes itself would run that way take the held copy; the rest go
through bitsandbytes untouched:

* calls it routes to its own fused kernel (few tokens, on some GPUs — its dispatch is
  asked, so the choice is the one it would make);
* an input whose dtype is not the weight's quantisation dtype (its forward dequantises
  into the input's dtype, its backward into the weight's, so no one copy serves both);
* weights repacked for bitsandbytes' CPU inference format, or in the [in, out] layout;
* a bitsandbytes without the ``gemm_4bit`` operator (before 0.50), whose calls differ.

Memory: one buffer for the largest layer, allocated once: its address never changes, so a
CUDA graph captured over held weights reads the right ones on every replay, and
`held_token` (its address while a layer is held, else 0) keys those graphs. Each weight
starts on a 512-byte boundary, as a fresh allocation would (a matmul's kernel choice may
depend on its operands' alignment).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from .dequantize import dequantize_nf4
from .nf4 import is_nf4_linear

__all__ = ["HeldWeights", "dequantized_bytes", "held_bytes", "held_token", "held_weight"]

_ALIGN = 512  # bytes: where the caching allocator starts every block
_held: dict[int, Tensor] = {}  # id(Params4bit) → its dequantised copy, while held
_token: dict[int, int] = {}  # id(layer) → the buffer's address, while held
_original = None  # bitsandbytes.matmul_4bit as the last hold found it (what unheld calls go to)


def _eligible(module: nn.Module) -> bool:
    if not is_nf4_linear(module):
        return False
    qs = module.weight.quant_state
    return (
        qs is not None
        and len(qs.shape) == 2
        and (not qs.nested or qs.state2.blocksize == 256)  # what bitsandbytes' matmul accepts
        and not getattr(qs, "packing_format_for_cpu", False)
        and hasattr(torch.ops.bitsandbytes, "gemm_4bit")
    )


def _linears(layer: nn.Module) -> list[nn.Module]:
    return [m for m in layer.modules() if _eligible(m)]


def _size(module: nn.Module) -> int:
    qs = module.weight.quant_state
    n = int(qs.shape[0]) * int(qs.shape[1]) * qs.dtype.itemsize
    return -(-n // _ALIGN) * _ALIGN


def held_bytes(layer: nn.Module) -> int:
    """Device bytes `layer`'s NF4 weights take dequantised (what holding it costs)."""
    return sum(_size(m) for m in _linears(layer))


def dequantized_bytes(layer: nn.Module) -> int:
    """The largest of `layer`'s 4-bit weights dequantised (0 without any): the transient
    copy a call makes when its weights are not held, which a CUDA graph's private pool
    keeps among the layer's activations."""
    return max(
        (_size(m) for m in layer.modules() if is_nf4_linear(m) and m.weight.quant_state is not None),
        default=0,
    )


def held_token(layer: nn.Module) -> int:
    """Nonzero (the held buffer's address) while `layer`'s weights are held: a CUDA graph
    captured then reads the held copies and must not replay otherwise."""
    return _token.get(id(layer), 0)


def held_weight(module: nn.Module) -> Tensor | None:
    """The held dequantised weight of a bitsandbytes ``Linear4bit`` (what
    ``bitsandbytes.functional.dequantize_4bit(weight, quant_state)`` returns), or None when
    it is not held."""
    weight = getattr(module, "weight", None)
    return None if weight is None else _held.get(id(weight))


def _bnb_dequantizes(A: Tensor, qs) -> bool:
    """Whether bitsandbytes' ``gemm_4bit`` would run this call as dequantise-then-matmul."""
    if A.device.type == "cpu":  # the default implementation; the CPU registers no gemm_4bit of its own
        return True
    if A.device.type != "cuda":
        return False
    ops = sys.modules.get("bitsandbytes.backends.cuda.ops")
    custom = getattr(ops, "_gemm_4bit_use_custom_fn", None)
    max_m = getattr(ops, "_gemm_4bit_custom_max_m", None)
    if custom is None or max_m is None:  # a dispatch we do not know: leave the call to it
        return False
    K = A.shape[-1]
    M = A.numel() // K
    if max_m < M or K % qs.blocksize:
        return True
    return not custom(A.device.index, A.dtype, M, int(qs.shape[0]), K)


class _HeldMatmul(torch.autograd.Function):
    """bitsandbytes' MatMul4Bit with the dequantised weight given: the same forward
    (``F.linear``) and backward (``grad @ W``; ``grad.sum(0)`` for a bias)."""

    @staticmethod
    def forward(ctx, A: Tensor, W: Tensor, bias: Tensor | None) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(W)  # its version bumps when the buffer is refilled: a late backward raises
        ctx.bias_dtype = None if bias is None else bias.dtype
        return nn.functional.linear(A, W, bias)

    @staticmethod
    def backward(ctx, grad_output: Tensor):  # type: ignore[override]
        (W,) = ctx.saved_tensors
        need_A, _, need_bias = ctx.needs_input_grad
        grad_bias = grad_output.sum(0, dtype=ctx.bias_dtype) if need_bias else None
        grad_A = torch.matmul(grad_output, W.to(grad_output.dtype)) if need_A else None
        return grad_A, None, grad_bias


def _matmul_4bit(
    A: Tensor, B: Tensor, quant_state=None, out: Tensor | None = None, bias: Tensor | None = None
):
    W = _held.get(id(B))
    if (
        W is None
        or out is not None
        or quant_state is not B.quant_state
        or A.numel() == 0
        or A.dtype != W.dtype
        or A.shape[-1] != int(quant_state.shape[1])
        or not _bnb_dequantizes(A, quant_state)
    ):
        return _original(A, B, quant_state, out=out, bias=bias)
    if torch.is_grad_enabled() and (A.requires_grad or (bias is not None and bias.requires_grad)):
        return _HeldMatmul.apply(A, W, bias)
    return nn.functional.linear(A, W, bias)


class HeldWeights:
    """A device buffer for the dequantised NF4 weights of one layer at a time, sized for
    the largest of `layers` (see the module doc)."""

    def __init__(self, layers: Sequence[nn.Module], device: torch.device | str):
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda" means the current one, as tensors say it
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.nbytes = max((held_bytes(layer) for layer in layers), default=0)
        self.buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device) if self.nbytes else None

    @contextmanager
    def hold(self, layer: nn.Module) -> Iterator[int]:
        """Dequantise `layer`'s NF4 weights into the buffer (they must be on its device)
        and route its 4-bit matmuls through them until the block ends. Yields how many
        weights are held. One layer at a time: the buffer is refilled for each."""
        global _original
        linears = [m for m in _linears(layer) if m.weight.device == self.device]
        if not linears or self.buffer is None:
            yield 0
            return
        if _token:
            raise RuntimeError("HeldWeights.hold: another layer is held; release it first")
        import bitsandbytes

        held, offset = {}, 0
        for m in linears:
            qs = m.weight.quant_state
            n = _size(m)
            if offset + n > self.nbytes:
                raise ValueError(
                    "HeldWeights.hold: this layer's weights exceed the buffer (built for other layers)"
                )
            view = self.buffer[offset : offset + n].view(qs.dtype)[: int(qs.shape[0]) * int(qs.shape[1])]
            view = view.view(*qs.shape)
            packed = m.weight.data.view(-1, 1)  # the layout bitsandbytes' matmul dequantises
            dequantize_nf4(packed, qs, out=view)
            held[id(m.weight)] = view
            offset += n
        # bitsandbytes writes through a pointer, which autograd does not see: a backward saved
        # over the previous contents must raise, not read these
        torch.autograd.graph.increment_version(self.buffer)
        _held.update(held)
        _token[id(layer)] = self.buffer.data_ptr()
        original = _original = bitsandbytes.matmul_4bit
        bitsandbytes.matmul_4bit = _matmul_4bit
        try:
            yield len(linears)
        finally:
            if bitsandbytes.matmul_4bit is _matmul_4bit:  # leave anyone else's patch alone
                bitsandbytes.matmul_4bit = original
            torch.autograd.graph.increment_version(self.buffer)  # nothing saved while held outlives it
            _token.clear()
            _held.clear()
