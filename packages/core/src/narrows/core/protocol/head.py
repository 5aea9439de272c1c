"""The LM-head hook: where the head's weight rows come from, one vocabulary chunk at a time.

A `HeadSource` yields ``(rows, weight_chunk, bias_chunk)`` on the compute device; any
source gives the same numbers for the same chunk size. `chunked_logits` equals the
one-matmul head up to summation order. `sharing_head_pass` serves several forwards'
losses from one read; `LogitMath` travels with every source.

why: docs/design.md#the-lm-head-hook
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from ..errors import NarrowsError
from .anatomy import anatomy_of
from .handle import state_of
from .logits import LogitMath

__all__ = [
    "DEFAULT_HEAD_ROWS",
    "HeadSource",
    "HeadSweep",
    "LogitMath",
    "ResidentHead",
    "attach_head_source",
    "chunked_logits",
    "head_source",
    "head_sweep",
    "sharing_head_pass",
]

DEFAULT_HEAD_ROWS = 8192  # vocabulary rows per chunk: 8192 x 4096 bf16 is 64 MiB


@runtime_checkable
class HeadSource(Protocol):
    """The LM head's weight, served in vocabulary chunks on the compute device."""

    vocab_size: int
    hidden_size: int
    dtype: torch.dtype
    device: torch.device
    math: LogitMath  # what the model applies to the head's output before the loss

    def chunks(self, rows: int | None = None) -> Iterator[tuple[slice, Tensor, Tensor | None]]:
        """Yield ``(vocab_slice, weight[vocab_slice], bias[vocab_slice] or None)``.

        `rows` is the consumer's preferred chunk size; a source may use fewer rows. A
        chunk is only valid until the next one is requested.
        """
        ...

    def gather(self, index: Tensor) -> tuple[Tensor, Tensor | None]:
        """Rows `index` (int64, any device) of the weight and bias, on the compute device."""
        ...

    @property
    def trainable_weight(self) -> nn.Parameter | None:
        """The weight as a parameter when the head trains (then it is resident), else None."""
        ...


def _linear_parts(head: nn.Module) -> tuple[Tensor, Tensor | None]:
    weight = getattr(head, "weight", None)
    if not isinstance(head, nn.Linear | nn.Embedding) or weight is None:
        raise NarrowsError(
            f"the LM head is a {type(head).__name__}, not a plain linear layer; narrows' chunked head needs "
            "nn.Linear (adapters on lm_head are not supported — leave lm_head out of target_modules)"
        )
    return weight, getattr(head, "bias", None)


class ResidentHead:
    """A head weight already on the device, served as views (no copies)."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None, math: LogitMath | None = None):
        self.weight, self.bias = weight, bias
        self.vocab_size, self.hidden_size = self.weight.shape
        self.dtype = self.weight.dtype
        self.device = self.weight.device
        self.math = math or LogitMath()

    @classmethod
    def of(cls, head: nn.Module, math: LogitMath | None = None) -> ResidentHead:
        """The source over a model's own head module (nn.Linear, or a tied embedding)."""
        return cls(*_linear_parts(head), math=math)

    @property
    def trainable_weight(self) -> nn.Parameter | None:
        return self.weight if self.weight.requires_grad else None

    def gather(self, index: Tensor) -> tuple[Tensor, Tensor | None]:
        index = index.to(self.device)
        b = None if self.bias is None else self.bias.detach().index_select(0, index)
        return self.weight.detach().index_select(0, index), b

    def chunks(self, rows: int | None = None) -> Iterator[tuple[slice, Tensor, Tensor | None]]:
        rows = rows or DEFAULT_HEAD_ROWS
        w = self.weight.detach()
        b = None if self.bias is None else self.bias.detach()
        for start in range(0, self.vocab_size, rows):
            sl = slice(start, min(start + rows, self.vocab_size))
            yield sl, w[sl], None if b is None else b[sl]


def attach_head_source(model: nn.Module, source: HeadSource) -> None:
    """Make `source` the place the model's head weight is served from."""
    state_of(model).head_source = source


def set_loss_working_set(model: nn.Module, estimate: Callable[[int], int] | None) -> None:
    """A sibling that replaces the model's loss (narrows-lmhead) tells memory planners
    (narrows-stream) how many bytes its loss holds at once for a number of tokens; None
    restores the default assumption of full [tokens, vocab] logits."""
    state_of(model).loss_working_set = estimate


