"""Third-party messages a narrows user cannot act on, silenced where they are raised (that
logger or that warning only, never a whole library) and listed by ``narrows doctor``
instead, so a bug report still shows them. Installed when ``narrows.core`` is imported."""

from __future__ import annotations

import logging
import re
import warnings
from dataclasses import dataclass

__all__ = ["NOTICES", "Notice", "install", "seen"]


@dataclass(frozen=True)
class Notice:
    kind: str  # "log" (a logging record) or "warning" (warnings.warn)
    source: str  # the logger's name, or the module the warning is attributed to
    pattern: str  # the start of the message
    why: str  # why nothing needs doing, for `narrows doctor`


NOTICES = (
    Notice(
        "log",
        "bitsandbytes.backends.cpu.ops",
        "Failed to load CPU gemm_4bit_forward from kernels-community",
        "bitsandbytes looked for an optional CPU kernel in the `kernels` package (not installed) and uses "
        "its own CPU code instead; nothing is missing for narrows",
    ),
    Notice(
        "warning",
        "transformers.modeling_utils",
        "`is_gradient_checkpointing` is deprecated",
        "PEFT reads the alias transformers 5 deprecated (a FutureWarning); nothing to change on your side",
    ),
)

_seen: list[str] = []  # messages silenced in this process, in order


class _Silence(logging.Filter):
    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith(self.pattern):
            return True
        if message not in _seen:
            _seen.append(message)
        return False


_installed = False


def install() -> None:
    """Silence `NOTICES` in this process (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    for notice in NOTICES:
        if notice.kind == "log":
            logging.getLogger(notice.source).addFilter(_Silence(notice.pattern))
        else:
            warnings.filterwarnings(
                "ignore", message=re.escape(notice.pattern), module=re.escape(notice.source)
            )


def seen() -> list[str]:
    """The silenced log messages raised so far in this process (warnings leave no trace:
    `narrows doctor` raises them again to show them)."""
    return list(_seen)
