"""A mixture-of-experts MLP as the fast layer computes it: the router, the routed experts
as two grouped matmuls over their stacks (dequantised one at a time), the weighted sum
back into token order, a sigmoid-gated shared expert where the family has one; and its
backward written out (the input's gradient, and the routed experts' LoRA adapters' where
they have them: the router and the stacks themselves are frozen).

Covered: transformers 5's Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, GLM-4-MoE, gpt-oss and DeepSeek-V3 blocks,
with their stacks in float or quantised by `narrows.core.quant.experts`. The routing is the
family's own: softmax in float32 over the router's logits, the top k, renormalised where the
family does, the weights rounded to the logits' dtype (Qwen) or kept in float32 (Mixtral);
GLM-4-MoE's (and DeepSeek-V3's) sigmoid scores chosen within the best groups of experts
(`_route_sigmoid`); or
gpt-oss's softmax over the k best biased logits alone. gpt-oss's experts are stored
transposed ([E, H, 2I], [E, I, H]), with biases, gate and up interleaved in their stack and
a clamped SwiGLU (`ops.clamped_glu`).

Without a cache the stacks are dequantised one at a time, each freed after its matmul
(gate/up's, then down's in the forward; down's, then gate/up's in the backward; a recompute,
which stops before the down projection, dequantises gate/up's alone), so a block holds its
largest stack at most, never all of them; with a cache (the resident layer's recompute,
which shares its weights with the backward) each is dequantised once for every pass that
shares it.

The experts' matmuls are `grouped.py`'s (torch's grouped matmul, or the loop over experts
beside it). The slots of a step are sorted by expert with a stable sort,
each expert's rows are computed on their own, and the k outputs of a token are summed in a
fixed order, so the result does not depend on how a kernel schedules its work.

LoRA on a stack (PEFT's ``target_parameters`` format, `narrows.core.protocol.expert_adapters`)
runs as ``(x · A_eᵀ) · B_eᵀ`` for each expert inside the same grouped pass, never as a
materialised ``W + s·BA``; its gradients are grouped matmuls over each expert's rows
(`grouped_mm_k`), written in the adapters' dtype as torch's grouped matmul writes them
(PEFT's own path, which folds the adapter into the stack, rounds them to it as well).

why: docs/design.md#the-moe-layer
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ...protocol.expert_adapters import ExpertAdapter, unwrap_experts
from ...quant.experts import expert_shape, expert_stacks
from .grouped import grouped_mm, grouped_mm_k
from .lora import WeightSource
from .ops import clamped_glu, clamped_glu_backward, swiglu, swiglu_backward

__all__ = ["MOE_BLOCKS", "MoEParts", "MoEState", "build_moe"]

# block type -> whether its routing weights stay float32 (Mixtral) or round to the logits' dtype
MOE_BLOCKS = {
    "Qwen3MoeSparseMoeBlock": False,
    "Qwen2MoeSparseMoeBlock": False,
    "MixtralSparseMoeBlock": True,
    "OlmoeSparseMoeBlock": False,
    "Glm4MoeMoE": True,
    "GptOssMLP": False,
    "DeepseekV3MoE": True,  # routed as GLM-4-MoE's
}
_STACKS = ("gate_up_proj", "down_proj")


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
    # GLM-4-MoE's routing: sigmoid scores, the top k chosen by score + `choice_bias` within the
    # best `topk_groups` of `groups` groups of experts, their scores renormalised and scaled
    choice_bias: Tensor | None = None  # (E,) float32; None: softmax routing
    groups: int = 1
    topk_groups: int = 1
    scale: float = 1.0
    adapters: dict[str, ExpertAdapter] = field(default_factory=dict)  # LoRA on a stack, by its name
    lora_dtype: torch.dtype | None = None  # the adapters' arithmetic: None, the activations' dtype
    # gpt-oss's: the router's bias and softmax over the chosen logits; stacks stored as x·W
    # ([E, H, 2I], [E, I, H]) with biases ([E, 2I], [E, H]); gate and up interleaved, clamped
    router_bias: Tensor | None = None
    softmax_chosen: bool = False
    transposed: bool = False
    biases: tuple[Tensor, Tensor] | None = None
    clamp: tuple[float, float] | None = None  # (alpha, limit) of `ops.clamped_glu`

    def params(self) -> list[nn.Parameter]:
        """The expert adapters' masters, in the order the backward returns their gradients."""
        return [
            t
            for name in _STACKS
            if name in self.adapters
            for t in (self.adapters[name].a, self.adapters[name].b)
        ]

    def low(self, like: Tensor) -> dict[str, tuple[Tensor, Tensor]]:
        """Each adapter's A [E, r, in] and B [E, out, r] in its arithmetic's dtype, cast
        once per pass (the backward reuses the forward's: the masters do not change between)."""
        dtype = self.lora_dtype or like.dtype
        return {n: (ad.a_stack(dtype), ad.b_stack(dtype)) for n, ad in self.adapters.items()}

    def stack(self, name: str, like: Tensor, cache: dict[str, Tensor] | None) -> Tensor:
        """Stack `name` (gate/up's or down's) in `like`'s dtype; with `cache`, dequantised
        once for every pass that shares it."""
        key = f"experts.{name}"
        if cache is not None and key in cache:
            return cache[key]
        (stack,) = expert_stacks(self.experts, (name,))
        stack = stack if stack.dtype == like.dtype else stack.to(like.dtype)
        if cache is not None:
            cache[key] = stack
        return stack


