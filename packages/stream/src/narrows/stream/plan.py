"""The residency planner: given a device budget, which decoder layers stay on the device
for good, how many device slabs to prefetch into, and what peak and transfer to expect.

Costs the budget must hold whatever the plan (the "fixed" part): non-layer frozen tensors
placed on the device (final norm, head, a tied embedding), the trainable parameters with
their gradients and AdamW state, the transient working set of one layer's recompute, and
the logits of the loss. Then the saved layer inputs (one hidden-state tensor per layer):
on the device, or offloaded to host memory with two in flight on the device.

The minimum is one device slab, every saved input offloaded (when offloading is allowed)
and, only when that is still too much and tiling was asked for, the MLP run in sequence
tiles (the largest tile that fits). What the budget has beyond it buys, in this order:
device slabs for prefetch, saved inputs kept on the device (the last layers first: their
backward comes first), then resident layers — spread evenly through the stack, so every
streamed layer's copy can hide behind the compute of its neighbours (seed 004's partial
residency) — or resident layers kept *whole*: run as resident training runs them, every
activation saved, no recompute. A whole layer saves a quarter of its step time (the
recompute forward) for the memory of its activations; a resident layer saves the copy
time its neighbours' compute cannot hide. A small step-time model (`step_seconds`)
picks the mix. Whole layers are the last layers: the streamed layer before them is still
in its device slab when backward turns, so no copy has to be started from inside their
plain autograd backward. With every layer whole a step is plain PEFT training without
checkpointing.

With CUDA graphs (`graphs=True`) the layers narrows runs itself (streamed, or resident and
recomputed) replay as graphs: the budget also holds the graphs' scratch pool, and the
step-time model prices those layers without the host's per-kernel cost, so at short
sequences a graphed recompute beats an eager whole layer and the planner picks it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from narrows.core import Anatomy, dequantized_bytes, format_bytes, loss_working_set

from .errors import BudgetTooSmallError
from .graphs import DEFAULT_SHAPES


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
    dequant_bytes: int = 0  # the largest 4-bit weight dequantised (narrows.core.dequantized_bytes)

    @classmethod
    def of(cls, anat: Anatomy, batch_size: int, seq_len: int) -> Shapes:
        """A model's shapes (from its anatomy) and a batch of `batch_size` × `seq_len` tokens."""
        cfg = anat.config
        act = anat.embed.weight.element_size() if hasattr(anat.embed, "weight") else 2
        return cls(
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
            dequant_bytes=max((dequantized_bytes(layer) for layer in anat.layers), default=0),
        )


# what of the training state (adapters, their gradients, the optimizer's) step mode keeps
# in host memory, and how the plan's report says it
HOST_STATE_NOTES = {
    "none": "",
    "optimizer": "; the optimizer's state in host memory, one layer's on the device",
    "adapters": "; adapters and optimizer state in host memory, one layer's at a time on the device",
}


