"""Deterministic kernels: the condition under which "bit-identical" is checkable on a GPU.

`deterministic()` sets ``torch.use_deterministic_algorithms(True)``, cuBLAS's fixed
workspace (``CUBLAS_WORKSPACE_CONFIG=:4096:8``: set it before the first GPU matmul) and
deterministic cuDNN. On the CPU every kernel narrows uses is already deterministic.

why: docs/design.md#deterministic-kernels
"""

from __future__ import annotations

import logging
import os

import torch

__all__ = ["deterministic"]

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