@dataclass
class MoEState:
    """What a block's forward keeps for its backward."""

    probs: Tensor  # the router's softmax, float32 (tokens, E)
    chosen: Tensor  # the k experts of each token, (tokens, k)
    token: Tensor  # the token of each slot in expert order (the (token, k) slots sorted by expert), (S,)
    back: Tensor  # where each slot went in that order (the inverse permutation)
    ends: Tensor  # where each expert's rows end, int32 (E,)
    weights: Tensor  # each sorted slot's routing weight, (S,)
    h: Tensor  # gate/up's output, (S, 2I)
    a: Tensor  # SwiGLU's, (S, I)
    low: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)  # `MoEParts.low`'s
    n: Tensor | None = None  # the block's input, (tokens, H), where gate/up has an adapter
    z: dict[str, Tensor] = field(default_factory=dict)  # each adapter's x·Aᵀ, (S, r)
    expert: Tensor | None = None  # each sorted slot's expert, where the stacks have biases


def _route(p: MoEParts, n: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The router's softmax (float32), each token's k experts, and their weights; or with a
    `choice_bias`, its sigmoid scores (float32) and GLM-4-MoE's grouped choice; or with
    `softmax_chosen`, the softmax over the chosen logits alone (float32, (tokens, k))."""
    if p.choice_bias is not None:
        return _route_sigmoid(p, n)
    if p.softmax_chosen:  # gpt-oss's: the k best biased logits, a softmax over them alone
        logits = F.linear(n, p.router, p.router_bias)
        best, chosen = torch.topk(logits, p.top_k, dim=-1)
        weights = torch.softmax(best.float(), dim=-1)
        return weights, chosen, weights.to(logits.dtype)
    logits = F.linear(n, p.router)
    probs = torch.softmax(logits.float(), dim=-1)
    top, chosen = torch.topk(probs, p.top_k, dim=-1)
    if p.renormalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return probs, chosen, top if p.float_weights else top.to(logits.dtype)


def _route_sigmoid(p: MoEParts, n: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """GLM-4-MoE's routing, as transformers computes it: float32 logits and their sigmoid;
    each group of experts scored by its two best biased scores, the best `topk_groups`
    groups kept, the top k of their biased scores chosen; the chosen experts' unbiased
    scores renormalised (+1e-20) and scaled."""
    logits = F.linear(n.float(), p.router.float())
    scores = torch.sigmoid(logits)
    choice = scores + p.choice_bias
    tokens, experts = choice.shape
    by_group = choice.view(tokens, p.groups, experts // p.groups)
    best = torch.topk(by_group.topk(2, dim=-1)[0].sum(dim=-1), k=p.topk_groups, dim=-1, sorted=False)[1]
    keep = torch.zeros(tokens, p.groups, device=n.device, dtype=torch.bool).scatter_(1, best, True)
    choice = choice.masked_fill(
        ~keep.unsqueeze(-1).expand_as(by_group).reshape(tokens, experts), float("-inf")
    )
    chosen = torch.topk(choice, k=p.top_k, dim=-1, sorted=False)[1]
    top = scores.gather(1, chosen)
    if p.renormalize:
        top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
    return scores, chosen, top * p.scale


def forward(
    p: MoEParts, n: Tensor, cache: dict[str, Tensor] | None, *, output: bool, keep: bool
) -> tuple[Tensor | None, MoEState | None]:
    """The routed experts' output on `n` (tokens, hidden), summed over each token's k, in
    `n`'s dtype (`output`), and what the backward needs (`keep`; a recompute keeps it
    without computing the down projection)."""
    tokens, k = n.shape[0], p.top_k
    probs, chosen, top = _route(p, n)
    flat = chosen.reshape(-1)
    experts = p.router.shape[0]
    # sorted by the narrowest key that holds an expert's index: fewer radix passes, same order
    order = torch.argsort(flat.to(_key_dtype(experts)), stable=True)
    ids = torch.arange(experts, device=n.device, dtype=flat.dtype)
    ends = torch.searchsorted(flat[order], ids, right=True).to(torch.int32)
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=n.device, dtype=order.dtype)
    low = p.low(n)
    z: dict[str, Tensor] = {}
    token = order // k
    x = n[token]
    gate_up = p.stack("gate_up_proj", n, cache)
    h = grouped_mm(x, gate_up if p.transposed else gate_up.transpose(-2, -1), ends)
    del gate_up  # freed before down's is dequantised (unless a cache holds it)
    expert = None
    if p.biases is not None:
        expert = flat[order]
        h.add_(p.biases[0][expert].to(h.dtype))
    _add_adapter(p, low, z, "gate_up_proj", x, h, ends)
    del x
    a = _activation(p, h)
    weights = top.reshape(-1)[order]
    out = None
    if output:
        down = p.stack("down_proj", n, cache)
        y = grouped_mm(a, down if p.transposed else down.transpose(-2, -1), ends)
        del down
        if expert is not None:
            y.add_(p.biases[1][expert].to(y.dtype))
        _add_adapter(p, low, z, "down_proj", a, y, ends)
        y = y * weights[:, None]
        out = y[back].view(tokens, k, -1).sum(dim=1).to(n.dtype)
    elif keep and "down_proj" in low:  # a recompute: down's adapter input alone
        z["down_proj"] = grouped_mm(_in(p, a), low["down_proj"][0].transpose(-2, -1), ends)
    if not keep:
        return out, None
    kept_n = n if "gate_up_proj" in low else None  # its slots' copies are gathered again when needed
    return out, MoEState(probs, chosen, token, back, ends, weights, h, a, low, kept_n, z, expert)


def _key_dtype(experts: int) -> torch.dtype:
    return torch.uint8 if experts <= 256 else torch.int16 if experts <= 32768 else torch.int64


def _activation(p: MoEParts, h: Tensor) -> Tensor:
    """The experts' gated activation of gate/up's output `h` (S, 2I)."""
    if p.clamp is not None:  # gpt-oss's: gate and up interleaved
        return clamped_glu(h[:, 0::2], h[:, 1::2], *p.clamp)
    return swiglu(h[:, : p.intermediate], h[:, p.intermediate :])


def _in(p: MoEParts, t: Tensor) -> Tensor:
    """`t` as the adapters read it (in `lora_dtype`, where one is set)."""
    return t if p.lora_dtype is None or t.dtype == p.lora_dtype else t.to(p.lora_dtype)


def _add_adapter(
    p: MoEParts, low: dict, z: dict[str, Tensor], name: str, x: Tensor, out: Tensor, ends: Tensor
) -> None:
    """``out += s · (x·Aᵀ)·Bᵀ`` per expert for stack `name`'s adapter (if it has one),
    keeping ``x·Aᵀ`` in `z`."""
    if name not in low:
        return
    a, b = low[name]
    z[name] = grouped_mm(_in(p, x), a.transpose(-2, -1), ends)
    out.add_(grouped_mm(z[name], b.transpose(-2, -1), ends).to(out.dtype), alpha=p.adapters[name].scaling)


def backward(
    p: MoEParts, s: MoEState, g: Tensor, cache: dict[str, Tensor] | None
) -> tuple[Tensor, list[Tensor]]:
    """The gradient of the block's input from its output's `g` (tokens, hidden): through
    the experts and through the routing weights into the router's softmax; and the expert
    adapters' (float32, in `MoEParts.params` order and their masters' layouts)."""
    tokens, k = g.shape[0], p.top_k
    grads: dict[str, tuple[Tensor, Tensor]] = {}
    g_slot = g[s.token]
    # each slot's gradient through down, unweighted
    down = p.stack("down_proj", g, cache)
    u = grouped_mm(g_slot, down.transpose(-2, -1) if p.transposed else down, s.ends)
    del down  # freed before gate/up's is dequantised (unless a cache holds it)
    if "down_proj" in s.low:  # u += s·(g·B)·A; its adapter sees g weighted by each slot's weight
        _adapter_backward(p, s, "down_proj", _in(p, g_slot), u, grads, s.weights[:, None])
    # d out / d weight of a slot = <g, down(a) + bias> = <g @ down, a> + <g, bias>: no down
    # output needed; the products rounded to the activations' dtype, as autograd's of
    # ``y * weight`` are
    g_weights = (u * s.a).sum(dim=-1, dtype=torch.float32)
    if s.expert is not None:
        g_weights += (g_slot * p.biases[1][s.expert].to(g_slot.dtype)).sum(dim=-1, dtype=torch.float32)
    del g_slot
    g_a = (u * s.weights[:, None]).to(u.dtype)
    if p.clamp is not None:  # gate/up's gradient written over its interleaved output
        clamped_glu_backward(g_a, s.h[:, 0::2], s.h[:, 1::2], *p.clamp)
        d_h = s.h
    else:
        d_gate, d_up = swiglu_backward(g_a, s.h[:, : p.intermediate], s.h[:, p.intermediate :], inplace=True)
        d_h = s.h if d_gate.data_ptr() == s.h.data_ptr() else torch.cat([d_gate, d_up], dim=-1)
        del d_gate, d_up
    del g_a, u
    gate_up = p.stack("gate_up_proj", g, cache)
    g_slots = grouped_mm(d_h, gate_up.transpose(-2, -1) if p.transposed else gate_up, s.ends)
    del gate_up
    if "gate_up_proj" in s.low:
        _adapter_backward(p, s, "gate_up_proj", _in(p, d_h), g_slots, grads, None)
    g_n = g_slots[s.back].view(tokens, k, -1).sum(dim=1).to(g.dtype)
    # the routing weights: the rounding (if any), the scale, the renormalisation, the top k,
    # the softmax (or the sigmoid)
    g_top = g_weights[s.back].view(tokens, k) * p.scale
    if p.softmax_chosen:  # through the softmax over the chosen logits (the bias frozen)
        g_best = s.probs * (g_top - (g_top * s.probs).sum(dim=-1, keepdim=True))
        g_logits = torch.zeros(tokens, p.router.shape[0], device=g.device, dtype=g_best.dtype)
        g_logits.scatter_(1, s.chosen, g_best)
        g_n.add_(g_logits.to(p.router.dtype) @ p.router)
        return g_n, [t for name in _STACKS if name in grads for t in grads[name]]
    if p.renormalize:
        raw = s.probs.gather(1, s.chosen)
        total = raw.sum(dim=-1, keepdim=True) + (1e-20 if p.choice_bias is not None else 0.0)
        g_top = (g_top - (g_top * raw).sum(dim=-1, keepdim=True) / total) / total
    g_probs = torch.zeros_like(s.probs).scatter_(1, s.chosen, g_top)
    if p.choice_bias is not None:  # float32 logits of float32 weights: cast back at the input
        g_logits = g_probs * s.probs * (1 - s.probs)
        g_n.add_((g_logits @ p.router.float()).to(g_n.dtype))
    else:
        g_logits = s.probs * (g_probs - (g_probs * s.probs).sum(dim=-1, keepdim=True))
        g_n.add_(g_logits.to(p.router.dtype) @ p.router)
    return g_n, [t for name in _STACKS if name in grads for t in grads[name]]


def _adapter_backward(
    p: MoEParts,
    s: MoEState,
    name: str,
    g_out: Tensor,
    g_in: Tensor,
    grads: dict[str, tuple[Tensor, Tensor]],
    weights: Tensor | None,
) -> None:
    """For ``out = x·Wᵀ + s·(x·Aᵀ)·Bᵀ`` per expert, from `g_out` (the slots' output
    gradient, unweighted): ``g_in += s·(g_out·B)·A``, and A's and B's gradients into
    `grads` — each slot's output scaled by its routing weight (`weights`, down's) when
    it reaches the block's output."""
    a, b = s.low[name]
    ad = p.adapters[name]
    gb = grouped_mm(g_out, b, s.ends)  # (S, r)
    g_in.add_(grouped_mm(gb, a, s.ends).to(g_in.dtype), alpha=ad.scaling)
    x = _in(p, s.n[s.token] if name == "gate_up_proj" else s.a)
    z = s.z[name]
    if weights is not None:
        gb, z = gb * weights.to(gb.dtype), z * weights.to(z.dtype)
    g_a = grouped_mm_k(gb, x, s.ends).float().mul_(ad.scaling)  # [E, r, in]
    g_b = grouped_mm_k(g_out, z, s.ends).float().mul_(ad.scaling)  # [E, out, r]
    grads[name] = (ad.a_grad(g_a), ad.b_grad(g_b))


