"""Which decoder layers the fast layer computes, and what it reads off one: the norms,
the four groups of linears (Q/K/V, o, gate/up, down) with their adapters, the heads.

Covered: Llama, Qwen2, Qwen3 and Mistral decoder layers loaded for SDPA attention, each
linear plain, bitsandbytes ``Linear4bit``, or either inside PEFT's LoRA wrapper with one
active adapter; and the Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, GLM-4-MoE, gpt-oss and
DeepSeek-V3 layers, whose MoE block `moe.py` reads (a shared expert's linears are then the
gate/up and down groups; LoRA on the routed experts' stacks is the MoE block's; DeepSeek-V3's
first layers have a dense MLP). DeepSeek-V3's multi-head latent attention (`LayerParts.latent`,
`latent_attention.py`) has q_a_proj (or a plain q_proj) as its Q/K/V group and q_b_proj,
kv_a_proj_with_mqa and kv_b_proj as groups of their own, any of them adapted. gpt-oss's attention sinks
(`LayerParts.sinks`) are loaded for its eager attention, whose masks transformers builds
whole (its sliding layers' included). Anything else is refused with its reason
(`build_parts`) and runs as it would without narrows.

why: docs/design.md#coverage
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ...protocol.anatomy import submodules
from ...protocol.recorders import recorded_key
from ...quant.dequantize import dequantize_nf4
from ...quant.held import held_weight
from ...quant.nf4 import is_nf4_linear
from ..lora_branches import _FusedForward
from .latent_attention import LatentParts
from .lora import Linear, LinearGroup
from .moe import MOE_BLOCKS, MoEParts, build_moe

__all__ = ["FAST_LAYER_TYPES", "LayerParts", "build_parts", "recorders_of"]

FAST_LAYER_TYPES = (
    "LlamaDecoderLayer",
    "Qwen2DecoderLayer",
    "Qwen3DecoderLayer",
    "MistralDecoderLayer",
    "Qwen3MoeDecoderLayer",
    "Qwen2MoeDecoderLayer",
    "MixtralDecoderLayer",
    "OlmoeDecoderLayer",
    "Glm4MoeDecoderLayer",
    "GptOssDecoderLayer",
    "DeepseekV3DecoderLayer",
)


@dataclass
class Norm:
    weight: Tensor
    eps: float


@dataclass
class LayerParts:
    """One decoder layer as the fast layer computes it."""

    norm1: Norm
    norm2: Norm
    q_norm: Norm | None
    k_norm: Norm | None
    qkv: LinearGroup
    o: LinearGroup
    gate_up: LinearGroup | None  # the MLP's, or an MoE block's shared expert's (None: it has none)
    down: LinearGroup | None
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    mlp_tile: int | None = None  # the MLP runs over sequence tiles of this many tokens
    moe: MoEParts | None = None  # the MLP is a mixture of experts
    full_qk_norm: bool = False  # the Q/K norms span all heads, before they split (OLMo's), not each head
    sinks: Tensor | None = None  # (heads,): each head's sink logit in its softmax's denominator (gpt-oss)
    half_rope: bool = False  # half-head tables turn both halves alike (gpt-oss's; not partial)
    latent: LatentParts | None = None  # latent attention (DeepSeek-V3's): qkv is then q_a (or q) alone
    recorded: frozenset[str] = frozenset()  # what transformers' recorders inside it collect

    def mlp_tiles(self, batch: int, seq: int) -> list[slice] | None:
        """The position slices the MLP runs over for a (batch, seq) input, or None for one
        pass: ``mlp_tile // batch`` positions of every sequence a tile, as
        `narrows.stream.tile_sequence` cuts them."""
        if self.mlp_tile is None or batch * seq <= self.mlp_tile:
            return None
        step = max(1, self.mlp_tile // batch)
        return [slice(s, min(s + step, seq)) for s in range(0, seq, step)]

    @property
    def groups(self) -> tuple[LinearGroup, ...]:
        latent = self.latent.groups if self.latent is not None else ()
        return tuple(g for g in (self.qkv, *latent, self.o, self.gate_up, self.down) if g is not None)

    def params(self) -> list[nn.Parameter]:
        """The adapters' tensors in the order the backward returns their gradients (the
        routed experts' last)."""
        return [t for g in self.groups for t in g.params()] + (self.moe.params() if self.moe else [])


