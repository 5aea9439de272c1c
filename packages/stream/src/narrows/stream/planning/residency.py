"""The residency decisions: given a device budget, which decoder layers stay on the
device for good (and which of those run whole), how many device slabs to prefetch into,
which saved inputs go to host memory, whether the MLP runs in sequence tiles and whether
the layers replay as CUDA graphs — and what peak and transfer to expect.

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
time its neighbours' compute cannot hide. The step-time model (`steptime.step_seconds`)
picks the mix. Whole layers are the last layers: the streamed layer before them is still
in its device slab when backward turns, so no copy has to be started from inside their
plain autograd backward. With every layer whole a step is plain PEFT training without
checkpointing.

With CUDA graphs (`graphs=True`) the layers narrows runs itself (streamed, or resident and
recomputed) replay as graphs: the budget also holds the graphs' scratch pool, and the
step-time model prices those layers without the host's per-kernel cost, so at short
sequences a graphed recompute beats an eager whole layer and the planner picks it.

The options arrive validated (`narrows.stream.StreamConfig`); `make_plan` does not check
them again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from narrows.core import format_bytes

from ..errors import BudgetTooSmallError
from .memory import Shapes, graph_bytes, input_bytes, whole_bytes, work_bytes
from .record import HOST_STATE_NOTES, Plan
from .steptime import Rates, step_seconds

__all__ = ["DEFAULT_TILE", "MIN_TILE", "make_plan", "spread", "tile_choices"]


def spread(count: int, total: int) -> tuple[int, ...]:
    """`count` indices spread evenly over range(total)."""
    if count <= 0:
        return ()
    if count >= total:
        return tuple(range(total))
    return tuple(sorted({int((i + 0.5) * total / count) for i in range(count)}))


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


def _choose(count: int, n: int, disk: Sequence[int]) -> tuple[int, ...]:
    """`count` resident layers: disk-tier layers first (spread among them), then the rest."""
    disk = sorted(disk)
    if count <= len(disk):
        return tuple(sorted(disk[i] for i in spread(count, len(disk))))
    others = [i for i in range(n) if i not in set(disk)]
    return tuple(sorted(disk + [others[i] for i in spread(count - len(disk), len(others))]))
