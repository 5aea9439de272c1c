"""narrows.eval — downstream checks through lm-evaluation-harness.

The lm-eval model ``narrows`` (`NarrowsLM`, found by ``lm_eval --model narrows`` with
nothing imported first), task files in `TASK_DIR` (``--include_path``), and `evaluate` /
``narrows eval``: base and adapted in one go, a report that flags differences beyond two
standard errors.

why: docs/design.md#eval
"""

from typing import TYPE_CHECKING

from narrows.core.lazy import lazy_attributes as _lazy_attributes
from narrows.core.versions import installed_version as _installed_version

if TYPE_CHECKING:
    from .lm import NarrowsLM
    from .loading import AdapterChoice, EvalModel, choose_adapter, load_for_eval, resolve_adapter
    from .report import Row, compare, write_report
    from .run import TASK_DIR, evaluate, resolve_tasks

# each module -> its public names, imported on first use (PEP 562): `narrows --help` (the
# ``narrows eval`` entry point, `cli`) registers without torch; `lm` imports lm-eval and
# registers the model ``narrows`` with it, only when NarrowsLM is asked for
_MODULES = {
    "lm": ("NarrowsLM",),
    "loading": ("AdapterChoice", "EvalModel", "choose_adapter", "load_for_eval", "resolve_adapter"),
    "report": ("Row", "compare", "write_report"),
    "run": ("TASK_DIR", "evaluate", "resolve_tasks"),
}
_LAZY = {name: module for module, names in _MODULES.items() for name in names}
__getattr__, __dir__ = _lazy_attributes(__name__, _LAZY)

__version__ = _installed_version("narrows-eval")
__all__ = [
    "TASK_DIR",
    "AdapterChoice",
    "EvalModel",
    "NarrowsLM",
    "Row",
    "__version__",
    "choose_adapter",
    "compare",
    "evaluate",
    "load_for_eval",
    "resolve_adapter",
    "resolve_tasks",
    "write_report",
]
