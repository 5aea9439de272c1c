"""`stream(model, gpu_budget=...)`: one call that makes a PEFT model train with its frozen
decoder layers streamed from host memory, and the handle it leaves on the model."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from narrows.core import (
    DEFAULT_HEAD_ROWS,
    Anatomy,
    SlabLayout,
    anatomy_of,
    assign,
    attach_head_source,
    chunked_logits,
    copies,
    dequantized_bytes,
    ensure_architecture,
    frozen_slots,
    loss_working_set,
    measure_peaks,
    parse_bytes,
    read_peaks,
    trainable_parameters,
    unwrap_model,
)
from narrows.core import deterministic as set_deterministic

from .engine import LayerStore, TransferEngine, park_layer
from .errors import StreamSetupError
from .graphs import LayerGraphs
from .head import StreamedHead
from .offload import ActivationOffload
from .plan import HOST_STATE_NOTES, OFFLOAD_MODES, RECOMPUTE_MODES, Plan, Rates, Shapes, make_plan
from .profile import Profile
from .remat import LayerCall, drop_cache, streamed_call
from .selfcheck import self_check
from .sideouts import SideOutputs
from .tiers import DiskReader, Tiers
from .tiling import tile_sequence
from .twincheck import check_stream as _check_stream  # noqa: F401  (registers the "stream" check)

log = logging.getLogger("narrows.stream")

__all__ = ["StreamHandle", "plan", "stream"]


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
    graphs: LayerGraphs | None = None  # CUDA graphs of the layers narrows runs
    replan: Callable[[Rates], Plan] | None = None  # the same plan made with other rates
    shapes: Shapes | None = None  # the model's and the batch's, as the plan took them

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
        start) and the bytes the engine actually moved."""
        measured = read_peaks(self.device).cuda_allocated if self.device.type == "cuda" else None
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


def _resolve_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _matmul_workspaces(device: torch.device) -> int:
    """Device bytes cuBLAS keeps for a training step's matmuls: a workspace per thread
    that runs them — the Python thread's forward and the autograd engine's backward —
    taken from the caching allocator at each thread's first matmul and kept for the
    process's life. (H100, torch 2.11: two 32 MiB blocks, the 40 MB a 7B step-mode
    run at 1900 MiB measured over its plan.) Without CUDA to ask, Hopper's size."""
    if device.type != "cuda":
        return 0
    size = 32 << 20
    get = getattr(torch._C, "_cuda_getCublasWorkspaceSize", None)
    if get is not None and torch.cuda.is_available():
        with torch.cuda.device(device):
            size = int(get())
    return 2 * size


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _shapes(anat: Anatomy, batch_size: int, seq_len: int) -> Shapes:
    cfg = anat.config
    act = anat.embed.weight.element_size() if hasattr(anat.embed, "weight") else 2
    return Shapes(
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


def _budget(gpu_budget: str | int | None, device: torch.device) -> int | None:
    if gpu_budget is None or gpu_budget == "min":
        return None
    if gpu_budget == "fit":
        if device.type != "cuda":
            return 2**62  # the CPU is the device: everything fits
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.9) + torch.cuda.memory_allocated(device)
    return parse_bytes(gpu_budget)


def _parts(model: nn.Module, anat: Anatomy, host_embedding: bool, stream_head: bool):
    """Frozen slots outside the decoder layers that go to the device (all but a host
    embedding and a streamed head)."""
    layer_prefixes = tuple(p + "." for p in anat.layer_paths)
    root = unwrap_model(model)
    kept = {id(s.owner) for s in frozen_slots(anat.embed)} if host_embedding else set()
    if stream_head:
        kept |= {id(s.owner) for s in frozen_slots(anat.head)}
    return [
        s for s in frozen_slots(root) if not s.name.startswith(layer_prefixes) and id(s.owner) not in kept
    ]


def _head_rows(anat: Anatomy, rows: int | None) -> int:
    return min(rows or DEFAULT_HEAD_ROWS, anat.config.vocab_size)


def _check_head(anat: Anatomy, head: str) -> bool:
    """Whether the head is streamed; refuses what cannot be."""
    if head not in ("resident", "stream"):
        raise StreamSetupError(
            f"head={head!r}: use 'resident' (default, bit-exact) or 'stream' (vocabulary chunks)"
        )
    if head == "resident":
        return False
    if any(p.requires_grad for p in anat.head.parameters()):
        raise StreamSetupError(
            "head='stream' needs a frozen LM head; this one trains, so use head='resident'"
        )
    if not isinstance(anat.head, nn.Linear):
        raise StreamSetupError(f"head='stream' needs lm_head to be nn.Linear, not {type(anat.head).__name__}")
    return True


