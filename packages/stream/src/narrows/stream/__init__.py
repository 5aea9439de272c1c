"""narrows.stream — train adapters on a frozen base that lives in host memory.

``stream(model, "12GiB")`` (or ``stream(model, StreamConfig(...))``) parks each decoder
layer's frozen storage in host memory and streams it to the device; training is
bit-identical (`torch.equal`) to the same model trained fully resident.
``StepTrainer(model, optimizer, grad_accum=G)`` runs each step block-major, `torch.equal`
to sequential accumulation; ``data_parallel(model)`` wraps a streamed model in DDP over its
adapters; ``pipeline_stage(model)`` streams one rank's block of layers as a stage of torch's
pipelining schedules. The plan (``model.narrows_stream.plan``) gives every decision with its reason.

why: docs/design.md#stream
"""

from typing import TYPE_CHECKING

from narrows.core.lazy import lazy_attributes as _lazy_attributes
from narrows.core.versions import installed_version as _installed_version

if TYPE_CHECKING:  # the names by module; `_MODULES` groups them by what they are for
    from .api import StreamHandle, stream
    from .checks.profile import LayerTimes, Profile
    from .config import StreamConfig
    from .distributed import check_ranks, data_parallel
    from .errors import BudgetTooSmallError, SelfCheckError, StreamSetupError
    from .execution.tiling import SequenceTiles, tile_sequence
    from .pipeline import pipeline_loss, pipeline_stage, save_pipeline_adapter, stage_names, whole_names
    from .planning import (
        Plan,
        Rates,
        choose_step_mode,
        default_host_budget,
        holds_weights,
        plan,
        step_mode_reserve,
    )
    from .stepmode import StepStats, StepTrainer
    from .stepmode.hf import StepModeTrainer
    from .storage.engine import TransferStats
    from .storage.pretrained import from_pretrained, prepare

# each module -> its public names, imported on first use (PEP 562): `narrows --help` (the
# ``narrows prepare`` entry point, `cli`) registers without torch. `hf` (transformers.Trainer,
# accelerate) loads only when StepModeTrainer is asked for. Grouped as above.
_MODULES = {
    # streaming a model
    "api": ("StreamHandle", "stream"),
    "config": ("StreamConfig",),
    "planning": (
        "Plan",
        "Rates",
        "choose_step_mode",
        "default_host_budget",
        "holds_weights",
        "plan",
        "step_mode_reserve",
    ),
    "execution.tiling": ("SequenceTiles", "tile_sequence"),
    # step mode
    "stepmode": ("StepStats", "StepTrainer"),
    "stepmode.hf": ("StepModeTrainer",),
    # loading
    "storage.pretrained": ("from_pretrained", "prepare"),
    # several ranks
    "distributed": ("check_ranks", "data_parallel"),
    "pipeline": ("pipeline_loss", "pipeline_stage", "save_pipeline_adapter", "stage_names", "whole_names"),
    # measuring
    "storage.engine": ("TransferStats",),
    "checks.profile": ("LayerTimes", "Profile"),
    # errors
    "errors": ("BudgetTooSmallError", "SelfCheckError", "StreamSetupError"),
}
_LAZY = {name: module for module, names in _MODULES.items() for name in names}
# twincheck first: it registers the "stream" architecture check
__getattr__, __dir__ = _lazy_attributes(__name__, _LAZY, first="checks.twincheck")


__version__ = _installed_version("narrows-stream")
__all__ = [
    "BudgetTooSmallError",
    "LayerTimes",
    "Plan",
    "Profile",
    "Rates",
    "SelfCheckError",
    "SequenceTiles",
    "StepModeTrainer",
    "StepStats",
    "StepTrainer",
    "StreamConfig",
    "StreamHandle",
    "StreamSetupError",
    "TransferStats",
    "__version__",
    "check_ranks",
    "choose_step_mode",
    "data_parallel",
    "default_host_budget",
    "from_pretrained",
    "holds_weights",
    "pipeline_loss",
    "pipeline_stage",
    "plan",
    "prepare",
    "save_pipeline_adapter",
    "stage_names",
    "step_mode_reserve",
    "stream",
    "tile_sequence",
    "whole_names",
]
