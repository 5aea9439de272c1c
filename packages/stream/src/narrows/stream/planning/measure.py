"""What the planner reads off a model before it decides: the device it runs on, the budget
in bytes, each decoder layer's frozen bytes, the frozen parts outside the layers that go
to the device (all but a host embedding and a streamed head), and the host memory
available. `stream` places the same
parts the plan counted, so both read them here."""

from __future__ import annotations

import torch
from torch import nn

from narrows.core import (
    DEFAULT_HEAD_ROWS,
    Anatomy,
    FrozenSlot,
    SlabLayout,
    frozen_slots,
    parse_bytes,
    unwrap_model,
)

from ..errors import StreamSetupError

__all__ = [
    "budget_bytes",
    "default_host_budget",
    "device_parts",
    "frozen_layer_bytes",
    "head_rows",
    "host_embedding",
    "matmul_workspaces",
    "resolve_device",
    "streams_head",
]


def resolve_device(device: torch.device | str | None) -> torch.device:
    """The device to train on: CUDA (the current one) when there is one, else the CPU."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def budget_bytes(gpu_budget: str | int | None, device: torch.device) -> int | None:
    """The budget in bytes: None for the smallest footprint; "fit", what the device has free."""
    if gpu_budget is None or gpu_budget == "min":
        return None
    if gpu_budget == "fit":
        if device.type != "cuda":
            return 2**62  # the CPU is the device: everything fits
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.9) + torch.cuda.memory_allocated(device)
    return parse_bytes(gpu_budget)


def matmul_workspaces(device: torch.device) -> int:
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


def frozen_layer_bytes(anat: Anatomy) -> list[int]:
    """Each decoder layer's frozen storage as one slab (NF4 state included)."""
    return [
        SlabLayout.of(frozen_slots(layer, prefix=path)).nbytes
        for path, layer in zip(anat.layer_paths, anat.layers)
    ]


def streams_head(anat: Anatomy, head: str) -> bool:
    """Whether the head is streamed; refuses a head that cannot be."""
    if head == "resident":
        return False
    if any(p.requires_grad for p in anat.head.parameters()):
        raise StreamSetupError(
            "head='stream' needs a frozen LM head; this one trains, so use head='resident'"
        )
    if not isinstance(anat.head, nn.Linear):
        raise StreamSetupError(f"head='stream' needs lm_head to be nn.Linear, not {type(anat.head).__name__}")
    return True


def head_rows(anat: Anatomy, rows: int | None) -> int:
    """Vocabulary rows per chunk of a streamed head."""
    return min(rows or DEFAULT_HEAD_ROWS, anat.config.vocab_size)


def host_embedding(anat: Anatomy, stream_head: bool) -> bool:
    """The embedding can stay on the host when it is frozen and not tied to a device head."""
    return (stream_head or not anat.tied) and not any(p.requires_grad for p in anat.embed.parameters())


def device_parts(
    model: nn.Module, anat: Anatomy, on_host_embedding: bool, stream_head: bool
) -> list[FrozenSlot]:
    """Frozen slots outside the decoder layers that go to the device (all but a host
    embedding and a streamed head)."""
    layer_prefixes = tuple(p + "." for p in anat.layer_paths)
    root = unwrap_model(model)
    kept = {id(s.owner) for s in frozen_slots(anat.embed)} if on_host_embedding else set()
    if stream_head:
        kept |= {id(s.owner) for s in frozen_slots(anat.head)}
    return [
        s for s in frozen_slots(root) if not s.name.startswith(layer_prefixes) and id(s.owner) not in kept
    ]


def default_host_budget() -> int:
    """85% of the memory the kernel reports available (MemAvailable) when narrows starts."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        import psutil  # type: ignore[import-not-found]  # not Linux

        avail = psutil.virtual_memory().available
    return int(avail * 0.85)