def _check_layer_options(
    offload: str, seq_tile: int | str | None, recompute: str = "auto"
) -> int | str | None:
    """The tile option as the planner takes it; refuses recompute, offload and tile
    values it cannot take."""
    if recompute not in RECOMPUTE_MODES:
        raise StreamSetupError(f"recompute={recompute!r}: use 'auto' (default: resident layers run without "
                               "recompute while the budget holds their activations) or 'all'")  # fmt: skip
    if offload not in OFFLOAD_MODES:
        raise StreamSetupError(f"offload={offload!r}: use 'auto' (default: saved layer inputs go to host memory "
                               "only when the budget needs it), 'off' or 'all'")  # fmt: skip
    if seq_tile in (None, "off"):
        return None
    if seq_tile == "auto" or (isinstance(seq_tile, int) and not isinstance(seq_tile, bool) and seq_tile > 0):
        return seq_tile
    raise StreamSetupError(f"seq_tile={seq_tile!r}: use None (default: never tile), 'auto' (tile the MLP over the "
                           "sequence only when the budget needs it) or a tile size in tokens, e.g. 4096")  # fmt: skip


def _check_graphs(graphs: object) -> None:
    if not (isinstance(graphs, bool) or graphs == "auto"):
        raise StreamSetupError(f"graphs={graphs!r}: use True (CUDA graphs), False (default: eager layers) or "
                               "'auto' (graphs where the planner predicts them faster)")  # fmt: skip


def plan(model: nn.Module, gpu_budget: str | int | None = None, *, device: torch.device | str | None = None,
         batch_size: int = 1, seq_len: int = 512, prefetch: int = 1, head: str = "resident",
         head_rows: int | None = None, offload: str = "auto", seq_tile: int | str | None = None,
         recompute: str = "auto", rates: Rates | None = None, graphs: bool | str = "auto",
         reserve: int = 0, host_state: str = "none") -> Plan:  # fmt: skip
    """What `stream` would do with this budget, without moving anything (`rates`: what
    the step-time model takes for the machine; default: fitted to the H100; `graphs`: as
    `stream`'s, whose pool the budget then holds; `reserve`, `host_state`: as `stream`'s)."""
    if isinstance(reserve, bool) or not isinstance(reserve, int) or reserve < 0:
        raise StreamSetupError(f"reserve={reserve!r}: give a number of bytes ≥ 0")
    _check_host_state(host_state)
    tile = _check_layer_options(offload, seq_tile, recompute)
    _check_graphs(graphs)
    ensure_architecture(model, "head", "stream")
    anat = anatomy_of(model)
    dev = _resolve_device(device)
    stream_head = _check_head(anat, head)
    host_embedding = _host_embedding(anat, stream_head)
    outside = _parts(model, anat, host_embedding, stream_head)
    fixed = _nbytes(s.tensor for s in outside) + _training_bytes(model, anat, host_state) + reserve
    fixed += _matmul_workspaces(dev)
    head_h2d = 0
    if stream_head:
        w = anat.head.weight
        fixed += 2 * _head_rows(anat, head_rows) * w.shape[1] * w.element_size()  # two chunk buffers
        head_h2d = 2 * _nbytes([w])  # one pass in forward, one in backward
    layer_bytes = [
        SlabLayout.of(frozen_slots(layer, prefix=path)).nbytes
        for path, layer in zip(anat.layer_paths, anat.layers)
    ]
    tiers: Tiers | None = getattr(anat.model, "narrows_tiers", None)
    return make_plan(layer_bytes, fixed_bytes=fixed, shapes=_shapes(anat, batch_size, seq_len),
                     budget=_budget(gpu_budget, dev), device=str(dev), prefetch=prefetch,
                     head_h2d_bytes=head_h2d, disk=tiers.disk if tiers else (),
                     host_bytes=tiers.predicted_host_bytes() if tiers else None,
                     host_budget=tiers.host_budget if tiers else None, offload=offload, tile=tile,
                     recompute=recompute, rates=rates, graphs=graphs, reserved=reserve,
                     host_state=host_state)  # fmt: skip


def _check_host_state(host_state: str) -> None:
    if host_state not in HOST_STATE_NOTES:
        raise StreamSetupError(
            f"host_state={host_state!r}: use one of {', '.join(map(repr, HOST_STATE_NOTES))}"
        )


