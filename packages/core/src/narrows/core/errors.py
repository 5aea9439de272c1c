"""Errors every narrows package raises: each says what is wrong and how to fix it."""

from __future__ import annotations


class NarrowsError(Exception):
    """Base class of the errors narrows raises on bad input or a missing piece."""

    exit_code = 2  # what the `narrows` command exits with when it stops on one


class Interrupted(NarrowsError):
    """The user stopped the run (Ctrl-C); the message says what was kept and how to go on.
    The command exits 130, as a shell does for a process ended by SIGINT."""

    exit_code = 130


class UnsupportedArchitectureError(NarrowsError, ValueError):
    """The model's layout is not one narrows knows (or could find by structure)."""


class MissingDependencyError(NarrowsError, ImportError):
    """An optional package a feature needs is not installed."""


class SlotMismatchError(NarrowsError, ValueError):
    """A frozen slot was pointed at a tensor of another shape, dtype or layout."""
