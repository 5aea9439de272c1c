"""Sequence tiling of a decoder layer's MLP: working set [tile, intermediate] instead of
[seq, intermediate].

`torch.equal` to the same tiling run resident; equal to an untiled MLP up to summation
order. Dropout masks are those the tile's forward drew. `tile_sequence(model, tokens)`
applies it to any model; `stream(seq_tile=...)` when asked or when the planner needs it.

why: docs/design.md#sequence-tiles
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from narrows.core import ambient_as, ambient_state, anatomy_of, ensure_architecture
from narrows.core.kernels import rng
from narrows.core.protocol import compose

from ..errors import StreamSetupError

__all__ = ["SequenceTiles", "tile_sequence", "tiled_mlps"]


@dataclass
class _Tiles:
    fn: Callable[[Tensor], Tensor]  # the MLP's own forward
    tokens: int  # tokens per tile (batch × positions)
    params: tuple[nn.Parameter, ...]
    states: list[rng.RngState] | None = None

    def slices(self, x: Tensor) -> list[slice]:
        step = max(1, self.tokens // max(1, x.shape[0]))  # positions per tile, every sequence of the batch
        return [slice(s, min(s + step, x.shape[1])) for s in range(0, x.shape[1], step)]


def _tile(x: Tensor, s: slice) -> Tensor:
    return x[:, s].contiguous()


class _NoCtx:
    """Stands in for autograd's ctx when the tiles run without a graph."""

    def save_for_backward(self, *tensors: Tensor) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        pass


class _TiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tiles: _Tiles, x: Tensor, *params: Tensor) -> Tensor:
        states, out = [], None
        for s in tiles.slices(x):
            states.append(rng.capture(x.device))
            y = tiles.fn(_tile(x, s))
            if out is None:
                out = y.new_empty((*x.shape[:2], *y.shape[2:]))
            out[:, s] = y
        ctx.tiles, ctx.states, ctx.ambient = tiles, states, ambient_state(x.device)
        ctx.save_for_backward(x)
        ctx.set_materialize_grads(False)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor | None):
        (x,) = ctx.saved_tensors
        tiles: _Tiles = ctx.tiles
        need_x, need_p = ctx.needs_input_grad[1], ctx.needs_input_grad[2:]
        if grad_out is None:
            return (None, None, *[None] * len(need_p))
        grad_x = torch.empty_like(x) if need_x else None
        sums: list[Tensor | None] = [None] * len(need_p)
        wanted = [p for p, n in zip(tiles.params, need_p) if n]
        for s, state in zip(tiles.slices(x), ctx.states):
            with rng.replay(state), torch.enable_grad(), ambient_as(ctx.ambient):
                xt = _tile(x, s).requires_grad_(need_x)
                y = tiles.fn(xt)
                grads = list(
                    torch.autograd.grad(
                        y, ([xt] if need_x else []) + wanted, _tile(grad_out, s), allow_unused=True
                    )
                )
            if need_x:
                grad_x[:, s] = grads.pop(0)
            for j, n in enumerate(need_p):
                g = grads.pop(0) if n else None
                if g is not None:
                    sums[j] = g if sums[j] is None else sums[j] + g  # tile order, always the same
        return (None, grad_x, *sums)


def _refuse_hooks(mlp: nn.Module, index: int) -> None:
    hooked = [
        type(m).__name__ for m in mlp.modules() if m is not mlp and (m._forward_hooks or m._forward_pre_hooks)
    ]
    if hooked:
        raise StreamSetupError(
            f"sequence tiling cannot run the MLP of decoder layer {index}: its {hooked[0]} has forward hooks "
            "(e.g. MoE router logits for the aux loss), which would see tiles without their gradient. "
            "Train without seq_tile (or remove the hooks)."
        )


def _tiled_forward(mlp: nn.Module, index: int, tokens: int) -> Callable[..., Tensor]:
    original = mlp.forward

    def forward(x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if args or kwargs or x.dim() != 3:
            raise StreamSetupError(
                f"sequence tiling expects the MLP of decoder layer {index} to take one [batch, seq, hidden] "
                "tensor; this one takes other arguments. Train without seq_tile."
            )
        if x.shape[0] * x.shape[1] <= tokens:
            return original(x)  # one tile: nothing to split
        _refuse_hooks(mlp, index)
        params = tuple(p for p in mlp.parameters() if p.requires_grad)
        tiles = _Tiles(original, tokens, params)
        if torch.is_grad_enabled() and (x.requires_grad or params):
            return _TiledMLP.apply(tiles, x, *params)
        return _TiledMLP.forward(_NoCtx(), tiles, x)  # evaluation: the same tiles, no graph

    forward.__wrapped__ = original  # type: ignore[attr-defined]
    forward.narrows_tile_tokens = tokens  # type: ignore[attr-defined]
    return forward


def _mlp_of(layer: nn.Module, index: int) -> nn.Module:
    mlp = getattr(layer, "mlp", None)
    if not isinstance(mlp, nn.Module):
        raise StreamSetupError(
            f"sequence tiling needs each decoder layer's position-wise part as `.mlp`; layer {index} "
            f"({type(layer).__name__}) has none. Train without seq_tile."
        )
    _refuse_hooks(mlp, index)
    return mlp


def tile_sequence(model: nn.Module, tokens: int) -> nn.Module:
    """Run every decoder layer's MLP over sequence tiles of `tokens` tokens (batch ×
    positions) in forward and backward. Equal up to summation order to the untiled model,
    `torch.equal` to the same tiling anywhere (resident or streamed). Returns the model."""
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise StreamSetupError(f"seq_tile must be a positive number of tokens, not {tokens!r}")
    ensure_architecture(model, "head")
    anat = anatomy_of(model)
    mlps = [_mlp_of(layer, i) for i, layer in enumerate(anat.layers)]
    for i, mlp in enumerate(mlps):
        if hasattr(mlp.forward, "narrows_tile_tokens"):
            mlp.forward = mlp.forward.__wrapped__  # retiling: replace the previous tile size
        mlp.forward = _tiled_forward(mlp, i, tokens)
    return model


def tiled_mlps(model: nn.Module) -> int | None:
    """The tile size the model's MLPs run with, or None when they are not tiled."""
    forwards = [getattr(getattr(layer, "mlp", None), "forward", None) for layer in anatomy_of(model).layers]
    tokens = {getattr(f, "narrows_tile_tokens", None) for f in forwards}
    return tokens.pop() if len(tokens) == 1 else None


@dataclass(frozen=True)
class SequenceTiles:
    """`tile_sequence`'s setting as a config for `narrows.core.apply` (stage ``"tiles"``)."""

    tokens: int


def _apply_tiles(model: nn.Module, config: SequenceTiles) -> nn.Module:
    return tile_sequence(model, config.tokens)


compose.register(SequenceTiles, "tiles", _apply_tiles)