def _hooked(module: nn.Module) -> bool:
    """Hooks, or a forward someone replaced (`fuse_lora`'s computes PEFT's formula, which
    the fast layer replaces as it replaces PEFT's; a forward that only tiles the sequence
    says how many tokens a tile, `_tile_of`). transformers' output recorders do not count:
    `FastLayer` gives way to the layer's own forward while one records (`recorders_of`)."""
    forward = module.__dict__.get("forward")
    return bool(
        any(recorded_key(h) is None for h in module._forward_hooks.values())
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
        or (forward is not None and not isinstance(forward, _FusedForward) and _tile_of(module) is None)
    )


def recorders_of(layer: nn.Module) -> frozenset[str]:
    """The outputs transformers' recorders on `layer`'s submodules collect (the layer's own
    run around the fast forward, as any hook of its own does)."""
    return frozenset(
        k for m in submodules(layer) for k in map(recorded_key, m._forward_hooks.values()) if k is not None
    )


def _tile_of(mlp: nn.Module) -> int | None:
    """Tokens per sequence tile of an MLP whose forward was replaced by one that only cuts
    the sequence into tiles (it says so with ``narrows_tile_tokens``, as
    `narrows.stream.tile_sequence`'s does); None otherwise."""
    tokens = getattr(mlp.__dict__.get("forward"), "narrows_tile_tokens", None)
    return tokens if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0 else None


def _trains_outside_adapters(layer: nn.Module) -> bool:
    """Whether a parameter of `layer` whose name has no ``lora_`` part requires grad (as
    ``named_parameters`` would find it)."""
    stack = [layer]
    while stack:
        module = stack.pop()
        if any(
            p is not None and p.requires_grad and "lora_" not in name
            for name, p in module._parameters.items()
        ):
            return True
        stack.extend(c for name, c in module._modules.items() if c is not None and "lora_" not in name)
    return False


def _norm(module: nn.Module) -> Norm | str:
    weight, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
    if not type(module).__name__.endswith("RMSNorm") or weight is None or eps is None:
        return f"its norm is a {type(module).__name__}, not the family's RMSNorm"
    if _hooked(module):
        return f"its {type(module).__name__} has hooks or a replaced forward"
    return Norm(weight, float(eps))


class _NF4Weight:
    """A bitsandbytes 4-bit weight: its held copy while one is held, else dequantised."""

    stacks = True

    def __init__(self, base: nn.Module):
        self.base = base
        self.shape = tuple(int(n) for n in base.weight.quant_state.shape)

    def ready(self, like: Tensor) -> Tensor | None:
        held = held_weight(self.base)
        return held if held is not None and held.dtype == like.dtype else None

    def __call__(self, like: Tensor) -> Tensor:
        held = held_weight(self.base)
        if held is None:
            held = dequantize_nf4(self.base.weight.data.view(-1, 1), self.base.weight.quant_state)
        return held if held.dtype == like.dtype else held.to(like.dtype)

    def into(self, out: Tensor) -> None:
        held = held_weight(self.base)
        if held is not None:
            out.copy_(held)
            return
        dequantize_nf4(self.base.weight.data.view(-1, 1), self.base.weight.quant_state, out=out)


class _DenseWeight:
    """A plain linear's weight (cast to the activations' dtype where it differs)."""

    stacks = False

    def __init__(self, base: nn.Linear):
        self.base = base
        self.shape = tuple(base.weight.shape)

    def ready(self, like: Tensor) -> Tensor | None:
        return self.base.weight if self.base.weight.dtype == like.dtype else None

    def __call__(self, like: Tensor) -> Tensor:
        w = self.base.weight
        return w if w.dtype == like.dtype else w.to(like.dtype)

    def into(self, out: Tensor) -> None:
        out.copy_(self.base.weight)


