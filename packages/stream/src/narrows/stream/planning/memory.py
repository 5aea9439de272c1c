"""The memory formulas the planner sizes a plan with: what one layer's saved input, a
whole layer's activations, a recompute's working set, the loss and the CUDA graphs' pool
take on the device, and what the trained state and step mode's extras take.

Each is fitted to H100 peaks at the Qwen2.5 shapes (the docstrings give the fits);
`test_plan_graphs.py`, `test_whole_layers.py` and `test_long_context.py` hold them to
measured CPU-side sizes where they can.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor, nn

from narrows.core import (
    Anatomy,
    anatomy_of,
    dequantized_bytes,
    dequantized_expert_bytes,
    expert_names,
    expert_shape,
    held_bytes,
    loss_working_set,
    moe_blocks,
    trainable_parameters,
    unwrap_experts,
)

from ..config import DEFAULT_SHAPES

__all__ = [
    "Shapes",
    "activation_bytes",
    "attention_dims",
    "dropout_mask_bytes",
    "graph_bytes",
    "held_weight_bytes",
    "input_bytes",
    "latent_bytes",
    "layer_work_bytes",
    "loss_work_bytes",
    "step_mode_reserve",
    "training_bytes",
    "whole_bytes",
    "whole_overlap_bytes",
    "work_bytes",
]


def _latent(cfg) -> bool:
    """Whether `cfg`'s attention is multi-head latent attention (DeepSeek-V3's)."""
    return isinstance(getattr(cfg, "kv_lora_rank", None), int) and isinstance(
        getattr(cfg, "v_head_dim", None), int
    )


def attention_dims(cfg) -> tuple[int, int, int]:
    """(heads, head width, key-value heads) as the planner prices attention: the config's;
    for multi-head latent attention (DeepSeek-V3's, whose ``head_dim`` is the rotary part
    alone) a head's mean width over its queries and keys (``nope + rope``) and its values
    (``v``), and as many key-value heads as heads (the latent is expanded to every head
    before SDPA): so queries and keys, values and the output, count at their widths."""
    heads = cfg.num_attention_heads
    if _latent(cfg):
        return heads, (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) // 2, heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return heads, head_dim, getattr(cfg, "num_key_value_heads", None) or heads


def latent_bytes(cfg, act_bytes: int) -> int:
    """What a token's multi-head latent attention (DeepSeek-V3's) keeps in the fast layer
    beyond the fit for the others (0 for any other attention): q_a's output and its norm's
    (``q_lora_rank`` each), the latent beside the shared key part and its norm's
    (``kv_lora_rank + rope`` and ``kv_lora_rank``), the queries' width beyond the mean head
    width the rest is priced at (``heads × (qk - v) / 2``), two float32 norm statistics.
    (`narrows.core.kernels.fastlayer.latent_attention`; a test counts them.)"""
    if not _latent(cfg):
        return 0
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    wider = cfg.num_attention_heads * max(0, qk - cfg.v_head_dim) // 2
    q_rank = getattr(cfg, "q_lora_rank", None) or 0
    return (2 * q_rank + 2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim + wider) * act_bytes + 8


@dataclass(frozen=True)
class Shapes:
    """What the activation estimate needs from the model config and the batch."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    vocab: int
    act_bytes: int  # bytes per activation element (2 for bf16)
    batch: int
    seq: int
    eager_attention: bool
    loss_bytes: int | None = None  # what a replaced loss says it holds (narrows.core.loss_working_set)
    dequant_bytes: int = 0  # the largest 4-bit weight dequantised at once (a fast layer's: gate + up)
    fast: bool = False  # every layer runs narrows.core's fast layer (it keeps and works in less)
    kv_width: int = 0  # keys' (and values') width per token; 0: taken as `hidden` (the most)
    q_width: int = 0  # queries' width per token (heads × head dim); 0: taken as `hidden`
    lora_float32: bool = False  # the fast layers' adapters in float32 (their temporaries in float32)
    dropout: bool = False  # the fast layers' adapters drop out (each keeps its mask for the backward)
    moe: MoEShape | None = None  # the mixture-of-experts MLP, where layers have one
    dense_mlp: bool = True  # some layer has a dense MLP (of `intermediate`)
    sinks: bool = False  # attention sinks (gpt-oss): the fast layer's SDPA runs on widened copies
    head_dim: int = 0  # a head's width (where `sinks`: the copies' width follows it)
    latent: int = 0  # bytes a token's latent attention keeps beyond the rest (`latent_bytes`)

    @classmethod
    def of(
        cls,
        anat: Anatomy,
        batch_size: int,
        seq_len: int,
        *,
        fast: bool = False,
        lora_float32: bool = False,
        dropout: bool = False,
    ) -> Shapes:
        """A model's shapes (from its anatomy) and a batch of `batch_size` × `seq_len` tokens;
        `fast`: every decoder layer runs as a fast layer; `lora_float32`: with float32 LoRA;
        `dropout`: the fast layers' adapters drop out."""
        cfg = anat.config
        act = anat.embed.weight.element_size() if hasattr(anat.embed, "weight") else 2
        _, head_dim, kv_heads = attention_dims(cfg)
        moe = MoEShape.of(anat)
        return cls(
            latent=latent_bytes(cfg, act) if fast else 0,
            layers=anat.num_layers,
            hidden=cfg.hidden_size,
            intermediate=getattr(cfg, "intermediate_size", 4 * cfg.hidden_size),
            heads=cfg.num_attention_heads,
            vocab=cfg.vocab_size,
            act_bytes=act,
            batch=batch_size,
            seq=seq_len,
            eager_attention=getattr(cfg, "_attn_implementation", "eager") == "eager",
            loss_bytes=loss_working_set(anat.model, batch_size * seq_len),
            # a fast layer dequantises gate and up side by side into one buffer: twice the largest
            dequant_bytes=(2 if fast else 1) * max(map(dequantized_bytes, anat.layers), default=0),
            fast=fast,
            kv_width=kv_heads * head_dim,
            head_dim=head_dim,
            q_width=cfg.num_attention_heads * head_dim,
            lora_float32=fast and lora_float32,
            dropout=fast and dropout,
            moe=moe,
            dense_mlp=moe is None or moe.dense_layers > 0,
            sinks=any(
                getattr(getattr(la, "self_attn", None), "sinks", None) is not None for la in anat.layers
            ),
        )

    @property
    def kv(self) -> int:
        return self.kv_width or self.hidden

    def sink_copies(self) -> int:
        """What the fast layer's attention with sinks gives SDPA beyond the layer's own q, k
        and v (`narrows.core.kernels.fastlayer.compute._attention_with_sinks`): the queries,
        keys and values copied a sink channel wider (each head rounded up to a multiple of
        8), the keys and values one position longer, the mask one column wider. SDPA's
        backward keeps them where a layer runs whole. (A test measures them.)"""
        if not (self.fast and self.sinks and self.head_dim):
            return 0
        d = self.head_dim
        padded, q_heads, kv_heads = d + 8 - d % 8, (self.q_width or self.hidden) // d, self.kv // d
        rows = self.batch * self.seq * (q_heads + 2 * kv_heads) + 2 * self.batch * kv_heads
        return (rows * padded + self.batch * self.seq * (self.seq + 1)) * self.act_bytes

    def sink_bytes(self) -> int:
        """`sink_copies` and the two masks the model builds whole for its eager attention
        (full and sliding), held for the step: what a layer's working set adds."""
        copies = self.sink_copies()
        return copies + 2 * self.batch * self.seq * self.seq * self.act_bytes if copies else 0

    @property
    def wide_queries(self) -> int:
        """Bytes a token's attention keeps beyond the hidden-sized fit where its queries are
        wider than the hidden size (Qwen3-MoE: 32 heads of 128 on a hidden size of 2048):
        three query-wide tensors (the projection, the rotated queries, the attention's
        output) counted at their width."""
        return 3 * max(0, (self.q_width or self.hidden) - self.hidden) * self.act_bytes


