"""The installed version of a narrows distribution, also when it runs from a source tree."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

SOURCE_VERSION = "0+source"


def installed_version(dist: str) -> str:
    """``dist``'s installed version; ``SOURCE_VERSION`` when its sources are imported from a
    checkout on ``PYTHONPATH`` without being installed (how the GPU machine runs them)."""
    try:
        return version(dist)
    except PackageNotFoundError:
        return SOURCE_VERSION
