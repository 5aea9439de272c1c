"""Pipeline stages over a streamed base: `pipeline_stage(model, budget)` keeps this rank's
contiguous block of decoder layers, streams only those under this rank's budget, and
returns torch's `PipelineStage` over them, for a schedule of `torch.distributed.pipelining`
(``ScheduleGPipe``, ``Schedule1F1B``) to run with micro-batches in flight.

Stage s of S holds layers [s·n/S, (s+1)·n/S): the first also embeds the tokens, the last
runs the model's own forward on to its loss (the final norm, the head and the loss, or the
loss a sibling put in their place), and every stage runs the model's own decoder forward
over its layers (positions, mask, rotary embeddings as the model makes them, from the
``position_ids`` given to every stage's ``step`` where rows are packed). The
activations sent between stages are the hidden states the model passes between those
layers, so each micro-batch's gradients are the ones one process computes; with the
schedule's ``scale_grads=False`` and `pipeline_loss` as its loss, the adapters' gradients
equal one process accumulating the same micro-batches, bit for bit (GPipe and 1F1B run each
stage's backwards in micro-batch order, the order autograd accumulates them in).

What a stage does not cover is refused by name: families whose decoder treats its input
embeddings differently from the hidden states between layers, auxiliary router losses
(they sum over every layer's routing), LayerDrop. Rows are whole causal sequences or
packed ones (no padding mask crosses between stages). `save_pipeline_adapter` writes the
stages' adapters as the whole model's one; `whole_names` and `stage_names` translate a
stage's tensor names to the whole model's and back.

why: docs/design.md#pipeline-stages
"""

from __future__ import annotations

import dataclasses
import re
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from narrows.core import anatomy_of
from narrows.core.protocol.handle import state_of

from .errors import StreamSetupError
from .storage.tiers import Tiers

__all__ = [
    "PipelineLoss",
    "pipeline_loss",
    "pipeline_stage",
    "save_pipeline_adapter",
    "stage_layers",
    "stage_names",
    "whole_names",
]

# each staged model's layer container (its path in the model) and the layers it kept
_KEPT: weakref.WeakKeyDictionary[nn.Module, tuple[str, range]] = weakref.WeakKeyDictionary()
# each staged model's stage computation (`_Stage`)
_STAGED: weakref.WeakKeyDictionary[nn.Module, nn.Module] = weakref.WeakKeyDictionary()

# families whose decoder forward takes `inputs_embeds` as the first layer's input, untouched
# (Gemma scales it, for one: a later stage would scale the hidden states again)
STAGED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "olmoe")


