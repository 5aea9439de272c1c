"""The residency decisions for a device budget: resident and whole layers, prefetch slabs,
offloaded inputs, sequence tiles and CUDA graphs — and the expected peak and transfer.

The budget always holds the fixed costs; the minimum is one device slab with every saved
input offloaded (and tiles only when asked for and still needed). Options arrive
validated (`StreamConfig`); `make_plan` does not check them again.

why: docs/design.md#residency
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from narrows.core import format_bytes

from ..config import DEFAULT_SHAPES
from ..errors import BudgetTooSmallError
from .memory import (
    GRAPH_MIXED,
    Shapes,
    graph_bytes,
    input_bytes,
    loss_work_bytes,
    whole_bytes,
    whole_overlap_bytes,
    work_bytes,
)
from .placement import most_resident
from .record import HOST_STATE_NOTES, Plan
from .steptime import Rates, step_seconds

__all__ = ["DEFAULT_TILE", "MIN_TILE", "make_plan", "tile_choices"]


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
    in_flight: int = 1,
    eager_beside_graphs: bool = True,
) -> Plan:
    """Decide residency for `budget` bytes of device memory (None: the smallest footprint).

    `offload`, `tile`, `recompute` and `graphs` take `StreamConfig`'s values; `disk`: layers
    whose host copy is on disk (made resident first); `head_h2d_bytes`: a streamed head's
    transfer per step; `rates`: the step-time model's (default: fitted); `host_bytes`,
    `host_budget`, `reserved`, `host_state`: carried into the plan's report (`host_state` also
    for `StepTrainer`, which must keep that state in host memory); `in_flight`: micro-batches
    whose saved activations a pipeline stage keeps at once (each its own; one working set);
    `eager_beside_graphs`: `StreamConfig`'s (False counts for fast layers, one in flight).

    why: docs/design.md#residency
    """
    if graphs == "auto":
        return _either(dict(locals()))
    layer_bytes = tuple(layer_bytes)
    n = len(layer_bytes)
    graphed = bool(graphs) and device.startswith("cuda")
    alone = not eager_beside_graphs and shapes.fast and in_flight == 1
    cost = _Footprint(layer_bytes, fixed_bytes, shapes, graphed, reserved, in_flight, alone)
    if budget is None:  # the smallest footprint: one slab beyond the prefetch, every input offloaded allowed
        t = tile_choices(tile, shapes.batch * shapes.seq, None)[0]
        resident, depth, kept = (), max(prefetch, 0), n if offload == "off" else 0
    else:
        resident, depth, kept, t = _floor(cost, budget, prefetch, offload, tile, host_state)
    whole: tuple[int, ...] = ()
    if budget is not None:
        resident, whole = _mix(cost, budget, resident, depth, kept, t, recompute, disk, rates, graphs)
        prefetch = depth if len(resident) < n else 0
    else:
        prefetch = depth
    streamed = [i for i in range(n) if i not in set(resident)]
    slabs = prefetch + 1 if streamed else 0
    offloaded = tuple(range(n - kept))  # the first layers: the last ones' backward comes first
    moved = _transfers(layer_bytes, streamed, slabs, disk, len(offloaded) * input_bytes(shapes))
    host_act = len(offloaded) * _page(input_bytes(shapes))
    return Plan(
        device=device,
        budget=budget,
        layer_bytes=layer_bytes,
        resident=resident,
        pool_slabs=slabs,
        prefetch=prefetch if streamed else 0,
        fixed_bytes=fixed_bytes,
        activation_bytes=cost.saved(kept, len(whole), cost.apart(t, len(whole))),
        work_bytes=work_bytes(shapes, t),
        predicted_peak=cost.peak(resident, slabs, kept, t, len(whole)),
        h2d_bytes_per_step=moved.h2d + head_h2d_bytes + moved.d2h,
        disk=tuple(sorted(set(disk))),
        disk_bytes_per_step=moved.disk,
        predicted_host_bytes=None if host_bytes is None else host_bytes + host_act,
        host_budget=host_budget,
        offloaded=offloaded,
        host_activation_bytes=host_act,
        d2h_bytes_per_step=moved.d2h,
        tile_tokens=t,
        whole=whole,
        graphs=graphs,
        graph_bytes=cost.pool(t, len(whole)),
        graph_peak_bytes=cost.pool_part(t, len(whole)),
        step_seconds=step_seconds(layer_bytes, shapes, len(resident), len(whole), rates, graphs),
        reserved_bytes=reserved,
        host_state=host_state,
        head_h2d_bytes=head_h2d_bytes,
    )


@dataclass(frozen=True)
class _Footprint:
    """The device peak of a candidate plan, from the memory formulas."""

    layer_bytes: tuple[int, ...]
    fixed: int
    shapes: Shapes
    graphed: bool  # graphs asked for on a CUDA device: their pool counts while any layer is graphed
    reserved: int
    in_flight: int = 1  # micro-batches whose saved activations are kept at once (a pipeline stage's)
    alone: bool = False  # no layer runs eagerly beside the graphs' pool (`StreamConfig.eager_beside_graphs`)

    @property
    def n(self) -> int:
        return len(self.layer_bytes)

    @property
    def slab(self) -> int:
        return max(self.layer_bytes)

    def saved(self, kept: int, whole: int = 0, apart: bool = False) -> int:
        """Kept inputs, two offloaded ones in flight, and whole layers' activations (less
        what the last whole layer and the working set never hold at once, unless they lie
        `apart`), for each micro-batch in flight."""
        a = input_bytes(self.shapes)
        overlap = whole_overlap_bytes(self.shapes) if whole and not apart else 0
        one = (kept - whole + min(2, self.n - kept)) * a + whole * whole_bytes(self.shapes) - overlap
        return self.in_flight * one

    def pool(self, t: int | None, whole: int) -> int:
        """The graphs' pool, while any layer is graphed (fast layers are, whole ones too):
        one batch shape's where nothing runs beside it (`alone`); where fast whole layers
        and recomputed ones both replay, the whole states lie among the recompute graphs'
        scratch, and the pool grows by `GRAPH_MIXED` of a whole layer's keep (on one H200 at
        Qwen3-30B-A3B's shape, 6 layers, 8 × 512 tokens, one whole layer of six: the main
        job peaked at 4.91 GiB against 4.80 priced without it, 4.95 with it)."""
        graphed = self.graphed and (whole < self.n or self.shapes.fast)
        if not graphed:
            return 0
        pool = graph_bytes(self.shapes, t, self.reserved, 1 if self.alone else DEFAULT_SHAPES)
        if self.shapes.fast and 0 < whole < self.n:
            pool += int(GRAPH_MIXED * whole_bytes(self.shapes))
        return pool

    def apart(self, t: int | None, whole: int) -> bool:
        """Whether the layers' working sets lie in the graphs' pool, apart from what whole
        layers keep (there, allocated): graphs, and no layer run eagerly beside them."""
        return self.alone and self.pool(t, whole) > 0

    def pool_part(self, t: int | None, whole: int) -> int:
        """What the graphs' pool adds to the peak beside the working set. Where no layer
        runs eagerly beside it (`alone`), the layers' working sets lie in it and beside it
        only the loss's: the pool less the working set it takes in. The first step, before
        any capture, runs eagerly without it: the working set stays counted."""
        pool = self.pool(t, whole)
        if not (self.alone and pool):
            return pool
        return max(0, pool + loss_work_bytes(self.shapes) - work_bytes(self.shapes, t))

    def peak(self, resident: tuple[int, ...], slabs: int, kept: int, t: int | None, whole: int = 0) -> int:
        return (
            self.fixed
            + self.saved(kept, whole, self.apart(t, whole))
            + work_bytes(self.shapes, t)
            + self.pool_part(t, whole)
            + slabs * self.slab
            + sum(self.layer_bytes[i] for i in resident)
        )


def _floor(
    cost: _Footprint, budget: int, prefetch: int, offload: str, tile: int | str | None, host_state: str
) -> tuple[tuple[int, ...], int, int, int | None]:
    """``(resident, prefetch depth, kept inputs, tile)`` before the residency mix: every layer
    resident if all fits; else the minimum (one slab, the inputs offloaded as allowed, the
    largest tile that fits), then prefetch slabs and kept inputs as the budget allows.
    Raises `BudgetTooSmallError` with what to change when even the minimum does not fit."""
    n, shapes = cost.n, cost.shapes
    tokens = shapes.batch * shapes.seq
    least_kept = n if offload == "off" else 0
    choices = tile_choices(tile, tokens, budget)
    if cost.peak(tuple(range(n)), 0, 0 if offload == "all" else n, choices[0]) <= budget:
        return tuple(range(n)), prefetch, 0 if offload == "all" else n, choices[0]
    fitting = [c for c in choices if cost.peak((), 1, least_kept, c) <= budget]
    if not fitting:
        raise BudgetTooSmallError(
            _too_small(
                budget,
                cost.peak((), 1, least_kept, choices[-1]),
                cost.slab,
                cost.fixed,
                cost.saved(least_kept),
                work_bytes(shapes, choices[-1]),
                offload,
                tile,
                cost.peak((), 1, 0, MIN_TILE) if tokens > MIN_TILE else None,
                host_state,
                cost.pool_part(choices[-1], 0),
            )
        )
    t = fitting[0]
    while prefetch > 0 and cost.peak((), prefetch + 1, least_kept, t) > budget:
        prefetch -= 1
    kept = least_kept
    if offload == "auto":
        while kept < n and cost.peak((), prefetch + 1, kept + 1, t) <= budget:
            kept += 1
    return (), prefetch, kept, t


def _mix(
    cost: _Footprint,
    budget: int,
    resident: tuple[int, ...],
    depth: int,
    kept: int,
    t: int | None,
    recompute: str,
    disk: Sequence[int],
    rates: Rates | None,
    graphs: bool,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(resident, whole)``: residency against whole layers. Each of the w whole layers (the
    last ones) is resident too; the rest of the budget buys resident layers, spread. The
    mix with the least predicted step time wins (ties: more resident)."""
    n = cost.n
    allow = recompute == "auto" and t is None and kept == n
    best = None
    for w in range(n + 1 if allow else 1):
        mix = most_resident(
            w, n, disk, lambda r, w=w: cost.peak(r, depth + 1 if len(r) < n else 0, kept, t, w) <= budget
        )
        if mix is None:
            break
        key = (step_seconds(cost.layer_bytes, cost.shapes, len(mix), w, rates, graphs), -len(mix))
        if best is None or key < best[0]:
            best = key, mix, tuple(range(n - w, n))
    if best is None:
        return resident, ()
    return best[1], best[2]


