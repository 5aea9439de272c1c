"""A base plus an adapter, loaded for inference: one path for whoever scores a model
(``narrows eval``, lm-eval's ``narrows`` model), loading the base as the main job does.

Siblings are imported only when asked for and checked to be installed first.

why: docs/design.md#inference-loading
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..errors import NarrowsError
from ..optional import is_available, require
from ..protocol.expert_adapters import adopt_quantized_experts
from .finetune.state import RunState, run_base, run_state

__all__ = [
    "AdapterChoice",
    "InferenceModel",
    "check_run_base",
    "choose_adapter",
    "load_base",
    "load_for_inference",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class AdapterChoice:
    """The adapter an evaluation scores: a PEFT folder, or a `narrows finetune` run (`run`)
    at `step` — its final adapter, or checkpoint `checkpoint`'s weights."""

    folder: Path
    run: RunState | None = None
    step: int | None = None
    checkpoint: int | None = None

    def describe(self) -> str:
        """What is scored, in words (printed, and recorded in the report)."""
        if self.run is None:
            return f"adapter {self.folder} (a PEFT folder: its training step is not recorded)"
        if self.checkpoint is not None:
            return (
                f"run {self.folder} at step {self.step}: checkpoint step-{self.step:06d} of "
                f"{self.run.steps} steps ({self.run.unfinished() or 'the run finished'})"
            )
        return f"run {self.folder} at step {self.step} (its final adapter)"


@dataclass
class InferenceModel:
    """What `load_for_inference` built: the model (adapter applied, frozen, in eval mode),
    its tokenizer, the device it computes on, whether its base is streamed, and the
    adapter chosen (None: the base alone)."""

    model: nn.Module
    tokenizer: object
    device: torch.device
    streamed: bool
    choice: AdapterChoice | None = None
    base_differs: list[str] | None = None  # how a base given explicitly differs from the run's own


def check_run_base(
    run: RunState, path: str | os.PathLike, *, explicit: bool, how: str = "--model {}"
) -> list[str]:
    """Check the base at `path` against the one `run` trained on, by content (sampled
    weights, `narrows.core.io.fingerprint`), before anything is loaded. The run's own base (not
    `explicit`) must be there and the same, or the refusal says so and how to score anyway
    (`how`: the way to give a base, e.g. ``--model {}``); a base given explicitly that
    differs is said on stderr and its differences returned, for the report to record."""
    where = Path(path)
    if not where.exists():
        raise NarrowsError(
            f"{run.root}: the base it trained on, {where}, is not there any more; if it moved, "
            f"give its new place: {how.format('NEW_PATH')} (its content is checked against the "
            "run's record)"
        )
    differs = run.base_differences(where)
    if not differs:  # the same content, or a run from before narrows recorded it
        return []
    said = "; ".join(differs)
    if not explicit:
        raise NarrowsError(
            f"{run.root}: its base {where} changed since the run trained on it ({said}): the scores "
            "would be of another model than the one trained. Put the original back, or give a base "
            f"explicitly with {how.format(where)} to score on it anyway (the difference is recorded "
            "with the scores)"
        )
    print(
        f"narrows: {how.format(where)} differs from the base {run.root} trained on ({said}); scoring on it as "
        "asked (recorded with the scores)",
        file=sys.stderr,
        flush=True,
    )
    return differs


def choose_adapter(
    path: str | os.PathLike, checkpoint: int | str | None = None, *, how: str = "--checkpoint {}"
) -> AdapterChoice:
    """The adapter in `path`: a `narrows finetune` run folder or a PEFT folder. A run is
    scored only at its newest state: its final adapter when it finished, else refused with
    the choices (finish it, or a `checkpoint` — a step or "latest" — asked for explicitly,
    `how` the way to ask). Errors name the path and what to do."""
    p = Path(path).expanduser()
    if not p.exists():
        raise NarrowsError(
            f"adapter path {str(p)!r} does not exist: give a run folder of `narrows finetune` or a "
            "folder written by PEFT's save_pretrained"
        )
    run = run_state(p)
    if run is None:
        if checkpoint is not None:
            raise NarrowsError(
                f"{how.format(checkpoint)} picks a checkpoint of a `narrows finetune` run; {str(p)!r} "
                "is not one (no config.json)"
            )
        if (p / "adapter_config.json").is_file():
            return AdapterChoice(p)
        raise NarrowsError(f"{str(p)!r} holds no adapter_config.json: it is not a PEFT adapter folder")
    if checkpoint is not None:
        return AdapterChoice(p, run, *([run.checkpoint(checkpoint)] * 2))
    why = run.unfinished()
    if why is None:
        return AdapterChoice(p, run, run.adapter_step)
    finish = f"finish it (narrows finetune --resume {p})"
    pick = (
        f", or evaluate a checkpoint explicitly ({how.format(run.newest)}, or {how.format('latest')})"
        if run.checkpoints
        else ""
    )
    raise NarrowsError(
        f"{str(p)!r} is a `narrows finetune` run whose newest state is not its final adapter "
        f"({why}): {finish}{pick}"
    )


def load_base(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype,
    quant: str | None,
    device: torch.device,
    streamed: bool = False,
    host_budget: str | int | None = None,
    cache: str | os.PathLike | bool = True,
    experts: str | None = None,
) -> tuple[nn.Module, object]:
    """The frozen base and its tokenizer, as the main job loads them: resident on `device`,
    or (`streamed`) straight into narrows-stream's host tiers (pinned RAM within
    `host_budget`, the rest on disk in the prepared-slab `cache`). `experts`: the routed
    experts' scheme of a mixture of experts with `quant="nf4"` (nf4, nf3 or nf2)."""
    from ..io.models import load_causal_lm

    if not streamed:
        return load_causal_lm(path, dtype=dtype, quant=quant, device=device, experts=experts)
    stream = require("narrows.stream", "streaming the base (a GPU budget)")
    return load_causal_lm(
        path,
        load=lambda folder: stream.from_pretrained(
            folder,
            quant=quant,
            experts=experts,
            dtype=dtype,
            host_budget=host_budget,
            cache=cache,
            device=device,
        ),
    )


