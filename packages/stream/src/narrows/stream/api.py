"""`stream(model, gpu_budget=...)`: one call that makes a PEFT model train with its frozen
decoder layers streamed from host memory, and the handle it leaves on the model."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from narrows.core import (
    Anatomy,
    HeldWeights,
    adopt_quantized_experts,
    anatomy_of,
    assign,
    attach_head_source,
    copies,
    ensure_architecture,
    frozen_slots,
    fuse_layers,
    measure_peaks,
    read_peaks,
    trainable_parameters,
    unwrap_model,
)
from narrows.core import deterministic as set_deterministic
from narrows.core.protocol.handle import state_of

from .checks.profile import Profile
from .checks.selfcheck import self_check
from .checks.twincheck import check_stream as _check_stream  # noqa: F401  (registers the "stream" check)
from .config import StreamConfig
from .errors import StreamSetupError
from .execution.executor import EagerExecutor, LayerExecutor
from .execution.graphs import LayerGraphs
from .execution.head import StreamedHead
from .execution.kept_attention import HostAttention
from .execution.offload import ActivationOffload
from .execution.wiring import executor_for, install_forwards, tile_mlps
from .planning import Plan, Rates, Shapes, plan, planned_shapes
from .planning.measure import device_parts, head_rows, host_embedding, resolve_device, streams_head
from .storage.engine import LayerStore, TransferEngine, park_layer
from .storage.tiers import DiskReader, Tiers

log = logging.getLogger("narrows.stream")

__all__ = ["StreamHandle", "stream"]


@dataclass
class StreamHandle:
    """What `stream` leaves on the model as ``model.narrows_stream``."""

    plan: Plan
    engine: TransferEngine
    stores: list[LayerStore]
    device: torch.device
    host_embedding: bool  # embedding rows are gathered on the host
    head: StreamedHead | None = None  # set when the LM head is streamed in vocabulary chunks
    offload: ActivationOffload | None = None  # saved layer inputs in host memory
    graphs: LayerGraphs | None = None  # the executor when it is CUDA graphs (their stats, pool and pause)
    replan: Callable[[Rates], Plan] | None = None  # the same plan made with other rates
    shapes: Shapes | None = None  # the model's and the batch's, as the plan took them
    config: StreamConfig | None = None  # what the model was streamed with (device resolved)
    executor: LayerExecutor = field(default_factory=EagerExecutor)  # runs the layers narrows runs (`wiring`)
    held: HeldWeights | None = None  # where 4-bit weights are held dequantised, when the plan holds them
    kernels: str = ""  # which kernels the decoder layers run, and why not the fast ones where they do not

    @contextmanager
    def profiling(self) -> Iterator[Profile]:
        """``with model.narrows_stream.profiling() as prof: train_step()`` — each layer's
        compute, copy and exposed copy time; ``print(prof)`` after the block, with what
        the planner would change given the measured rates (see `profile`)."""
        prof = Profile(self.device, self.plan, self.replan)
        self.engine.profiler = prof
        try:
            yield prof
        finally:
            self.engine.profiler = None
            prof.finish()

    @property
    def stats(self):
        return self.engine.stats

    def measure(self) -> Any:
        """``with model.narrows_stream.measure() as peaks: train_step()`` — measured peak."""
        return measure_peaks(self.device)

    def report(self) -> dict[str, object]:
        """Predicted against measured: the plan's peak and per-step transfer beside the
        device's peak allocation since the last `narrows.core.reset_peaks` (or process
        start; with CUDA graphs, the pool and the captures as `LayerGraphs.peak_bytes` counts
        them, since the last `graphs.reset_peak()` too) and the bytes the engine actually moved."""
        measured = read_peaks(self.device).cuda_allocated if self.device.type == "cuda" else None
        if measured is not None and self.graphs is not None:
            measured = self.graphs.peak_bytes(measured)
        return {
            "predicted_peak": self.plan.predicted_peak,
            "measured_peak": measured,
            "peak_ratio": measured / self.plan.predicted_peak if measured else None,
            "predicted_h2d_per_step": self.plan.h2d_bytes_per_step,
            "predicted_d2h_per_step": self.plan.d2h_bytes_per_step,
            "offloaded_layers": len(self.plan.offloaded),
            "tile_tokens": self.plan.tile_tokens,
            "whole_layers": len(self.plan.whole),
            "head_streamed": self.head is not None,
            **self.stats.as_dict(),
            "graphs": self.graphs.stats.as_dict() if self.graphs is not None else None,
            "graph_pool_bytes": self.graphs.pool_bytes() if self.graphs is not None else 0,
        }


def _park(anat: Anatomy, tiers: Tiers | None, pin: bool) -> list[LayerStore]:
    """Each layer's host store: where `from_pretrained` placed it (pinned slab or disk
    tier), taken without a copy; otherwise its frozen tensors packed into a new slab."""
    stores = []
    for i, (path, layer) in enumerate(zip(anat.layer_paths, anat.layers)):
        if tiers is None:
            stores.append(park_layer(i, layer, path, pin=pin))
            continue
        on_disk = i in tiers.disk
        store = park_layer(
            i, layer, path, pin=pin, home=tiers.homes[i], layout=tiers.layouts[i], on_disk=on_disk
        )
        if on_disk and not store.on_disk:
            log.warning(
                "narrows.stream: layer %d was changed after loading; its disk-tier copy was read into "
                "host memory",
                i,
            )
        stores.append(store)
    return stores


def _refuse_move(owner: nn.Module, device: torch.device) -> Callable[..., nn.Module]:
    original = owner.to

    def to(*args: Any, **kwargs: Any) -> nn.Module:
        dev, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is not None or (dev is not None and torch.device(dev).type != device.type):
            raise StreamSetupError(
                "a streamed model cannot be moved or cast: its frozen layers live in host slabs. "
                "Move or cast the model before calling narrows.stream.stream()."
            )
        return owner  # already where it belongs (what Trainer's .to(device) expects)

    to.__wrapped__ = original  # type: ignore[attr-defined]
    return to


def _no_checkpointing(model: nn.Module) -> None:
    lm = unwrap_model(model)
    on = getattr(lm, "is_activation_checkpointing", None)  # transformers >= 5.x name
    if on is None:
        on = getattr(lm, "is_gradient_checkpointing", False)
    if on:
        log.warning(
            "narrows.stream: HF gradient checkpointing is redundant with streaming "
            "(every layer is already recomputed in backward); turning it off."
        )
        lm.gradient_checkpointing_disable()

    def refuse(*args: Any, **kwargs: Any) -> None:
        log.warning(
            "narrows.stream: gradient_checkpointing_enable() ignored — streaming already "
            "recomputes every layer in backward, so checkpointing would only add a second recompute."
        )

    for m in {id(model): model, id(lm): lm}.values():
        m.gradient_checkpointing_enable = refuse


def _refuse_layerdrop(model: nn.Module) -> None:
    """LayerDrop (XGLM, OPT, …) skips decoder layers at random in training: the plan, the
    prefetch order and step mode's capture all expect every layer once, in order, and
    whether a run would notice would depend on the RNG. Refused whatever the RNG state."""
    lm = unwrap_model(model)
    config = getattr(lm, "config", None)
    configs = [config, config.get_text_config()] if hasattr(config, "get_text_config") else [config]
    found = [("config.layerdrop", getattr(c, "layerdrop", 0)) for c in configs]
    found += [
        (f"{name or type(lm).__name__}.layerdrop", getattr(m, "layerdrop", 0))
        for name, m in lm.named_modules()
    ]
    for where, p in found:
        if isinstance(p, int | float) and not isinstance(p, bool) and p > 0:
            raise StreamSetupError(
                f"{where}={p}: in training this model skips each decoder layer at random (LayerDrop), which "
                "narrows.stream cannot run layer by layer as resident training does. Set config.layerdrop = 0 "
                "(load with from_pretrained(..., layerdrop=0), or on a loaded model set model.config.layerdrop = 0 "
                "and the decoder's .layerdrop = 0), then stream it"
            )


def _refuse_alora(model: nn.Module) -> None:
    """aLoRA: PEFT hands each call's offsets to the adapters through forward hooks that live
    only inside ``PeftModel.forward``. A streamed layer recomputed in backward runs after
    they are gone (its adapter silently off), and the self-check, which stops the model at
    its first layer, leaves them behind. Any aLoRA adapter on the model, active or not, is
    refused, in training and in inference."""
    try:
        from peft.tuners.lora.variants import ALoraLinearVariant
    except ImportError:  # a PEFT without aLoRA
        return
    for name, m in model.named_modules():
        for key, variant in getattr(m, "lora_variant", {}).items():
            if isinstance(variant, ALoraLinearVariant):
                raise StreamSetupError(
                    f"{name} carries an aLoRA adapter ({key!r}, alora_invocation_tokens): PEFT passes its "
                    "per-call offsets to the adapters through hooks that exist only during PeftModel.forward, "
                    "and narrows.stream recomputes layers outside it. Train aLoRA without narrows.stream, or use "
                    "a plain LoRA adapter (no alora_invocation_tokens)"
                )


def stream(model: nn.Module, config: StreamConfig | int | str | None = None, /, **options: Any) -> nn.Module:
    """Stream the frozen decoder layers of `model` (a PEFT model on the CPU) to the device.

    `config`: a `StreamConfig`, or its budget with other fields as keywords
    (``stream(model, "12GiB", seq_len=1024)``); the planner decides every "auto" once, and
    ``model.narrows_stream`` keeps the config and the plan with its reasons. Training is then
    bit-identical to fully resident training given deterministic kernels (always on the CPU;
    on CUDA pass ``deterministic=True``). The model's config, ``use_cache`` included, is left as
    given. Refused: LayerDrop (``layerdrop`` > 0) for training, an aLoRA adapter. An
    unannounced architecture is first checked on its shrunk twin. Returns the same model.

    why: docs/design.md#the-stream-call
    """
    cfg = StreamConfig.of(config, **options)
    if getattr(model, "narrows_stream", None) is not None:
        raise StreamSetupError("this model is already streamed")
    if cfg.inference and cfg.graphs == "auto":
        cfg = cfg.replace(
            graphs=False
        )  # forward passes only: nothing is recomputed, no step repeats a capture
    if not cfg.inference:
        _refuse_layerdrop(model)
    _refuse_alora(model)
    adopt_quantized_experts(model)  # PEFT's LoRA on quantised expert stacks, run by narrows
    if cfg.deterministic:
        set_deterministic(True)
    ensure_architecture(model, "head", "stream")
    anat = anatomy_of(model)
    dev = resolve_device(cfg.device)
    cfg = cfg.replace(device=dev)
    trainables = trainable_parameters(model)
    if not trainables and not cfg.inference:
        raise StreamSetupError(
            "nothing in this model trains: add adapters first, e.g. "
            "model = peft.get_peft_model(model, LoraConfig(...)), then call narrows.stream.stream(model); "
            "to evaluate without training, pass inference=True"
        )
    on_device = [
        s.name
        for layer, p in zip(anat.layers, anat.layer_paths)
        for s in frozen_slots(layer, prefix=p)
        if s.tensor.device.type == "cuda"
    ]
    if dev.type == "cuda" and on_device:
        raise StreamSetupError(
            f"the model's decoder layers are already on the GPU ({on_device[0]!r}, …): streaming needs them in host "
            "memory. Load the model on the CPU (no device_map, or device_map='cpu') and let "
            "narrows.stream.stream() place what belongs on the GPU."
        )
    the_plan = plan(model, cfg)  # the one plan of this start: every decision and its reason
    stream_head = streams_head(anat, cfg.head)
    tile_mlps(model, the_plan)  # before anything moves: refuses an MLP it cannot tile (`wiring`)

    # the user's config stays as it is (use_cache included: with packed rows it decides the
    # attention mask, so changing it would change the user's own resident runs); a streamed
    # layer drops the KV cache per call where its recompute would write it twice
    _no_checkpointing(model)

    on_host_embedding = host_embedding(anat, stream_head)
    outside = device_parts(model, anat, on_host_embedding, stream_head)
    assign(outside, copies(outside, dev))
    for p in trainables.values():
        p.data = p.data.to(dev)

    pin = dev.type == "cuda"
    tiers: Tiers | None = state_of(anat.model).tiers
    stores = _park(anat, tiers, pin)
    disk = [s.index for s in stores if s.on_disk]
    reader = DiskReader(tiers.cache, disk, ring=tiers.ring_slabs, pin=pin) if disk else None
    engine = TransferEngine(
        stores, dev, pool_size=the_plan.pool_slabs, resident=set(the_plan.resident), reader=reader
    )

    acts = ActivationOffload(dev, set(the_plan.offloaded), copy_stream=engine.copy_stream, stats=engine.stats)
    attention = None
    if the_plan.kept_attention:  # the fast layers' attention in host memory from forward to backward
        kept = set(the_plan.kept_attention)
        attention = HostAttention(
            kept, ActivationOffload(dev, kept, copy_stream=engine.copy_stream, stats=engine.stats)
        )
    executor = executor_for(the_plan, dev, cfg.kernels, attention)
    layer_graphs = executor if isinstance(executor, LayerGraphs) else None
    kernels_said = "PEFT's modules (kernels='peft')"
    if cfg.kernels == "fast":  # whole layers too: the bits of fuse_layers on a resident model
        fused = fuse_layers(model, recompute=False, lora_dtype=torch.float32 if cfg.lora_dtype else None)
        kernels_said = str(fused)
        (log.warning if fused.refused else log.info)("narrows.stream: %s", kernels_said)
    streamed_head = None
    if stream_head:
        streamed_head = StreamedHead(
            anat.head.weight,
            anat.head.bias,
            dev,
            stats=engine.stats,
            copy_stream=engine.copy_stream,
            rows=head_rows(anat, cfg.head_rows),
            math=anat.logit_math,
        )
        anat.head.weight.data = streamed_head.host  # one host copy, shared with a tied embedding
        attach_head_source(model, streamed_head)
    held = HeldWeights(anat.layers, dev) if the_plan.held_weights else None
    install_forwards(
        anat,
        the_plan,
        engine,
        acts,
        executor,
        streamed_head,
        on_host_embedding,
        dev,
        held,
        whole_graphs=cfg.kernels == "fast",
    )

    shapes = planned_shapes(model, anat, cfg)
    # the same plan with other rates (a profile's): the budget as this plan resolved it
    replanned = cfg.replace(gpu_budget=the_plan.budget)

    def replan(rates: Rates) -> Plan:
        return plan(model, replanned, rates=rates)

    for m in {id(model): model, id(anat.model): anat.model}.values():
        m.to = _refuse_move(m, dev)
        # any DistributedDataParallel wrapping it (yours, accelerate's, Trainer's) leaves the
        # frozen base alone: no broadcast of the host copy, no mixed-device refusal; and the
        # buffers (every rank built the same; some live in host memory with their layer)
        frozen = [n for n, p in m.named_parameters() if not p.requires_grad] + [
            n for n, _ in m.named_buffers()
        ]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(m, frozen)
        m.narrows_stream = StreamHandle(
            the_plan,
            engine,
            stores,
            dev,
            on_host_embedding,
            streamed_head,
            acts,
            layer_graphs,
            replan,
            shapes,
            cfg,
            executor,
            held,
            kernels_said,
        )
    if cfg.check and not cfg.inference:
        self_check(model, anat, engine, acts)
    log.info("narrows.stream plan:\n%s", the_plan)
    return model
