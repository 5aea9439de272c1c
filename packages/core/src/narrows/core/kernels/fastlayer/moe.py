"""A mixture-of-experts MLP as the fast layer computes it: the router, the routed experts
as two grouped matmuls over their stacks (dequantised once per pass), the weighted sum
back into token order, a sigmoid-gated shared expert where the family has one; and its
backward written out (input gradients only: the router and the experts are frozen).

Covered: transformers 5's Qwen3-MoE, Qwen2-MoE, Mixtral and OLMoE blocks, with their stacks in
float or quantised by `narrows.core.quant.experts`. The routing is the family's own:
softmax in float32 over the router's logits, the top k, renormalised where the family
does, the weights rounded to the logits' dtype (Qwen) or kept in float32 (Mixtral).

`grouped_mm` is torch's grouped matmul where it runs (its reference, `grouped_mm_reference`,
is a loop over the experts). The slots of a step are sorted by expert with a stable sort,
each expert's rows are computed on their own, and the k outputs of a token are summed in a
fixed order, so the result does not depend on how a kernel schedules its work.

why: docs/design.md#the-moe-layer
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ...quant.experts import expert_shape, expert_stacks
from .lora import WeightSource
from .ops import swiglu, swiglu_backward

__all__ = ["MOE_BLOCKS", "MoEParts", "MoEState", "build_moe", "grouped_mm", "grouped_mm_reference"]

# block type -> whether its routing weights stay float32 (Mixtral) or round to the logits' dtype
MOE_BLOCKS = {
    "Qwen3MoeSparseMoeBlock": False,
    "Qwen2MoeSparseMoeBlock": False,
    "MixtralSparseMoeBlock": True,
    "OlmoeSparseMoeBlock": False,
}
_STACKS = ("gate_up_proj", "down_proj")


def grouped_mm_reference(x: Tensor, w: Tensor, ends: Tensor) -> Tensor:
    """``x[rows of e] @ w[e]`` for each expert e, whose rows end at ``ends[e]``."""
    out = x.new_empty(x.shape[0], w.shape[-1])
    start = 0
    for e, end in enumerate(ends.tolist()):
        out[start:end] = x[start:end] @ w[e]
        start = end
    return out


def _native(x: Tensor, w: Tensor) -> bool:
    """Whether torch's grouped matmul takes these operands: rows 16-byte aligned, and on
    CUDA bf16 on compute capability 8.0 or newer."""
    if not hasattr(F, "grouped_mm"):
        return False
    size = x.element_size()
    aligned = (
        (x.shape[-1] * size) % 16 == 0 and (w.shape[-1] * size) % 16 == 0 and (w.shape[-2] * size) % 16 == 0
    )
    if x.is_cuda:
        return aligned and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (8, 0)
    return aligned and x.dtype in (torch.float32, torch.bfloat16)


def grouped_mm(x: Tensor, w: Tensor, ends: Tensor) -> Tensor:
    """(S, K) rows sorted by expert times each expert's (K, N) matrix of `w` [E, K, N]:
    torch's grouped matmul where it runs, else the reference."""
    if _native(x, w):
        return F.grouped_mm(x, w, offs=ends)
    return grouped_mm_reference(x, w, ends)


@dataclass
class MoEParts:
    """One MoE block as the fast layer computes it (the shared expert's linears are the
    layer's ``gate_up`` and ``down`` groups)."""

    router: Tensor  # (E, H)
    top_k: int
    renormalize: bool
    float_weights: bool  # routing weights kept in float32 (else rounded to the logits' dtype)
    experts: nn.Module  # holds ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]
    intermediate: int
    shared_gate: WeightSource | None = None  # (1, H): the shared expert's sigmoid gate (Qwen2-MoE)

    def stacks(self, like: Tensor, cache: dict[str, Tensor] | None) -> tuple[Tensor, Tensor]:
        """gate/up's and down's stacks in `like`'s dtype; with `cache`, dequantised once
        for every pass that shares it."""
        if cache is not None and "experts" in cache:
            return cache["experts"], cache["experts.down"]
        gate_up, down = (
            s if s.dtype == like.dtype else s.to(like.dtype) for s in expert_stacks(self.experts, _STACKS)
        )
        if cache is not None:
            cache["experts"], cache["experts.down"] = gate_up, down
        return gate_up, down


