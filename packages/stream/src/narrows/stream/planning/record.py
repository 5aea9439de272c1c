"""`Plan`: every decision the planner made for one streamed model, with its reasons, and
how it reads (``print(plan)``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from narrows.core import format_bytes

__all__ = ["HOST_STATE_NOTES", "Plan"]

# what of the training state (adapters, their gradients, the optimizer's) step mode keeps
# in host memory, and how the plan's report says it
HOST_STATE_NOTES = {
    "none": "",
    "optimizer": "; the optimizer's state in host memory, one layer's on the device",
    "adapters": "; adapters and optimizer state in host memory, one layer's at a time on the device",
}


@dataclass(frozen=True)
class Plan:
    """What `narrows.stream.plan` decided, each choice with its reason where there was one;
    `stream` applies it and `StepTrainer` reads it."""

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
    graph_bytes: int = 0  # the graphs' scratch pool and capture workspaces
    # what the pool adds to the peak beside `work_bytes`: all of it, unless no layer runs eagerly
    # beside it (`StreamConfig.eager_beside_graphs` False): then it holds the layers' working sets
    graph_peak_bytes: int = 0
    step_seconds: float = 0.0  # the step-time model's figure for the layers (ranks plans; not a promise)
    graphs_choice: str = ""  # with graphs="auto": why they are on or off
    reserved_bytes: int = 0  # left free in the budget for the caller (step mode's held weights); in the peak
    host_state: str = "none"  # what of the training state waits in host memory (step mode's offload)
    head_h2d_bytes: int = 0  # a streamed LM head's two passes (forward, backward) of one micro-batch
    grad_accum: int = 1  # micro-batches a step the accumulation was decided for
    accumulation: str = "sequential"  # or "block-major" (`StepTrainer`)
    accumulation_choice: str = ""  # why, as `choose_step_mode` (or the config) said
    held_weights: bool = (
        False  # 4-bit weights dequantised once and held: through a block-major pass, or a backward
    )
    held_choice: str = ""  # why (`holds_weights`)
    kept_attention: tuple[int, ...] = ()  # fast layers whose attention waits in host memory for the backward
    attention_host_bytes: int = 0  # the host memory that takes (page-locked on CUDA)
    attention_choice: str = ""  # why (`attention.keep_attention`)
    ranks: int = 1  # data-parallel ranks the plan was made under (their gradient buckets in fixed_bytes)
    data_parallel_bytes: int = 0  # DDP's buckets and one gathered bucket (`narrows.core.data_parallel_bytes`)

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
            (
                "layers",
                f"{n} ({format_bytes(sum(self.layer_bytes))} frozen, largest {format_bytes(max(self.layer_bytes))})",
            ),
            (
                "resident layers",
                f"{len(self.resident)} of {n}"
                + (f": {list(self.resident)}" if 0 < len(self.resident) < n else ""),
            ),
            (
                "kept whole",
                f"{len(self.whole)} of {n} layers run without recompute"
                + (f": {list(self.whole)}" if 0 < len(self.whole) < n else ""),
            ),
            ("device slabs", f"{self.pool_slabs} (prefetch depth {self.prefetch})"),
            (
                "fixed on device",
                format_bytes(self.fixed_bytes)
                + (
                    f" (of which {format_bytes(self.reserved_bytes)} reserved: held weights, kept attention in flight, step mode's room, or the caller's)"
                    if self.reserved_bytes
                    else ""
                )
                + HOST_STATE_NOTES[self.host_state]
                + (
                    f"; {format_bytes(self.data_parallel_bytes)} of it DDP's gradient buckets over {self.ranks} ranks"
                    if self.ranks > 1
                    else ""
                ),
            ),
            (
                "saved activations",
                f"{format_bytes(self.activation_bytes)} on the device"
                + (
                    f"; inputs of {len(self.offloaded)} of {n} layers offloaded to host ({format_bytes(self.host_activation_bytes)})"
                    if self.offloaded
                    else ""
                ),
            ),
            (
                "sequence tiling",
                "off"
                if self.tile_tokens is None
                else f"MLP in tiles of {self.tile_tokens} tokens (equal to untiled training up to summation order)",
            ),
            ("layer + loss working set", format_bytes(self.work_bytes)),
            (
                "CUDA graphs",
                (
                    "off"
                    if not self.graphs
                    else f"on: the layers narrows runs replay as graphs (pool {format_bytes(self.graph_bytes)})"
                    if self.graph_bytes
                    else "on, but every layer runs whole (eager): no graphs"
                )
                + (f" ({self.graphs_choice})" if self.graphs_choice else ""),
            ),
            ("predicted peak", format_bytes(self.predicted_peak)),
            ("host→device per step", format_bytes(self.h2d_bytes_per_step)),
        ]
        if self.grad_accum > 1:
            rows.append(("accumulation", self.accumulation_choice or self.accumulation))
        if self.held_choice:
            rows.append(("held 4-bit weights", self.held_choice))
        if self.attention_choice:
            rows.append(("kept attention", self.attention_choice))
        if self.d2h_bytes_per_step:
            rows.append(("device→host per step", format_bytes(self.d2h_bytes_per_step)))
        if self.predicted_host_bytes is not None:
            budget = "" if self.host_budget is None else f" (budget {format_bytes(self.host_budget)})"
            rows.append(("predicted host RSS", format_bytes(self.predicted_host_bytes) + budget))
            rows.append(
                (
                    "disk tier",
                    f"{len(self.disk)} of {n} layers, {format_bytes(self.disk_bytes_per_step)} read per step"
                    if self.disk
                    else "none: every layer pinned in host RAM",
                )
            )
        w = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)