def _training_bytes(model: nn.Module, anat: Anatomy, host_state: str) -> int:
    """Device bytes of the trainable parameters, their gradients and AdamW's two fp32
    moments; with step mode's host state, the part of them it keeps on the device:
    "optimizer", one layer's state (every gradient may be there at once: a step in
    sequential order keeps them all until its end); "adapters", one layer's parameters,
    gradients and state (only block-major steps, which `StepTrainer` then insists on).
    Trainable parameters outside the layers (a trained head) count whole either way."""

    def numel(ps: list[Tensor]) -> int:
        return sum(p.numel() for p in ps)

    trainable = list(trainable_parameters(model).values())
    if host_state == "none":
        return 2 * _nbytes(trainable) + 8 * numel(trainable)
    per_layer = [[p for p in layer.parameters() if p.requires_grad] for layer in anat.layers]
    in_layers = {id(p) for ps in per_layer for p in ps}
    other = [p for p in trainable if id(p) not in in_layers]
    # a layer's update: its state, and AdamW's temporaries (as large again)
    if host_state == "optimizer":
        return 2 * _nbytes(trainable) + 8 * numel(other) + 16 * max(map(numel, per_layer), default=0)
    one_layer = max((2 * _nbytes(ps) + 16 * numel(ps) for ps in per_layer), default=0)
    return 2 * _nbytes(other) + 8 * numel(other) + one_layer


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
            log.warning("narrows.stream: layer %d was changed after loading; its disk-tier copy was read into "
                        "host memory", i)  # fmt: skip
        stores.append(store)
    return stores


def _host_embedding(anat: Anatomy, stream_head: bool) -> bool:
    """The embedding can stay on the host when it is frozen and not tied to a device head."""
    return (stream_head or not anat.tied) and not any(p.requires_grad for p in anat.embed.parameters())


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
        log.warning("narrows.stream: HF gradient checkpointing is redundant with streaming "
                    "(every layer is already recomputed in backward); turning it off.")  # fmt: skip
        lm.gradient_checkpointing_disable()

    def refuse(*args: Any, **kwargs: Any) -> None:
        log.warning("narrows.stream: gradient_checkpointing_enable() ignored — streaming already "
                    "recomputes every layer in backward, so checkpointing would only add a second recompute.")  # fmt: skip

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


def _check_args(index: int, args: tuple, kwargs: dict) -> None:
    def walk(x: Any) -> None:
        if isinstance(x, Tensor) and x.requires_grad:
            raise StreamSetupError(
                f"layer {index} received a tensor argument that requires grad besides its hidden states; "
                "narrows.stream differentiates only the hidden states and the adapters."
            )
        if isinstance(x, tuple | list):
            for y in x:
                walk(y)
        elif isinstance(x, dict):
            for y in x.values():
                walk(y)

    walk(args)
    walk(kwargs)


def _layer_forward(index: int, layer: nn.Module, engine: TransferEngine, offload: ActivationOffload,
                   graphs: LayerGraphs | None = None) -> Callable[..., Any]:  # fmt: skip
    original = layer.forward
    params = tuple(p for p in layer.parameters() if p.requires_grad)
    side = SideOutputs(layer, index)

    def forward(*args: Any, **kwargs: Any) -> Any:
        if args:
            hidden, args = args[0], args[1:]
        else:
            hidden = kwargs.pop("hidden_states")
        if torch.is_grad_enabled():
            drop_cache(kwargs)
        _check_args(index, args, kwargs)
        call = LayerCall(index, original, args, kwargs, engine, params, side, offload, graphs=graphs)
        return streamed_call(call, hidden)

    forward.__wrapped__ = forward.narrows_original = original  # type: ignore[attr-defined]
    return forward