@dataclass(frozen=True)
class _Moved:
    h2d: int  # frozen layers copied to the device a step
    disk: int  # of them, read from the disk tier
    d2h: int  # saved inputs offloaded to host memory (and copied back: counted in h2d too)


def _transfers(
    layer_bytes: tuple[int, ...], streamed: list[int], slabs: int, disk: Sequence[int], moved_out: int
) -> _Moved:
    """Each streamed layer is loaded for forward and again for backward, except the ones
    the pool still holds at the turns: the last layers at forward→backward, the first
    layers at backward→next forward (steady state of a training loop)."""
    held = min(slabs, len(streamed))
    kept_slabs = streamed[-held:] + streamed[:held] if held else []
    on_disk = set(disk)
    h2d = 2 * sum(layer_bytes[i] for i in streamed) - sum(layer_bytes[i] for i in kept_slabs)
    disk_read = 2 * sum(layer_bytes[i] for i in streamed if i in on_disk) - sum(
        layer_bytes[i] for i in kept_slabs if i in on_disk
    )
    return _Moved(h2d, disk_read, moved_out)


def _either(args: dict) -> Plan:
    """`make_plan(graphs="auto")`: the faster of the plans with and without graphs. Graphs
    need a CUDA device, and the smallest footprint (no budget) stays without their pool.

    The step-time model decides. A mixture of experts' fast layers are launch-bound on
    the host when eager (`steptime.MOE_HOST_SECONDS`), so there graphs win unless their pool
    streams layers whose copies the compute cannot hide. On one H200 at Qwen3-30B-A3B's
    shape, 6 layers, 8 × 512 tokens, the main job in one call: at `4.25GiB` graphs with 3
    layers resident 0.066 s a step (3.92 GiB) against 0.077 eagerly with all 6 (4.04 GiB),
    Unsloth 0.064 (4.27 GiB); at `4.6GiB` graphs with all 6 resident 0.066 s (4.22 GiB). Graphs
    that streamed every layer from one or two slabs (an earlier pricing of the pool) took
    0.127 and 0.086 s against 0.089 and 0.082 eagerly: the model prices those copies exposed."""
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
    return replace(
        pick,
        graphs_choice=f"auto: predicted {graphed.step_seconds:.3g} s of layer time a step with "
        f"graphs, {eager.step_seconds:.3g} s without",
    )