@dataclass(frozen=True)
class MoEShape:
    """A mixture-of-experts MLP as the planner prices it, read off the model's modules: E
    experts of intermediate width I, k of them per token, a shared expert of width
    `shared` (0: none), and the bytes its quantised stacks take dequantised: all of them
    (`dequant_bytes`, the layer's largest: transformers' experts hold both through their
    call and, saved by their matmuls, until the layer's backward), and the largest one
    alone (`stack_bytes`: narrows' fast layer dequantises them one at a time)."""

    experts: int
    top_k: int
    intermediate: int
    shared: int
    dequant_bytes: int
    dense_layers: int  # layers without one
    gate_tensors: int = 4  # intermediate-sized tensors a chosen expert keeps (7: gpt-oss's clamped SwiGLU)
    adapter_rank: int = 0  # LoRA on the routed experts' stacks: its rank (0: none)
    stack_bytes: int = 0  # the largest quantised stack dequantised (what a fast layer holds at once)

    @classmethod
    def of(cls, anat: Anatomy) -> MoEShape | None:
        cfg, found, dense = anat.config, None, 0
        for layer in anat.layers:
            blocks = list(moe_blocks(layer))
            if not blocks:
                dense += 1
            elif found is None:
                found = blocks[0]
        if found is None:
            return None
        experts = found.experts
        # every stack is [E, …]; the down projection's per-expert size, hidden × width, is the least
        shapes = [expert_shape(experts, n) for n in expert_names(experts)]
        n_experts = int(shapes[0][0])
        width = min(math.prod(shape[1:]) for shape in shapes) // cfg.hidden_size
        top_k = int(getattr(cfg, "num_experts_per_tok", None) or getattr(experts, "top_k", 0) or 1)
        shared = 0
        for name, child in found.block.named_children():
            if name != found.experts_name and name not in found.routers:
                shared += sum(m.out_features for n, m in child.named_modules() if n.endswith("up_proj"))
        unwrapped = unwrap_experts(getattr(found.block, found.experts_name))
        adapters = unwrapped[1].values() if not isinstance(unwrapped, str) else ()
        return cls(
            experts=n_experts,
            top_k=top_k,
            intermediate=width,
            shared=shared,
            dequant_bytes=max(map(dequantized_expert_bytes, anat.layers), default=0),
            stack_bytes=max((dequantized_expert_bytes(la, largest=True) for la in anat.layers), default=0),
            dense_layers=dense,
            adapter_rank=max((a.rank for a in adapters), default=0),
            # gpt-oss clamps gate and up, and keeps the clamped ones, the sigmoid and up + 1 too
            gate_tensors=7 if hasattr(experts, "limit") else 4,
        )

    def kept(self, hidden: int, act: int) -> int:
        """Bytes a token's MoE MLP keeps for its backward (transformers' grouped-matmul
        experts): the router's logits and float32 probabilities and its top-k; per chosen
        expert the token's copy, gate and up, the activation and their product (1 hidden-
        and `gate_tensors` intermediate-sized); the shared expert's gate, up, activation and
        product. (The saved tensors of transformers' MoE blocks, counted on the CPU:
        Qwen3-MoE's, Mixtral's and gpt-oss's this within 1%, Qwen2-MoE's within 3%.)"""
        router = self.experts * (4 + act) + 16 * self.top_k
        per_expert = hidden + self.gate_tensors * self.intermediate
        return router + (self.top_k * per_expert + 4 * self.shared) * act

    def work(self, hidden: int, act: int) -> int:
        """Bytes a token's MoE MLP holds at the peak of its recompute and backward: what it
        keeps, the gradients in flight through the chosen experts (the output's, the
        product's, gate and up's, the token copy's: 2 hidden- and 3 intermediate-sized per
        expert) and the shared expert's (3 intermediate-sized)."""
        return (
            self.kept(hidden, act)
            + (self.top_k * (2 * hidden + 3 * self.intermediate) + 3 * self.shared) * act
        )

    def fast_kept(self, hidden: int, act: int) -> int:
        """Bytes a token's MoE MLP keeps for its backward in narrows' fast layer
        (`narrows.core.kernels.fastlayer.moe.MoEState`): the float32 softmax, the chosen
        experts, the sort and its inverse, the weights; per chosen expert gate/up's output
        and the activation (3 intermediate-sized); the shared expert's gate, up, product and
        output; with LoRA on the stacks, the block's input and each adapter's ``x·Aᵀ`` per
        chosen expert. No dequantised stack: the fast layer dequantises them again for the
        backward."""
        router = 4 * self.experts + 28 * self.top_k
        shared = 3 * self.shared + (hidden if self.shared else 0)
        lora = hidden + 2 * self.top_k * self.adapter_rank if self.adapter_rank else 0
        return router + (3 * self.top_k * self.intermediate + shared + lora) * act

    def fast_work(self, hidden: int, act: int) -> int:
        """Bytes a token's MoE MLP holds at the peak of the fast layer's recompute and
        backward: what it keeps, and per chosen expert the output's gradient gathered, its
        gradient through down and the weighted one (a hidden- and two intermediate-sized),
        or the input's gradient before and after un-sorting (two hidden-sized), whichever
        is more; the router's float32 gradients; the shared expert's three."""
        per_expert = max(hidden + 2 * self.intermediate, 2 * hidden)
        return (
            self.fast_kept(hidden, act)
            + 12 * self.experts
            + (self.top_k * per_expert + 3 * self.shared) * act
        )


