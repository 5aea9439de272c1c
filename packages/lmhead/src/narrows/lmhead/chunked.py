"""Exact cross-entropy through the LM head without the [tokens, vocab] logits.

`linear_cross_entropy` computes ``sum_i w_i * CE(h_i @ W.T + b, y_i)`` in (vocabulary chunk
x token chunk) tiles, reading a core `HeadSource` once in forward and once in backward; it
saves only the per-token log-sum-exp [N] fp32. Logits in the head's dtype upcast to fp32,
`LogitMath` and every reduction fp32. `linear_cross_entropies` gives each item its own
call's numbers in one pass. `reference_cross_entropy` is the full-logits reference.

why: docs/design.md#the-chunked-cross-entropy
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor, nn

from narrows.core import DEFAULT_HEAD_ROWS, HeadSource, LogitMath, ResidentHead, ambient_as, ambient_state

__all__ = [
    "DEFAULT_TILE_BYTES",
    "cross_entropy_from_logits",
    "linear_cross_entropies",
    "linear_cross_entropy",
    "reference_cross_entropy",
]

# one fp32 [token chunk x vocabulary chunk] tile: 2048 tokens of an 8192-row chunk. Larger
# tiles mean fewer kernels a step (at 16 MiB the host, not the device, set the loss's pace)
DEFAULT_TILE_BYTES = 64 * 2**20

Tile = tuple[int, slice, Tensor, Tensor | None, slice]  # item, vocabulary rows, weight, bias, token rows


def _tile_logits(h: Tensor, w: Tensor, b: Tensor | None, math: LogitMath) -> Tensor:
    z = nn.functional.linear(h, w, b)
    z = z.float() if z.dtype != torch.float32 else z  # fresh either way: safe to modify in place
    return math.apply_(z)


def _tiles(source: HeadSource, sizes: list[int], head_rows: int | None, tile_bytes: int) -> Iterator[Tile]:
    """Every (vocabulary chunk, token chunk) tile of every item (token count in `sizes`),
    in the order that suits the source; each item is tiled as it would be alone.

    A resident head is on the device: items and token chunks go outside, so each token's
    gradient is finished before the next chunk starts and only [T, H] is ever accumulated
    in fp32. A streamed head is read chunk by chunk from host memory: vocabulary chunks go
    outside, so the head is read once per pass — for all items together.
    """
    rows = min(head_rows or DEFAULT_HEAD_ROWS, source.vocab_size)
    step = max(1, tile_bytes // (4 * rows))

    def token_chunks(n: int) -> list[slice]:
        return [slice(t, min(t + step, n)) for t in range(0, n, step)]

    if isinstance(source, ResidentHead):
        for k, n in enumerate(sizes):
            for ts in token_chunks(n):
                for sl, w, b in source.chunks(head_rows):
                    yield k, sl, w, b, ts
    else:
        for sl, w, b in source.chunks(head_rows):
            for k, n in enumerate(sizes):
                for ts in token_chunks(n):
                    yield k, sl, w, b, ts


def _target_logit(z: Tensor, sl: slice, y: Tensor) -> Tensor:
    local = y - sl.start
    hit = (local >= 0) & (local < z.shape[1])
    return torch.where(hit, z.gather(1, local.clamp(0, z.shape[1] - 1)[:, None])[:, 0], 0.0)


class _LinearCrossEntropy(torch.autograd.Function):
    """The losses of items ``(hidden, targets, token_weights)``, one per item, in one pass
    over the head; every item's numbers are those it would get alone."""

    @staticmethod
    def forward(
        ctx,
        source: HeadSource,
        math: LogitMath,
        head_rows: int | None,
        tile_bytes: int,  # type: ignore[override]
        weight: Tensor | None,
        *items: Tensor,
    ) -> tuple[Tensor, ...]:
        hiddens, targets, token_weights = items[0::3], items[1::3], items[2::3]
        dev = hiddens[0].device
        sizes = [h.shape[0] for h in hiddens]
        m = [torch.full((n,), -torch.inf, dtype=torch.float32, device=dev) for n in sizes]
        s = [torch.zeros(n, dtype=torch.float32, device=dev) for n in sizes]
        tgt = [torch.zeros(n, dtype=torch.float32, device=dev) for n in sizes]
        for k, sl, w, b, ts in _tiles(source, sizes, head_rows, tile_bytes):
            z = _tile_logits(hiddens[k][ts], w, b, math)
            tgt[k][ts] += _target_logit(z, sl, targets[k][ts])
            m_new = torch.maximum(m[k][ts], z.amax(dim=1))
            s[k][ts] = s[k][ts] * torch.exp(m[k][ts] - m_new) + z.sub_(m_new[:, None]).exp_().sum(dim=1)
            m[k][ts] = m_new
        lse = [mk + torch.log(sk) for mk, sk in zip(m, s)]
        ctx.save_for_backward(*items, *lse)
        ctx.source, ctx.math, ctx.head_rows, ctx.tile_bytes = source, math, head_rows, tile_bytes
        ctx.weight_dtype = None if weight is None else weight.dtype
        ctx.ambient = ambient_state(dev)  # the backward recomputes the logits as this forward did
        return tuple(((lk - tk) * wk).sum() for lk, tk, wk in zip(lse, tgt, token_weights))

    @staticmethod
    def backward(ctx, *grads: Tensor):  # type: ignore[override]
        saved = ctx.saved_tensors
        count = len(grads)
        hiddens, targets, token_weights, lse = (
            saved[0 : 3 * count : 3],
            saved[1 : 3 * count : 3],
            saved[2 : 3 * count : 3],
            saved[3 * count :],
        )
        source, math = ctx.source, ctx.math
        resident = isinstance(source, ResidentHead)
        want_h = [ctx.needs_input_grad[5 + 3 * k] for k in range(count)]
        want_w = ctx.needs_input_grad[4]
        tw = [w * g.float() for w, g in zip(token_weights, grads)]
        # in the hidden dtype, as autograd hands it on
        gh = [torch.empty_like(h) if want else None for h, want in zip(hiddens, want_h)]
        gw = (
            torch.zeros(source.vocab_size, hiddens[0].shape[1], dtype=torch.float32, device=hiddens[0].device)
            if want_w
            else None
        )
        acc: list[Tensor | None] = [None] * count
        acc_rows: list[slice | None] = [None] * count
        # under the forward's autocast settings: the logits its log-sum-exp came from, and the
        # matmuls in the precision resident autocast training differentiates them in
        with ambient_as(ctx.ambient):
            for k, sl, w, b, ts in _tiles(
                source, [h.shape[0] for h in hiddens], ctx.head_rows, ctx.tile_bytes
            ):
                h = hiddens[k][ts]
                z = _tile_logits(h, w, b, math)
                dfinal = math.derivative(z)  # d final logit / d raw logit (scale, softcap)
                dz = z.sub_(lse[k][ts, None]).exp_()  # softmax, in place of the logits
                # minus one at each target inside this chunk, minus zero (x as it was) in every
                # other row: no row selection, so the host never waits on the device for it
                local = targets[k][ts] - sl.start
                hit = (local >= 0) & (local < dz.shape[1])
                at = (torch.arange(dz.shape[0], device=dz.device), local.clamp(0, dz.shape[1] - 1))
                dz.index_put_(at, dz[at] - hit.to(dz.dtype))
                dz.mul_(tw[k][ts, None])
                if dfinal is not None:
                    dz.mul_(dfinal)
                dz = dz.to(w.dtype)  # HF's backward hands the logits gradient on in the head dtype
                if gh[k] is not None:
                    if resident:  # token-outer: finish this chunk, then store it
                        if acc_rows[k] != ts:
                            if acc[k] is not None:
                                gh[k][acc_rows[k]] = acc[k].to(gh[k].dtype)
                            acc[k] = torch.zeros(
                                ts.stop - ts.start, h.shape[1], dtype=torch.float32, device=h.device
                            )
                            acc_rows[k] = ts
                        acc[k] += dz @ w
                    else:  # vocabulary-outer: one fp32 accumulator for all of an item's tokens
                        if acc[k] is None:
                            acc[k] = torch.zeros(hiddens[k].shape, dtype=torch.float32, device=h.device)
                        acc[k][ts] += dz @ w
                if gw is not None:
                    gw[sl] += dz.t() @ h
        out: list[Tensor | None] = [None, None, None, None, None if gw is None else gw.to(ctx.weight_dtype)]
        for k in range(count):
            if gh[k] is not None:
                gh[k][acc_rows[k] if resident else slice(None)] = acc[k].to(gh[k].dtype)
            out += [gh[k], None, None]
        return tuple(out)


