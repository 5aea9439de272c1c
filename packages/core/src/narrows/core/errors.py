"""Errors every narrows package raises: each says what is wrong and how to fix it."""

from __future__ import annotations


class NarrowsError(Exception):
    """Base class of the errors narrows raises on bad input or a missing piece."""


class UnsupportedArchitectureError(NarrowsError, ValueError):
    """The model's layout is not one narrows knows (or could find by structure)."""


class MissingDependencyError(NarrowsError, ImportError):
    """An optional package a feature needs is not installed."""


class SlotMismatchError(NarrowsError, ValueError):
    """A frozen slot was pointed at a tensor of another shape, dtype or layout."""
