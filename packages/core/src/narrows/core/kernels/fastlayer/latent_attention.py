"""Multi-head latent attention (DeepSeek-V3's, Kimi K2's) up to SDPA's inputs, and its
backward from their gradients: what the fast layer runs in place of the Q/K/V projections
for a layer whose keys and values come out of one low-rank latent.

The layer's Q/K/V group holds ``q_a_proj`` (or a plain ``q_proj``); `LatentParts` the
rest, each linear a group of its own, run (and their dropout masks drawn) in the order
transformers calls them: q_a, q_b, kv_a, kv_b. Per token::

    q      = q_b(norm_q(q_a(x)))               (heads, nope + rope)   [q_proj(x) without q_a]
    c, k_r = split(kv_a(x), [rank, rope])       the latent and one key part shared by all heads
    k, v   = split(kv_b(norm_kv(c)), [nope, v]) (heads, nope), (heads, v)
    query  = [q_nope, rope(q_rope)]             key = [k, rope(k_r) on every head]

so SDPA reads queries and keys of ``nope + rope`` channels and values of ``v`` channels
(its scale is the layer's: ``(nope + rope)^-0.5``, times YaRN's mscale² where the rotary
embedding is YaRN's). Where the checkpoint lays the rotated channels out in interleaved
pairs (``rope_interleave``), they are de-interleaved first, which is what transformers'
``apply_rotary_pos_emb_interleave`` computes (the same bits). Both latent norms are
frozen RMSNorms; ``q_b`` and ``kv_b`` are linear groups of one, LoRA on each optional.

The backward is written out: the shared key part's gradient is the sum over heads, the
rotation's transpose, the norms', each group's own (`LinearGroup.backward`).

why: docs/design.md#latent-attention
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .lora import GroupState, LinearGroup
from .ops import NormState, rms_norm_backward, rms_norm_rows, rope_pair, rope_pair_backward

if TYPE_CHECKING:
    from .parts import Norm

__all__ = ["LatentParts", "LatentState", "backward", "forward", "halves_to_pairs", "pairs_to_halves"]


@dataclass
class LatentParts:
    """A layer's latent attention beyond its Q/K/V group (q_a_proj, or a plain q_proj)."""

    q_b: LinearGroup | None  # None: the queries come from a plain q_proj (no q_lora_rank)
    kv_a: LinearGroup  # kv_a_proj_with_mqa: the latent and the shared key part, side by side
    kv_b: LinearGroup
    q_norm: Norm | None  # q_a_layernorm (None with q_b)
    kv_norm: Norm  # kv_a_layernorm
    heads: int
    rank: int  # kv_lora_rank: the latent's width
    nope: int  # qk_nope_head_dim
    rope: int  # qk_rope_head_dim
    v_dim: int  # v_head_dim
    interleave: bool  # rope_interleave: the rotated channels come in (even, odd) pairs

    @property
    def groups(self) -> tuple[LinearGroup, ...]:
        return (self.kv_a, self.kv_b) if self.q_b is None else (self.q_b, self.kv_a, self.kv_b)


@dataclass
class LatentState:
    """What the latent path's backward needs beyond the Q/K/V group's state."""

    q_pre: Tensor | None  # q_a's output, as q_a_layernorm read it (None without q_b)
    q_rstd: NormState | None
    q_b: GroupState | None
    kv_a: GroupState
    c_pre: Tensor  # the latent before kv_a_layernorm, as it read it
    kv_rstd: NormState
    kv_b: GroupState | None = None