@dataclass(frozen=True)
class Plan:
    device: str
    budget: int | None
    layer_bytes: tuple[int, ...]
    resident: tuple[int, ...]
    pool_slabs: int
    prefetch: int
    fixed_bytes: int
    activation_bytes: int
    work_bytes: int
    predicted_peak: int
    h2d_bytes_per_step: int
    disk: tuple[int, ...] = ()  # layers whose host copy is on disk (the prepared cache)
    disk_bytes_per_step: int = 0
    predicted_host_bytes: int | None = None  # host RSS with the base in its tiers
    host_budget: int | None = None
    offloaded: tuple[int, ...] = ()  # layers whose saved input goes to host memory
    host_activation_bytes: int = 0  # host memory those inputs take (page-locked on CUDA)
    d2h_bytes_per_step: int = 0
    tile_tokens: int | None = None  # the MLP runs in sequence tiles of this many tokens
    whole: tuple[int, ...] = ()  # resident layers run without recompute, activations saved
    graphs: bool = False  # the layers narrows runs replay as CUDA graphs
    graph_bytes: int = 0  # the graphs' scratch pool and capture workspaces, in the peak
    step_seconds: float = 0.0  # the step-time model's figure for the layers (ranks plans; not a promise)
    graphs_choice: str = ""  # with graphs="auto": why they are on or off
    reserved_bytes: int = 0  # left free in the budget for the caller (step mode's held weights); in the peak
    host_state: str = "none"  # what of the training state waits in host memory (step mode's offload)
    head_h2d_bytes: int = 0  # a streamed LM head's two passes (forward, backward) of one micro-batch

    @property
    def streamed(self) -> tuple[int, ...]:
        return tuple(i for i in range(len(self.layer_bytes)) if i not in set(self.resident))

    def as_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["streamed"] = list(self.streamed)
        return d

    def __str__(self) -> str:
        n = len(self.layer_bytes)
        rows = [
            ("device", self.device),
            ("budget", "none (smallest footprint)" if self.budget is None else format_bytes(self.budget)),
            ("layers", f"{n} ({format_bytes(sum(self.layer_bytes))} frozen, largest {format_bytes(max(self.layer_bytes))})"),
            ("resident layers", f"{len(self.resident)} of {n}" + (f": {list(self.resident)}" if 0 < len(self.resident) < n else "")),
            ("kept whole", f"{len(self.whole)} of {n} layers run without recompute" + (
                f": {list(self.whole)}" if 0 < len(self.whole) < n else "")),
            ("device slabs", f"{self.pool_slabs} (prefetch depth {self.prefetch})"),
            ("fixed on device", format_bytes(self.fixed_bytes) + (
                f" (of which {format_bytes(self.reserved_bytes)} reserved: step mode's dequantised weights)"
                if self.reserved_bytes else "") + HOST_STATE_NOTES[self.host_state]),
            ("saved activations", f"{format_bytes(self.activation_bytes)} on the device" + (
                f"; inputs of {len(self.offloaded)} of {n} layers offloaded to host ({format_bytes(self.host_activation_bytes)})"
                if self.offloaded else "")),
            ("sequence tiling", "off" if self.tile_tokens is None else
             f"MLP in tiles of {self.tile_tokens} tokens (equal to untiled training up to summation order)"),
            ("layer + loss working set", format_bytes(self.work_bytes)),
            ("CUDA graphs", ("off" if not self.graphs else
             f"on: the layers narrows runs replay as graphs (pool {format_bytes(self.graph_bytes)})"
             if len(self.whole) < len(self.layer_bytes) else "on, but every layer runs whole (eager): no graphs")
             + (f" ({self.graphs_choice})" if self.graphs_choice else "")),
            ("predicted peak", format_bytes(self.predicted_peak)),
            ("host→device per step", format_bytes(self.h2d_bytes_per_step)),
        ]  # fmt: skip
        if self.d2h_bytes_per_step:
            rows.append(("device→host per step", format_bytes(self.d2h_bytes_per_step)))
        if self.predicted_host_bytes is not None:
            budget = "" if self.host_budget is None else f" (budget {format_bytes(self.host_budget)})"
            rows.append(("predicted host RSS", format_bytes(self.predicted_host_bytes) + budget))
            rows.append(("disk tier", f"{len(self.disk)} of {n} layers, {format_bytes(self.disk_bytes_per_step)} read per step"
                         if self.disk else "none: every layer pinned in host RAM"))  # fmt: skip
        w = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


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
    512 and 4096 tokens, 455 KB at 32B; this predicts 316 and 461.)"""
    tokens = s.batch * s.seq
    kept = tokens * (18 * s.hidden + 5 * s.intermediate) * s.act_bytes
    if s.eager_attention:
        kept += 2 * s.batch * s.heads * s.seq * s.seq * s.act_bytes
    return kept


def layer_work_bytes(s: Shapes, tile: int | None = None) -> int:
    """One layer's recompute and backward working set (see `work_bytes`)."""
    tokens = s.batch * s.seq
    mlp_tokens = tokens if tile is None else min(tokens, tile)
    layer = (tokens * 26 * s.hidden + mlp_tokens * 6 * s.intermediate) * s.act_bytes
    if s.eager_attention:
        layer += 2 * s.batch * s.heads * s.seq * s.seq * s.act_bytes
    return layer


