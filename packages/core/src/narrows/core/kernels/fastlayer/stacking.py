"""Tensors that already lie side by side in one storage, seen as one: the stacked weights
of a group of linears (held weights, laid out in order), and the halves of a stacked
matmul's output or gradient — so a group runs one matmul without copying them together."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["joined", "side_by_side"]


def joined(ts: Sequence[Tensor], dim: int) -> Tensor:
    """`ts` joined along `dim`: `side_by_side`'s view where they lie so, else a copy (``cat``;
    also for no rows, where empty tensors have no address to lie side by side at)."""
    view = side_by_side(ts, dim)
    return torch.cat(list(ts), dim=dim) if view is None else view


def side_by_side(ts: Sequence[Tensor | None], dim: int) -> Tensor | None:
    """The 2-D tensors `ts` as one, joined along `dim`, where they already lie so in one
    storage (rows one block after another, or column blocks of one row-major buffer) —
    a view, nothing copied; None where they do not."""
    if not ts or any(t is None or t.dim() != 2 or t.stride(1) != 1 for t in ts):
        return None
    first = ts[0]
    size = first.element_size()
    store = first.untyped_storage().data_ptr()
    for a, b in itertools.pairwise(ts):
        if (
            b.dtype != first.dtype
            or b.untyped_storage().data_ptr() != store
            or b.stride(0) != first.stride(0)
        ):
            return None
        if b.shape[1 - dim] != first.shape[1 - dim]:
            return None
        step = a.shape[0] * a.stride(0) if dim == 0 else a.shape[1]
        if b.data_ptr() != a.data_ptr() + step * size:
            return None
    if dim == 0:
        if first.stride(0) != first.shape[1]:
            return None
        return first.as_strided((sum(t.shape[0] for t in ts), first.shape[1]), (first.shape[1], 1))
    width = sum(t.shape[1] for t in ts)
    if first.stride(0) != width:
        return None
    return first.as_strided((first.shape[0], width), (width, 1))
