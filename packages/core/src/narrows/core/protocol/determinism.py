"""Deterministic kernels: the condition under which "bit-identical" is checkable on a GPU.

`deterministic()` sets ``torch.use_deterministic_algorithms(True)``, cuBLAS's fixed
workspace (``CUBLAS_WORKSPACE_CONFIG=:4096:8``: set it before the first GPU matmul) and
deterministic cuDNN. On the CPU every kernel narrows uses is already deterministic.

`rank_ordered_sum` is the same condition across ranks: a DDP communication hook that adds
the ranks' gradients in rank order, as one process accumulating their micro-batches one
after another adds them. An all-reduce adds them in an order of its own (NCCL's ring or
tree), so beyond two ranks its sum differs from that one process in the last bits.

why: docs/design.md#deterministic-kernels
"""

from __future__ import annotations

import logging
import os

import torch

__all__ = ["data_parallel_bytes", "deterministic", "rank_ordered_sum"]

log = logging.getLogger("narrows")

CUBLAS_WORKSPACE = ":4096:8"


def deterministic(enabled: bool = True) -> None:
    """Make every kernel this process runs reproducible run to run (or stop insisting)."""
    if enabled and os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in (":4096:8", ":16:8"):
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            log.warning(
                "narrows: CUBLAS_WORKSPACE_CONFIG set after CUDA started; export "
                "CUBLAS_WORKSPACE_CONFIG=:4096:8 before launching for cuBLAS to honour it"
            )
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
    torch.use_deterministic_algorithms(enabled)
    torch.backends.cudnn.deterministic = enabled
    if enabled:
        torch.backends.cudnn.benchmark = False  # autotuning picks kernels run by run


DDP_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's default bucket_cap_mb


def rank_ordered_sum(average: bool = False):
    """A `DistributedDataParallel` communication hook (``ddp.register_comm_hook(group, hook)``)
    under which R ranks, one micro-batch each, train exactly what one process does accumulating
    those R micro-batches in rank order: every rank's gradient bucket is gathered and added
    ``((g0 + g1) + g2) + ...``, as autograd adds each micro-batch's gradient to ``.grad``.
    `average`: then divided by R, DDP's mean (equal to scaling each micro-batch's loss by 1/R
    where R is a power of two; DDP's own mean is no closer elsewhere).

    It moves R buckets to every rank where an all-reduce moves about two (small for adapters'
    gradients), one bucket at a time: the gather is ordered on the current stream before the
    sum, which is written into the bucket itself, so the R copies of one bucket (at most R ×
    25 MiB, DDP's default cap) are all the memory it adds. Handing DDP the gathered copies
    instead would keep every bucket's until the backward ends: R times the gradients."""
    import torch.distributed as dist

    def hook(group, bucket):  # no annotations: DDP inspects the hook's signature
        mine = bucket.buffer()  # one flat tensor
        world = dist.get_world_size(group)
        every = torch.empty(world * mine.numel(), dtype=mine.dtype, device=mine.device)
        dist.all_gather_into_tensor(every, mine, group=group)  # the current stream waits for it
        every = every.view(world, *mine.shape)
        mine.copy_(every[0])
        for k in range(1, world):
            mine.add_(every[k])
        if average:
            mine.div_(world)
        done = torch.futures.Future()
        done.set_result(mine)
        return done

    return hook


def data_parallel_bytes(trainable_bytes: int, world: int) -> int:
    """Device bytes DDP over `world` ranks with `rank_ordered_sum` adds to a step: its
    buckets, a copy of every trainable gradient, and one bucket gathered from every rank."""
    if world < 2:
        return 0
    return trainable_bytes + world * min(trainable_bytes, DDP_BUCKET_BYTES)
