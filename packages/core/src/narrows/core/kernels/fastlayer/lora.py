"""Linears that share one input, each with an optional LoRA adapter: the base matmuls in
the activation dtype, and the adapters' matmuls on tensor cores in that dtype too, from
the float32 masters cast once per call — with float32 gradients for the masters.

With ``lora_dtype=torch.float32`` the adapters compute as PEFT's float32 adapters do.
Dropout masks are drawn per adapter in the group's order from the device's generator;
replaying the generator redraws them (`masks`).

why: docs/design.md#lora-groups
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn

from .adapter_math import adapter_then_base, add_adapter, dropped, mm_f32
from .stacking import joined, side_by_side

__all__ = [
    "Linear",
    "LinearGroup",
    "Masks",
    "WeightSource",
    "mm_f32",
]  # mm_f32: adapter_math's, used by callers through here


class WeightSource(Protocol):
    """A frozen base weight, (out, in): a 4-bit one dequantised or held, a plain one as it is."""

    shape: tuple[int, int]
    stacks: bool  # a group of these runs one matmul on them stacked

    def __call__(self, like: Tensor) -> Tensor:
        """The weight in `like`'s dtype."""

    def ready(self, like: Tensor) -> Tensor | None:
        """The weight in `like`'s dtype where that costs nothing (held, or already so)."""

    def into(self, out: Tensor) -> None:
        """Write the weight into `out` (its rows of a stacked buffer)."""


@dataclass
class Linear:
    """One linear: its frozen base (a weight source, so a 4-bit weight can be dequantised
    or held), its bias, and its adapter (None for none)."""

    name: str
    weight: WeightSource
    bias: Tensor | None
    a: nn.Parameter | None  # (r, in) float32 master
    b: nn.Parameter | None  # (out, r)
    scaling: float
    dropout: float

    def w(self, like: Tensor, cache: dict[str, Tensor] | None) -> Tensor:
        """The base weight in `like`'s dtype; with `cache`, fetched (a 4-bit one
        dequantised) once for every use that shares the cache."""
        if cache is None:
            return self.weight(like)
        w = cache.get(self.name)
        if w is None:
            w = cache[self.name] = self.weight(like)
        return w


@dataclass
class _Low:
    """A group's adapters cast to the activation dtype once per forward (the backward
    reuses them: the masters do not change between a forward and its backward)."""

    a: list[Tensor | None]  # each linear's A (None without an adapter)
    b: list[Tensor | None]
    a_all: Tensor | None  # every A of the group stacked (without dropout: one matmul for all)
    b_all: Tensor | None = None  # every B block-diagonal, (Σ out, Σ r): `LinearGroup.blocked`


class Masks(list):
    """Each adapter's dropout mask (None where it drops nothing out), and `outs`: the draw's
    own dropped-out input for each (``n · mask / keep``), where its bits are `dropped`'s —
    on CUDA, for adapters computing in the input's dtype (the CPU's kernel rounds twice).
    The forward's adapters read `outs` once and let them go (`LinearGroup.state`), so they
    live no longer than the one matmul each would have computed them for."""

    def __init__(self, masks: list[Tensor | None], outs: list[Tensor | None] | None = None):
        super().__init__(masks)
        self.outs = outs


@dataclass
class GroupState:
    """What a group's forward keeps for its backward."""

    n: Tensor  # the shared input, (tokens, in)
    h: list[Tensor | None]  # each adapter's (tokens, r) activation
    masks: list[Tensor | None]  # each adapter's dropout mask, bool (None without dropout)
    low: _Low | None  # the adapters in the activation dtype, as the forward cast them (None: cast again)


