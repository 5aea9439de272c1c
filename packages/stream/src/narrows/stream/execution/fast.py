"""The fast layer as a layer executor: a covered decoder layer runs `narrows.core.kernels.fastlayer`'s
entry points (forward, selective recompute, written-out backward) directly.

Its bits are resident `fuse_layers`'s. A layer or call it does not cover (hooked side
outputs, a KV cache, ``is_causal=False``) goes to the executor it wraps; under CUDA graphs
it is not used. Held 4-bit weights and kept attention are read where the plan has them.

why: docs/design.md#the-fast-executor
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from narrows.core.kernels.fastlayer import FastLayer, read_call

from .executor import LayerExecutor, LayerRun, SideGrads
from .kept_attention import HostAttention

__all__ = ["FastExecutor"]


class FastExecutor(LayerExecutor):
    """Covered layers through their `FastLayer` (`narrows.core.kernels.fastlayer`); the
    rest to `fallback`."""

    def __init__(self, fallback: LayerExecutor, attention: HostAttention | None = None):
        self.fallback = fallback
        self.attention = attention  # where the plan keeps attention, and for which layers

    def forward(self, run: LayerRun, hidden: Tensor) -> Tensor:
        fast = FastLayer.of(run.layer)
        parts = fast.parts()
        call = None if parts is None else read_call(run.layer, run.args, run.kwargs)
        if call is None or call.kv is not None:
            run.eager = True  # (a recorder collecting this forward's outputs among the reasons)
            return self.fallback.forward(run, hidden)
        keeps = run.may_keep and self.attention is not None and run.index in self.attention.layers
        out, run.kept = fast.forward(parts, hidden, call, self.attention.store(run.index) if keeps else None)
        return out

    def backward(
        self,
        run: LayerRun,
        hidden: Tensor,
        grad_out: Tensor | None,
        params: Sequence[Tensor],
        side: SideGrads | None = None,
    ) -> list[Tensor | None]:
        fast = FastLayer.of(run.layer)
        parts = None if run.eager else fast.parts()
        call = None if parts is None else read_call(run.layer, run.args, run.kwargs)
        if call is None or call.kv is not None or (side is not None and side.grads) or grad_out is None:
            return self.fallback.backward(run, hidden, grad_out, params, side)
        kept, run.kept = run.kept, None
        if self.attention is not None:
            self.attention.prefetch(run.index - 1)  # the next backward's, behind its weights
        g_x, grads = fast.gradients(parts, grad_out, hidden=hidden.detach(), call=call, kept=kept)
        by_id = {id(p): g for p, g in zip(parts.params(), grads)}
        out: list[Tensor | None] = [g_x] if hidden.requires_grad else []
        return out + [by_id[id(p)].to(p.dtype) if id(p) in by_id else None for p in params]