def _too_small(
    budget: int,
    minimum: int,
    slab: int,
    fixed: int,
    saved: int,
    work: int,
    offload: str,
    tile: int | str | None,
    tiled_minimum: int | None,
    host_state: str,
    pool: int = 0,
) -> str:
    hints = []
    if pool:
        hints.append(
            "run the layers without CUDA graphs (graphs=False; narrows finetune --no-cuda-graphs), which "
            f"leaves out their pool ({format_bytes(pool)})"
        )
    if host_state != "adapters":
        hints.append(
            "in step mode, keep the optimizer state (host_state='optimizer'; narrows finetune "
            "--offload-optimizer) or the adapters too (host_state='adapters'; --offload-adapters) in host "
            "memory"
        )
    if offload == "off":
        hints.append("allow offloading the saved layer inputs to host memory (offload_inputs='auto')")
    if tile is None and tiled_minimum is not None and tiled_minimum < minimum:
        hints.append(
            f"tile the MLP over the sequence (seq_tile='auto'; equal to untiled training up to summation "
            f"order), which needs {format_bytes(tiled_minimum)}"
        )
    hints.append("shorten the sequence / batch (activations scale with both)")
    return (
        f"a GPU budget of {format_bytes(budget)} cannot hold the minimum of {format_bytes(minimum)}: "
        f"one streamed layer ({format_bytes(slab)}), fixed costs ({format_bytes(fixed)}: head, norm, "
        f"adapters with gradients and optimizer state{HOST_STATE_NOTES[host_state]}; over several ranks, DDP's "
        f"gradient buckets), saved activations ({format_bytes(saved)}), the working set ({format_bytes(work)})"
        + (f" and what the CUDA graphs' pool adds ({format_bytes(pool)})" if pool else "")
        + f". Give at least {format_bytes(minimum)}, or "
        + ", or ".join(hints)
        + "."
    )