def linear_cross_entropy(
    hidden: Tensor,
    targets: Tensor,
    source: HeadSource,
    token_weights: Tensor,
    *,
    head_rows: int | None = None,
    tile_bytes: int = DEFAULT_TILE_BYTES,
) -> Tensor:
    """``sum_i token_weights[i] * CE(head(hidden[i]), targets[i])`` without full logits.

    `hidden` [N, H] and `targets` [N] (every target a valid vocabulary index — select
    trainable positions first); `token_weights` [N] fp32 carries the reduction (1/count for
    a mean). The head's weight gradient flows when ``source.trainable_weight`` is set.
    """
    return linear_cross_entropies(
        [(hidden, targets, token_weights)], source, head_rows=head_rows, tile_bytes=tile_bytes
    )[0]


def linear_cross_entropies(
    items: Sequence[tuple[Tensor, Tensor, Tensor]],
    source: HeadSource,
    *,
    head_rows: int | None = None,
    tile_bytes: int = DEFAULT_TILE_BYTES,
) -> list[Tensor]:
    """`linear_cross_entropy` of several ``(hidden, targets, token_weights)`` items — the
    micro-batches of a step — with one read of a streamed head in forward and one in
    backward for all of them. Each item's loss and gradient are `torch.equal` to its own
    `linear_cross_entropy`. A head that trains takes one item at a time (its gradient
    would be summed over the items in another order)."""
    if not items:
        return []
    for hidden, targets, token_weights in items:
        if hidden.dim() != 2 or targets.shape != hidden.shape[:1] or token_weights.shape != targets.shape:
            raise ValueError(
                f"hidden must be [N, H] with targets and token_weights [N]; got {tuple(hidden.shape)}, "
                f"{tuple(targets.shape)}, {tuple(token_weights.shape)}"
            )
    weight = source.trainable_weight
    if weight is not None and len(items) > 1:
        raise ValueError("a head that trains takes one item at a time: call linear_cross_entropy for each")
    flat = [t for hidden, targets, token_weights in items for t in (hidden, targets, token_weights.float())]
    return list(_LinearCrossEntropy.apply(source, source.math, head_rows, tile_bytes, weight, *flat))


def cross_entropy_from_logits(
    logits: Tensor, targets: Tensor, token_weights: Tensor, math: LogitMath | None = None
) -> Tensor:
    """``sum_i w_i * CE(logits_i, y_i)`` from materialised raw head outputs, upcast to fp32
    first, then the architecture's `LogitMath`."""
    z = (math or LogitMath())(logits.float())
    return (nn.functional.cross_entropy(z, targets, reduction="none") * token_weights.float()).sum()


def reference_cross_entropy(
    hidden: Tensor,
    targets: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    token_weights: Tensor,
    math: LogitMath | None = None,
) -> Tensor:
    """The full-logits computation (what HF's loss does): what the chunked one is held to."""
    return cross_entropy_from_logits(nn.functional.linear(hidden, weight, bias), targets, token_weights, math)
