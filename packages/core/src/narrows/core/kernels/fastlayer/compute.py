"""One decoder layer's forward, its recompute and its backward, written out: what the
fast layer runs instead of the layer's modules and autograd's graph of them.

`forward` (nothing kept), `recompute` (what the backward needs, no down_proj output),
`forward_keeping` (both) and `forward_keeping_attention` share one forward and give the
same bits; `backward` gives the input's gradient and the adapters' (float32).

why: docs/design.md#the-written-out-layer
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.nn import functional as F

from . import latent_attention, moe
from .lora import GroupState
from .ops import (
    NormState,
    rms_norm,
    rms_norm_backward,
    rms_norm_rows,
    rope_pair,
    rope_pair_backward,
    swiglu,
    swiglu_backward,
)
from .parts import LayerParts

__all__ = [
    "AttentionStore",
    "KeptAttention",
    "OnDevice",
    "Saved",
    "backward",
    "forward",
    "forward_keeping",
    "forward_keeping_attention",
    "recompute",
]


class AttentionStore(Protocol):
    """Where a kept attention node's saved tensors live between a forward and its backward."""

    def saving(self, mask: Tensor | None) -> AbstractContextManager[Any]:
        """The context the attention call runs in (saved-tensor hooks, or none); `mask` is
        the call's attention mask, an input of every layer (left where it is)."""

    def keep(self, leaves: tuple[Tensor, Tensor, Tensor], attn: Tensor) -> Callable[[], Tensor]:
        """After the call: what gives its output back on the device, for the recompute."""


class OnDevice:
    """Kept on the device as they are: the node holds its saved tensors, the output is held."""

    def saving(self, mask: Tensor | None) -> AbstractContextManager[Any]:
        return nullcontext()

    def keep(self, leaves: tuple[Tensor, Tensor, Tensor], attn: Tensor) -> Callable[[], Tensor]:
        return lambda: attn


