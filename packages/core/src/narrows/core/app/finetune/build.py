"""Inputs checked before the heavy work, then the model built: the user's checkpoint read
block by block, PEFT's adapter on it, and the siblings asked for (narrows-dora for
``--adapter dora``, narrows-stream for ``--gpu-budget``, narrows-lmhead for ``--lmhead``),
each imported only when asked for."""

from __future__ import annotations

import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from ...errors import NarrowsError
from ...io.checkpoint import CheckpointFolder
from ...kernels.fastlayer import FastLayers, coverage
from ...kernels.lora_branches import fuse_lora
from ...memory import parse_bytes
from ...protocol.anatomy import anatomy_of
from ...protocol.compose import apply
from ...protocol.determinism import data_parallel_bytes
from ...protocol.expert_adapters import adopt_quantized_experts
from ...protocol.handle import state_of
from ...protocol.slots import trainable_parameters
from ...protocol.targets import LoraTargets, lora_targets
from ...quant.experts import expert_names, moe_blocks
from ...sizes import format_bytes
from ..data import Example, Packed, Tokenized, open_source, parse_columns, tokenize, tokenize_rows
from .config import DataConfig, FinetuneConfig, lmhead_options

if TYPE_CHECKING:  # narrows-stream is optional: imported where a streamed run needs it
    from narrows.stream import StreamConfig

__all__ = [
    "build_model",
    "check_model_files",
    "head_savings",
    "load_data",
    "load_model",
    "run_dtype",
    "seed_all",
    "stream_config",
]


def seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def run_dtype(cfg: FinetuneConfig, device: torch.device) -> torch.dtype:
    if cfg.base.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, cfg.base.dtype)


def check_model_files(cfg: FinetuneConfig) -> Path:
    """The model's HF folder, its safetensors headers read and checked (missing or cut
    shards, unsupported quantisation) before any weight is; a GGUF file is converted once."""
    from ...io.models import resolve_model_path

    if cfg.base.model is None:
        from ..bundled import smollm2_gguf

        return resolve_model_path(smollm2_gguf())
    folder = resolve_model_path(cfg.base.model)
    checkpoint = CheckpointFolder(folder)
    checkpoint.check_model_type()  # before the tokenizer, which reads config.json too
    checkpoint.check_quantization()
    if checkpoint.packed:
        scheme = cfg.base.expert_quant if cfg.base.quant == "nf4" else "auto"
        held = (
            f"decode to bf16 as they load (exactly: each FP4 value times its power-of-two scale is a bf16 "
            f"value), then are quantised again to {scheme} as --expert-quant asks"
            if scheme != "auto"
            else "stay MXFP4 as stored (4.25 bits a weight), dequantised each pass to the exact bf16 values "
            "they stand for (--expert-quant nf4/nf3/nf2 with --quant nf4 would quantise those values again)"
        )
        print(f"narrows: {len(checkpoint.packed)} MXFP4 expert stacks {held}", file=sys.stderr, flush=True)
    return folder


def load_data(
    cfg: FinetuneConfig, tokenizer
) -> tuple[Sequence[Example], Sequence[Example], list[dict], list[str]]:
    """(train, eval, exact-match rows, what was read), every row checked before any training.
    With ``--packing`` the training examples are packed into ``--seq-len`` sequences; the
    held-out ones stay one per sequence."""
    d, rows = cfg.dataset, cfg.evaluation.eval_rows
    if cfg.base.model is None:
        from ..bundled import gsm8k_split

        train_rows, held_out = gsm8k_split()
        train = tokenize_rows(
            ((f"gsm8k-train:{i}", r) for i, r in enumerate(train_rows)), tokenizer, d.seq_len
        )
        evals = tokenize_rows(
            ((f"gsm8k-held-out:{i}", r) for i, r in enumerate(held_out[:rows])), tokenizer, d.seq_len
        )
        said = [f"data: GSM8K worked answers, {train.describe()}"]
        return (
            _packed(d, train, said),
            evals,
            held_out[rows : rows + cfg.evaluation.exact_match],
            said,
        )
    renames = parse_columns(d.columns)
    train, how = tokenize(open_source(d.data, d.data_split), tokenizer, d.seq_len, renames)  # type: ignore[arg-type]
    said = [f"data {d.data}: {train.describe()} ({how})"]
    evals: Sequence[Example] = []
    if d.eval_data:
        evals, how = tokenize(
            open_source(d.eval_data, d.eval_split, "--eval-data"), tokenizer, d.seq_len, renames
        )
        said.append(f"eval data {d.eval_data}: {evals.describe()} ({how}); the first {rows} evaluated")
        evals = evals[:rows]
    return _packed(d, train, said), evals, [], said


def _packed(d: DataConfig, train: Tokenized, said: list[str]) -> Sequence[Example]:
    if not d.packing:
        return train
    packed = Packed(train, d.seq_len)
    said.append(
        f"packing: {len(train)} examples in {len(packed)} sequences of {d.seq_len} tokens, "
        f"{packed.fill():.1%} of them real tokens"
    )
    return packed