def pairs_to_halves(x: Tensor) -> Tensor:
    """Channels in interleaved pairs ``(x0, x1), (x2, x3), …`` as the even ones, then the
    odd ones (``rope_interleave``'s layout to the rotate-half layout `ops.rope` turns)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


def halves_to_pairs(x: Tensor) -> Tensor:
    """`pairs_to_halves`' inverse (and transpose: a permutation's gradient goes back)."""
    half = x.shape[-1] // 2
    return torch.stack([x[..., :half], x[..., half:]], dim=-1).flatten(-2)


def forward(
    p: LatentParts,
    q_in: Tensor,
    n: Tensor,
    bs: tuple[int, int],
    cos: Tensor,
    sin: Tensor,
    cache: dict[str, Tensor] | None,
    *,
    attend: bool,
) -> tuple[tuple[Tensor, Tensor, Tensor] | None, tuple[Tensor, Tensor] | None, LatentState]:
    """From the Q/K/V group's output (`q_in`: q_a's or q_proj's, (tokens, width)) and its
    input `n` (kv_a's too): SDPA's query, key, value, (batch, heads, seq, width), and the latent
    and the rotated shared key part, (batch, 1, seq, width) as transformers' cache keeps
    them; and what the backward needs. Without `attend` (a recompute whose attention was
    kept) q_b's and kv_b's outputs are not computed: only their adapters' side is (the
    dropout masks drawn in the same order)."""
    batch, seq = bs
    q_pre = q_rstd = st_qb = None
    q = q_in
    if p.q_b is not None:
        q_n, q_pre, q_rstd = rms_norm_rows(q_in, p.q_norm.weight, p.q_norm.eps)
        masks = p.q_b.masks(q_n)
        if attend:
            (q,), st_qb = p.q_b.forward(q_n, masks, cache)
        else:
            st_qb = p.q_b.state(q_n, masks)
    (kv_in,), st_kva = p.kv_a.forward(n, p.kv_a.masks(n), cache)
    c, k_rope = kv_in.split([p.rank, p.rope], dim=1)
    c_n, c_pre, kv_rstd = rms_norm_rows(c, p.kv_norm.weight, p.kv_norm.eps)
    masks = p.kv_b.masks(c_n)
    state = LatentState(q_pre, q_rstd, st_qb, st_kva, c_pre, kv_rstd)
    if not attend:
        state.kv_b = p.kv_b.state(c_n, masks)
        return None, None, state
    (kv,), state.kv_b = p.kv_b.forward(c_n, masks, cache)
    q = q.view(batch, seq, p.heads, p.nope + p.rope)
    q_nope, q_rope = q.split([p.nope, p.rope], dim=-1)
    k_rope = k_rope.reshape(batch, seq, 1, p.rope).transpose(1, 2)  # (batch, 1, seq, rope)
    q_rope = q_rope.transpose(1, 2)  # (batch, heads, seq, rope)
    if p.interleave:
        q_rope, k_rope = pairs_to_halves(q_rope), pairs_to_halves(k_rope)
    q_rope, k_rope = rope_pair(q_rope.contiguous(), k_rope.contiguous(), cos, sin)
    kv = kv.view(batch, seq, p.heads, p.nope + p.v_dim)
    k_nope, v = kv.split([p.nope, p.v_dim], dim=-1)
    # each built (batch, seq, heads, width) and read transposed, as the other families' are
    query = torch.cat([q_nope, q_rope.transpose(1, 2)], dim=-1).transpose(1, 2)
    shared = k_rope.transpose(1, 2).expand(batch, seq, p.heads, p.rope)
    key = torch.cat([k_nope, shared], dim=-1).transpose(1, 2)
    value = v.contiguous().transpose(1, 2)  # (alone, a column block would keep kv_b's output alive)
    latent = c_n.view(batch, 1, seq, p.rank)
    return (query, key, value), (latent, k_rope), state


def backward(
    p: LatentParts,
    s: LatentState,
    gq: Tensor,
    gk: Tensor,
    gv: Tensor,
    cos: Tensor,
    sin: Tensor,
    cache: dict[str, Tensor] | None,
) -> tuple[Tensor, Tensor, list[Tensor]]:
    """From SDPA's inputs' gradients, (batch, heads, seq, width): the Q/K/V group's output
    gradient (q_a's or q_proj's, (tokens, width)), kv_a's input gradient (the layer's normed
    input's share through the keys and values) and the adapters' of `LatentParts.groups`
    (float32, in their order)."""
    tokens = gq.shape[0] * gq.shape[2]
    gq, gk = gq.transpose(1, 2), gk.transpose(1, 2)  # (batch, seq, heads, nope + rope)
    g_q_rope = gq[..., p.nope :].transpose(1, 2)
    # the shared key part was read by every head: its gradient is their sum (in float32)
    g_k_rope = gk[..., p.nope :].sum(dim=2, keepdim=True, dtype=torch.float32).to(gk.dtype).transpose(1, 2)
    g_q_rope, g_k_rope = rope_pair_backward(g_q_rope.contiguous(), g_k_rope.contiguous(), cos, sin)
    if p.interleave:
        g_q_rope, g_k_rope = halves_to_pairs(g_q_rope), halves_to_pairs(g_k_rope)
    g_q = torch.cat([gq[..., : p.nope], g_q_rope.transpose(1, 2)], dim=-1).reshape(tokens, -1)
    g_kv = torch.cat([gk[..., : p.nope], gv.transpose(1, 2)], dim=-1).reshape(tokens, -1)
    del gq, gk, gv
    g_c, p_kv_b = p.kv_b.backward([g_kv], s.kv_b, cache)
    del g_kv
    g_c = rms_norm_backward(g_c, s.c_pre, p.kv_norm.weight, s.kv_rstd)
    g_kv_in = torch.cat([g_c.view(tokens, p.rank), g_k_rope.transpose(1, 2).reshape(tokens, p.rope)], dim=1)
    g_n, p_kv_a = p.kv_a.backward([g_kv_in], s.kv_a, cache)
    del g_kv_in
    p_q_b: list[Tensor] = []
    if p.q_b is not None:
        g_q, p_q_b = p.q_b.backward([g_q], s.q_b, cache)
        g_q = rms_norm_backward(g_q, s.q_pre, p.q_norm.weight, s.q_rstd).view(tokens, -1)
    return g_q, g_n, [*p_q_b, *p_kv_a, *p_kv_b]
