"""Exact cross-entropy through the LM head without the [tokens, vocab] logits.

`linear_cross_entropy` computes ``sum_i w_i * CE(h_i @ W.T + b, y_i)`` in tiles of
(vocabulary chunk x token chunk). The weight comes from a core `HeadSource`, one
vocabulary chunk at a time, so a head kept in host memory by narrows-stream is read once
in forward and once in backward and never needs to be on the device whole:

- forward: an online log-sum-exp over vocabulary chunks (running max and rescaled sum
  per token) and the target logit; only the per-token log-sum-exp [N] fp32 is saved;
- backward: each tile's logits are recomputed and turned into the softmax gradient,
  multiplied into the hidden-state gradient (an fp32 accumulator per token chunk) and,
  for a head that trains, into the weight gradient (fp32).

Logits are computed in the head's dtype and upcast to fp32 (as HF's loss does); the
architecture's `LogitMath` (Cohere's scale, Granite's divisor, Gemma's softcapping) and
every reduction are fp32. Tile arithmetic runs in place, so the
working set is about one fp32 tile plus its head-dtype matmul output.

`reference_cross_entropy` is the plain full-logits computation the tests hold it to.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

from narrows.core import DEFAULT_HEAD_ROWS, HeadSource, LogitMath, ResidentHead, ambient_as, ambient_state

__all__ = [
    "DEFAULT_TILE_BYTES",
    "cross_entropy_from_logits",
    "linear_cross_entropy",
    "reference_cross_entropy",
]

DEFAULT_TILE_BYTES = 16 * 2**20  # one fp32 [token chunk x vocabulary chunk] tile

Tile = tuple[slice, Tensor, Tensor | None, slice]  # vocabulary rows, weight, bias, token rows


def _tile_logits(h: Tensor, w: Tensor, b: Tensor | None, math: LogitMath) -> Tensor:
    z = nn.functional.linear(h, w, b)
    z = z.float() if z.dtype != torch.float32 else z  # fresh either way: safe to modify in place
    return math.apply_(z)


def _tiles(source: HeadSource, n: int, head_rows: int | None, tile_bytes: int) -> Iterator[Tile]:
    """Every (vocabulary chunk, token chunk) tile, in the order that suits the source.

    A resident head is on the device: token chunks go outside, so each token's gradient is
    finished before the next chunk starts and only [T, H] is ever accumulated in fp32. A
    streamed head is read chunk by chunk from host memory: vocabulary chunks go outside,
    so the head is read once per pass.
    """
    rows = min(head_rows or DEFAULT_HEAD_ROWS, source.vocab_size)
    step = max(1, tile_bytes // (4 * rows))
    if isinstance(source, ResidentHead):
        for t in range(0, n, step):
            ts = slice(t, min(t + step, n))
            for sl, w, b in source.chunks(head_rows):
                yield sl, w, b, ts
    else:
        for sl, w, b in source.chunks(head_rows):
            for t in range(0, n, step):
                yield sl, w, b, slice(t, min(t + step, n))


def _target_logit(z: Tensor, sl: slice, y: Tensor) -> Tensor:
    local = y - sl.start
    hit = (local >= 0) & (local < z.shape[1])
    return torch.where(hit, z.gather(1, local.clamp(0, z.shape[1] - 1)[:, None])[:, 0], 0.0)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor | None, targets: Tensor, token_weights: Tensor,  # type: ignore[override]
                source: HeadSource, math: LogitMath, head_rows: int | None,
                tile_bytes: int) -> Tensor:  # fmt: skip
        n, dev = hidden.shape[0], hidden.device
        m = torch.full((n,), -torch.inf, dtype=torch.float32, device=dev)
        s = torch.zeros(n, dtype=torch.float32, device=dev)
        tgt = torch.zeros(n, dtype=torch.float32, device=dev)
        for sl, w, b, ts in _tiles(source, n, head_rows, tile_bytes):
            z = _tile_logits(hidden[ts], w, b, math)
            tgt[ts] += _target_logit(z, sl, targets[ts])
            m_new = torch.maximum(m[ts], z.amax(dim=1))
            s[ts] = s[ts] * torch.exp(m[ts] - m_new) + z.sub_(m_new[:, None]).exp_().sum(dim=1)
            m[ts] = m_new
        lse = m + torch.log(s)
        ctx.save_for_backward(hidden, targets, token_weights, lse)
        ctx.source, ctx.math, ctx.head_rows, ctx.tile_bytes = source, math, head_rows, tile_bytes
        ctx.weight_dtype = None if weight is None else weight.dtype
        ctx.ambient = ambient_state(dev)  # the backward recomputes the logits as this forward did
        return ((lse - tgt) * token_weights).sum()

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        hidden, targets, token_weights, lse = ctx.saved_tensors
        source, math = ctx.source, ctx.math
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        tw = token_weights * grad.float()
        gh = torch.empty_like(hidden) if want_h else None  # in the hidden dtype, as autograd hands it on
        gw = (
            torch.zeros(source.vocab_size, hidden.shape[1], dtype=torch.float32, device=hidden.device)
            if want_w
            else None
        )
        acc, acc_rows = None, None
        # under the forward's autocast settings: the logits its log-sum-exp came from, and the
        # matmuls in the precision resident autocast training differentiates them in
        with ambient_as(ctx.ambient):
            for sl, w, b, ts in _tiles(source, hidden.shape[0], ctx.head_rows, ctx.tile_bytes):
                h = hidden[ts]
                z = _tile_logits(h, w, b, math)
                dfinal = math.derivative(z)  # d final logit / d raw logit (scale, softcap)
                dz = z.sub_(lse[ts, None]).exp_()  # softmax, in place of the logits
                local = targets[ts] - sl.start
                rows = torch.nonzero((local >= 0) & (local < dz.shape[1]))[:, 0]
                dz[rows, local[rows]] -= 1.0
                dz.mul_(tw[ts, None])
                if dfinal is not None:
                    dz.mul_(dfinal)
                dz = dz.to(w.dtype)  # HF's backward hands the logits gradient on in the head dtype
                if gh is not None:
                    if isinstance(source, ResidentHead):  # token-outer: finish this chunk, then store it
                        if acc_rows != ts:
                            if acc is not None:
                                gh[acc_rows] = acc.to(gh.dtype)
                            acc = torch.zeros(
                                ts.stop - ts.start, hidden.shape[1], dtype=torch.float32, device=h.device
                            )
                            acc_rows = ts
                        acc += dz @ w
                    else:  # vocabulary-outer: one fp32 accumulator for all tokens
                        if acc is None:
                            acc = torch.zeros(hidden.shape, dtype=torch.float32, device=h.device)
                        acc[ts] += dz @ w
                if gw is not None:
                    gw[sl] += dz.t() @ h
        if gh is not None:
            gh[acc_rows if isinstance(source, ResidentHead) else slice(None)] = acc.to(gh.dtype)
        gw = None if gw is None else gw.to(ctx.weight_dtype)
        return gh, gw, None, None, None, None, None, None


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
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1] or token_weights.shape != targets.shape:
        raise ValueError(
            f"hidden must be [N, H] with targets and token_weights [N]; got {tuple(hidden.shape)}, "
            f"{tuple(targets.shape)}, {tuple(token_weights.shape)}"
        )
    return _LinearCrossEntropy.apply(hidden, source.trainable_weight, targets, token_weights.float(), source,
                                     source.math, head_rows, tile_bytes)  # fmt: skip


def cross_entropy_from_logits(logits: Tensor, targets: Tensor, token_weights: Tensor,
                              math: LogitMath | None = None) -> Tensor:  # fmt: skip
    """``sum_i w_i * CE(logits_i, y_i)`` from materialised raw head outputs, upcast to fp32
    first, then the architecture's `LogitMath`."""
    z = (math or LogitMath())(logits.float())
    return (nn.functional.cross_entropy(z, targets, reduction="none") * token_weights.float()).sum()


def reference_cross_entropy(hidden: Tensor, targets: Tensor, weight: Tensor, bias: Tensor | None,
                            token_weights: Tensor, math: LogitMath | None = None) -> Tensor:  # fmt: skip
    """The full-logits computation (what HF's loss does): what the chunked one is held to."""
    return cross_entropy_from_logits(nn.functional.linear(hidden, weight, bias), targets, token_weights, math)
