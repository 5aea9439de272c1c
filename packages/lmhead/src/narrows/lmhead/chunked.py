"""Exact cross-entropy through the LM head without the [tokens, vocab] logits.

`linear_cross_entropy` computes ``sum_i w_i * CE(h_i @ W.T + b, y_i)`` in tiles of
(vocabulary chunk x token chunk). The weight comes from a core `HeadSource`, one
vocabulary chunk at a time, so a head kept in host memory by narrows-stream is read in
two sequential passes and never needs to be on the device whole:

1. an online log-sum-exp over vocabulary chunks (running max and rescaled sum per token)
   and the target logit;
2. only when a gradient is needed: the softmax gradient of each tile, multiplied into
   the hidden-state gradient (fp32 accumulator) and, for a head that trains, the weight
   gradient.

Because the loss is linear in the per-token weights, the gradient is complete at the end
of the forward; backward only scales it by the incoming scalar. Nothing is recomputed and
the head is not read again in backward. Logits are computed in the head's dtype and
upcast to fp32 (as HF's loss does), softcapping (Gemma) and every reduction in fp32.

`reference_cross_entropy` is the plain full-logits computation the tests hold it to.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from narrows.core import DEFAULT_HEAD_ROWS, HeadSource, ResidentHead

__all__ = [
    "DEFAULT_TILE_BYTES",
    "cross_entropy_from_logits",
    "linear_cross_entropy",
    "reference_cross_entropy",
]

DEFAULT_TILE_BYTES = 32 * 2**20  # one fp32 [token chunk x vocabulary chunk] tile


def _tile_logits(h: Tensor, w: Tensor, b: Tensor | None, softcap: float | None) -> Tensor:
    z = nn.functional.linear(h, w, b).float()
    return z if softcap is None else torch.tanh(z / softcap) * softcap


def _token_rows(rows: int, tile_bytes: int) -> int:
    return max(1, tile_bytes // (4 * rows))


def _lse_update(z: Tensor, sl: slice, y: Tensor, m: Tensor, s: Tensor, tgt: Tensor) -> None:
    """Fold one tile into the running max `m`, rescaled sum `s` and target logit `tgt`."""
    m_new = torch.maximum(m, z.amax(dim=1))
    s.copy_(s * torch.exp(m - m_new) + torch.exp(z - m_new[:, None]).sum(dim=1))
    m.copy_(m_new)
    local = y - sl.start
    hit = (local >= 0) & (local < z.shape[1])
    tgt += torch.where(hit, z.gather(1, local.clamp(0, z.shape[1] - 1)[:, None])[:, 0], 0.0)


def _tile_grad(
    z: Tensor, sl: slice, y: Tensor, lse: Tensor, tw: Tensor, softcap: float | None, dtype
) -> Tensor:
    """d(loss)/d(logits) of one tile, in the head dtype (as HF's backward casts it)."""
    dz = torch.exp(z - lse[:, None])
    local = y - sl.start
    rows = torch.nonzero((local >= 0) & (local < z.shape[1]))[:, 0]
    dz[rows, local[rows]] -= 1.0
    dz *= tw[:, None]
    if softcap is not None:
        dz *= 1.0 - (z / softcap) ** 2
    return dz.to(dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor | None, targets: Tensor, token_weights: Tensor,  # type: ignore[override]
                source: HeadSource, softcap: float | None, head_rows: int | None, tile_bytes: int,
                need_grad: bool) -> Tensor:  # fmt: skip
        n, dev = hidden.shape[0], hidden.device
        m = torch.full((n,), -torch.inf, dtype=torch.float32, device=dev)
        s = torch.zeros(n, dtype=torch.float32, device=dev)
        tgt = torch.zeros(n, dtype=torch.float32, device=dev)
        gh = torch.empty_like(hidden) if need_grad else None  # the hidden gradient, in the hidden dtype
        gw = (
            None
            if weight is None or not need_grad
            else torch.zeros(weight.shape, dtype=torch.float32, device=dev)
        )

        def pass2(ts: slice, lse: Tensor, acc: Tensor, chunks) -> None:
            for sl, w, b in chunks:
                h = hidden[ts]
                dz = _tile_grad(_tile_logits(h, w, b, softcap), sl, targets[ts], lse, token_weights[ts], softcap,
                                w.dtype)  # fmt: skip
                acc += dz @ w
                if gw is not None:
                    gw[sl] += dz.t() @ h

        if isinstance(source, ResidentHead):
            # the head is on the device: token chunks outside, so each token's gradient is
            # finished (fp32) before the next chunk starts and only [T, H] is ever fp32
            step = _token_rows(min(head_rows or DEFAULT_HEAD_ROWS, source.vocab_size), tile_bytes)
            for t in range(0, n, step):
                ts = slice(t, min(t + step, n))
                for sl, w, b in source.chunks(head_rows):
                    _lse_update(
                        _tile_logits(hidden[ts], w, b, softcap), sl, targets[ts], m[ts], s[ts], tgt[ts]
                    )
                if gh is not None:
                    acc = torch.zeros(ts.stop - ts.start, hidden.shape[1], dtype=torch.float32, device=dev)
                    pass2(ts, m[ts] + torch.log(s[ts]), acc, source.chunks(head_rows))
                    gh[ts] = acc.to(hidden.dtype)
        else:
            # a streamed head: vocabulary chunks outside, so the head is read in two passes
            step = None

            def tiles():
                nonlocal step
                for sl, w, b in source.chunks(head_rows):
                    step = step or _token_rows(sl.stop - sl.start, tile_bytes)
                    for t in range(0, n, step):
                        yield sl, w, b, slice(t, min(t + step, n))

            for sl, w, b, ts in tiles():
                _lse_update(_tile_logits(hidden[ts], w, b, softcap), sl, targets[ts], m[ts], s[ts], tgt[ts])
            if gh is not None:
                acc = torch.zeros(hidden.shape, dtype=torch.float32, device=dev)
                lse = m + torch.log(s)
                for sl, w, b, ts in tiles():
                    pass2(ts, lse[ts], acc[ts], [(sl, w, b)])
                gh.copy_(acc)
        lse = m + torch.log(s)
        ctx.grads = (gh, gw)
        ctx.weight_dtype = None if weight is None else weight.dtype
        return ((lse - tgt) * token_weights).sum()

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        gh, gw = ctx.grads
        ctx.grads = None
        if not bool(grad == 1):
            gh = (gh.float() * grad).to(gh.dtype)
        gw = None if gw is None else gw.mul_(grad).to(ctx.weight_dtype)
        return gh, gw, None, None, None, None, None, None, None


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
    weight = source.trainable_weight
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight is not None)
    return _LinearCrossEntropy.apply(hidden, weight, targets, token_weights.float(), source, source.softcap,
                                     head_rows, tile_bytes, need_grad)  # fmt: skip


def cross_entropy_from_logits(logits: Tensor, targets: Tensor, token_weights: Tensor,
                              softcap: float | None = None) -> Tensor:  # fmt: skip
    """``sum_i w_i * CE(logits_i, y_i)`` from materialised logits, upcast to fp32 first."""
    z = logits.float()
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    return (nn.functional.cross_entropy(z, targets, reduction="none") * token_weights.float()).sum()


def reference_cross_entropy(hidden: Tensor, targets: Tensor, weight: Tensor, bias: Tensor | None,
                            token_weights: Tensor, softcap: float | None = None) -> Tensor:  # fmt: skip
    """The full-logits computation (what HF's loss does): what the chunked one is held to."""
    return cross_entropy_from_logits(
        nn.functional.linear(hidden, weight, bias), targets, token_weights, softcap
    )