@dataclass
class MoEState:
    """What a block's forward keeps for its backward."""

    probs: Tensor  # the router's softmax, float32 (tokens, E)
    chosen: Tensor  # the k experts of each token, (tokens, k)
    order: Tensor  # the (token, k) slots sorted by expert, (S,)
    back: Tensor  # where each slot went in that order (the inverse permutation)
    ends: Tensor  # where each expert's rows end, int32 (E,)
    weights: Tensor  # each sorted slot's routing weight, (S,)
    h: Tensor  # gate/up's output, (S, 2I)
    a: Tensor  # SwiGLU's, (S, I)


def _route(p: MoEParts, n: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The router's softmax (float32), each token's k experts, and their weights."""
    logits = F.linear(n, p.router)
    probs = torch.softmax(logits.float(), dim=-1)
    top, chosen = torch.topk(probs, p.top_k, dim=-1)
    if p.renormalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return probs, chosen, top if p.float_weights else top.to(logits.dtype)


def forward(
    p: MoEParts, n: Tensor, cache: dict[str, Tensor] | None, *, output: bool, keep: bool
) -> tuple[Tensor | None, MoEState | None]:
    """The routed experts' output on `n` (tokens, hidden), summed over each token's k, in
    `n`'s dtype (`output`), and what the backward needs (`keep`; a recompute keeps it
    without computing the down projection)."""
    tokens, k = n.shape[0], p.top_k
    probs, chosen, top = _route(p, n)
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)
    experts = p.router.shape[0]
    ids = torch.arange(experts, device=n.device, dtype=flat.dtype)
    ends = torch.searchsorted(flat[order], ids, right=True).to(torch.int32)
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=n.device, dtype=order.dtype)
    gate_up, down = p.stacks(n, cache)
    h = grouped_mm(n[order // k], gate_up.transpose(-2, -1), ends)
    a = swiglu(h[:, : p.intermediate], h[:, p.intermediate :])
    weights = top.reshape(-1)[order]
    out = None
    if output:
        y = grouped_mm(a, down.transpose(-2, -1), ends) * weights[:, None]
        out = y[back].view(tokens, k, -1).sum(dim=1).to(n.dtype)
    state = MoEState(probs, chosen, order, back, ends, weights, h, a) if keep else None
    return out, state


def backward(p: MoEParts, s: MoEState, g: Tensor, cache: dict[str, Tensor] | None) -> Tensor:
    """The gradient of the block's input from its output's `g` (tokens, hidden): through
    the experts and through the routing weights into the router's softmax."""
    tokens, k = g.shape[0], p.top_k
    gate_up, down = p.stacks(g, cache)
    u = grouped_mm(g[s.order // k], down, s.ends)  # each slot's gradient through down, unweighted
    # d out / d weight of a slot = <g, down(a)> = <g @ down, a>: no down output needed; the
    # products rounded to the activations' dtype, as autograd's of ``y * weight`` are
    g_weights = (u * s.a).sum(dim=-1, dtype=torch.float32)
    g_a = (u * s.weights[:, None]).to(u.dtype)
    d_gate, d_up = swiglu_backward(g_a, s.h[:, : p.intermediate], s.h[:, p.intermediate :], inplace=True)
    del g_a, u
    d_h = s.h if d_gate.data_ptr() == s.h.data_ptr() else torch.cat([d_gate, d_up], dim=-1)
    g_slots = grouped_mm(d_h, gate_up, s.ends)
    g_n = g_slots[s.back].view(tokens, k, -1).sum(dim=1).to(g.dtype)
    # the routing weights: the rounding (if any), the renormalisation, the top k, the softmax
    g_top = g_weights[s.back].view(tokens, k)
    if p.renormalize:
        raw = s.probs.gather(1, s.chosen)
        total = raw.sum(dim=-1, keepdim=True)
        g_top = (g_top - (g_top * raw).sum(dim=-1, keepdim=True) / total) / total
    g_probs = torch.zeros_like(s.probs).scatter_(1, s.chosen, g_top)
    g_logits = s.probs * (g_probs - (g_probs * s.probs).sum(dim=-1, keepdim=True))
    return g_n.add_(g_logits.to(p.router.dtype) @ p.router)


def shared_gate_forward(p: MoEParts, n: Tensor) -> Tensor:
    """The shared expert's gate, ``sigmoid(n @ wᵀ)`` (tokens, 1)."""
    return torch.sigmoid(F.linear(n, p.shared_gate(n)))


def shared_gate_backward(p: MoEParts, gate: Tensor, shared: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """For ``out = gate · shared``: the shared expert's output gradient and the gate's input
    gradient."""
    g_gate = (g.float() * shared.float()).sum(dim=-1, keepdim=True) * gate.float() * (1 - gate.float())
    return g * gate, g_gate.to(g.dtype) @ p.shared_gate(g)


def build_moe(mlp: nn.Module) -> MoEParts | str:
    """`mlp` as the fast layer computes it, or why it does not."""
    kind = type(mlp).__name__
    if kind not in MOE_BLOCKS:
        return f"its MLP is a {kind}; fast MoE layers cover {', '.join(MOE_BLOCKS)}"
    router, experts = getattr(mlp, "gate", None), getattr(mlp, "experts", None)
    if router is None or experts is None or not isinstance(getattr(router, "weight", None), Tensor):
        return "its MoE block has no router weight or experts where transformers keeps them"
    if not type(router).__name__.endswith("TopKRouter"):
        return f"its router is a {type(router).__name__} (LoRA on the router is not in the fast layer)"
    if set(_STACKS) - set(experts._parameters) or any(n in experts.__dict__ for n in _STACKS):
        return (
            f"its experts are a {type(experts).__name__} without gate_up_proj and down_proj stacks of their "
            "own (LoRA on the routed experts is not in the fast layer)"
        )
    if any(getattr(experts, a, d) != d for a, d in (("has_bias", False), ("is_transposed", False))):
        return "its experts have biases or transposed stacks"
    apply_gate = getattr(type(experts), "_apply_gate", None)  # transformers' default: silu(gate) · up
    if not getattr(experts, "is_concatenated", True) or getattr(apply_gate, "__name__", None) not in (
        None,
        "_default_apply_gate",
    ):
        return "its experts gate in their own way (interleaved or clamped SwiGLU)"
    if getattr(experts, "_is_expert_parallel", False):
        return "its experts are split over ranks (expert parallelism)"
    act = getattr(getattr(experts, "config", None), "hidden_act", "silu")
    if act not in ("silu", "swish"):
        return f"its experts' activation is {act!r}, not SiLU"
    if mlp.training and getattr(mlp, "jitter_noise", 0):
        return "router jitter noise is on"
    gate_up, down = (expert_shape(experts, n) for n in _STACKS)
    e, two_i, hidden = gate_up
    if tuple(down) != (e, hidden, two_i // 2) or tuple(router.weight.shape) != (e, hidden):
        return f"its expert stacks {tuple(gate_up)} and {tuple(down)} are not [E, 2I, H] and [E, H, I]"
    if (getattr(mlp, "shared_expert_gate", None) is None) != (getattr(mlp, "shared_expert", None) is None):
        return "its shared expert has no gate (or a gate without an expert)"
    return MoEParts(
        router.weight,
        int(router.top_k),
        bool(getattr(router, "norm_topk_prob", True)),
        MOE_BLOCKS[kind],
        experts,
        two_i // 2,
    )