def _mlp(s: Shapes, dense: float, moe: int) -> float:
    """A token's MLP term: the dense MLP's (`dense` bytes), the MoE MLP's (`moe`), or the
    larger where the model has both kinds of layer."""
    return max(dense if s.dense_mlp else 0, moe if s.moe is not None else 0)


def input_bytes(s: Shapes) -> int:
    """One layer's saved input: a [batch, seq, hidden] tensor."""
    return s.batch * s.seq * s.hidden * s.act_bytes


def activation_bytes(s: Shapes) -> int:
    """Saved layer inputs when every one stays on the device."""
    return s.layers * input_bytes(s)


def whole_bytes(s: Shapes) -> int:
    """What one layer run whole (no recompute) keeps for its backward.

    About eighteen hidden-sized and five intermediate-sized tensors per token (the input,
    the norms' outputs and statistics, q/k/v/o and the attention output, the MLP's gate,
    up, activation and product, and the inputs the adapters save), plus the attention
    probabilities when attention is eager. (Fitted to H100 peaks of resident PEFT without
    checkpointing against with it: 316 KB per token per layer at the Qwen2.5-7B shape at
    512 and 4096 tokens, 455 KB at 32B; this predicts 316 and 461.)

    A fast layer (`Shapes.fast`) keeps about half: the input, five hidden-sized tensors
    (the norms' outputs, the queries, the attention output, the residual sum), the keys
    and values, and gate, up and their product; a quarter hidden of slack covers the
    adapters' rank-wide activations and the norms' statistics. (`benchmarks/fast_memory.py`
    on the H100, bytes per token beyond the input / predicted: 151.9 / 153.3 KB at 7B,
    221.6 / 223.7 at 32B, 263.9 / 267.5 at 72B.) With dropout (`Shapes.dropout`) it keeps
    each adapter's mask too, the size of the adapter's input: six hidden-sized and one
    intermediate-sized a token where all seven linears drop out (`dropout_mask_bytes`).

    A mixture of experts (`Shapes.moe`) keeps its MoE MLP's (`MoEShape.kept`) in place of
    the dense MLP's five intermediate-sized tensors, and its dequantised NF4 stacks, which
    the grouped matmuls save for the backward. A fast layer's latent attention keeps
    `Shapes.latent` a token more (`latent_bytes`)."""
    tokens = s.batch * s.seq
    if s.fast:
        moe = s.moe.fast_kept(s.hidden, s.act_bytes) + s.wide_queries if s.moe is not None else 0
        mlp = _mlp(s, 3 * s.intermediate * s.act_bytes, moe)
        kept = int(tokens * ((6.25 * s.hidden + 2 * s.kv) * s.act_bytes + mlp + s.latent))
        return kept + dropout_mask_bytes(s) + s.sink_copies()
    moe = s.moe.kept(s.hidden, s.act_bytes) if s.moe is not None else 0
    kept = tokens * (
        18 * s.hidden * s.act_bytes + s.wide_queries + _mlp(s, 5 * s.intermediate * s.act_bytes, moe)
    )
    kept += s.moe.dequant_bytes if s.moe is not None else 0
    if s.eager_attention:
        kept += 2 * s.batch * s.heads * s.seq * s.seq * s.act_bytes
    return int(kept)


