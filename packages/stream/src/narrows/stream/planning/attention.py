"""Whether the fast layers keep their attention from forward to backward, in host memory.

"auto" keeps it where attention's share of a layer's recompute reaches `KEEP_SHARE`; the
device then holds one more layer's kept attention in flight, host memory every recomputed
layer's.

why: docs/design.md#kept-attention
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from narrows.core import Anatomy, format_bytes

from ..config import StreamConfig
from ..errors import BudgetTooSmallError
from .measure import default_host_budget
from .memory import Shapes, attention_dims
from .record import Plan

__all__ = ["KEEP_SHARE", "attention_bytes", "attention_share", "keep_attention"]

KEEP_SHARE = 0.25  # "auto" keeps attention where its forward is at least this share of a recompute


def attention_bytes(anat: Anatomy, tokens: int, act_bytes: int) -> int:
    """One layer call's kept attention: q and the output (heads wide), k and v (key-value
    heads wide) in the activations' dtype, and the float32 log-sum-exp per head."""
    heads, head_dim, kv_heads = attention_dims(anat.config)
    return tokens * ((2 * heads + 2 * kv_heads) * head_dim * act_bytes + heads * 4)


def attention_share(anat: Anatomy, seq: int) -> float:
    """Attention's forward as a share of a fast layer's recompute (its matmuls without
    down_proj's, plus the attention), per token of a `seq`-token causal sequence."""
    cfg = anat.config
    heads, head_dim, kv_heads = attention_dims(anat.config)
    hidden, inter = cfg.hidden_size, getattr(cfg, "intermediate_size", 4 * cfg.hidden_size)
    matmuls = hidden * (2 * heads + 2 * kv_heads) * head_dim + 2 * hidden * inter  # q, k, v, o; gate, up
    attn = seq * heads * head_dim  # QKᵀ and PV over the causal half: 2·seq·width/2 each
    return attn / (matmuls + attn)


def keep_attention(
    anat: Anatomy,
    plan: Plan,
    replan: Callable[[int], Plan],
    cfg: StreamConfig,
    shapes: Shapes,
    host_available: int | None = None,
) -> Plan:
    """`plan` with the recomputed layers' attention kept in host memory, or its reason not.
    Where the plan leaves no room for one more layer's attention in flight, ``replan(bytes)``
    makes the same plan with that much more reserved (fewer resident layers, more inputs
    offloaded: at the sequences where attention is kept, the weights' copies hide behind
    compute anyway). Host memory: the host budget where the model has one (its tiers), else
    `host_available` (default: 85% of what the kernel reports available now), which the
    plan's offloaded inputs share."""
    option, seq = cfg.keep_attention, cfg.seq_len
    if option is False:
        return replace(plan, attention_choice="off (keep_attention=False)")
    given, why = plan, None
    recomputed = tuple(i for i in range(len(plan.layer_bytes)) if i not in set(plan.whole))
    if not shapes.fast:
        why = "PEFT's modules run the layers (only the fast layers keep it)"
    elif cfg.inference:
        why = "forward passes only"
    elif plan.graphs:
        why = "CUDA graphs replay the recompute as it is"
    elif plan.accumulation == "block-major":
        why = "block-major steps recompute every layer as it is"
    elif not recomputed:
        why = "every layer runs whole: nothing is recomputed"
    share = attention_share(anat, seq)
    per_call = attention_bytes(anat, cfg.batch_size * seq, shapes.act_bytes)
    host = per_call * len(recomputed)
    if why is None and option == "auto":
        if share < KEEP_SHARE:
            why = (
                f"attention is {share:.0%} of a layer's recompute at {seq} tokens; kept from {KEEP_SHARE:.0%}"
            )
        elif plan.budget is None:
            why = f"no budget: the smallest footprint (one more layer's in flight takes {format_bytes(per_call)})"
    peak = plan.predicted_peak + per_call
    if why is None and plan.budget is not None and peak > plan.budget:
        try:
            plan = replan(per_call)
            peak = plan.predicted_peak
            recomputed = tuple(i for i in range(len(plan.layer_bytes)) if i not in set(plan.whole))
            host = per_call * len(recomputed)
        except BudgetTooSmallError:
            why = f"the budget does not hold one more layer's attention in flight ({format_bytes(per_call)})"
    if why is None and plan.host_budget is not None and plan.predicted_host_bytes is not None:
        if plan.predicted_host_bytes + host > plan.host_budget:
            why = f"host memory: {format_bytes(host)} more than the host budget holds"
    elif why is None:
        available = default_host_budget() if host_available is None else host_available
        if plan.host_activation_bytes + host > available:
            why = (
                f"host memory: {format_bytes(host)} beside the offloaded inputs' "
                f"{format_bytes(plan.host_activation_bytes)}; {format_bytes(available)} available"
            )
    if why is not None:
        return replace(given, attention_choice=f"off ({why})")
    return replace(  # out in the forward and back in the backward, as offloaded inputs are counted
        plan,
        kept_attention=recomputed,
        attention_host_bytes=host,
        predicted_peak=peak,
        d2h_bytes_per_step=plan.d2h_bytes_per_step + host,
        h2d_bytes_per_step=plan.h2d_bytes_per_step + host,
        predicted_host_bytes=None if plan.predicted_host_bytes is None else plan.predicted_host_bytes + host,
        attention_choice=f"on: {len(recomputed)} layers' attention in host memory ({format_bytes(host)}); attention "
        f"is {share:.0%} of a layer's recompute at {seq} tokens",
    )