def loss_working_set(model: nn.Module, tokens: int) -> int | None:
    """The attached loss estimate for `tokens` tokens, or None (full logits assumed)."""
    estimate = state_of(model).loss_working_set
    return None if estimate is None else int(estimate(tokens))


def head_source(model: nn.Module) -> HeadSource:
    """The attached source of the model's head, else its resident weight."""
    source = state_of(model).head_source
    if source is not None:
        return source
    anat = anatomy_of(model)
    return ResidentHead.of(anat.head, math=anat.logit_math)


@dataclass
class _Filed:
    key: Hashable  # losses with equal keys share one pass
    inputs: Any
    compute: Callable[[list[Any]], list[Tensor]]  # the inputs of one pass -> their losses, in order
    finish: Callable[[Tensor], Tensor] | None  # what the forward does to its loss afterwards (an aux loss)


class HeadSweep:
    """Losses filed by forwards run inside `sharing_head_pass`, computed together.

    A consumer files ``(key, inputs, compute, finish)``: `compute` maps the inputs of
    every filing with the same key (in filing order) to their losses, reading the head
    once for all of them; `finish` is applied to each loss after, as the forward would
    have. Each loss must come out exactly as the forward alone would have computed it.
    """

    def __init__(self) -> None:
        self._filed: list[_Filed] = []

    def __len__(self) -> int:
        return len(self._filed)

    def file(
        self,
        key: Hashable,
        inputs: Any,
        compute: Callable[[list[Any]], list[Tensor]],
        finish: Callable[[Tensor], Tensor] | None = None,
    ) -> None:
        self._filed.append(_Filed(key, inputs, compute, finish))

    def losses(self) -> list[Tensor]:
        """Every filed loss, in filing order; the sweep is empty afterwards."""
        filed, self._filed = self._filed, []
        out: list[Tensor] = []
        start = 0
        while start < len(filed):
            end = start + 1
            while end < len(filed) and filed[end].key == filed[start].key:
                end += 1
            group = filed[start:end]
            values = group[0].compute([f.inputs for f in group])
            out += [v if f.finish is None else f.finish(v) for f, v in zip(group, values)]
            start = end
        return out


@contextmanager
def sharing_head_pass(model: nn.Module) -> Iterator[HeadSweep]:
    """Within: forwards of `model` whose loss replacement supports it file their loss
    with the yielded `HeadSweep` instead of computing it (their output's loss is None)."""
    state = state_of(model)
    if state.head_sweep is not None:
        raise RuntimeError("sharing_head_pass is already active on this model")
    state.head_sweep = sweep = HeadSweep()
    try:
        yield sweep
    finally:
        state.head_sweep = None


def head_sweep(model: nn.Module) -> HeadSweep | None:
    """The active `HeadSweep` of `model` (see `sharing_head_pass`), else None."""
    return state_of(model).head_sweep


class _ChunkedLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, source: HeadSource, rows: int | None) -> Tensor:  # type: ignore[override]
        flat = hidden.reshape(-1, hidden.shape[-1])
        out = flat.new_empty(flat.shape[0], source.vocab_size)
        for sl, w, b in source.chunks(rows):
            out[:, sl] = nn.functional.linear(flat, w, b)
        ctx.source, ctx.rows, ctx.shape = source, rows, hidden.shape
        return out.view(*hidden.shape[:-1], source.vocab_size)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        g = grad.reshape(-1, grad.shape[-1])
        acc = torch.zeros(g.shape[0], ctx.shape[-1], dtype=torch.float32, device=g.device)
        for sl, w, _ in ctx.source.chunks(ctx.rows):
            acc += g[:, sl] @ w  # each chunk's product in the head dtype, the sum over chunks in fp32
        return acc.to(grad.dtype).view(ctx.shape), None, None


def chunked_logits(hidden: Tensor, source: HeadSource, rows: int | None = None) -> Tensor:
    """``hidden @ weight.T + bias`` built one vocabulary chunk at a time (frozen head only).

    The source's `LogitMath` is not applied here: this replaces the head module, and the
    model's own forward applies its scaling and softcapping after the head.
    """
    if source.trainable_weight is not None:
        raise NarrowsError(
            "chunked_logits serves a frozen head only; this head trains, so keep it as a plain resident layer"
        )
    return _ChunkedLogits.apply(hidden, source, rows)
