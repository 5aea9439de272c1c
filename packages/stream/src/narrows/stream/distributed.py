"""Data parallel over a streamed base: `data_parallel(model)` wraps a streamed (or resident)
PEFT model in `DistributedDataParallel` over its adapters only.

Only the trainable parameters are synchronised and summed, in rank order
(`narrows.core.rank_ordered_sum`); ranks that differ in versions, trainable parameters or
stream layout stop every rank with a message naming the rank. R ranks, one micro-batch
each, equal one process accumulating the R micro-batches bit for bit (R a power of two
for DDP's mean; any R with ``average=False``). Torch's own DDP over a streamed model (as
accelerate and the Trainer build it) all-reduces: exact at two ranks, within rounding
beyond (register `rank_ordered_sum` on it for exact).

why: docs/design.md#data-parallel
"""

from __future__ import annotations

import contextlib
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from narrows.core import rank_ordered_sum, trainable_parameters
from narrows.core.protocol.handle import state_of

from .errors import StreamSetupError

_PACKAGES = ("narrows-core", "narrows-stream", "narrows-dora", "narrows-lmhead")


def _versions() -> dict[str, str]:
    found = {}
    for name in _PACKAGES:
        with contextlib.suppress(PackageNotFoundError):  # siblings a rank does not install
            found[name] = version(name)
    return found


def fingerprint(model: nn.Module) -> dict[str, Any]:
    """What every rank must agree on before training together."""
    handle = getattr(model, "narrows_stream", None)
    plan = handle.plan if handle is not None else None
    # what changes the numbers; residency and graphs do not (a "fit" budget may differ by rank)
    layout = (
        None if plan is None else {"layer_bytes": list(plan.layer_bytes), "tile_tokens": plan.tile_tokens}
    )
    return {
        "narrows": _versions(),
        "trainable": [(n, tuple(p.shape), str(p.dtype)) for n, p in trainable_parameters(model).items()],
        "plan": layout,
    }


def check_ranks(model: nn.Module, group: Any = None) -> None:
    """Stop every rank, naming the first that differs from rank 0, when the ranks are not
    about to train the same thing (a collective: every rank calls it)."""
    mine = fingerprint(model)
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    for rank, theirs in enumerate(every):
        for key in mine:
            if theirs[key] != every[0][key]:
                raise StreamSetupError(
                    f"rank {rank} differs from rank 0 in {key}: {_diff(every[0][key], theirs[key])}. Every rank "
                    "must run the same narrows versions on the same model with the same adapters; check the "
                    "environment each rank starts in and the arguments it was given"
                )


def _diff(a: Any, b: Any) -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        keys = sorted(set(a) | set(b), key=str)
        return "; ".join(f"{k}: {a.get(k)!r} against {b.get(k)!r}" for k in keys if a.get(k) != b.get(k))
    if isinstance(a, list) and isinstance(b, list):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return f"item {i}: {x!r} against {y!r}"
        return f"{len(a)} items against {len(b)}"
    return f"{a!r} against {b!r}"


def data_parallel(model: nn.Module, *, average: bool = True, **ddp_kwargs: Any) -> DistributedDataParallel:
    """`DistributedDataParallel(model, **ddp_kwargs)` over the trainable parameters only,
    after `check_ranks`, the ranks' gradients added in rank order and (`average`, DDP's
    default) divided by their number. Call it after `narrows.stream.stream(model, ...)` (and
    after narrows-dora / narrows-lmhead are applied), in every rank, with the process group
    initialised. On CUDA pass ``device_ids=[local_rank]`` as usual."""
    if not dist.is_available() or not dist.is_initialized():
        raise StreamSetupError(
            "data_parallel needs an initialised process group: launch with torchrun and call "
            "torch.distributed.init_process_group() first (backend 'nccl' on GPUs, 'gloo' on the CPU)"
        )
    trainable = trainable_parameters(model)
    if not trainable:
        raise StreamSetupError(
            "nothing in this model trains: add adapters before wrapping it for data parallel"
        )
    device = _device(model, ddp_kwargs)
    if device is not None and device.type == "cuda":  # NCCL's object collectives use the current device
        torch.cuda.set_device(device)
    check_ranks(model, ddp_kwargs.get("process_group"))
    frozen = [n for n, _ in model.named_parameters() if n not in trainable]  # stream() set it too
    frozen += [n for n, _ in model.named_buffers()]  # the same on every rank
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, frozen)
    state_of(model).data_parallel = True  # StepTrainer refuses it: its gradients bypass DDP's hooks
    ddp = DistributedDataParallel(model, **ddp_kwargs)
    ddp.register_comm_hook(ddp_kwargs.get("process_group"), rank_ordered_sum(average))
    return ddp


def _device(model: nn.Module, ddp_kwargs: dict[str, Any]) -> torch.device | None:
    ids = ddp_kwargs.get("device_ids")
    if ids:
        return torch.device("cuda", ids[0]) if isinstance(ids[0], int) else torch.device(ids[0])
    handle = getattr(model, "narrows_stream", None)
    return handle.device if handle is not None else None