def whole_overlap_bytes(s: Shapes) -> int:
    """What the whole layers and a recomputed layer's working set (`work_bytes`) never hold
    at once: one whole layer's keep. Whole layers run last in the forward and are
    differentiated first, so the last one's backward (its own working set) happens with the
    others still kept but no recompute, and the recomputed layers come after all of them
    are freed: the peak is the working set plus every whole layer but one. Counted for a
    mixture of experts, whose whole layers keep their dequantised expert stacks (Qwen3-30B-A3B's
    shape, 6 layers, on the H100, 4096 and 8192 tokens, one to five whole layers: each
    whole layer measured 1.87 and 2.53 GB more, 1.88 and 2.56 priced). A dense model's
    whole-layer prices were fitted with every whole layer counted on top of the working
    set: 0 there."""
    return whole_bytes(s) if s.moe is not None else 0


def dropout_mask_bytes(s: Shapes) -> int:
    """One fast layer's dropout masks, each the size of its adapter's input, a byte an
    element (bool): Q, K, V, o, gate and up read hidden-sized inputs, down an
    intermediate-sized one (all seven counted). 0 without dropout. On the H100 at 7B, 8 ×
    512 tokens, dropout 0.05: the `8GiB` plan peaked at 6.87 GiB against 7.95 predicted, the
    smallest footprint at 3.29 against 3.47 (an A/B on the H100, kept in git history). (With
    masks in the activations' dtype, twice this, the smallest footprint had peaked 0.43 GiB
    higher than without and the `8GiB` plan's five whole layers 1.67 GiB.)"""
    if not s.dropout:
        return 0
    return s.batch * s.seq * (6 * s.hidden + s.intermediate)