def check_budget_before_loading(cfg: FinetuneConfig, folder: Path, world_size: int = 1) -> None:
    """Stop a run whose ``--gpu-budget`` the adapters alone overflow before any weight is
    read: their weights, gradients and AdamW's two moments (what ``--offload-optimizer``
    leaves on the device: weights and gradients), and over several ranks DDP's gradient
    buckets, counted on the model's skeleton (meta device) with the run's targets. The
    planner's floor is higher (a streamed layer, activations, the working set); it judges
    the rest once the model is loaded."""
    m = cfg.memory
    if m.gpu_budget in ("off", "fit", "min") or m.offload_adapters:
        return
    from peft import get_peft_model

    from ...io.loader import skeleton
    from .state import lora_config

    model = skeleton(CheckpointFolder(folder), torch.bfloat16)
    model = get_peft_model(model, lora_config(cfg, _targets(model, cfg.lora.targets)))
    trainable = list(trainable_parameters(model).values())
    numel = sum(p.numel() for p in trainable)
    size = sum(p.numel() * p.element_size() for p in trainable)
    state = 0 if m.offload_optimizer else 8 * numel  # AdamW's two fp32 moments
    ddp = data_parallel_bytes(size, world_size)
    need = 2 * size + state + ddp
    budget = parse_bytes(m.gpu_budget)
    if budget >= need:
        return
    parts = f"{format_bytes(size)} of weights, as much in gradients"
    parts += "" if m.offload_optimizer else f", {format_bytes(state)} of AdamW's moments"
    parts += f", {format_bytes(ddp)} of DDP's gradient buckets over {world_size} ranks" if ddp else ""
    ways = [] if m.offload_optimizer else ["--offload-optimizer (the moments in host memory)"]
    ways += ["--offload-adapters (one layer's adapters on the device at a time)"]
    ways += [f"fewer --targets or a lower --rank (now {cfg.lora.rank})"]
    raise NarrowsError(
        f"--gpu-budget {m.gpu_budget} cannot hold the adapters alone: {numel:,} trainable parameters "
        f"({cfg.lora.adapter}, rank {cfg.lora.rank}, --targets {cfg.lora.targets}) take {format_bytes(need)} on the "
        f"device ({parts}), before any layer of the model or its activations. Give well over "
        f"{format_bytes(need)} (--gpu-budget min: the smallest footprint the plan finds), or "
        + ", or ".join(ways)
    )