def _linear(name: str, module: nn.Module) -> Linear | str:
    """`module` as a `Linear`, or why the fast layer does not compute it."""
    adapter = None
    base = module
    if hasattr(module, "base_layer") and hasattr(module, "lora_A"):
        if module.merged or module.disable_adapters or len(module.active_adapters) != 1:
            return f"{name} has merged, disabled or several active adapters"
        key = module.active_adapters[0]
        if key in getattr(module, "lora_variant", {}):
            return f"{name} runs a LoRA variant ({type(module.lora_variant[key]).__name__}; DoRA, aLoRA, ...)"
        if key in module.lora_A:
            a, b, drop = module.lora_A[key], module.lora_B[key], module.lora_dropout[key]
            if (
                type(a) is not nn.Linear
                or type(b) is not nn.Linear
                or a.bias is not None
                or b.bias is not None
            ):
                return f"{name}'s adapter is not a plain pair of bias-free linears (lora_bias?)"
            if type(drop) not in (nn.Identity, nn.Dropout):
                return f"{name}'s LoRA dropout is a {type(drop).__name__}"
            if any(map(_hooked, (module, a, b, drop))):
                return f"{name} or its adapter has hooks or a replaced forward"
            if isinstance(drop, nn.Dropout) and drop.p >= 1.0:  # in eval mode too: the plan sees one answer
                return f"{name}'s LoRA dropout is {drop.p:g}: it drops every input"  # (PEFT's forward: a zero branch)
            p = drop.p if isinstance(drop, nn.Dropout) and drop.training else 0.0
            adapter = (a.weight, b.weight, float(module.scaling[key]), float(p))
        base = module.base_layer
    if _hooked(base):
        return f"{name}'s base layer has hooks or a replaced forward"
    if is_nf4_linear(base):
        if base.weight.quant_state is None or getattr(
            base.weight.quant_state, "packing_format_for_cpu", False
        ):
            return f"{name}'s 4-bit weight is not quantised, or repacked for CPU inference"
        weight = _NF4Weight(base)
    elif type(base) is nn.Linear:
        weight = _DenseWeight(base)
    else:
        return f"{name} is a {type(base).__name__}, not an nn.Linear or a bitsandbytes Linear4bit"
    a, b, scaling, dropout = adapter if adapter else (None, None, 0.0, 0.0)
    return Linear(name, weight, base.bias, a, b, scaling, dropout)