def layer_work_bytes(s: Shapes, tile: int | None = None) -> int:
    """One layer's recompute and backward working set (see `work_bytes`).

    An untiled fast layer's is what its recompute keeps plus its backward's gradients —
    about sixteen hidden-sized and 3.6 intermediate-sized tensors a token, the attention
    backward's float32 accumulators among them — and its dequantised 4-bit weights: gate
    and up stacked in one buffer, two of the largest (`Shapes.dequant_bytes`).
    (`benchmarks/fast_memory.py` on the H100 before gate and up were stacked, peak bytes
    per token / predicted with one weight: 264.9 / 284.2 KB at 7B and 4096 tokens, 249.4 /
    255.2 at 32K; 428.0 / 432.0 at 32B; 580.3 / 593.3 at 72B. The second weight adds at
    most its own size; at 4096 tokens it prices 33 KB a token more at 7B.)

    A tiled one keeps eleven hidden-sized tensors a token for every token (attention's
    share) and, for one tile's tokens, the MLP's five hidden-sized and 3.6 intermediate-sized
    — its MLP is recomputed and differentiated a tile at a time — beside the MLP's
    weights, dequantised once for all tiles (priced as two stacked buffers). Fitted to one
    device measurement, above it: 7B at 32K tokens in 2048-token tiles peaked at 3.21 GB
    (`benchmarks/fast_memory.py`, case `fast_memory_tiled_7b` of `benchmarks/results/h100.jsonl`), priced at
    3.48 GB (8.5% over; the untiled formula with the tile's MLP priced 4.58 GB). Float32
    LoRA (`Shapes.lora_float32`) adds its float32 temporaries, counted from the code, not
    measured. Dropout (`Shapes.dropout`; never with tiles) adds the layer's masks and one
    dropped-out input at a time, the widest down_proj's (`dropout_mask_bytes`, and an
    intermediate-sized tensor a token).

    A mixture of experts run by PEFT's modules (`Shapes.moe`, not `Shapes.fast`) holds its
    MoE MLP's working set (`MoEShape.work`) in place of the dense MLP's six
    intermediate-sized tensors, and its dequantised NF4 stacks. (Qwen3-30B-A3B's shape, 6
    layers, narrows-lmhead's loss, on the H100, every layer streamed: peaks of 3.47 and
    3.53 GiB at 8 × 512 tokens (the smallest footprint, 4 GiB), 4.56 at 4 × 2048, priced
    3.58, 3.64 and 4.77; case moe_plan_* of `benchmarks/results/h100.jsonl`.)

    A fast MoE layer holds `MoEShape.fast_work` and one dequantised stack, the largest
    (`MoEShape.stack_bytes`: the fast layer frees each before it dequantises the next),
    beside what the recompute keeps for the attention's backward and the gradients at the
    block (a fast whole layer's keep, `whole_bytes`, and two hidden-sized tensors a token).
    Latent attention adds `Shapes.latent` a token beside the experts and twice that to the
    attention's backward (the recompute's copy, and the gradients of as much).
    Its attention's backward comes after the experts' is done, so the layer holds the larger
    of the two. (On one H200 at Qwen3-30B-A3B's shape, 6 layers, 8 × 512 tokens,
    narrows-lmhead's loss: the smallest footprint, the `4.6GiB` and the `8GiB` plans peaked
    at 2.47, 4.29 and 5.14 GiB, priced 2.66, 4.47 and 5.31; the sum of the two had priced
    the first and the last at 2.78 and 5.42. Case peers_qwen3-30b-a3b-6l_8x512 of
    `benchmarks/results/h200.jsonl`.)"""
    tokens = s.batch * s.seq
    mlp_tokens = tokens if tile is None else min(tokens, tile)
    if s.fast:
        # float32 LoRA's temporaries, counted (not fitted): an adapter's float32 product and its
        # float32 input, an intermediate-sized pair at the MLP, a hidden-sized pair elsewhere
        wide = (
            (tokens * 2 * s.hidden + mlp_tokens * 2 * s.intermediate) * s.act_bytes if s.lora_float32 else 0
        )
        if mlp_tokens == tokens:
            act, attention = s.act_bytes, tokens * (16 * s.hidden * s.act_bytes + 2 * s.latent)
            dense = attention + tokens * 3.6 * s.intermediate * act if s.dense_mlp else 0
            moe = 0
            if s.moe is not None:  # the experts' backward is done before the attention's begins
                beside = (8.25 * s.hidden + 2 * s.kv) * act + s.wide_queries + s.latent
                experts = tokens * (beside + s.moe.fast_work(s.hidden, act)) + s.moe.stack_bytes
                moe = max(attention + tokens * s.wide_queries, experts)
            work = int(max(dense, moe)) + s.dequant_bytes + wide + s.sink_bytes()
            if s.dropout:
                work += dropout_mask_bytes(s) + tokens * s.intermediate * s.act_bytes
            return work
        work = (tokens * 11 * s.hidden + tile * (5 * s.hidden + 3.6 * s.intermediate)) * s.act_bytes
        work += 2 * s.dequant_bytes
        return int(work) + wide + s.sink_bytes()
    moe = s.moe.work(s.hidden, s.act_bytes) if s.moe is not None else 0
    layer = tokens * (26 * s.hidden * s.act_bytes + s.wide_queries)
    layer += mlp_tokens * _mlp(s, 6 * s.intermediate * s.act_bytes, moe)
    layer += s.moe.dequant_bytes if s.moe is not None else 0
    if s.eager_attention:
        layer += 2 * s.batch * s.heads * s.seq * s.seq * s.act_bytes
    return int(layer)