def load_model(cfg: FinetuneConfig, folder: Path, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The frozen base: a streamed one goes straight into its host tiers (pinned RAM within
    --host-budget, the rest on disk in the prepared-slab cache). The same loading as a
    scored model's (`narrows.core.app.inference`)."""
    from ..inference import load_base

    cache = False if cfg.memory.cache == "off" else (cfg.memory.cache or True)
    return load_base(
        folder,
        dtype=dtype,
        quant=cfg.base.quant,
        device=device,
        streamed=cfg.memory.gpu_budget != "off",
        host_budget=cfg.memory.host_budget,
        cache=cache,
        experts=cfg.base.expert_quant
        if cfg.base.quant == "nf4" and cfg.base.expert_quant != "auto"
        else None,
    )[0]


def _targets(model: nn.Module, targets: str) -> LoraTargets:
    """``--targets`` on this model: all-linear is `lora_targets`' (a mixture of experts leaves
    its routers and routed experts frozen, and says so); ``experts`` adds the routed experts'
    stacks (all of them; a stack's own name, e.g. gate_up_proj, that one); other names must
    be linears' names."""
    wanted = [t.strip() for t in targets.split(",") if t.strip()]
    stacks = sorted(
        {s for layer in anatomy_of(model).layers for b in moe_blocks(layer) for s in expert_names(b.experts)}
    )
    on_experts = [t for t in wanted if t == "experts" or t in stacks]
    modules = [t for t in wanted if t not in on_experts]
    parameters: tuple[str, ...] = ()
    if on_experts:
        try:
            every = lora_targets(model, experts=True).parameters
        except NarrowsError as e:
            raise NarrowsError(f"--targets {targets!r}: {e}") from None
        parameters = tuple(p for p in every if "experts" in on_experts or p.rsplit(".", 1)[-1] in on_experts)
    if modules == ["all-linear"]:
        base = lora_targets(model, experts=bool(parameters))
        return LoraTargets(base.modules, base.frozen, parameters)
    linear = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    missing = [t for t in modules if t not in linear]
    if missing or not (modules or parameters):
        raise NarrowsError(
            f"--targets {targets!r}: no linear module named {missing or targets!r} in this model; it has "
            f"{sorted(linear)}"
            + (f", and the routed experts' stacks {stacks} (experts: all of them)" if stacks else "")
            + " (or use all-linear)"
        )
    return LoraTargets(tuple(modules), (), parameters)


def head_savings(cfg: FinetuneConfig):
    """``--lmhead`` as narrows-lmhead's config for `narrows.core.apply` (None: off). Evaluation
    runs through the exact chunked loss too: the full logits of an eval batch would take more
    than the budget the training fits (2.56 GB at 1900 MiB, 7B on the H100)."""
    options = lmhead_options(cfg.memory.lmhead)
    if options is None:
        return None
    import narrows.lmhead

    return narrows.lmhead.HeadSavings(options, eval_logits=False)


def build_model(
    cfg: FinetuneConfig, model: nn.Module, device: torch.device, dtype: torch.dtype, world_size: int = 1
) -> nn.Module:
    """The PEFT model that trains: adapter (initialised from the run's seed), then DoRA,
    streaming and the LM-head savings as asked."""
    from peft import get_peft_model

    from .state import lora_config

    targets = _targets(model, cfg.lora.targets)
    seed_all(cfg.training.seed)  # the adapter's initialisation
    model = get_peft_model(model, lora_config(cfg, targets))
    adopt_quantized_experts(model)
    state_of(model).targets = str(targets)
    if cfg.lora.adapter == "dora":
        import narrows.dora

        narrows.dora.use_narrows_dora(model)
    # each LoRA branch one autograd node, a shared input cast once: PEFT's bits, less saved
    # memory, 2-10% shorter steps on the H100 (cases fuse_* of benchmarks/results/h100.jsonl)
    fuse_lora(model)
    # narrows' transforms in their one order (narrows.core.apply): the loss first (a planner
    # sizes the loss that will run), then the tiles, the fast layers (which run the tiles) or
    # the stream (which runs its own tiles and fast layers)
    configs = [c for c in (head_savings(cfg),) if c is not None]
    kernels = "PEFT's modules (--kernels peft)"
    if cfg.memory.gpu_budget == "off":
        model.to(device)
        tile = cfg.memory.tile()
        if tile is not None:
            import narrows.stream

            configs.append(narrows.stream.SequenceTiles(tile))
        if cfg.base.kernels == "fast":
            configs.append(FastLayers(lora_dtype=torch.float32 if cfg.base.lora_dtype == "float32" else None))
        model = apply(model, *configs)
        if cfg.base.kernels == "fast":  # (not with LoRA dropout in tiles: it says so)
            kernels = str(coverage(model))
    elif cfg.training.pipeline_stages > 1:  # the loss; the job's stages stream (`stages.Stages`)
        model = apply(model, *configs)
    else:
        model = apply(model, *configs, stream_config(cfg, device, world_size))
        if cfg.base.kernels == "fast":
            kernels = model.narrows_stream.kernels
    state_of(model).kernels = kernels  # what the run's summary says of them
    return model


def stream_config(cfg: FinetuneConfig, device: torch.device, world_size: int = 1) -> StreamConfig:
    """The job's flags as one `narrows.stream.StreamConfig`: the budget and batch, the
    micro-batches a step and whether step mode was asked for (else the planner decides),
    what step mode keeps in host memory (left out of the budget), and the tiles and
    graphs asked for (else the planner's); packed, no room for a layer run eagerly beside
    the graphs' pool (the job evaluates with them released)."""
    import narrows.stream

    m = cfg.memory
    host_state = "adapters" if m.offload_adapters else "optimizer" if m.offload_optimizer else "none"
    return narrows.stream.StreamConfig(
        gpu_budget=m.gpu_budget if m.gpu_budget in ("fit", "min") else parse_bytes(m.gpu_budget),
        device=device,
        batch_size=cfg.training.batch,
        seq_len=cfg.dataset.seq_len,
        seq_tile=m.tile(),
        graphs="auto" if m.cuda_graphs is None else m.cuda_graphs,
        # packed batches have one shape, and evaluations run in the graphs' room (`graphs_released`)
        eager_beside_graphs=not cfg.dataset.packing,
        grad_accum=cfg.training.grad_accum,
        step_mode="auto" if m.step_mode is None else m.step_mode,
        host_state=host_state,
        world_size=world_size,
        kernels=cfg.base.kernels,
        lora_dtype="float32" if cfg.base.lora_dtype == "float32" else None,
    )


def choose_accumulation(cfg: FinetuneConfig, model: nn.Module) -> tuple[bool, str]:
    """Whether the step runs block-major (narrows.stream.StepTrainer) or in sequence, and
    why: as asked, or where neither was asked, the stream plan's decision.
    The numbers trained are the same either way. "" where a step has one micro-batch."""
    if cfg.memory.gpu_budget == "off" or cfg.training.pipeline_stages > 1:
        return False, ""
    if cfg.memory.step_mode is not None:  # given, or the settings a resumed run started with
        return cfg.memory.step_mode, (
            "block-major (asked for: --step-mode, --offload-optimizer or --offload-adapters)"
            if cfg.memory.step_mode
            else "sequential (step mode off: --no-step-mode, or the settings this run started with)"
        )
    if cfg.training.grad_accum < 2:
        return False, ""
    plan = model.narrows_stream.plan  # the planner decided when it planned the stream
    return plan.accumulation == "block-major", plan.accumulation_choice