GRAPH_WORKSPACE = 128 << 20  # cuBLAS workspaces of the capture stream, and the pool's rounding
GRAPH_ACTIVATIONS = 1.05  # the pool's intermediates, in layer working sets (`layer_work_bytes`)
GRAPH_DEQUANT = 1.6  # the pool's dequantised weights, in largest 4-bit weights


def graph_bytes(s: Shapes, tile: int | None = None, reserved: int = 0) -> int:
    """What CUDA graphs add to the peak: their shared pool holds the intermediates of one
    layer's forward graph and of one recompute-and-backward graph (not live at once, and
    the pool reuses their blocks), and — unless step mode holds them — the 4-bit weights
    each call dequantises, whose blocks the pool cannot fully reuse for one another; plus
    the capture stream's workspaces, plus the static buffers of the other batch shapes
    kept (hidden states in and out, and their gradients: four hidden-sized tensors each,
    at most the planned length). Held weights live in `reserved` room (step mode's
    reserve); where they are not held, that room is free for the pool's copies, so only
    what exceeds it is added.
    (Fitted above the H100 pools at the Qwen2.5 NF4 shapes, 512 tokens, one shape; GB
    measured / predicted, leaving out the other shapes' buffers. Weights dequantised per
    call: 0.375 / 0.57 at 7B, 0.730 / 0.91 at 32B, 1.281 / 1.33 at 72B. Held: 0.388 / 0.46
    at 32B, 0.505 / 0.55 at 72B. `test_plan_graphs.py` checks each.)"""
    other_shapes = (DEFAULT_SHAPES - 1) * 4 * input_bytes(s)
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
    tokens = s.batch * s.seq
    loss = s.loss_bytes if s.loss_bytes is not None else tokens * s.vocab * (2 * s.act_bytes + 4 + 4 + 2)
    return max(layer_work_bytes(s, tile), loss)


def spread(count: int, total: int) -> tuple[int, ...]:
    """`count` indices spread evenly over range(total)."""
    if count <= 0:
        return ()
    if count >= total:
        return tuple(range(total))
    return tuple(sorted({int((i + 0.5) * total / count) for i in range(count)}))


OFFLOAD_MODES = ("auto", "off", "all")
RECOMPUTE_MODES = ("auto", "all")
MIN_TILE = 512  # tokens: below this a tile's matmuls stop using the device well
DEFAULT_TILE = 2048  # the tile at the smallest footprint: its MLP working set is small beside the rest


