"""narrows.stream — train adapters on a frozen base that lives in host memory.

``narrows.stream.stream(model, gpu_budget="12GiB")`` parks every decoder layer's frozen
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

from importlib.metadata import version as _version

from narrows.core import register_architecture_check as _register_check

from .accumulation import choose_step_mode, holds_weights, step_mode_reserve
from .api import StreamHandle, plan, stream
from .distributed import check_ranks, data_parallel
from .engine import TransferStats
from .errors import BudgetTooSmallError, SelfCheckError, StreamSetupError
from .plan import Plan, Rates
from .pretrained import default_host_budget, from_pretrained, prepare
from .profile import LayerTimes, Profile
from .stepmode import StepStats, StepTrainer
from .tiling import tile_sequence
from .twincheck import check_stream as _check_stream

_register_check("stream", _check_stream)


def __getattr__(name: str):
    if name == "StepModeTrainer":  # transformers.Trainer (and accelerate) load only when asked for
        from .hf import StepModeTrainer

        return StepModeTrainer
    raise AttributeError(f"module 'narrows.stream' has no attribute {name!r}")


__version__ = _version("narrows-stream")
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
