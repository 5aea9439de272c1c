"""`StreamConfig`: everything a user may set about streaming a model, in one frozen
object, validated once here, each refusal naming its field.

Every mode defaults to "the planner decides" where the planner can decide (``"auto"``).
`stream(model, config)` and `plan(model, config)` take it; both also take the same
settings as keywords (``stream(model, "12GiB", seq_len=1024)``), which become a config
here, so there is one place that knows what a setting may be.

Names say one thing each: ``prefetch_depth`` is how many layers ahead the copy of the
frozen weights runs (the device slabs beyond the one in use); ``offload_inputs`` is
where each layer's saved *input* waits for its backward; ``host_state`` is what of the
*training state* (optimizer state, adapters) step mode keeps in host memory. Held 4-bit
weights have one setting, ``hold_weights``; the room they take is the planner's to leave.
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

    `gpu_budget`: bytes or a size like ``"12GiB"`` the run may use on the device; ``"fit"``
    keeps as many layers resident as the free memory allows; None streams every layer
    with the smallest footprint. `batch_size` × `seq_len` size the activation estimate.
    `head="stream"` keeps a frozen LM head in host memory and serves it in vocabulary
    chunks of `head_rows` through core's head hook (with a tied embedding, both read the
    one host copy); its input gradient is then summed over chunks, so it equals the
    resident head up to summation order — bit-exact against the same chunked head
    resident. `check` runs a one-layer streamed-vs-resident self-check first (False for
    layers known to be nondeterministic). `inference=True` streams for forward passes
    only: nothing needs to train, and the self-check (which compares gradients) and the
    graphs are off.
    `offload_inputs`: where each layer's saved input waits for its backward. "auto" keeps
    it on the device while the budget allows and moves the rest to host memory
    (bit-identical either way; with no budget, all of them move); "off" never moves one;
    "all" moves every one. `seq_tile`: None never tiles; "auto" runs the MLPs over
    sequence tiles only when the budget cannot hold the whole-sequence working set; a
    number of tokens always does. Tiled training is `torch.equal` to the same tiling
    resident (`narrows.stream.tile_sequence`) and equal to untiled training up to
    summation order. `recompute`: "auto" runs resident layers *whole* — as resident
    training runs them, activations saved, no recompute — while the budget holds their
    activations (with every layer whole, a step is plain PEFT training without
    checkpointing); "all" recomputes every layer in backward.
    `graphs=True` replays each layer narrows runs itself (streamed or recomputed) as CUDA
    graphs — its forward, and its recompute with its backward — the same kernels on the
    same inputs, so still bit-identical, without the host's per-kernel cost; a layer
    whose forward waits for the host runs eagerly (``model.narrows_stream.graphs.stats.
    refused`` says why). The plan then counts the graphs' pool and prices graphed layers
    without the host's per-kernel cost, so at short sequences it recomputes resident
    layers rather than keep them whole. "auto": on a CUDA device with a budget, graphs
    when the plan with them fits and is predicted faster (the plan says which and why);
    off for the smallest footprint, for inference, and on a CPU, which has no graphs
    (True there runs the same buffer path eagerly, for tests). A batch shape is captured
    when it comes round again, and graphs are kept for the four most recent shapes, so
    batches padded to varying widths hold bounded memory (the plan counts it).
    `grad_accum`: micro-batches per optimizer step. With 2 or more the plan also decides
    the accumulation (`Plan.accumulation`): `step_mode` True runs each step block-major
    (`StepTrainer`: every streamed layer copied twice a step instead of twice per
    micro-batch, the same numbers), False in sequence, "auto" block-major where the
    step-time model predicts it at least 5% faster and the host has room for the
    micro-batches' saved inputs (`choose_step_mode` says why). A plan for step mode on a
    CUDA device leaves room for what a block-major step keeps beyond the plan (the held
    weights and the micro-batches' layer boundaries: `step_mode_reserve`) and keeps no
    layer whole (block-major recomputes every layer). `hold_weights`: each layer's 4-bit
    weights dequantised once into a held buffer the size of the largest layer's
    (`narrows.core.HeldWeights`: bitsandbytes' own matmuls on the held copy, the same
    bits) — in step mode once per pass for every micro-batch, in sequential steps once
    for each recomputed layer's backward (recompute and input gradient: two
    dequantisations a micro-batch instead of three). True, False, or "auto": where the
    plan has the room and the step-time model predicts it faster (not at the smallest
    footprint). `host_state`: what of the training state the plan may leave out of the
    device budget, for `StepTrainer` to keep in host memory: "none" (the adapters, their
    gradients and AdamW's state all on the device), "optimizer" (one layer's optimizer
    state on the device, each layer updated as its gradients complete) or "adapters"
    (one layer's adapters, gradients and state; block-major steps only). `world_size`:
    data-parallel ranks training the model (several keep accumulation sequential).
    `reserve`: device bytes the plan leaves free within the budget, for the caller.
    `keep_attention`: each recomputed fast layer's attention (SDPA's node: q, k, v, its
    output and log-sum-exp) kept from the forward for the backward in host memory, so the
    recompute runs no attention and no Q/K/V base matmul: True, False, or "auto" — at long
    context, where attention is a large share of a layer's recompute, with a budget that
    holds one more layer's attention in flight and host memory every recomputed layer's
    (not at the smallest footprint, nor with CUDA graphs or block-major steps, which
    replay the recompute as it is).
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
    for name in ("grad_accum", "world_size"):
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
    _choice(c, "host_state", HOST_STATES, "what of the training state StepTrainer keeps in host memory")
    for name in ("check", "inference", "deterministic"):
        if not isinstance(getattr(c, name), bool):
            raise StreamSetupError(f"{name}={getattr(c, name)!r}: use True or False")


def tile_option(config: StreamConfig) -> int | str | None:
    """The tile as the planner takes it: None for never ("off" says the same)."""
    return None if config.seq_tile in (None, "off") else config.seq_tile


def _apply_stream(model: Any, config: StreamConfig) -> Any:
    from .api import stream

    return stream(model, config)


compose.register(StreamConfig, "residency", _apply_stream)
