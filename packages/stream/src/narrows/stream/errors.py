"""Errors narrows-stream raises on bad input; each says what to do instead."""

from narrows.core import NarrowsError


class BudgetTooSmallError(NarrowsError, ValueError):
    """The GPU budget cannot hold even one streamed layer plus the fixed costs."""


class StreamSetupError(NarrowsError, ValueError):
    """The model cannot be streamed as given (already on the GPU in full, nothing trains, …)."""


class SelfCheckError(NarrowsError, RuntimeError):
    """Streamed and resident execution of one layer disagreed at start-up."""