class LinearGroup:
    """Linears that read one input (Q/K/V; gate/up; o; down)."""

    def __init__(self, linears: Sequence[Linear], lora_dtype: torch.dtype | None = None):
        self.linears = list(linears)
        self.lora_dtype = lora_dtype  # the adapters' arithmetic: None, the activations' dtype
        self.adapted = [p for p in self.linears if p.a is not None]
        self.dropout = any(p.dropout > 0 for p in self.adapted)
        self.stacked = len(self.linears) > 1 and all(p.weight.stacks for p in self.linears)
        self.widths = [p.weight.shape[0] for p in self.linears]
        self.key = "+".join(p.name for p in self.linears)
        # a stacked group whose adapters share one scale and drop nothing out runs them as one:
        # ``out += s · h_all @ B_allᵀ`` with every B on the diagonal of one matrix, and in the
        # backward ``s · [g_q g_k g_v] @ B_all`` and A's and B's gradients as one matmul each.
        # The zeros add nothing; the host launches 8 matmuls fewer per Q/K/V forward and
        # backward (4 per gate/up), each about 80 µs of its time on the H100 machine.
        self.blocked = (
            self.stacked
            and not self.dropout
            and len(self.adapted) > 1
            and lora_dtype is None
            and len({p.scaling for p in self.adapted}) == 1
        )

    def stacked_weight(self, like: Tensor, cache: dict[str, Tensor] | None) -> Tensor:
        """The group's weights stacked, (Σ out, in) in `like`'s dtype: a view where they lie
        so already, else each written into its rows of one new buffer; with `cache`,
        fetched once for every use that shares it."""
        w = None if cache is None else cache.get(self.key)
        if w is not None:
            return w
        w = side_by_side([p.weight.ready(like) for p in self.linears], dim=0)
        if w is None:
            w = torch.empty(
                sum(self.widths), self.linears[0].weight.shape[1], dtype=like.dtype, device=like.device
            )
            for p, rows in zip(self.linears, w.split(self.widths)):
                p.weight.into(rows)
        if cache is not None:
            cache[self.key] = w
        return w

    def params(self) -> list[nn.Parameter]:
        return [t for p in self.adapted for t in (p.a, p.b)]

    def masks(self, n: Tensor) -> list[Tensor | None]:
        """Each adapter's dropout mask (bool: the 1/keep scale is applied where it is used,
        so a dropped-out input is rounded once, not scaled by a rounded 1/keep), drawn in
        order from `n`'s device's generator (a replay of the same generator state draws the
        same masks) by `torch.native_dropout`, dropout's own kernel (on the CPU a
        `bernoulli_` in `n`'s dtype, as before). Its dropped-out output rides along for
        the forward where it has `dropped`'s bits (`Masks`)."""
        reuse = n.is_cuda and self._wide(n) is n
        masks: list[Tensor | None] = []
        outs: list[Tensor | None] = []
        for p in self.linears:
            if p.a is None or p.dropout == 0:
                masks.append(None)
                outs.append(None)
                continue
            out, mask = torch.native_dropout(n, p.dropout, True)
            masks.append(mask)
            outs.append(out if reuse else None)
        return Masks(masks, outs if reuse and self.dropout else None)

    def _low(self, dtype: torch.dtype) -> _Low:
        none: list[Tensor | None] = [None] * len(self.linears)
        if not self.adapted:
            return _Low(none, none, None)
        b = [None if p.b is None else p.b.to(dtype) for p in self.linears]
        if self.dropout:
            return _Low([None if p.a is None else p.a.to(dtype) for p in self.linears], b, None)
        a_all = torch.cat([p.a for p in self.adapted]).to(dtype)
        rows = iter(a_all.split([p.a.shape[0] for p in self.adapted]))
        a = [next(rows) if p.a is not None else None for p in self.linears]
        if not self.blocked:
            return _Low(a, b, a_all)
        b_all = a_all.new_zeros(sum(self.widths), a_all.shape[0])
        blocks, col = [], 0
        for p, rows_p in zip(self.linears, b_all.split(self.widths)):
            if p.b is None:
                blocks.append(None)
                continue
            block = rows_p[:, col : col + p.b.shape[1]]
            blocks.append(block.copy_(p.b.detach()))  # rounded as `.to` rounds
            col += p.b.shape[1]
        return _Low(a, blocks, a_all, b_all)

    def _h(
        self, n: Tensor, masks: list[Tensor | None], low: _Low, outs: list[Tensor | None] | None = None
    ) -> list[Tensor | None]:
        """Each adapter's ``n @ Aᵀ`` (dropped out: `outs`' where given), in the activation dtype."""
        if not self.adapted:
            return [None] * len(self.linears)
        if low.a_all is not None:
            h_all = n.mm(low.a_all.t())
            hs = iter(h_all.split([p.a.shape[0] for p in self.adapted], dim=1))
            return [next(hs) if p.a is not None else None for p in self.linears]
        outs = outs or [None] * len(self.linears)
        return [
            None if a is None else (dropped(n, m, p) if o is None else o).mm(a.t())
            for p, a, m, o in zip(self.linears, low.a, masks, outs)
        ]

    def forward(
        self,
        n: Tensor,
        masks: list[Tensor | None],
        cache: dict[str, Tensor] | None = None,
        *,
        skip: Sequence[str] = (),
        residual: Tensor | None = None,
    ) -> tuple[list[Tensor | None], GroupState]:
        """Each linear's output (None for those in `skip`: the backward does not need
        them), and what the backward needs. With `residual` (one linear only) the output
        is ``residual + linear(n)``: the linear (base and adapter) is rounded at its own
        size, and the sum with the residual once — as PEFT's layer and the decoder's add
        round them. (Adding the adapter onto a sum that holds the residual would round at
        the residual's size twice.) Without an adapter or bias, the add is the matmul's
        epilogue."""
        state = self.state(n, masks)
        low, h = state.low, state.h
        if self.stacked:
            assert not skip and residual is None, "a stacked group is never skipped nor given a residual"
            w = self.stacked_weight(n, cache)
            biases = [p.bias for p in self.linears]
            bias = None
            if any(b is not None for b in biases):
                bias = torch.cat(
                    [n.new_zeros(o) if b is None else b.to(n.dtype) for b, o in zip(biases, self.widths)]
                )
            if low.b_all is not None:  # every adapter in one matmul; h's blocks lie side by side
                base = adapter_then_base(
                    n,
                    w,
                    joined([hp for hp in h if hp is not None], dim=1),
                    low.b_all,
                    self.adapted[0].scaling,
                    bias,
                )
            else:
                base = n.mm(w.t()) if bias is None else torch.addmm(bias, n, w.t())
            outs: list[Tensor | None] = list(base.split(self.widths, dim=1))
            for out, p, hp, b in zip(outs, self.linears, h, low.b) if low.b_all is None else ():
                if hp is not None:
                    add_adapter(out, hp, b, p.scaling)
            return outs, state
        outs = []
        for p, hp, b in zip(self.linears, h, low.b):
            if p.name in skip:
                outs.append(None)
                continue
            w = p.w(n, cache)
            if residual is not None and hp is None and p.bias is None:
                outs.append(torch.addmm(residual, n, w.t()))
                continue
            if hp is not None and hp.dtype == n.dtype:
                out = adapter_then_base(n, w, hp, b, p.scaling, p.bias)
            else:
                out = n.mm(w.t()) if p.bias is None else torch.addmm(p.bias.to(n.dtype), n, w.t())
                if hp is not None:
                    add_adapter(out, hp, b, p.scaling)
            outs.append(out if residual is None else out.add_(residual))
        return outs, state

    def state(self, n: Tensor, masks: list[Tensor | None]) -> GroupState:
        """What the backward needs from `forward` without any output: the adapters' side
        alone (a recompute whose outputs were kept: the attention's Q/K/V)."""
        low = self._low(self.lora_dtype or n.dtype)
        outs = getattr(masks, "outs", None)
        if outs is not None:
            masks.outs = None  # read once, here: the state keeps the masks alone
        return GroupState(n, self._h(self._wide(n), masks, low, outs), list(masks), low)

    def backward(
        self, grads: Sequence[Tensor], state: GroupState, cache: dict[str, Tensor] | None = None
    ) -> tuple[Tensor, list[Tensor]]:
        """The input's gradient and the adapters' (float32, ``a`` then ``b`` per adapter,
        in `params` order), from each linear's output gradient."""
        n = state.n
        low = state.low if state.low is not None else self._low(self.lora_dtype or n.dtype)
        n_lora = self._wide(n)
        g_joined = joined(grads, dim=1) if self.stacked else None  # side by side already where written so
        if low.b_all is not None:
            param_grads, branch, dropped_out = self._blocked_backward(g_joined, state, low, n_lora)
        else:
            param_grads, branch, dropped_out = self._adapter_grads(grads, state, low, n_lora)
        # the adapters' branch (when it is in the activations' dtype) first, the base accumulated onto it
        first = branch is not None and branch[1].dtype == n.dtype
        g_n: Tensor | None = branch[0].mm(branch[1]) if first else None
        if self.stacked:
            w = self.stacked_weight(n, cache)
            g_n = g_joined.mm(w) if g_n is None else g_n.addmm_(g_joined, w)
        else:
            for p, g in zip(self.linears, grads):
                w = p.w(g, cache)
                g_n = g.mm(w) if g_n is None else g_n.addmm_(g, w)
        if branch is not None and not first:  # float32 LoRA: its branch added in float32, rounded once
            g_n.add_(branch[0].mm(branch[1]))
        for p, gh, m, a in dropped_out:  # (float32 LoRA: rounded as it is added)
            g_n.add_(dropped(gh.mm(a), m, p))
        return g_n, param_grads

    def _adapter_grads(
        self,
        grads: Sequence[Tensor],
        state: GroupState,
        low: _Low,
        n: Tensor,
    ) -> tuple[list[Tensor], tuple[Tensor, Tensor] | None, list[tuple]]:
        """The adapters' gradients, one adapter at a time, and their branches of the
        input's gradient: as one ``(ghs side by side) @ A_all`` where nothing drops out,
        else one ``(gh_p @ A_p)`` per adapter, to be dropped out (``(linear, gh, mask, A)``)."""
        param_grads: list[Tensor] = []
        gh_all: list[Tensor] = []
        dropped_out: list[tuple] = []
        for p, g, hp, m, a, b in zip(self.linears, grads, state.h, state.masks, low.a, low.b):
            if p.a is None:
                continue
            g = g if g.dtype == b.dtype else g.to(b.dtype)
            gh = g.mm(b).mul_(p.scaling)  # (tokens, r): the scaled branch's gradient
            g_b = mm_f32(g.t(), hp).mul_(p.scaling)
            g_a = mm_f32(gh.t(), dropped(n, m, p))
            param_grads += [g_a, g_b]
            if self.dropout:
                dropped_out.append((p, gh, m, a))
            else:  # every adapter's branch joins in one matmul
                gh_all.append(gh)
        branch = (torch.cat(gh_all, dim=1), low.a_all) if gh_all else None
        return param_grads, branch, dropped_out

    def _blocked_backward(
        self,
        g_joined: Tensor,
        state: GroupState,
        low: _Low,
        n: Tensor,
    ) -> tuple[list[Tensor], tuple[Tensor, Tensor], list[tuple]]:
        """`_adapter_grads` of a `blocked` group: ``gh = s · [g_q g_k g_v] @ B_all`` (every
        adapter's branch gradient side by side), A's gradients as one ``ghᵀ @ n``, B's as
        one ``s · [g_q g_k g_v]ᵀ @ h_all`` whose diagonal blocks they are (copied out: a
        gradient keeps its parameter's layout); the input's branch, ``gh @ A_all``; nothing
        dropped out (a blocked group has no dropout)."""
        scaling = self.adapted[0].scaling
        g = g_joined if g_joined.dtype == low.b_all.dtype else g_joined.to(low.b_all.dtype)
        gh = g.mm(low.b_all).mul_(scaling)
        g_a = mm_f32(gh.t(), n).split([p.a.shape[0] for p in self.adapted])
        g_b_all = mm_f32(g.t(), joined([hp for hp in state.h if hp is not None], dim=1)).mul_(scaling)
        out: list[Tensor] = []
        i = col = 0
        for p, rows in zip(self.linears, g_b_all.split(self.widths)):
            if p.a is not None:
                r = p.a.shape[0]
                out += [g_a[i], rows[:, col : col + r].contiguous()]
                i, col = i + 1, col + r
        return out, (gh, low.a_all), []

    def _wide(self, n: Tensor) -> Tensor:
        """The input the adapters read: `n`, or `n` in `lora_dtype` (float32 LoRA)."""
        return n if self.lora_dtype is None or self.lora_dtype == n.dtype else n.to(self.lora_dtype)
