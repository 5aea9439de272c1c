"""narrows.stream — train adapters on a frozen base that lives in host memory.

``narrows.stream.stream(model, "12GiB")`` (or ``stream(model, StreamConfig(...))``: every
setting in one frozen object) parks every decoder layer's frozen
storage (NF4 quantisation state included) in one host slab per layer and streams it to the
GPU with prefetch; backward recomputes each layer under its saved RNG state (resident
layers the budget can afford run whole, without the recompute). Training is
bit-identical (`torch.equal`) to the same model trained fully resident.
``StepTrainer(model, optimizer, grad_accum=G)`` runs each optimizer step block-major: every
streamed layer crosses the link once for the forward of all G micro-batches and once for
their backward, `torch.equal` to sequential accumulation (``choose_step_mode`` says whether
it pays for a streamed model); there each layer's 4-bit weights are dequantised once per
pass for all G (``stream(..., reserve=step_mode_reserve(model))`` leaves the room for
them within the budget). ``data_parallel(model)`` wraps
a streamed model in DistributedDataParallel over its adapters, for torchrun.
"""

from typing import TYPE_CHECKING

from narrows.core.lazy import lazy_attributes as _lazy_attributes
from narrows.core.versions import installed_version as _installed_version

if TYPE_CHECKING:
    from .accumulation import choose_step_mode, holds_weights, step_mode_reserve
    from .api import StreamHandle, plan, stream
    from .config import StreamConfig
    from .distributed import check_ranks, data_parallel
    from .engine import TransferStats
    from .errors import BudgetTooSmallError, SelfCheckError, StreamSetupError
    from .hf import StepModeTrainer
    from .plan import Plan, Rates
    from .pretrained import default_host_budget, from_pretrained, prepare
    from .profile import LayerTimes, Profile
    from .stepmode import StepStats, StepTrainer
    from .tiling import tile_sequence

# each module -> its public names, imported on first use (PEP 562): `narrows --help` (the
# ``narrows prepare`` entry point, `cli`) registers without torch. `hf` (transformers.Trainer,
# accelerate) loads only when StepModeTrainer is asked for.
_MODULES = {
    "accumulation": ("choose_step_mode", "holds_weights", "step_mode_reserve"),
    "api": ("StreamHandle", "plan", "stream"),
    "config": ("StreamConfig",),
    "distributed": ("check_ranks", "data_parallel"),
    "engine": ("TransferStats",),
    "errors": ("BudgetTooSmallError", "SelfCheckError", "StreamSetupError"),
    "hf": ("StepModeTrainer",),
    "plan": ("Plan", "Rates"),
    "pretrained": ("default_host_budget", "from_pretrained", "prepare"),
    "profile": ("LayerTimes", "Profile"),
    "stepmode": ("StepStats", "StepTrainer"),
    "tiling": ("tile_sequence",),
}
_LAZY = {name: module for module, names in _MODULES.items() for name in names}
# twincheck first: it registers the "stream" architecture check
__getattr__, __dir__ = _lazy_attributes(__name__, _LAZY, first="twincheck")


__version__ = _installed_version("narrows-stream")
__all__ = [
    "BudgetTooSmallError",
    "LayerTimes",
    "Plan",
    "Profile",
    "Rates",
    "SelfCheckError",
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
    "plan",
    "prepare",
    "step_mode_reserve",
    "stream",
    "tile_sequence",
]