def _page(n: int) -> int:
    return -(-n // 4096) * 4096


def tile_choices(tile: int | str | None, tokens: int, budget: int | None) -> list[int | None]:
    """Tile sizes to try, most preferred first: untiled unless asked; with "auto", untiled
    then powers of two downwards (the smallest footprint takes `DEFAULT_TILE`)."""
    if isinstance(tile, int):
        return [tile]  # asked for: a batch no longer than a tile runs as one tile anyway
    if tile != "auto":
        return [None]
    if budget is None:
        return [DEFAULT_TILE if tokens > DEFAULT_TILE else None]
    sizes, t = [], 1 << max(0, (tokens - 1).bit_length() - 1)  # the largest power of two below tokens
    while t >= MIN_TILE:
        sizes.append(t)
        t //= 2
    return [None, *sizes]


def make_plan(
    layer_bytes: Sequence[int],
    *,
    fixed_bytes: int,
    shapes: Shapes,
    budget: int | None,
    device: str,
    prefetch: int = 1,
    head_h2d_bytes: int = 0,
    disk: Sequence[int] = (),
    host_bytes: int | None = None,
    host_budget: int | None = None,
    offload: str = "auto",
    tile: int | str | None = None,
    recompute: str = "auto",
    rates: Rates | None = None,
    graphs: bool | str = False,
    reserved: int = 0,
    host_state: str = "none",
) -> Plan:
    """Decide residency for `budget` bytes of device memory (None: the smallest footprint).

    `head_h2d_bytes`: what a streamed LM head adds to the transfer per step. `disk`: the
    layers whose host copy is on disk; they are the first made resident, since a resident
    layer is read once instead of twice a step. `host_bytes`/`host_budget`: the host tiers'
    predicted footprint and its budget, for the report. `offload`: "auto" (saved inputs
    stay on the device while the budget allows), "off" (never offloaded) or "all".
    `tile`: None (never tiled), "auto" (tiled only when the budget needs it) or a tile
    size in tokens (always). `recompute`: "auto" (resident layers are kept whole while
    the budget allows) or "all" (every layer is recomputed in backward). `rates`: the
    machine's transfer and compute times for the step-time model (default: fitted).
    `graphs`: the layers narrows runs replay as CUDA graphs (their pool is counted, and
    they are priced without the host's per-kernel cost); "auto": on a CUDA device with a
    budget, the plan with graphs if it fits and its predicted step time is lower.
    `reserved`: how much of `fixed_bytes` the caller reserved (for the report).
    `host_state`: what of the training state `fixed_bytes` left in host memory (for the
    report and for `StepTrainer`, which must then keep it there)."""
    if graphs == "auto":
        return _either(dict(locals()))
    if not isinstance(graphs, bool):
        raise ValueError(f"graphs={graphs!r}: use True, False or 'auto'")
    if offload not in OFFLOAD_MODES:
        raise ValueError(f"offload={offload!r}: use one of {', '.join(OFFLOAD_MODES)}")
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute={recompute!r}: use one of {', '.join(RECOMPUTE_MODES)}")
    layer_bytes = tuple(layer_bytes)
    n = len(layer_bytes)
    slab = max(layer_bytes)
    a = input_bytes(shapes)
    tokens = shapes.batch * shapes.seq

    kept_whole = whole_bytes(shapes)

    def saved(kept: int, whole: int = 0) -> int:  # kept inputs, two offloaded ones in flight, whole layers
        return (kept - whole + min(2, n - kept)) * a + whole * kept_whole

    def pool(t: int | None, whole: int) -> int:  # the graphs' pool, while any layer is graphed
        return graph_bytes(shapes, t, reserved) if graphs and whole < n and device.startswith("cuda") else 0

    def footprint(resident: tuple[int, ...], slabs: int, kept: int, t: int | None, whole: int = 0) -> int:
        return (
            fixed_bytes
            + saved(kept, whole)
            + work_bytes(shapes, t)
            + pool(t, whole)
            + slabs * slab
            + sum(layer_bytes[i] for i in resident)
        )

    least_kept = n if offload == "off" else 0
    depth = prefetch
    choices = tile_choices(tile, tokens, budget)
    if budget is None:
        resident, prefetch, kept, t = (), max(prefetch, 0), least_kept, choices[0]
    elif footprint(tuple(range(n)), 0, 0 if offload == "all" else n, choices[0]) <= budget:
        resident, prefetch, kept, t = tuple(range(n)), 0, 0 if offload == "all" else n, choices[0]
    else:
        fitting = [c for c in choices if footprint((), 1, least_kept, c) <= budget]
        if not fitting:
            raise BudgetTooSmallError(_too_small(budget, footprint((), 1, least_kept, choices[-1]), slab, fixed_bytes,
                                                 saved(least_kept), work_bytes(shapes, choices[-1]), offload, tile,
                                                 footprint((), 1, 0, MIN_TILE) if tokens > MIN_TILE else None,
                                                 host_state))  # fmt: skip
        t = fitting[0]
        while prefetch > 0 and footprint((), prefetch + 1, least_kept, t) > budget:
            prefetch -= 1
        kept = least_kept
        if offload == "auto":
            while kept < n and footprint((), prefetch + 1, kept + 1, t) <= budget:
                kept += 1
        resident, depth = (), prefetch
    whole: tuple[int, ...] = ()
    if budget is not None:
        # residency against whole layers: each of the w whole layers (the last ones) is
        # resident too; the rest of the budget buys resident layers, spread. The mix with
        # the least predicted step time wins (ties: more resident).
        allow = recompute == "auto" and t is None and kept == n
        best = None
        for w in range(n + 1 if allow else 1):
            mix = _most_resident(w, n, disk, lambda r, w=w: footprint(r, depth + 1 if len(r) < n else 0,
                                                                        kept, t, w) <= budget)  # fmt: skip
            if mix is None:
                break
            key = (step_seconds(layer_bytes, shapes, len(mix), w, rates, graphs), -len(mix))
            if best is None or key < best[0]:
                best = key, mix, tuple(range(n - w, n))
        if best is not None:
            _, resident, whole = best
        prefetch = depth if len(resident) < n else 0
    streamed = [i for i in range(n) if i not in set(resident)]
    slabs = prefetch + 1 if streamed else 0
    offloaded = tuple(range(n - kept))  # the first layers: the last ones' backward comes first
    # each streamed layer is loaded for forward and again for backward, except the ones the
    # pool still holds at the turns: the last layers at forward→backward, the first layers
    # at backward→next forward (steady state of a training loop)
    held = min(slabs, len(streamed))
    kept_slabs = streamed[-held:] + streamed[:held] if held else []
    moved_out = len(offloaded) * a
    h2d = 2 * sum(layer_bytes[i] for i in streamed) - sum(layer_bytes[i] for i in kept_slabs) + head_h2d_bytes
    on_disk = set(disk)
    disk_read = 2 * sum(layer_bytes[i] for i in streamed if i in on_disk) - sum(
        layer_bytes[i] for i in kept_slabs if i in on_disk
    )
    host_act = len(offloaded) * _page(a)
    return Plan(
        device=device,
        budget=budget,
        layer_bytes=layer_bytes,
        resident=resident,
        pool_slabs=slabs,
        prefetch=prefetch if streamed else 0,
        fixed_bytes=fixed_bytes,
        activation_bytes=saved(kept, len(whole)),
        work_bytes=work_bytes(shapes, t),
        predicted_peak=footprint(resident, slabs, kept, t, len(whole)),
        h2d_bytes_per_step=h2d + moved_out,
        disk=tuple(sorted(on_disk)),
        disk_bytes_per_step=disk_read,
        predicted_host_bytes=None if host_bytes is None else host_bytes + host_act,
        host_budget=host_budget,
        offloaded=offloaded,
        host_activation_bytes=host_act,
        d2h_bytes_per_step=moved_out,
        tile_tokens=t,
        whole=whole,
        graphs=graphs,
        graph_bytes=pool(t, len(whole)),
        step_seconds=step_seconds(layer_bytes, shapes, len(resident), len(whole), rates, graphs),
        reserved_bytes=reserved,
        host_state=host_state,
        head_h2d_bytes=head_h2d_bytes,
    )


def _either(args: dict) -> Plan:
    """`make_plan(graphs="auto")`: the faster of the plans with and without graphs. Graphs
    need a CUDA device, and the smallest footprint (no budget) stays without their pool."""
    args["layer_bytes"] = tuple(args["layer_bytes"])  # read twice
    eager = make_plan(**{**args, "graphs": False})
    if args["budget"] is None or not str(args["device"]).startswith("cuda"):
        why = "no budget: the smallest footprint" if args["budget"] is None else "not a CUDA device"
        return replace(eager, graphs_choice=f"auto: {why}")
    try:
        graphed = make_plan(**{**args, "graphs": True})
    except BudgetTooSmallError:
        return replace(eager, graphs_choice="auto: their pool does not fit the budget")
    if graphed.tile_tokens != eager.tile_tokens:  # tiling changes the sums: not the planner's to trade
        return replace(
            eager, graphs_choice="auto: their pool would need sequence tiles the eager plan does not"
        )
    pick = graphed if graphed.step_seconds < eager.step_seconds else eager
    return replace(pick, graphs_choice=f"auto: predicted {graphed.step_seconds:.3g} s of layer time a step with "
                                       f"graphs, {eager.step_seconds:.3g} s without")  # fmt: skip


def _too_small(budget: int, minimum: int, slab: int, fixed: int, saved: int, work: int, offload: str,
               tile: int | str | None, tiled_minimum: int | None, host_state: str) -> str:  # fmt: skip
    hints = []
    if host_state != "adapters":
        hints.append("in step mode, keep the optimizer state (host_state='optimizer'; narrows finetune "
                     "--offload-optimizer) or the adapters too (host_state='adapters'; --offload-adapters) in host "
                     "memory")  # fmt: skip
    if offload == "off":
        hints.append("allow offloading the saved layer inputs to host memory (offload_inputs='auto')")
    if tile is None and tiled_minimum is not None and tiled_minimum < minimum:
        hints.append(f"tile the MLP over the sequence (seq_tile='auto'; equal to untiled training up to summation "
                     f"order), which needs {format_bytes(tiled_minimum)}")  # fmt: skip
    hints.append("shorten the sequence / batch (activations scale with both)")
    return (
        f"a GPU budget of {format_bytes(budget)} cannot hold the minimum of {format_bytes(minimum)}: "
        f"one streamed layer ({format_bytes(slab)}), fixed costs ({format_bytes(fixed)}: head, norm, "
        f"adapters with gradients and optimizer state{HOST_STATE_NOTES[host_state]}), saved activations ({format_bytes(saved)}) and the working set ({format_bytes(work)}). "
        f"Give at least {format_bytes(minimum)}, or " + ", or ".join(hints) + "."
    )


def _most_resident(whole: int, n: int, disk: Sequence[int], fits) -> tuple[int, ...] | None:
    """The largest resident set holding the last `whole` layers that `fits` (None if even
    those alone do not): the whole layers plus resident layers chosen among the others."""
    tail = tuple(range(n - whole, n))
    if fits(tuple(range(n))):
        return tuple(range(n))  # no streamed layer left: no device slabs either
    if not fits(tail):
        return None
    head_disk = [i for i in disk if i < n - whole]  # disk layers among the ones not whole
    lo, hi = 0, n - whole - 1  # binary search: below all-resident, fits() is monotone
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(_choose(mid, n - whole, head_disk) + tail):
            lo = mid
        else:
            hi = mid - 1
    return _choose(lo, n - whole, head_disk) + tail


# The step-time model that ranks plans (not a prediction the report shows): fitted to the
# H100 (PCIe gen5, bitsandbytes-style NF4 dequantisation per forward) at the Qwen2.5 shapes.
H2D_RATE = 40e9  # bytes/s host→device from pinned memory (measured 35–55)
MATMUL_RATE = 400e12  # flop/s a layer's matmuls reach at a few thousand tokens
DEQUANT_RATE = 500e9  # parameters/s the device dequantises NF4 weights at, per use
HOST_RATE = 65e9  # parameters/s: an eager NF4 layer's forward on the host (its per-kernel
# launches; the batch-1 floor), which graph replays do not pay


@dataclass(frozen=True)
class Rates:
    """What the step-time model takes for the machine: the fitted defaults, or what a
    profile measured (`narrows.stream.Profile.rates`)."""

    h2d: float = H2D_RATE  # bytes/s host→device
    forward_s: float | None = None  # one layer's forward; None: from the matmul and dequantisation rates
    graphed: bool = False  # forward_s was measured on graph replays


def layer_seconds(
    nbytes: int, s: Shapes, rates: Rates | None = None, graphed: bool = False
) -> tuple[float, float]:
    """One layer's forward compute time (eager, or replayed as a CUDA graph) and one
    host→device copy of it, predicted. A measured forward replaces the model's figure for
    the way it was measured; the other way is scaled by the model's ratio."""
    rates = rates or Rates()
    params = 4 * s.hidden * s.hidden + 3 * s.hidden * s.intermediate
    matmul = 2 * s.batch * s.seq * params / MATMUL_RATE
    quantised = nbytes < params  # below a byte per parameter: dequantised on every use
    graph = matmul + (params / DEQUANT_RATE if quantised else 0.0)  # what the device does
    eager = max(graph, params / HOST_RATE) if quantised else graph  # or the host, if slower
    compute = graph if graphed else eager
    if rates.forward_s is not None:
        compute = rates.forward_s * compute / (graph if rates.graphed else eager)
    return compute, nbytes / rates.h2d


def dequant_seconds(nbytes: int, s: Shapes) -> float:
    """One dequantisation of a 4-bit layer's weights (0 for a float layer)."""
    params = 4 * s.hidden * s.hidden + 3 * s.hidden * s.intermediate
    return params / DEQUANT_RATE if nbytes < params else 0.0


def step_seconds(layer_bytes: Sequence[int], s: Shapes, resident: int, whole: int,
                 rates: Rates | None = None, graphs: bool = False, *, micro_batches: int = 1,
                 block_major: bool = False, held: bool = False) -> float:  # fmt: skip
    """Predicted time of one step's layers with `resident` resident layers of which
    `whole` run without recompute: forward, backward (twice the forward), the recompute
    of every other layer, and what a streamed layer's copies cannot hide — behind the
    previous layer's forward, and behind the next layer's backward and recompute. With
    `graphs` the layers narrows runs (all but the whole ones) are priced as graph replays;
    whole layers run eagerly either way. Over `micro_batches`: sequential accumulation
    copies each streamed layer twice per micro-batch; `block_major` (step mode) twice a
    step, each copy behind the compute of every micro-batch, and every layer recomputed
    (step mode keeps no layer whole). `held` (block-major only): each layer's 4-bit weights
    are dequantised once per pass for all micro-batches (`narrows.core.HeldWeights`)
    instead of three times per micro-batch (forward, recompute, input gradient)."""
    n = len(layer_bytes)
    whole = 0 if block_major else whole
    eager, c = layer_seconds(max(layer_bytes), s, rates)
    f = layer_seconds(max(layer_bytes), s, rates, graphed=True)[0] if graphs else eager
    behind = micro_batches if block_major else 1  # micro-batches' compute one copy hides behind
    exposed = max(0.0, c - behind * f) + max(0.0, c - 3 * behind * f)
    copies = 1 if block_major else micro_batches
    compute = micro_batches * (whole * 3 * eager + (n - whole) * 4 * f)
    if block_major and held:  # three per micro-batch (forward, recompute, input gradient) become two a step
        d = min(f, dequant_seconds(max(layer_bytes), s))
        compute -= n * (3 * micro_batches - 2) * d
    return compute + copies * (n - resident) * exposed


def _choose(count: int, n: int, disk: Sequence[int]) -> tuple[int, ...]:
    """`count` resident layers: disk-tier layers first (spread among them), then the rest."""
    disk = sorted(disk)
    if count <= len(disk):
        return tuple(sorted(disk[i] for i in spread(count, len(disk))))
    others = [i for i in range(n) if i not in set(disk)]
    return tuple(sorted(disk + [others[i] for i in spread(count - len(disk), len(others))]))