def load_for_inference(
    pretrained: str | os.PathLike | nn.Module | None,
    *,
    tokenizer: object | None = None,
    adapter: str | os.PathLike | AdapterChoice | None = None,
    checkpoint: int | str | None = None,
    dtype: str | torch.dtype = "auto",
    quant: str | None = None,
    gpu_budget: str | int | None = None,
    host_budget: str | int | None = None,
    device: str | torch.device | None = None,
    seq_len: int = 2048,
    batch_size: int = 1,
    caller: str = "load_for_inference",
) -> InferenceModel:
    """Load `pretrained` (+ `adapter`) for forward-only use; every refusal comes before the
    slow load.

    `quant="nf4"`: decoder linears in NF4; `gpu_budget`: the base streamed through
    narrows-stream, scoring exactly as the resident model does. `pretrained` may be a model in
    host memory (pass its `tokenizer`) or None for a run folder's base. A run folder is used at
    its final adapter and refused while that is not its newest state, unless `checkpoint`
    (a step or ``"latest"``) is given; its base is checked by content (`check_run_base`).
    `adapter` may be a checked `AdapterChoice`; `caller` is named in messages.

    why: docs/design.md#inference-loading
    """
    dev = (
        torch.device(device)
        if device is not None
        else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    )
    if quant not in (None, "none", "nf4"):
        raise NarrowsError(f"quant must be nf4 or none, got {quant!r}")
    chosen = isinstance(adapter, AdapterChoice)  # chosen, and its base checked, by the caller
    if chosen:
        choice = adapter
    else:  # before the slow load
        choice = choose_adapter(adapter, checkpoint, how="checkpoint={}") if adapter else None
    if checkpoint is not None and choice is None:
        raise NarrowsError(
            f"checkpoint={checkpoint} picks a checkpoint of a run: give the run as the adapter too"
        )
    explicit = pretrained is not None
    if pretrained is None:
        if choice is None or choice.run is None:
            raise NarrowsError(
                "no base model given (pretrained): give a model folder or .gguf file, or a "
                "`narrows finetune` run folder as the adapter, whose base it then is"
            )
        pretrained = run_base(choice.run.config).path
    differs = None
    if choice is not None and choice.run is not None and not chosen and not isinstance(pretrained, nn.Module):
        differs = check_run_base(choice.run, pretrained, explicit=explicit, how="pretrained={}") or None
    if gpu_budget is not None:
        require("narrows.stream", "evaluation with gpu_budget (streaming the base)")
    elif host_budget is not None:
        raise NarrowsError("host_budget bounds the host copy of a streamed base: give gpu_budget too")
    if isinstance(pretrained, nn.Module):
        if tokenizer is None:
            raise NarrowsError(
                f"a model passed as an object needs its tokenizer: {caller}(model, tokenizer=...)"
            )
        model = pretrained
    else:
        model, tokenizer = load_base(
            pretrained,
            dtype=_dtype(dtype, dev),
            quant=quant,
            device=dev,
            streamed=gpu_budget is not None,
            host_budget=host_budget,
        )
    if quant == "nf4" and not getattr(model, "is_loaded_in_4bit", False):  # a model passed in memory
        from ..quant.nf4 import quantize_nf4

        quantize_nf4(model, device=dev if dev.type == "cuda" else None, park="cpu")
    if choice is not None:
        model = _with_adapter(model, choice)
    model.eval()
    model.requires_grad_(False)  # nothing trains here: no gradient or optimizer room is planned for any of it
    if gpu_budget is not None:
        import narrows.stream

        budget = None if gpu_budget in ("min", "none") else gpu_budget
        # the layers' own modules (PEFT's), as the resident path runs them: a streamed
        # evaluation scores every request exactly as a resident one. The fast layers compute
        # in another order (the adapter's product first, the base accumulated onto it), so
        # their scores differ from PEFT's in the last bits on some CPUs and in bf16 on CUDA
        narrows.stream.stream(
            model, budget, device=dev, batch_size=batch_size, seq_len=seq_len, inference=True, kernels="peft"
        )
    else:
        model.to(dev)
    return InferenceModel(model, tokenizer, dev, gpu_budget is not None, choice, differs)


def _dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise NarrowsError(f"dtype must be auto or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def _with_adapter(model: nn.Module, choice: AdapterChoice) -> nn.Module:
    """`model` wrapped by PEFT with the chosen adapter (a checkpoint's weights in the run's
    own adapter configuration), not trainable; its DoRA layers narrows-dora's."""
    if choice.checkpoint is not None:
        model = choice.run.load_checkpoint(model, choice.checkpoint)
    else:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(choice.folder), is_trainable=False)
    adopt_quantized_experts(model)  # LoRA on quantised expert stacks, run as narrows runs it
    _use_narrows_dora(model)
    return model


def _use_narrows_dora(model: nn.Module) -> None:
    """PEFT's DoRA layers swapped for narrows-dora's (the same numbers, without the dense
    B·A) where it is installed; without it, PEFT's run."""
    if not is_available("narrows.dora"):
        return
    from peft.tuners.lora.dora import DoraLinearLayer

    if any(type(m) is DoraLinearLayer for m in model.modules()):
        import narrows.dora

        narrows.dora.use_narrows_dora(model)
