"""Every check of what is installed lives here, so that a missing optional package
always produces the same actionable message (which distribution, which extra).

Public: the sibling packages check their own optional backends (triton, liger-kernel, cut-cross-entropy)
through `is_available` and `require` too, so the message is the same wherever it is raised.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from functools import cache
from types import ModuleType

from .errors import MissingDependencyError

__all__ = ["NARROWS_PACKAGES", "OPTIONAL", "distribution_version", "is_available", "require"]

# import name -> (distribution to install, the narrows extra that pulls it in, or None)
OPTIONAL: dict[str, tuple[str, str | None]] = {
    "bitsandbytes": ("bitsandbytes", "narrows-core[nf4]"),
    "triton": ("triton", "narrows-dora[kernels]"),
    "lm_eval": ("lm-eval", "narrows-eval"),
    "gguf": ("gguf", "narrows-core[gguf]"),
    "matplotlib": ("matplotlib", "narrows-core[plot]"),
    "cut_cross_entropy": ("cut-cross-entropy", None),
    "liger_kernel": ("liger-kernel", "narrows-core[liger]"),
    "tensorboard": ("tensorboard", "narrows-core[tensorboard]"),
    "wandb": ("wandb", "narrows-core[wandb]"),
}

# narrows packages by import name -> distribution name
NARROWS_PACKAGES: dict[str, str] = {
    "narrows.core": "narrows-core",
    "narrows.stream": "narrows-stream",
    "narrows.dora": "narrows-dora",
    "narrows.lmhead": "narrows-lmhead",
    "narrows.eval": "narrows-eval",
}


@cache
def is_available(module: str) -> bool:
    """True when `module` can be imported (found on the path; not imported here)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def distribution_version(dist: str) -> str | None:
    """The installed version of distribution `dist`, None where it is not installed."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def require(module: str, feature: str) -> ModuleType:
    """Import an optional dependency or raise an error naming the install line.

    `feature` says what the user asked for ("NF4 quantisation"), so the message
    reads as an answer to what they did rather than a stack trace.
    """
    if module in NARROWS_PACKAGES:
        dist, extra = NARROWS_PACKAGES[module], None
    else:
        dist, extra = OPTIONAL.get(module, (module, None))
    if not is_available(module):
        how = f"pip install '{extra}'" if extra else f"pip install {dist}"
        raise MissingDependencyError(
            f"{feature} needs the package `{dist}`, which is not installed. Install it with: {how}"
        )
    return importlib.import_module(module)