def shared_gate_forward(p: MoEParts, n: Tensor) -> Tensor:
    """The shared expert's gate, ``sigmoid(n @ wᵀ)`` (tokens, 1)."""
    return torch.sigmoid(F.linear(n, p.shared_gate(n)))


def shared_gate_backward(p: MoEParts, gate: Tensor, shared: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """For ``out = gate · shared``: the shared expert's output gradient and the gate's input
    gradient."""
    g_gate = (g.float() * shared.float()).sum(dim=-1, keepdim=True) * gate.float() * (1 - gate.float())
    return g * gate, g_gate.to(g.dtype) @ p.shared_gate(g)


def build_moe(mlp: nn.Module, lora_dtype: torch.dtype | None = None) -> MoEParts | str:
    """`mlp` as the fast layer computes it, or why it does not."""
    kind = type(mlp).__name__
    if kind not in MOE_BLOCKS:
        return f"its MLP is a {kind}; fast MoE layers cover {', '.join(MOE_BLOCKS)}"
    gpt_oss = kind == "GptOssMLP"
    router = getattr(mlp, "gate", None) or getattr(mlp, "router", None)  # gpt-oss's is `router`
    experts = getattr(mlp, "experts", None)
    if router is None or experts is None or not isinstance(getattr(router, "weight", None), Tensor):
        return "its MoE block has no router weight or experts where transformers keeps them"
    if not type(router).__name__.lower().endswith("topkrouter"):
        return f"its router is a {type(router).__name__} (LoRA on the router is not in the fast layer)"
    unwrapped = unwrap_experts(experts)
    if isinstance(unwrapped, str):
        return unwrapped
    experts, adapters = unwrapped
    if set(_STACKS) - set(experts._parameters) or any(n in experts.__dict__ for n in _STACKS):
        return f"its experts are a {type(experts).__name__} without gate_up_proj and down_proj stacks of their own"
    if set(adapters) - set(_STACKS):
        return f"LoRA on its experts' {', '.join(sorted(set(adapters) - set(_STACKS)))}"
    if gpt_oss:
        if type(experts).__name__ != "GptOssExperts" or not _gpt_oss_gate(experts):
            return f"its experts are a {type(experts).__name__}, not gpt-oss's with its clamped SwiGLU"
        if not isinstance(getattr(router, "bias", None), Tensor):
            return "its router has no bias where gpt-oss keeps one"
    elif any(getattr(experts, a, d) != d for a, d in (("has_bias", False), ("is_transposed", False))):
        return "its experts have biases or transposed stacks"
    apply_gate = getattr(type(experts), "_apply_gate", None)  # transformers' default: silu(gate) · up
    if not gpt_oss and (
        not getattr(experts, "is_concatenated", True)
        or getattr(apply_gate, "__name__", None) not in (None, "_default_apply_gate")
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
    if gpt_oss:
        e, hidden, two_i = gate_up
        want, said = (e, two_i // 2, hidden), "[E, H, 2I] and [E, I, H]"
    else:
        e, two_i, hidden = gate_up
        want, said = (e, hidden, two_i // 2), "[E, 2I, H] and [E, H, I]"
    if tuple(down) != want or tuple(router.weight.shape) != (e, hidden):
        return f"its expert stacks {tuple(gate_up)} and {tuple(down)} are not {said}"
    if getattr(mlp, "shared_expert_gate", None) is not None and getattr(mlp, "shared_expert", None) is None:
        return "its shared expert's gate has no expert"
    return MoEParts(
        router.weight,
        int(router.top_k),
        bool(getattr(router, "norm_topk_prob", True)) and not gpt_oss,
        MOE_BLOCKS[kind],
        experts,
        two_i // 2,
        adapters=adapters,
        lora_dtype=lora_dtype,
        choice_bias=getattr(router, "e_score_correction_bias", None),
        groups=int(getattr(router, "num_group", 1) or 1),
        topk_groups=int(getattr(router, "topk_group", 1) or 1),
        scale=float(getattr(router, "routed_scaling_factor", 1.0) or 1.0),
        router_bias=router.bias if gpt_oss else None,
        softmax_chosen=gpt_oss,
        transposed=gpt_oss,
        biases=(experts.gate_up_proj_bias, experts.down_proj_bias) if gpt_oss else None,
        clamp=(float(experts.alpha), float(experts.limit)) if gpt_oss else None,
    )


def _gpt_oss_gate(experts: nn.Module) -> bool:
    """Whether `experts` gate as gpt-oss's do (`ops.clamped_glu`: its own `_apply_gate`, an
    alpha and a limit), not in a way of their own."""
    apply_gate = getattr(type(experts), "_apply_gate", None)
    return (
        getattr(apply_gate, "__qualname__", "") == "GptOssExperts._apply_gate"
        and isinstance(getattr(experts, "alpha", None), float | int)
        and isinstance(getattr(experts, "limit", None), float | int)
        and not getattr(experts, "is_concatenated", False)
        and getattr(experts, "is_transposed", False)
        and getattr(experts, "has_bias", False)
    )