def stage_layers(layers: int, stages: int, stage: int) -> range:
    """The decoder layers stage `stage` of `stages` holds: a contiguous, even split."""
    if not 0 <= stage < stages or stages > layers:
        raise StreamSetupError(
            f"stage {stage} of {stages}: a pipeline needs 0 <= stage < stages <= the model's {layers} layers"
        )
    return range(stage * layers // stages, (stage + 1) * layers // stages)


class _Stage(nn.Module):
    """One stage's computation: tokens or hidden states in; hidden states out, or on the
    last stage the loss of the model's own forward (its head and loss, or the loss a
    sibling replaced it with, as narrows-lmhead's chunked one: no logits kept)."""

    def __init__(self, causal_lm: nn.Module, decoder: nn.Module, first: bool, last: bool):
        super().__init__()
        self.lm, self.first, self.last = causal_lm, first, last
        self._decoder = [decoder]  # inside `lm`: not registered twice
        self.loss_kwargs: dict[str, Any] = {}  # the loss's own (`PipelineLoss.num_items_in_batch`)

    def forward(self, x: Tensor, labels: Tensor | None = None, **side: Tensor) -> Tensor:
        """`labels` (the last stage's) and `side` (what every stage's decoder takes beside
        its input: ``position_ids`` of packed rows) are the schedule's keyword arguments,
        split into the same micro-batches."""
        inputs = {"input_ids": x} if self.first else {"inputs_embeds": x}
        if not self.last:
            return self._decoder[0](**inputs, **side, use_cache=False).last_hidden_state
        if labels is None:
            raise StreamSetupError(
                "the last stage computes the loss: give its schedule's step the labels as labels= "
                "(and as target=, which torch's schedule asks of the last stage)"
            )
        return self.lm(**inputs, labels=labels, **side, **self.loss_kwargs, use_cache=False).loss


def _refuse(anat: Any) -> None:
    config = anat.config
    if anat.model_type not in STAGED_FAMILIES:
        raise StreamSetupError(
            f"pipeline stages cover {', '.join(STAGED_FAMILIES)}; this is a {anat.model_type} (train it with "
            "data parallelism: one rank a GPU, every rank streaming the whole base)"
        )
    if getattr(config, "output_router_logits", False) and getattr(config, "router_aux_loss_coef", 0):
        raise StreamSetupError(
            "the router's auxiliary loss sums over every layer's routing, which no stage sees whole: "
            "set config.output_router_logits = False to train with pipeline stages"
        )
    if getattr(config, "layerdrop", 0) or getattr(config, "layer_drop", 0):
        raise StreamSetupError("LayerDrop skips layers at random: pipeline stages run every layer of theirs")


def pipeline_stage(
    model: nn.Module,
    gpu_budget: Any = None,
    /,
    *,
    stage: int | None = None,
    stages: int | None = None,
    device: torch.device | str | None = None,
    group: Any = None,
    micro_batches: int = 1,
    schedule: str = "1f1b",
    **options: Any,
):
    """This rank's `torch.distributed.pipelining.PipelineStage` of `model` (a PEFT model,
    loaded by transformers or by `from_pretrained` into host tiers): its block of decoder
    layers kept (the others dropped from the model, its config's ``num_hidden_layers`` and
    ``layer_types``, and its host tiers), streamed under `gpu_budget` (`stream`'s; ``None``:
    resident) with `options` (before the last stage, which alone calls it, a frozen head is
    streamed from host memory unless `options` say ``head``), and the model's own forward
    over them. `stage` and `stages` default to the rank and world size of `group` (default:
    the default process group). Build the schedule with ``scale_grads=False`` and
    `pipeline_loss`; the first stage is given the input ids, the last the labels; save the
    adapter with `save_pipeline_adapter`.

    The plan prices what the schedule keeps: `micro_batches` M a step and `schedule`
    ("gpipe": every stage holds all M micro-batches' saved activations until the backward;
    "1f1b": stage s of S holds min(M, S - s)), the boundary tensors sent and received, and
    on the last stage the losses in flight; ``options["batch_size"]`` is a micro-batch's
    rows. Run the schedule's ``step`` with ``return_outputs=False`` (its outputs kept for
    the caller are not priced)."""
    from torch.distributed.pipelining import PipelineStage

    from .api import stream

    if stage is None or stages is None:
        if not dist.is_initialized():
            raise StreamSetupError(
                "pipeline_stage needs torch.distributed.init_process_group first (or stage= and stages=)"
            )
        stage = dist.get_rank(group) if stage is None else stage
        stages = dist.get_world_size(group) if stages is None else stages
    anat = anatomy_of(model)
    _refuse(anat)
    kept = stage_layers(anat.num_layers, stages, stage)
    first, last = stage == 0, stage == stages - 1
    parent_path, _, attr = anat.layer_paths[0].rpartition(".")[0].rpartition(".")
    parent = anat.model.get_submodule(parent_path) if parent_path else anat.model
    setattr(parent, attr, nn.ModuleList([anat.layers[i] for i in kept]))
    _KEPT[anat.model] = (f"{parent_path}.{attr}" if parent_path else attr, kept)
    handle = state_of(anat.model)
    if handle.tiers is not None:  # from_pretrained's host tiers: this stage's layers, renumbered
        handle.tiers = _stage_tiers(handle.tiers, kept)
    config = anat.config  # the model now holds this stage's layers, and says so
    config.num_hidden_layers = len(kept)
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = [config.layer_types[i] for i in kept]
    if not last:  # the final norm belongs to the last stage's output
        anat.decoder.norm = nn.Identity()
    if not last and not any(p.requires_grad for p in anat.head.parameters()):
        # a head no stage before the last calls: served from host memory, not held on the device
        options.setdefault("head", "stream")
    options.update(_in_flight(stage, stages, micro_batches, schedule))
    stream(model, gpu_budget, **({"device": device} if device is not None else {}), **options)
    where = (
        model.narrows_stream.device
        if getattr(model, "narrows_stream", None)
        else torch.device(device or "cpu")
    )
    module = _Stage(anat.model, anat.decoder, first, last)
    _STAGED[anat.model] = module
    return PipelineStage(module, stage, stages, where, group=group)


SCHEDULES = ("gpipe", "1f1b")


def _in_flight(stage: int, stages: int, micro: int, schedule: str) -> dict[str, Any]:
    """The stream settings that price what `schedule` keeps on stage `stage` of `stages`
    with `micro` micro-batches a step: the micro-batches whose saved activations it holds
    at once, whether it computes the loss, and its boundary tensors — a receive buffer a
    micro-batch for the hidden states and each in-flight one's input gradient until its
    send completes (all but the first stage), a receive buffer a micro-batch for the
    output gradients and each in-flight one's output until its backward (all but the
    last). (On 2 H200s, Qwen2.5-72B's shape, 8 × 512 tokens a micro-batch, 16 GiB: the
    last stage peaked 88 MB above its plan before the input gradients, 64 MB each, were
    counted; 24 MB above with them, 0.14%.)"""
    if schedule not in SCHEDULES:
        raise StreamSetupError(
            f"schedule={schedule!r}: use 'gpipe' or '1f1b' (the schedule this stage runs in)"
        )
    if not isinstance(micro, int) or micro < 1:
        raise StreamSetupError(f"micro_batches={micro!r}: give the schedule's micro-batches a step, ≥ 1")
    first, last = stage == 0, stage == stages - 1
    held = micro if schedule == "gpipe" else min(micro, stages - stage)
    buffers = (0 if first else micro + held) + (0 if last else micro + held)
    return {"in_flight": held, "computes_loss": last, "stage_buffers": buffers}


def _stage_tiers(tiers: Tiers, kept: range) -> Tiers:
    """`tiers` of the kept layers alone, numbered from 0 as the stage's model numbers them
    (their homes, layouts, disk and shared layers, and the prepared cache's entries)."""
    from .storage.cache import PreparedCache

    cache = tiers.cache
    if cache is not None:
        cache = PreparedCache(cache.path, cache.meta, [cache.layers[i] for i in kept])
    return dataclasses.replace(
        tiers,
        homes=[tiers.homes[i] for i in kept],
        layouts=[tiers.layouts[i] for i in kept],
        disk=tuple(i - kept.start for i in tiers.disk if i in kept),
        shared=tuple(i - kept.start for i in tiers.shared if i in kept),
        cache=cache,
    )


class PipelineLoss:
    """The schedule's loss: the last stage's output (the model's own loss of the
    micro-batch), times `scale`; the target the schedule passes is not read (the labels
    reach the last stage as ``labels=``). Set `num_items_in_batch` (before each step: the
    step's trainable tokens) for the sum over a micro-batch's tokens divided by it, as a
    forward given ``num_items_in_batch`` computes."""

    def __init__(self, model: nn.Module, scale: float = 1.0) -> None:
        self.lm = anatomy_of(model).model
        self.scale = scale

    @property
    def num_items_in_batch(self) -> int | None:
        return self._stage().loss_kwargs.get("num_items_in_batch")

    @num_items_in_batch.setter
    def num_items_in_batch(self, items: int | None) -> None:
        kwargs = self._stage().loss_kwargs
        kwargs.pop("num_items_in_batch", None)
        if items is not None:
            kwargs["num_items_in_batch"] = items

    def _stage(self) -> nn.Module:
        if self.lm not in _STAGED:
            raise StreamSetupError(
                "pipeline_loss is the loss of a model pipeline_stage split: split it first"
            )
        return _STAGED[self.lm]

    def __call__(self, loss: Tensor, target: Any = None) -> Tensor:
        return loss * self.scale if self.scale != 1.0 else loss


def pipeline_loss(model: nn.Module, scale: float = 1.0) -> PipelineLoss:
    """The schedule's loss (`PipelineLoss`): times `scale` (1 / micro-batches for the mean
    one process accumulating them computes with ``(loss * scale).backward()``)."""
    return PipelineLoss(model, scale)


def _numbering(model: nn.Module) -> tuple[re.Pattern, str, range]:
    anat = anatomy_of(model)
    if anat.model not in _KEPT:
        raise StreamSetupError("this model is whole: pipeline_stage did not split it")
    container, kept = _KEPT[anat.model]
    return re.compile(rf"(^|\.){re.escape(container)}\.(\d+)\."), container, kept


def whole_names(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """`state` (this stage's tensors by its own names) by the whole model's names: its
    layers numbered as in the model before the split."""
    number, container, kept = _numbering(model)
    return {
        number.sub(lambda m: f"{m[1]}{container}.{int(m[2]) + kept.start}.", k, count=1): v
        for k, v in state.items()
    }


def stage_names(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """This stage's share of `state` (the whole model's tensors by its names), by the
    stage's own names: its layers' tensors renumbered, other layers' left out, the rest
    (outside the layers) kept."""
    number, container, kept = _numbering(model)
    mine = {}
    for k, v in state.items():
        m = number.search(k)
        if m is None:
            mine[k] = v
        elif int(m[2]) in kept:
            mine[number.sub(lambda m: f"{m[1]}{container}.{int(m[2]) - kept.start}.", k, count=1)] = v
    return mine


def save_pipeline_adapter(model: nn.Module, folder: str | Path, *, group: Any = None) -> None:
    """Write the whole model's adapter to `folder` as PEFT's ``save_pretrained`` writes one
    (``adapter_model.safetensors``, ``adapter_config.json``): every stage's adapter tensors,
    their layers numbered as in the whole model, gathered to rank 0 of `group`, which writes
    them. A collective: every stage calls it."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    try:
        mine = whole_names(model, {k: v.detach().cpu() for k, v in get_peft_model_state_dict(model).items()})
    except StreamSetupError:
        raise StreamSetupError(
            "save_pipeline_adapter saves a model pipeline_stage split; this one is whole"
        ) from None
    stages: list[dict | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(stages, mine, group=group)
    if dist.get_rank(group) != 0:
        return
    merged: dict[str, Tensor] = {}
    for part in stages:  # a head or embedding adapter every stage holds: the last stage's, which trains it
        merged.update(part or {})
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(merged, folder / "adapter_model.safetensors", metadata={"format": "pt"})
    model.peft_config[model.active_adapter].save_pretrained(folder)
