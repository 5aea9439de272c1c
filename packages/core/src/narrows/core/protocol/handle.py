"""The one attribute narrows keeps on a user's model: ``narrows``, a `ModelState` on the
transformers model inside any PEFT wrapper (`state_of`). Every package keeps what it attaches
there — the loss replacement and what it tells planners, the head's source, a running head
sweep, a streamed base's tiers and checkpoint — instead of attributes of its own on the
user's modules. `model.narrows_stream` stays beside it: users' code reads it (README).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from .anatomy import unwrap_model

__all__ = ["ModelState", "state_of"]


@dataclass(eq=False)
class ModelState:
    """What narrows has attached to one model (None: nothing of that kind)."""

    lmhead: Any = None  # narrows-lmhead's handle, while its loss replaces the model's
    loss_working_set: Any = None  # tokens -> bytes the loss holds at once (for planners)
    head_source: Any = None  # where the head's weight is served from (a streamed head)
    head_sweep: Any = None  # the running `sharing_head_pass`'s sweep
    tiers: Any = None  # where a streamed base's layers live (narrows-stream)
    checkpoint: Path | None = None  # the folder the model was loaded from, layer by layer
    file_sources: dict[int, Any] = field(default_factory=dict)  # each layer's tensors' places in that folder
    kernels: str | None = None  # what the decoder layers run, in words (the main job's summary)
    targets: str | None = None  # what the adapter adapts and leaves frozen, in words (the main job's)
    data_parallel: bool = False  # replicated across ranks (narrows-stream's data_parallel)


def state_of(model: nn.Module) -> ModelState:
    """The `ModelState` of `model` (the transformers model inside its PEFT wrappers), made
    on first use."""
    inner = unwrap_model(model)
    state = inner.__dict__.get("narrows")
    if state is None:
        state = ModelState()
        inner.__dict__["narrows"] = state
    return state