GRAPH_WORKSPACE = 128 << 20  # cuBLAS workspaces of the capture stream, and the pool's rounding
GRAPH_ACTIVATIONS = 1.05  # the pool's intermediates, in layer working sets (`layer_work_bytes`)
GRAPH_DEQUANT = 1.6  # the pool's dequantised weights, in largest 4-bit weights
GRAPH_MIXED = 1.0  # a mix of whole and recomputed layers' graphs: the pool's extra, in whole layers' keeps


def graph_bytes(s: Shapes, tile: int | None = None, reserved: int = 0, shapes: int = DEFAULT_SHAPES) -> int:
    """What CUDA graphs' shared pool holds: the intermediates of one layer's forward graph
    and of one recompute-and-backward graph (not live at once, and the pool reuses their
    blocks); and — unless step mode holds them — the 4-bit weights each call dequantises,
    whose blocks the pool cannot fully reuse for one another; plus the capture stream's
    workspaces, plus the static buffers of the other batch shapes kept (hidden states in and
    out, and their gradients: four hidden-sized tensors each, at most the planned length;
    `shapes` kept at once, one where batches have one shape).
    Held weights live in `reserved` room (step mode's reserve); where they are not held,
    that room is free for the pool's copies, so only what exceeds it is added. The plan puts
    it beside the eager working set where a layer may run eagerly while the graphs are held
    (`StreamConfig.eager_beside_graphs`).
    (Fitted above the H100 pools at the Qwen2.5 NF4 shapes, 512 tokens, one shape; GB
    measured / predicted, leaving out the other shapes' buffers. Weights dequantised per
    call: 0.375 / 0.57 at 7B, 0.730 / 0.91 at 32B, 1.281 / 1.33 at 72B. Held: 0.388 / 0.46
    at 32B, 0.505 / 0.55 at 72B. `test_plan_graphs.py` checks each.)"""
    other_shapes = (shapes - 1) * 4 * input_bytes(s)
    dequant = max(0, int(GRAPH_DEQUANT * s.dequant_bytes) - reserved)
    return int(GRAPH_ACTIVATIONS * layer_work_bytes(s, tile)) + dequant + GRAPH_WORKSPACE + other_shapes


