"""`narrows finetune`: one LoRA / DoRA fine-tune with whatever narrows packages are installed.

The main job, apart from core's protocol modules: `config` (what a run depends on),
`run_folder` (the run folder: lock, settings, checkpoints, metrics), `build` (inputs checked,
model loaded and wrapped), `loop` (the training steps), `evaluate` (held-out loss, exact
match), `report` (summary, adapter, plot), `job` (new and resumed runs), `state` (what
state a run folder is in, for whoever scores it), `ranks` (several
ranks launched by torchrun) and `command` (the CLI flags). A resumed run ends with the adapter `torch.equal` to an uninterrupted one.
"""

from typing import TYPE_CHECKING

from ...lazy import lazy_attributes as _lazy_attributes

if TYPE_CHECKING:
    from .config import RESUMABLE, FinetuneConfig, lmhead_options
    from .evaluate import eval_loss, exact_match
    from .job import finetune, resume
    from .report import format_summary
    from .run_folder import RunFolder
    from .state import RunBase, RunState, run_base, run_state

# imported on first use (PEP 562): the CLI's flags (`command`) load without torch
_LAZY = {
    "RESUMABLE": "config",
    "FinetuneConfig": "config",
    "lmhead_options": "config",
    "eval_loss": "evaluate",
    "exact_match": "evaluate",
    "finetune": "job",
    "resume": "job",
    "format_summary": "report",
    "RunFolder": "run_folder",
    "RunBase": "state",
    "RunState": "state",
    "run_base": "state",
    "run_state": "state",
}
__getattr__, __dir__ = _lazy_attributes(__name__, _LAZY)


__all__ = [
    "RESUMABLE",
    "FinetuneConfig",
    "RunBase",
    "RunFolder",
    "RunState",
    "eval_loss",
    "exact_match",
    "finetune",
    "format_summary",
    "lmhead_options",
    "resume",
    "run_base",
    "run_state",
]
