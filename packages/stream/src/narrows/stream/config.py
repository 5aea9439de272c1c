"""`StreamConfig`: everything a user may set about streaming a model, in one frozen
object, validated once here, each refusal naming its field.

Every mode defaults to "the planner decides" (``"auto"``) where the planner can decide;
`stream` and `plan` take a config or the same settings as keywords, which become one here.

why: docs/design.md#streamconfig
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from narrows.core import parse_bytes
from narrows.core.protocol import compose

from .errors import StreamSetupError

__all__ = ["DEFAULT_SHAPES", "HOST_STATES", "OFFLOAD_INPUTS", "RECOMPUTE", "StreamConfig"]

OFFLOAD_INPUTS = ("auto", "off", "all")
RECOMPUTE = ("auto", "all")
HOST_STATES = ("none", "optimizer", "adapters")
HEADS = ("resident", "stream")
KERNELS = ("peft", "fast")
BUDGET_WORDS = ("fit", "min")

DEFAULT_SHAPES = 4  # batch shapes whose CUDA graphs are kept at once (the plan counts their buffers)

# keywords the API took before the config had names of its own: old name -> field
RENAMED = {"offload": "offload_inputs", "prefetch": "prefetch_depth"}


@dataclass(frozen=True)
class StreamConfig:
    """What `narrows.stream.stream` may be told; each field's comment gives its values.

    Guarantees per setting: `offload_inputs`, `recompute`, `graphs`, `keep_attention`,
    `hold_weights`, `step_mode` and `host_state` never change the numbers (bit-identical to
    resident training); `head="stream"` equals the resident head up to summation order
    (bit-exact against the same chunked head resident); `seq_tile` is `torch.equal` to the same
    tiling resident and equal to untiled up to summation order — None never tiles, "auto"
    tiles only when the budget needs it, a number of tokens always tiles. `inference=True`
    trains nothing (no self-check, no graphs). `reserve`: device bytes left free in the budget.

    why: docs/design.md#streamconfig
    """

    # budget and the batch the plan sizes activations for
    gpu_budget: int | str | None = (
        None  # bytes or "12GiB"; "fit": what the device has free; None/"min": smallest
    )
    device: Any = None  # torch.device or its name; None: CUDA when there is one, else the CPU
    batch_size: int = 1
    seq_len: int = 512
    # residency of the frozen weights
    prefetch_depth: int = (
        1  # layers whose copy runs ahead of the compute (device slabs beyond the one in use)
    )
    head: str = "resident"  # "stream": a frozen LM head served from host memory in vocabulary chunks
    head_rows: int | None = None  # vocabulary rows per chunk of a streamed head (None: 8192)
    # activations
    offload_inputs: str = (
        "auto"  # saved layer inputs to host memory: "auto" (as the budget needs), "off", "all"
    )
    seq_tile: int | str | None = (
        None  # the MLP in sequence tiles: None (never), "auto" (as the budget needs), tokens
    )
    recompute: str = (
        "auto"  # "auto": resident layers run whole while the budget holds them; "all": recompute every one
    )
    graphs: bool | str = (
        "auto"  # CUDA graphs of the layers narrows runs: True, False, "auto" (where predicted faster)
    )
    # room in the plan for a layer run eagerly while the graphs' pool is held (a batch shape not yet
    # captured, a forward without gradients); False where none comes: every training batch of one
    # shape, and passes without gradients inside `graphs.released()`, as `narrows finetune --packing` runs
    eager_beside_graphs: bool = True
    kernels: str = "fast"  # "fast": narrows.core's fast layers where they cover a layer (twin: fuse_layers); "peft": PEFT's
    # the fast layers' adapter arithmetic: None (the activations' dtype) or "float32" (PEFT's); stream fuses
    # the layers itself with this (a model fused before with another lora_dtype takes this one)
    lora_dtype: str | None = None
    # accumulation and step mode (`StepTrainer`)
    grad_accum: int = 1  # micro-batches a step: with 2 or more the plan weighs block-major steps
    step_mode: bool | str = "auto"  # block-major accumulation: True, False, "auto" (where predicted faster)
    hold_weights: bool | str = (
        "auto"  # step mode dequantises 4-bit weights once per pass: True, False, "auto"
    )
    host_state: str = "none"  # training state in host memory: "none", "optimizer", "adapters"
    world_size: int = 1  # data-parallel ranks (step mode trains in one process)
    reserve: int = 0  # device bytes the plan leaves free in the budget, for the caller
    # a pipeline stage (`pipeline_stage` sets these): micro-batches whose saved activations it keeps at
    # once, whether it computes the loss (the last stage), and the boundary tensors (layer-input sized)
    # the schedule keeps for its sends and receives
    in_flight: int = 1
    computes_loss: bool = True
    stage_buffers: int = 0
    keep_attention: bool | str = (
        "auto"  # fast layers' attention kept from forward to backward in host memory: True, False, "auto"
    )
    # the run
    check: bool = True  # a one-layer streamed-vs-resident self-check before training
    inference: bool = False  # forward passes only (evaluation): nothing trains
    deterministic: bool = False  # deterministic kernels (on CUDA, the condition for bit-identical)

    def __post_init__(self) -> None:
        _check(self)

    @classmethod
    def of(cls, config: StreamConfig | int | str | None = None, /, **options: Any) -> StreamConfig:
        """A config from what a caller gave: a `StreamConfig` (with `options` replacing
        fields of it), or a budget and fields as keywords. The names the API used
        before (``offload``, ``prefetch``) are taken for their fields."""
        for old, new in RENAMED.items():
            if old in options:
                if new in options:
                    raise StreamSetupError(f"{old}= and {new}= name the same setting: give {new}= alone")
                options[new] = options.pop(old)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise StreamSetupError(
                f"unknown stream setting{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}: "
                f"StreamConfig takes {', '.join(sorted(known))}"
            )
        if isinstance(config, StreamConfig):
            return replace(config, **options) if options else config
        if "gpu_budget" in options and config is not None:
            raise StreamSetupError("the budget is given twice: positionally and as gpu_budget=")
        if config is not None:
            options["gpu_budget"] = config
        return cls(**options)

    def replace(self, **options: Any) -> StreamConfig:
        """This config with some fields changed (validated again)."""
        return StreamConfig.of(self, **options)


def _whole(value: object, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _choice(config: StreamConfig, name: str, choices: tuple[str, ...], meaning: str) -> None:
    value = getattr(config, name)
    if value not in choices:
        raise StreamSetupError(f"{name}={value!r}: use {' or '.join(map(repr, choices))} ({meaning})")


def _check(c: StreamConfig) -> None:
    """Every field's value, refused with its name and what to give instead."""
    budget = c.gpu_budget
    if budget is not None and budget not in BUDGET_WORDS:
        try:
            parse_bytes(budget)
        except (ValueError, TypeError) as e:
            raise StreamSetupError(
                f"gpu_budget={budget!r}: {e}; or 'fit', or None for the smallest footprint"
            ) from None
    for name, least in (("batch_size", 1), ("seq_len", 1), ("prefetch_depth", 0)):
        if not _whole(getattr(c, name), least):
            raise StreamSetupError(f"{name}={getattr(c, name)!r}: give a whole number ≥ {least}")
    if c.head_rows is not None and not _whole(c.head_rows, 1):
        raise StreamSetupError(
            f"head_rows={c.head_rows!r}: give a whole number of vocabulary rows ≥ 1, or None"
        )
    _choice(c, "head", HEADS, "'resident' is bit-exact; 'stream' serves a frozen head in vocabulary chunks")
    _choice(
        c,
        "offload_inputs",
        OFFLOAD_INPUTS,
        "'auto', the default, moves saved layer inputs to host memory only when the budget needs it",
    )
    _choice(
        c,
        "recompute",
        RECOMPUTE,
        "'auto', the default: resident layers run without recompute while the budget holds their activations",
    )
    if not (c.seq_tile is None or c.seq_tile in ("off", "auto") or _whole(c.seq_tile, 1)):
        raise StreamSetupError(
            f"seq_tile={c.seq_tile!r}: use None (default: never tile), 'auto' (tile the MLP over "
            "the sequence only when the budget needs it) or a tile size in tokens, e.g. 4096"
        )
    _choice(
        c,
        "kernels",
        KERNELS,
        "'peft' trains PEFT's bits; 'fast' the bits of narrows.core.fuse_layers on a "
        "resident model (Llama-family layers; others run PEFT's)",
    )
    if c.lora_dtype not in (None, "float32"):
        raise StreamSetupError(
            f"lora_dtype={c.lora_dtype!r}: use None (the fast layers' adapters compute in the "
            "activations' dtype, bf16 on tensor cores) or 'float32' (PEFT's arithmetic for them)"
        )
    if c.lora_dtype is not None and c.kernels != "fast":
        raise StreamSetupError(
            f"lora_dtype={c.lora_dtype!r} is the fast layers' option; with kernels='peft' PEFT "
            "computes the adapters in their own dtype already: leave lora_dtype None"
        )
    if not (isinstance(c.graphs, bool) or c.graphs == "auto"):
        raise StreamSetupError(
            f"graphs={c.graphs!r}: use True (CUDA graphs), False (eager layers) or 'auto' "
            "(default: graphs where the planner predicts them faster)"
        )
    for name in ("grad_accum", "world_size", "in_flight"):
        if not _whole(getattr(c, name), 1):
            raise StreamSetupError(f"{name}={getattr(c, name)!r}: give a whole number ≥ 1")
    for name, meaning in (
        ("step_mode", "block-major accumulation; 'auto' where predicted faster"),
        (
            "hold_weights",
            "4-bit weights dequantised once per pass in step mode; 'auto' where the plan has the room",
        ),
        (
            "keep_attention",
            "the fast layers' attention kept in host memory for the backward; 'auto' at long context",
        ),
    ):
        if not (isinstance(getattr(c, name), bool) or getattr(c, name) == "auto"):
            raise StreamSetupError(f"{name}={getattr(c, name)!r}: use True, False or 'auto' ({meaning})")
    if not _whole(c.reserve, 0):
        raise StreamSetupError(f"reserve={c.reserve!r}: give a number of bytes ≥ 0")
    if not _whole(c.stage_buffers, 0):
        raise StreamSetupError(f"stage_buffers={c.stage_buffers!r}: give a whole number ≥ 0")
    _choice(c, "host_state", HOST_STATES, "what of the training state StepTrainer keeps in host memory")
    for name in ("check", "inference", "deterministic", "computes_loss", "eager_beside_graphs"):
        if not isinstance(getattr(c, name), bool):
            raise StreamSetupError(f"{name}={getattr(c, name)!r}: use True or False")


def tile_option(config: StreamConfig) -> int | str | None:
    """The tile as the planner takes it: None for never ("off" says the same)."""
    return None if config.seq_tile in (None, "off") else config.seq_tile


def _apply_stream(model: Any, config: StreamConfig) -> Any:
    from .api import stream

    return stream(model, config)


compose.register(StreamConfig, "residency", _apply_stream)