def work_bytes(s: Shapes, tile: int | None = None) -> int:
    """Transient working set: the larger of one layer's recompute graph and the loss.

    A layer's recompute and backward hold about twenty-six hidden-sized tensors (q/k/v/o,
    residuals, the norms' fp32 upcasts, attention's gradient accumulators, and the loss's
    gradient waiting beside them) and six intermediate-sized ones (gate, up, act, product
    and two gradients — for one tile of `tile` tokens when the MLP is tiled), plus the
    attention probabilities when attention is eager. (Fitted to H100 peaks of the
    Qwen2.5-7B shape from 4K to 64K tokens, tiled and untiled: within 6% of each, over
    rather than under at 16K and beyond.) The loss holds logits in the activation dtype, their fp32
    upcast, the log-softmax and the gradient (fp32), and the gradient cast back. (Measured
    on the H100: 10 bytes per logit under-predicted a 32B seq-4096 run by 3%.) A loss that
    never builds the logits (narrows-lmhead) reports its own figure instead.
    """
    return max(layer_work_bytes(s, tile), loss_work_bytes(s))


def loss_work_bytes(s: Shapes) -> int:
    """The loss's working set (see `work_bytes`)."""
    if s.loss_bytes is not None:
        return s.loss_bytes
    return s.batch * s.seq * s.vocab * (2 * s.act_bytes + 4 + 4 + 2)


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def training_bytes(model: nn.Module, anat: Anatomy, host_state: str) -> int:
    """Device bytes of the trainable parameters, their gradients and AdamW's two fp32
    moments; with step mode's host state, the part of them it keeps on the device:
    "optimizer", one layer's state (every gradient may be there at once: a step in
    sequential order keeps them all until its end); "adapters", one layer's parameters,
    gradients and state (only block-major steps, which `StepTrainer` then insists on).
    Trainable parameters outside the layers (a trained head) count whole either way."""

    def numel(ps: list[Tensor]) -> int:
        return sum(p.numel() for p in ps)

    trainable = list(trainable_parameters(model).values())
    if host_state == "none":
        return 2 * nbytes(trainable) + 8 * numel(trainable)
    per_layer = [[p for p in layer.parameters() if p.requires_grad] for layer in anat.layers]
    in_layers = {id(p) for ps in per_layer for p in ps}
    other = [p for p in trainable if id(p) not in in_layers]
    # a layer's update: its state, and AdamW's temporaries (as large again)
    if host_state == "optimizer":
        return 2 * nbytes(trainable) + 8 * numel(other) + 16 * max(map(numel, per_layer), default=0)
    one_layer = max((2 * nbytes(ps) + 16 * numel(ps) for ps in per_layer), default=0)
    return 2 * nbytes(other) + 8 * numel(other) + one_layer


def held_weight_bytes(model: nn.Module) -> int:
    """The buffer step mode holds a layer's 4-bit weights in, dequantised: the largest
    decoder layer's (0 without 4-bit weights; `narrows.core.HeldWeights`)."""
    return max((held_bytes(layer) for layer in anatomy_of(model).layers), default=0)


def step_mode_reserve(
    model: nn.Module, grad_accum: int = 1, *, batch_size: int = 1, seq_len: int = 512
) -> int:
    """Device bytes a block-major step takes beyond what a plan counts: the held weights
    (`held_weight_bytes`) and, with `grad_accum` G ≥ 2 micro-batches of `batch_size` ×
    `seq_len` tokens, the layer boundary each micro-batch keeps on the device from one
    layer to the next — its output in the forward, the gradient reaching it in the
    backward: G + 1 [batch, seq, hidden] tensors (one being made). The planner leaves this
    room when it plans for step mode (``StreamConfig(grad_accum=G)``); ``reserve=`` leaves
    it by hand."""
    held = held_weight_bytes(model)
    if grad_accum < 2:
        return held
    return held + (grad_accum + 1) * input_bytes(Shapes.of(anatomy_of(model), batch_size, seq_len))