@dataclass
class KeptAttention:
    """One layer call's attention, kept from its forward: the SDPA node (with everything
    its backward reads saved in it) and its output for the recompute."""

    node: Any  # torch.autograd.graph.Node: one node on the leaves q, k, v
    out: Callable[[], Tensor]

    def grads(self, g_attn: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q's, k's and v's gradients: the node differentiated alone, as `autograd.grad`
        over it would (it is the whole graph between them)."""
        gq, gk, gv = self.node(g_attn)[:3]
        return gq, gk, gv


def _one_node(attn: Tensor, leaves: tuple[Tensor, Tensor, Tensor]) -> bool:
    """Whether SDPA recorded one node on the leaves themselves (a fused kernel's; the math
    fallback records a graph of many, which is not kept). On the H100 with torch 2.11,
    flash, cuDNN and memory-efficient attention each record one, with and without a mask
    and grouped-query heads; grouped-query heads with a mask under deterministic kernels
    fall back to the math path."""
    nexts = attn.grad_fn.next_functions if attn.grad_fn is not None else ()
    got = [getattr(f, "variable", None) for f, _ in nexts[:3]]
    return len(got) == 3 and all(a is b for a, b in zip(got, leaves))


@dataclass
class Saved:
    """What a layer's backward needs from its forward."""

    shape: torch.Size
    x: Tensor  # (tokens, hidden)
    rstd1: NormState
    qkv: GroupState
    heads_pre: (
        tuple[Tensor, Tensor, NormState, NormState] | None
    )  # Qwen3: q, k before their norms, and the rstds
    cos: Tensor  # the rotary tables, (batch or 1, seq, head_dim)
    sin: Tensor
    leaves: tuple[Tensor, Tensor, Tensor] | None  # attention's q, k, v (leaves of its one-node graph)
    attn: Tensor  # its output, (batch, heads, seq, head_dim)
    o: GroupState
    h1: Tensor
    rstd2: NormState
    gate_up: GroupState | None  # None (and gate, up, down too) when the MLP runs in tiles:
    gate: Tensor | None  # the backward recomputes it tile by tile from `n2`
    up: Tensor | None
    down: GroupState | None
    n2: Tensor | None = None  # the tiled MLP's input
    kept: KeptAttention | None = None  # the forward's attention (then `leaves` is None)
    moe: moe.MoEState | None = None  # an MoE block's routed experts (gate_up, down: its shared expert)
    shared: tuple[Tensor | None, Tensor] | None = None  # the shared expert's gate (None: ungated) and output
    latent: latent_attention.LatentState | None = None  # latent attention's path beyond the Q/K/V group


def _attention(parts: LayerParts, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    if mask is not None:
        mask = mask[:, :, :, : k.shape[-2]]
    if parts.sinks is not None:
        return _attention_with_sinks(parts, q, k, v, mask)
    causal = q.shape[2] > 1 and mask is None
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        is_causal=causal,
        scale=parts.scaling,
        enable_gqa=parts.kv_heads != parts.heads,
    )


def _attention_with_sinks(parts: LayerParts, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """Attention whose softmax has one more logit per head in its denominator (gpt-oss's
    sinks), through SDPA: a key in front of the others that every query sees, with a zero
    value, whose logit is the sink. Each head gets one more channel, s_h / scaling in its
    queries, 1 in that key and 0 in the others (then zeros to a multiple of 8 channels), so
    the scaled product is s_h for the sink and unchanged for every key. Without a mask a
    zero query goes in front too, so that the causal mask (aligned at the top left) lets
    each query see the sink and its own keys; with one, the mask gets a column that admits
    the sink."""
    b, heads, t, d = q.shape
    kv_heads, width = k.shape[1], d + 8 - d % 8  # (at least one more channel)
    sink = (parts.sinks.to(torch.float32) / parts.scaling).to(q.dtype).view(1, heads, 1, 1)
    qs = F.pad(q, (0, width - d))
    qs[..., d : d + 1] = sink.expand(b, heads, t, 1)
    key = q.new_zeros(b, kv_heads, 1, width)
    key[..., d] = 1
    ks = torch.cat([key, F.pad(k, (0, width - d))], dim=2)
    vs = torch.cat([v.new_zeros(b, kv_heads, 1, width), F.pad(v, (0, width - d))], dim=2)
    if mask is None:
        qs = torch.cat([qs.new_zeros(b, heads, 1, width), qs], dim=2)
    else:
        admit = torch.ones if mask.dtype == torch.bool else torch.zeros
        mask = torch.cat([admit(*mask.shape[:-1], 1, dtype=mask.dtype, device=mask.device), mask], dim=-1)
    out = F.scaled_dot_product_attention(
        qs,
        ks,
        vs,
        attn_mask=mask,
        is_causal=mask is None,
        scale=parts.scaling,
        enable_gqa=kv_heads != heads,
    )
    return out[:, :, -t:, :d]


KVSink = Callable[[Tensor, Tensor], object]  # takes the keys and values (a KV cache's update)


@dataclass
class _Front:
    """A layer call up to its attention: what the rest of it and its backward read."""

    x: Tensor  # the input, (batch, seq, hidden)
    x2: Tensor  # the same, (tokens, hidden)
    rstd1: NormState
    qkv: GroupState
    heads_pre: tuple[Tensor, Tensor, NormState, NormState] | None
    cos: Tensor
    sin: Tensor
    latent: latent_attention.LatentState | None = None


def _run(
    parts: LayerParts,
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    mask: Tensor | None,
    cache: dict[str, Tensor] | None,
    *,
    output: bool,
    keep: bool,
    kv: KVSink | None = None,
    store: AttentionStore | None = None,
    kept: KeptAttention | None = None,
) -> tuple[Tensor | None, Saved | None, KeptAttention | None]:
    """The layer's output (`output`), what its backward needs (`keep`) and, with `store`,
    its attention kept there; with `kept`, the attention a forward kept is read instead
    of run (and Q/K/V's base matmul skipped where nothing else reads its output)."""
    batch, seq, hidden = x.shape
    if parts.half_rope and 2 * cos.shape[-1] == parts.head_dim:  # gpt-oss's: both halves turned alike
        cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
    x2 = x.reshape(-1, hidden)
    n1, rstd1 = rms_norm(x2, parts.norm1.weight, parts.norm1.eps)
    masks = parts.qkv.masks(n1)
    if parts.latent is not None:
        return _run_latent(
            parts, x, x2, n1, rstd1, masks, cos, sin, mask, cache, output, keep, kv, store, kept
        )
    if kept is not None and parts.q_norm is None:  # the adapters' side only: q, k, v were kept
        front = _Front(x, x2, rstd1, parts.qkv.state(n1, masks), None, cos, sin)
        return _rest(parts, front, kept.out(), None, kept, cache, output=output, keep=keep)
    (q, k, v), st_qkv = parts.qkv.forward(n1, masks, cache)
    heads_pre = None
    if parts.q_norm is not None and parts.full_qk_norm:  # OLMo's: over all heads, before they split
        q, k, heads_pre = _qk_norms(parts, q, k)
    q = q.view(batch, seq, parts.heads, parts.head_dim)
    k = k.view(batch, seq, parts.kv_heads, parts.head_dim)
    if parts.q_norm is not None and not parts.full_qk_norm:  # Qwen3's: each head's
        q, k, heads_pre = _qk_norms(parts, q, k)
    front = _Front(x, x2, rstd1, st_qkv, heads_pre, cos, sin)
    if kept is not None:  # per-head norms: their inputs recomputed, the attention still kept
        return _rest(parts, front, kept.out(), None, kept, cache, output=output, keep=keep)
    q, k = rope_pair(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    v = v.view(batch, seq, parts.kv_heads, parts.head_dim)
    if not v.is_contiguous():
        # a column block of the stacked Q/K/V output: attention keeps it, and alone it would
        # keep that whole output alive (on the device, or unable to go to host memory)
        v = v.contiguous()
    v = v.transpose(1, 2)
    if kv is not None:
        kv(k, v)
    return _attend(parts, front, q, k, v, mask, cache, output=output, keep=keep, store=store)


def _run_latent(
    parts: LayerParts,
    x: Tensor,
    x2: Tensor,
    n1: Tensor,
    rstd1: NormState,
    masks: list[Tensor | None],
    cos: Tensor,
    sin: Tensor,
    mask: Tensor | None,
    cache: dict[str, Tensor] | None,
    output: bool,
    keep: bool,
    kv: KVSink | None,
    store: AttentionStore | None,
    kept: KeptAttention | None,
) -> tuple[Tensor | None, Saved | None, KeptAttention | None]:
    """`_run` for latent attention (`latent_attention`): its Q/K/V group, then the latent
    path to SDPA's inputs; with `kept`, q_b's and kv_b's outputs are not computed. `kv`
    receives the normed latent and the rotated shared key part (what transformers caches)."""
    (q_in,), st_qkv = parts.qkv.forward(n1, masks, cache)
    qkv, latents, st = latent_attention.forward(
        parts.latent, q_in, n1, x.shape[:2], cos, sin, cache, attend=kept is None
    )
    del q_in
    front = _Front(x, x2, rstd1, st_qkv, None, cos, sin, st)
    if kept is not None:
        return _rest(parts, front, kept.out(), None, kept, cache, output=output, keep=keep)
    if kv is not None:
        kv(*latents)
    return _attend(parts, front, *qkv, mask, cache, output=output, keep=keep, store=store)


def _attend(
    parts: LayerParts,
    front: _Front,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    cache: dict[str, Tensor] | None,
    *,
    output: bool,
    keep: bool,
    store: AttentionStore | None,
) -> tuple[Tensor | None, Saved | None, KeptAttention | None]:
    """`_run` from SDPA's inputs, (batch, heads, seq, width), on: the attention (recorded
    as the backward's one-node graph where anything is kept), then `_rest`."""
    new_kept = None
    if keep or store is not None or not torch.is_inference_mode_enabled():
        # recorded as the backward's one-node graph; recorded in a forward that keeps nothing
        # too, so SDPA picks the same kernel (and gives the same bits) as in the recompute
        leaves = tuple(t.detach().requires_grad_() for t in (q, k, v))
        with torch.enable_grad(), store.saving(mask) if store is not None else nullcontext():
            attn = _attention(parts, *leaves, mask)
        if store is not None and _one_node(attn, leaves):
            new_kept = KeptAttention(attn.grad_fn, store.keep(leaves, attn))
    else:
        leaves, attn = None, _attention(parts, q, k, v, mask)
    return _rest(parts, front, attn, leaves, new_kept, cache, output=output, keep=keep)


def _qk_norms(parts: LayerParts, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor, tuple]:
    """Q and K through their norms, and what the backward needs (`Saved.heads_pre`: the
    norms' inputs, as rows where Liger's norm ran on them, and their states)."""
    qn, q_rows, rq = rms_norm_rows(q, parts.q_norm.weight, parts.q_norm.eps)
    kn, k_rows, rk = rms_norm_rows(k, parts.k_norm.weight, parts.k_norm.eps)
    return qn, kn, (q_rows, k_rows, rq, rk)


def _rest(
    parts: LayerParts,
    f: _Front,
    attn: Tensor,
    leaves: tuple[Tensor, Tensor, Tensor] | None,
    kept: KeptAttention | None,
    cache: dict[str, Tensor] | None,
    *,
    output: bool,
    keep: bool,
) -> tuple[Tensor | None, Saved | None, KeptAttention | None]:
    """`_run` from the attention's output on: o, the MLP, and what is kept."""
    batch, seq, hidden = f.x.shape
    o_in = attn.detach().transpose(1, 2).reshape(-1, parts.heads * parts.head_dim)
    (h1,), st_o = parts.o.forward(o_in, parts.o.masks(o_in), cache, residual=f.x2)
    n2, rstd2 = rms_norm(h1, parts.norm2.weight, parts.norm2.eps)
    tiles = parts.mlp_tiles(batch, seq)
    extra = {}
    if parts.moe is not None:
        out, gate, up, st_gu, st_d, extra = _moe_mlp(parts, n2, cache, h1 if output else None, keep)
        out = None if out is None else out.view(batch, seq, hidden)
        mlp = (st_gu, gate, up, st_d, None)
    elif tiles is not None:
        out = _tiled_mlp(parts, n2, h1, (batch, seq), tiles, cache) if output else None
        mlp: tuple = (None, None, None, None, n2)
    else:
        out, gate, up, st_gu, st_d = _mlp(parts, n2, cache, residual=h1 if output else None)
        out = None if out is None else out.view(batch, seq, hidden)
        mlp = (st_gu, gate, up, st_d, None)
    if not keep:
        return out, None, kept  # the attention's graph goes with `attn` unless kept
    saved = Saved(
        f.x.shape,
        f.x2,
        f.rstd1,
        f.qkv,
        f.heads_pre,
        f.cos,
        f.sin,
        leaves,
        attn,
        st_o,
        h1,
        rstd2,
        *mlp,
        kept=kept,
        latent=f.latent,
        **extra,
    )
    return out, saved, kept


def _mlp(
    parts: LayerParts,
    n: Tensor,
    cache: dict[str, Tensor] | None,
    residual: Tensor | None,
) -> tuple[Tensor | None, Tensor, Tensor, GroupState, GroupState]:
    """The MLP on `n` (all tokens, or one tile's): ``residual + down(swiglu(gate, up))``
    when `residual` is given, else no down_proj output (a backward's recompute); gate, up
    and both groups' states beside it."""
    (gate, up), st_gu = parts.gate_up.forward(n, parts.gate_up.masks(n), cache)
    a = swiglu(gate, up)
    skip = () if residual is not None else ("down",)
    (out,), st_d = parts.down.forward(a, parts.down.masks(a), cache, skip=skip, residual=residual)
    return out, gate, up, st_gu, st_d


def _moe_mlp(
    parts: LayerParts, n: Tensor, cache: dict[str, Tensor] | None, residual: Tensor | None, keep: bool
) -> tuple[Tensor | None, Tensor | None, Tensor | None, GroupState | None, GroupState | None, dict]:
    """An MoE block on `n`: ``residual + experts(n) + sigmoid(gate(n)) · shared(n)`` when
    `residual` is given (the shared expert where the block has one); the shared expert's
    gate, up and states, and what `Saved` keeps of the block (`keep`)."""
    out, state = moe.forward(parts.moe, n, cache, output=residual is not None, keep=keep)
    gate = up = st_gu = st_d = shared = None
    if parts.gate_up is not None:  # its output is kept for the gate's gradient: no skip
        (gate, up), st_gu = parts.gate_up.forward(n, parts.gate_up.masks(n), cache)
        a = swiglu(gate, up)
        (s_out,), st_d = parts.down.forward(a, parts.down.masks(a), cache)
        s_gate = moe.shared_gate_forward(parts.moe, n) if parts.moe.shared_gate is not None else None
        out = None if out is None else out + (s_out if s_gate is None else s_gate * s_out)
        shared = (s_gate, s_out)
    if residual is not None:
        out = residual + out
    return out, gate, up, st_gu, st_d, dict(moe=state, shared=shared)


def _moe_backward(
    parts: LayerParts, saved: Saved, g_out: Tensor, cache: dict[str, Tensor] | None
) -> tuple[Tensor, list[Tensor], list[Tensor], list[Tensor]]:
    """An MoE block's input gradient, its shared expert's adapters' (gate/up, down) and its
    routed experts' adapters'."""
    g_n2, p_experts = moe.backward(parts.moe, saved.moe, g_out, cache)
    if parts.gate_up is None:
        return g_n2, [], [], p_experts
    s_gate, s_out = saved.shared
    g_shared, g_n_gate = g_out, None  # an ungated shared expert (GLM-4-MoE's) sees the output's gradient
    if s_gate is not None:
        g_shared, g_n_gate = moe.shared_gate_backward(parts.moe, s_gate, s_out, g_out)
    g_a, p_down = parts.down.backward([g_shared], saved.down, cache)
    d_gate, d_up = swiglu_backward(g_a, saved.gate, saved.up, inplace=True)
    g_ns, p_gu = parts.gate_up.backward([d_gate, d_up], saved.gate_up, cache)
    g_n2.add_(g_ns)
    return (g_n2 if g_n_gate is None else g_n2.add_(g_n_gate)), p_gu, p_down, p_experts


def _rows(t: Tensor, bs: tuple[int, int], tile: slice) -> Tensor:
    """The rows of flat (batch·seq, width) `t` at the positions `tile` of every sequence."""
    return t.view(*bs, -1)[:, tile].reshape(-1, t.shape[-1])


def _tiled_mlp(
    parts: LayerParts,
    n2: Tensor,
    h1: Tensor,
    bs: tuple[int, int],
    tiles: list[slice],
    cache: dict[str, Tensor] | None,
) -> Tensor:
    """``h1 + down(swiglu(gate_up(n2)))`` tile by tile (no dropout: `why_not` refuses it)."""
    cache = {} if cache is None else cache  # the MLP's weights dequantised once for every tile
    out = torch.empty(*bs, h1.shape[-1], dtype=h1.dtype, device=h1.device)
    for tile in tiles:
        o = _mlp(parts, _rows(n2, bs, tile), cache, residual=_rows(h1, bs, tile))[0]
        out[:, tile] = o.view(bs[0], -1, h1.shape[-1])
    return out


def _tiled_mlp_backward(
    parts: LayerParts, saved: Saved, g_out: Tensor, tiles: list[slice], cache: dict[str, Tensor] | None
) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """The MLP input's gradient and gate/up's and down's adapter gradients, one tile at a
    time: each tile's forward recomputed, differentiated, its gradients summed in order."""
    cache = {} if cache is None else cache
    bs = saved.shape[:2]
    g_n2 = torch.empty_like(saved.n2)
    sums: list[Tensor] | None = None
    for tile in tiles:
        _, gate, up, st_gu, st_d = _mlp(parts, _rows(saved.n2, bs, tile), cache, residual=None)
        g_a, p_down = parts.down.backward([_rows(g_out, bs, tile)], st_d, cache)
        d_gate, d_up = swiglu_backward(g_a, gate, up, inplace=True)
        g_t, p_gu = parts.gate_up.backward([d_gate, d_up], st_gu, cache)
        g_n2.view(*bs, -1)[:, tile] = g_t.view(bs[0], -1, g_t.shape[-1])
        grads = [*p_gu, *p_down]
        sums = grads if sums is None else [acc.add_(g) for acc, g in zip(sums, grads)]
    n_gu = len(parts.gate_up.params())
    return g_n2, sums[:n_gu], sums[n_gu:]


def forward(
    parts: LayerParts,
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    mask: Tensor | None,
    cache: dict[str, Tensor] | None = None,
    kv: KVSink | None = None,
) -> Tensor:
    """The layer's output; nothing kept. `kv` receives the keys and values (rotated)."""
    with torch.no_grad():
        return _run(parts, x, cos, sin, mask, cache, output=True, keep=False, kv=kv)[0]


def forward_keeping_attention(
    parts: LayerParts, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, store: AttentionStore
) -> tuple[Tensor, KeptAttention | None]:
    """The layer's output and its attention kept in `store` for `recompute` (None where
    SDPA recorded more than one node: its math fallback, which the recompute runs again)."""
    with torch.no_grad():
        out, _, kept = _run(parts, x, cos, sin, mask, None, output=True, keep=False, store=store)
    return out, kept


def forward_keeping(
    parts: LayerParts,
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    mask: Tensor | None,
    cache: dict[str, Tensor] | None = None,
    kv: KVSink | None = None,
    store: AttentionStore | None = None,
) -> tuple[Tensor, Saved]:
    """The output and what the backward needs (resident training without recompute); with
    `store`, the attention's node is kept there (`Saved.kept`), so the backward calls it
    alone and leaves what it saved in place (a CUDA graph replays the backward again)."""
    with torch.no_grad():
        out, saved, _ = _run(parts, x, cos, sin, mask, cache, output=True, keep=True, kv=kv, store=store)
    for state in (saved.qkv, saved.o, saved.gate_up, saved.down):
        if state is not None:  # kept until the step's backward: that casts the adapters again
            state.low = None
    return out, saved


def recompute(
    parts: LayerParts,
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    mask: Tensor | None,
    cache: dict[str, Tensor] | None = None,
    kept: KeptAttention | None = None,
) -> Saved:
    """What the backward needs, recomputed from the layer's input (the RNG replayed by
    the caller when an adapter drops out); down_proj's output is not computed, nor the
    attention where the forward `kept` it."""
    with torch.no_grad():
        return _run(parts, x, cos, sin, mask, cache, output=False, keep=True, kept=kept)[1]


def backward(
    parts: LayerParts, saved: Saved, grad: Tensor, cache: dict[str, Tensor] | None = None
) -> tuple[Tensor, list[Tensor]]:
    """The input's gradient and the adapters' (in `parts.params()` order, float32)."""
    batch, seq, hidden = saved.shape
    with torch.no_grad():
        g_out = grad.reshape(-1, hidden)
        p_experts: list[Tensor] = []
        if saved.moe is not None:
            g_n2, p_gu, p_down, p_experts = _moe_backward(parts, saved, g_out, cache)
        elif saved.down is None:  # the MLP ran in tiles: recomputed and differentiated tile by tile
            g_n2, p_gu, p_down = _tiled_mlp_backward(parts, saved, g_out, parts.mlp_tiles(batch, seq), cache)
        else:
            g_a, p_down = parts.down.backward([g_out], saved.down, cache)
            d_gate, d_up = swiglu_backward(g_a, saved.gate, saved.up, inplace=True)
            g_n2, p_gu = parts.gate_up.backward([d_gate, d_up], saved.gate_up, cache)
            del d_gate, d_up
        g_h1 = rms_norm_backward(g_n2, saved.h1, parts.norm2.weight, saved.rstd2).add_(g_out)
        (g_attn, p_o) = parts.o.backward([g_h1], saved.o, cache)
        g_attn = g_attn.view(batch, seq, parts.heads, parts.head_dim).transpose(1, 2)
    if saved.kept is not None:
        with torch.no_grad():
            gq, gk, gv = saved.kept.grads(g_attn)
    else:
        gq, gk, gv = torch.autograd.grad(saved.attn, saved.leaves, g_attn)
    with torch.no_grad():
        p_latent: list[Tensor] = []
        g_n1_kv = None
        if saved.latent is not None:  # q_a's (or q_proj's) output gradient; kv_a's share of g_n1
            g_q, g_n1_kv, p_latent = latent_attention.backward(
                parts.latent, saved.latent, gq, gk, gv, saved.cos, saved.sin, cache
            )
            flat = [g_q]
        else:
            gq, gk = rope_pair_backward(gq, gk, saved.cos, saved.sin)
            gq, gk = gq.transpose(1, 2), gk.transpose(1, 2)
            if saved.heads_pre is not None:
                q_pre, k_pre, rq, rk = saved.heads_pre
                # the norms' inputs: (tokens, all heads) for OLMo's, rows of one head where Liger's ran
                gq, gk = gq.reshape(q_pre.shape), gk.reshape(k_pre.shape)
                gq = rms_norm_backward(gq, q_pre, parts.q_norm.weight, rq)
                gk = rms_norm_backward(gk, k_pre, parts.k_norm.weight, rk)
            flat = [t.reshape(batch * seq, -1) for t in (gq, gk, gv.transpose(1, 2))]
        del gq, gk, gv
        g_n1, p_qkv = parts.qkv.backward(flat, saved.qkv, cache)
        if g_n1_kv is not None:
            g_n1.add_(g_n1_kv)
        g_x = rms_norm_backward(g_n1, saved.x, parts.norm1.weight, saved.rstd1).add_(g_h1)
    return g_x.view(batch, seq, hidden), [*p_qkv, *p_latent, *p_o, *p_gu, *p_down, *p_experts]