def build_parts(layer: nn.Module, lora_dtype: torch.dtype | None = None) -> LayerParts | str:
    """`layer` as the fast layer computes it, or why it does not (`FastLayer` keeps the
    result until the layer changes)."""
    kind = type(layer).__name__
    if kind not in FAST_LAYER_TYPES:
        return f"fast layers cover {', '.join(FAST_LAYER_TYPES)}; this is a {kind}"
    attn, mlp = layer.self_attn, layer.mlp
    config = attn.config
    if getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
        return f"its activation is {config.hidden_act!r}, not SiLU"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1 splits its matmuls"
    if attn.training and getattr(attn, "attention_dropout", 0.0):
        return "attention dropout is on"
    if getattr(attn, "is_causal", True) is False or getattr(config, "is_causal", True) is False:
        return "its attention is bidirectional (is_causal=False); the fast layer's is causal"
    sinks = getattr(attn, "sinks", None)
    implementation = getattr(config, "_attn_implementation", None)
    if isinstance(sinks, Tensor):
        if implementation != "eager":  # the family's only SDPA-free path whose masks are whole
            return (
                f"attention with sinks runs as {implementation!r}; the fast layer computes it where the "
                "model runs 'eager' (load the model with attn_implementation='eager')"
            )
    elif implementation != "sdpa":
        return (
            f"attention runs as {getattr(config, '_attn_implementation', None)!r}; the fast layer runs SDPA "
            "(load the model with attn_implementation='sdpa')"
        )
    if getattr(config, "clip_qkv", None) is not None:
        return "its queries, keys and values are clipped (clip_qkv)"
    if _trains_outside_adapters(layer):
        return (
            "a weight or bias outside the adapters trains (the fast layer differentiates the adapters only)"
        )
    if any(map(_hooked, (attn, mlp))):  # the layer's own hooks still run around the fast forward
        return "its attention or its MLP has hooks or a replaced forward"
    norms = [_norm(layer.input_layernorm), _norm(layer.post_attention_layernorm)]
    for name in ("q_norm", "k_norm"):
        norms.append(_norm(getattr(attn, name)) if hasattr(attn, name) else None)
    moe, dense = None, mlp
    if type(mlp).__name__ in MOE_BLOCKS:
        moe = build_moe(mlp, lora_dtype)
        if isinstance(moe, str):
            return moe
        if _tile_of(mlp) is not None:
            return "its MoE block runs in sequence tiles (the fast layer routes all tokens at once)"
        inner = [
            m
            for m in (
                getattr(mlp, "gate", None) or mlp.router,
                mlp.experts,
                moe.experts,
                getattr(mlp, "shared_expert_gate", None),
            )
            if m is not None
        ]
        if any(map(_hooked, inner)):
            return "its router or experts have hooks or a replaced forward"
        # Qwen2-MoE's shared expert (sigmoid-gated), or GLM-4-MoE's shared experts (one MLP, ungated)
        dense = getattr(mlp, "shared_expert", None) or getattr(mlp, "shared_experts", None)
        if dense is not None and _hooked(dense):
            return "its shared expert has hooks or a replaced forward"
        if getattr(mlp, "shared_expert_gate", None) is not None:
            gate = _linear("shared_gate", mlp.shared_expert_gate)
            if isinstance(gate, str) or gate.a is not None or gate.bias is not None:
                return "its shared expert's gate is not a bias-free linear without an adapter"
            moe.shared_gate = gate.weight
    latent = kind == "DeepseekV3DecoderLayer"  # multi-head latent attention
    if latent:
        if not type(layer).__module__.startswith("transformers.models.deepseek_v3."):
            return (
                f"its DeepseekV3DecoderLayer is {type(layer).__module__}'s (remote code), not transformers'"
            )
        if config.num_key_value_heads != config.num_attention_heads:
            return "its latent attention has fewer key-value heads than heads (transformers expands both)"
        plain_q = attn.q_proj is not None
        attention = [("q", attn.q_proj)] if plain_q else [("q_a", attn.q_a_proj), ("q_b", attn.q_b_proj)]
        attention += [("kv_a", attn.kv_a_proj_with_mqa), ("kv_b", attn.kv_b_proj)]
        norms += [None if plain_q else _norm(attn.q_a_layernorm), _norm(attn.kv_a_layernorm)]
    else:
        attention = [("q", attn.q_proj), ("k", attn.k_proj), ("v", attn.v_proj)]
    linears = {}
    for name, module in (
        *attention,
        ("o", attn.o_proj),
        *(
            (("gate", dense.gate_proj), ("up", dense.up_proj), ("down", dense.down_proj))
            if dense is not None
            else ()
        ),
    ):
        linears[name] = _linear(name, module)
    bad = next((r for r in (*norms, *linears.values()) if isinstance(r, str)), None)
    if bad is not None:
        return bad
    tile = _tile_of(mlp)
    if tile is not None and any(
        linears[n].dropout > 0 for n in ("gate", "up", "down") if linears[n].a is not None
    ):
        return "its MLP runs in sequence tiles with LoRA dropout (the fast layer's tiles redraw no masks)"

    def g(group: list[Linear]) -> LinearGroup:
        return LinearGroup(group, lora_dtype)

    latent_parts = None
    if latent:
        qkv = g([linears["q"] if plain_q else linears["q_a"]])
        latent_parts = LatentParts(
            None if plain_q else g([linears["q_b"]]),
            g([linears["kv_a"]]),
            g([linears["kv_b"]]),
            norms[4],
            norms[5],
            config.num_attention_heads,
            int(config.kv_lora_rank),
            int(config.qk_nope_head_dim),
            int(config.qk_rope_head_dim),
            int(config.v_head_dim),
            bool(getattr(config, "rope_interleave", False)),
        )
        head_dim = latent_parts.v_dim  # the attention output's heads (o_proj's input), as values are
    else:
        qkv, head_dim = g([linears["q"], linears["k"], linears["v"]]), attn.head_dim
    return LayerParts(
        norms[0],
        norms[1],
        norms[2],
        norms[3],
        qkv,
        g([linears["o"]]),
        g([linears["gate"], linears["up"]]) if dense is not None else None,
        g([linears["down"]]) if dense is not None else None,
        config.num_attention_heads,
        config.num_key_value_heads,
        head_dim,
        float(attn.scaling),
        tile,
        moe=moe,
        recorded=recorders_of(layer),
        full_qk_norm=norms[2] is not None and norms[2].weight.shape[-1] != head_dim,
        sinks=sinks if isinstance(sinks, Tensor) else None,
        half_rope=kind == "GptOssDecoderLayer",
        latent=latent_parts,
    )
