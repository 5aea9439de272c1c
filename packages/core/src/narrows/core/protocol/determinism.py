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

__all__ = ["deterministic", "rank_ordered_sum"]

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


def rank_ordered_sum(average: bool = False):
    """A `DistributedDataParallel` communication hook (``ddp.register_comm_hook(group, hook)``)
    under which R ranks, one micro-batch each, train exactly what one process does accumulating
    those R micro-batches in rank order: every rank's gradient bucket is gathered and added
    ``((g0 + g1) + g2) + ...``, as autograd adds each micro-batch's gradient to ``.grad``.
    `average`: then divided by R, DDP's mean (equal to scaling each micro-batch's loss by 1/R
    where R is a power of two; DDP's own mean is no closer elsewhere). It moves R buckets to
    every rank where an all-reduce moves about two: small for adapters' gradients."""
    import torch.distributed as dist

    def hook(group, bucket):  # no annotations: DDP inspects the hook's signature
        mine = bucket.buffer()  # one flat tensor
        world = dist.get_world_size(group)
        flat = torch.empty(world * mine.numel(), dtype=mine.dtype, device=mine.device)
        work = dist.all_gather_into_tensor(flat, mine, group=group, async_op=True)

        def fold(_fut):
            every = flat.view(world, *mine.shape)
            total = every[0]
            for k in range(1, world):
                total.add_(every[k])
            return total.div_(world) if average else total

        return work.get_future().then(fold)

    return hook