def stream(
    model: nn.Module,
    gpu_budget: str | int | None = None,
    *,
    device: torch.device | str | None = None,
    batch_size: int = 1,
    seq_len: int = 512,
    prefetch: int = 1,
    head: str = "resident",
    head_rows: int | None = None,
    check: bool = True,
    inference: bool = False,
    deterministic: bool = False,
    offload: str = "auto",
    seq_tile: int | str | None = None,
    recompute: str = "auto",
    graphs: bool | str = "auto",
    reserve: int = 0,
    host_state: str = "none",
) -> nn.Module:
    """Stream the frozen decoder layers of `model` (a PEFT model on the CPU) to `device`.

    `gpu_budget`: bytes or a size like ``"12GiB"`` the run may use on the device; ``"fit"``
    keeps as many layers resident as the free memory allows; None streams every layer
    with the smallest footprint. `batch_size`/`seq_len` size the activation estimate.
    Training afterwards is bit-identical to training the same model fully resident, given
    deterministic kernels: always on the CPU; on CUDA pass ``deterministic=True`` (or call
    `narrows.core.deterministic()`), which makes the resident run itself reproducible.
    An architecture narrows does not announce is first checked on its shrunk twin.
    `head="stream"` also keeps a frozen LM head in host memory and serves it in vocabulary
    chunks through core's head hook (with a tied embedding, both read the one host copy);
    the head's input gradient is then summed over chunks, so it equals the resident head
    up to summation order — bit-exact against the same chunked head kept resident.
    `head_rows` sets the vocabulary rows per chunk (default 8192).
    `check` runs a one-layer streamed-vs-resident self-check first (``check=False`` skips
    it, e.g. for a model whose layers are known to be nondeterministic).
    `inference=True` streams a model for forward passes only (evaluation): nothing needs
    to train, and the self-check (which compares gradients) is skipped. Under ``no_grad``
    each layer then runs as a plain prefetched forward either way.
    `offload`: where each layer's saved input waits for its backward. "auto" (default)
    keeps it on the device while the budget allows and moves the rest to host memory
    (bit-identical either way; with no budget, all of them move); "off" never moves one;
    "all" moves every one. `seq_tile`: None (default) never tiles; "auto" runs the MLPs
    over sequence tiles only when the budget cannot hold the whole-sequence working set;
    a number of tokens always does. Tiled training is `torch.equal` to the same tiling
    resident (`narrows.stream.tile_sequence`) and equal to untiled training up to
    summation order. `recompute`: "auto" (default) runs resident layers *whole* — as
    resident training runs them, activations saved, no recompute — while the budget holds
    their activations (with every layer whole, a step is plain PEFT training without
    checkpointing); "all" recomputes every layer in backward. `graphs=True` replays each
    layer narrows runs itself (streamed or recomputed) as CUDA graphs — its forward, and
    its recompute with its backward — the same kernels on the same inputs, so still
    bit-identical, without the host's per-kernel cost; a layer whose forward waits for
    the host runs eagerly (``model.narrows_stream.graphs.stats.refused`` says why). The
    plan then counts the graphs' pool and prices graphed layers without the host's
    per-kernel cost, so at short sequences it recomputes resident layers rather than
    keep them whole. "auto": on a CUDA device with a budget, graphs when the plan with
    them fits and is predicted faster (the plan's report says which and why); off for the
    smallest footprint (no budget), for `inference=True`, and on a CPU, which has no
    graphs (True there runs the same buffer path eagerly, for tests). "auto" is the
    default. A batch shape is captured when it comes round again, and graphs are kept for
    the four most recent shapes, so batches padded to varying widths hold bounded memory
    (the plan counts it); widths that never repeat run eagerly. `reserve`: device bytes
    the plan leaves free within the budget, for step mode's dequantised weights
    (`step_mode_reserve`; `StepTrainer` holds them when they were reserved).
    `host_state`: what of the training state the plan may leave in host memory, for
    `StepTrainer`'s offload: "none" (default: the adapters, their gradients and AdamW's
    state all on the device), "optimizer" (`offload_optimizer=True`: one layer's
    optimizer state on the device) or "adapters" (`offload_adapters=True` too: one
    layer's adapters, gradients and state; block-major steps only).
    `StepTrainer` must then keep it there, and refuses otherwise.
    The model's config is left as it was given (``use_cache`` included: a streamed layer
    drops the KV cache per call in training, and with packed rows the cache decides the
    attention mask, so pass ``use_cache=False`` yourself for per-sequence masks). A model
    with LayerDrop (``layerdrop`` > 0) is refused for training, whatever the RNG state.
    Returns the same model object; ``model.narrows_stream`` holds the plan and statistics.
    """
    if getattr(model, "narrows_stream", None) is not None:
        raise StreamSetupError("this model is already streamed")
    _check_graphs(graphs)
    if inference and graphs == "auto":
        graphs = False  # forward passes only: nothing is recomputed, and no step repeats a capture
    if not inference:
        _refuse_layerdrop(model)
    if deterministic:
        set_deterministic(True)
    ensure_architecture(model, "head", "stream")
    anat = anatomy_of(model)
    dev = _resolve_device(device)
    trainables = trainable_parameters(model)
    if not trainables and not inference:
        raise StreamSetupError(
            "nothing in this model trains: add adapters first, e.g. "
            "model = peft.get_peft_model(model, LoraConfig(...)), then call narrows.stream.stream(model); "
            "to evaluate without training, pass inference=True"
        )
    on_device = [s.name for layer, p in zip(anat.layers, anat.layer_paths) for s in frozen_slots(layer, prefix=p)
                 if s.tensor.device.type == "cuda"]  # fmt: skip
    if dev.type == "cuda" and on_device:
        raise StreamSetupError(
            f"the model's decoder layers are already on the GPU ({on_device[0]!r}, …): streaming needs them in host "
            "memory. Load the model on the CPU (no device_map, or device_map='cpu') and let "
            "narrows.stream.stream() place what belongs on the GPU."
        )
    the_plan = plan(model, gpu_budget, device=dev, batch_size=batch_size, seq_len=seq_len, prefetch=prefetch,
                    head=head, head_rows=head_rows, offload=offload, seq_tile=seq_tile,
                    recompute=recompute, graphs=graphs, reserve=reserve, host_state=host_state)  # fmt: skip
    stream_head = _check_head(anat, head)
    if the_plan.tile_tokens is not None:
        tile_sequence(model, the_plan.tile_tokens)  # before anything moves: refuses an MLP it cannot tile

    # the user's config stays as it is (use_cache included: with packed rows it decides the
    # attention mask, so changing it would change the user's own resident runs); a streamed
    # layer drops the KV cache per call where its recompute would write it twice
    _no_checkpointing(model)

    host_embedding = _host_embedding(anat, stream_head)
    outside = _parts(model, anat, host_embedding, stream_head)
    assign(outside, copies(outside, dev))
    for p in trainables.values():
        p.data = p.data.to(dev)

    pin = dev.type == "cuda"
    tiers: Tiers | None = getattr(anat.model, "narrows_tiers", None)
    stores = _park(anat, tiers, pin)
    disk = [s.index for s in stores if s.on_disk]
    reader = DiskReader(tiers.cache, disk, ring=tiers.ring_slabs, pin=pin) if disk else None
    engine = TransferEngine(stores, dev, pool_size=the_plan.pool_slabs, resident=set(the_plan.resident),
                            reader=reader)  # fmt: skip

    acts = ActivationOffload(dev, set(the_plan.offloaded), copy_stream=engine.copy_stream, stats=engine.stats)
    layer_graphs = LayerGraphs(dev) if the_plan.graphs else None
    for i, layer in enumerate(anat.layers):
        if i not in the_plan.whole:  # a whole layer runs untouched, as in resident training
            layer.forward = _layer_forward(i, layer, engine, acts, layer_graphs)

    streamed_head = None
    if stream_head:
        streamed_head = StreamedHead(anat.head.weight, anat.head.bias, dev, stats=engine.stats,
                                     copy_stream=engine.copy_stream, rows=_head_rows(anat, head_rows),
                                     math=anat.logit_math)  # fmt: skip
        anat.head.weight.data = streamed_head.host  # one host copy, shared with a tied embedding
        attach_head_source(model, streamed_head)
        anat.head.forward = lambda hidden: chunked_logits(hidden, streamed_head)

    if host_embedding:
        embed_forward = anat.embed.forward

        def embed(input_ids: Tensor, *args: Any, **kwargs: Any) -> Tensor:
            # gather rows on the host: the full embedding matrix never goes to the device
            return embed_forward(input_ids.to("cpu"), *args, **kwargs).to(dev, non_blocking=True)

        anat.embed.forward = embed

    # the same plan with other rates (a profile's): the budget as this plan resolved it
    replan = functools.partial(plan, model, the_plan.budget, device=dev, batch_size=batch_size, seq_len=seq_len,
                               prefetch=prefetch, head=head, head_rows=head_rows, offload=offload,
                               seq_tile=seq_tile, recompute=recompute, graphs=graphs, reserve=reserve,
                               host_state=host_state)  # fmt: skip
    for m in {id(model): model, id(anat.model): anat.model}.values():
        m.to = _refuse_move(m, dev)
        # any DistributedDataParallel wrapping it (yours, accelerate's, Trainer's) leaves the
        # frozen base alone: no broadcast of the host copy, no mixed-device refusal; and the
        # buffers (every rank built the same; some live in host memory with their layer)
        frozen = [n for n, p in m.named_parameters() if not p.requires_grad] + [
            n for n, _ in m.named_buffers()
        ]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(m, frozen)
        m.narrows_stream = StreamHandle(the_plan, engine, stores, dev, host_embedding, streamed_head, acts,
                                        layer_graphs, lambda rates: replan(rates=rates),
                                        _shapes(anat, batch_size, seq_len))  # fmt: skip
    if check and not inference:
        self_check(model, anat, engine, acts)
    log.info("narrows.stream plan:\n%s", the_plan)
    return model
