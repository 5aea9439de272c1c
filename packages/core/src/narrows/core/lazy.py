"""Package attributes imported on first use (PEP 562), so that light entry points
(``narrows --help``, the siblings' ``narrows.cli`` registrations) never import torch.

A package names where each public attribute lives and binds the returned pair:
``__getattr__, __dir__ = lazy_attributes(__name__, {"stream": "api", ...})``.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from importlib import import_module

__all__ = ["lazy_attributes"]


def lazy_attributes(
    package: str, where: dict[str, str], *, first: str | None = None
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """(``__getattr__``, ``__dir__``) for `package`: `where` maps a public name to the
    submodule holding it (relative, without the dot); `first` is a submodule imported
    before any of them (one that registers something on import)."""

    def __getattr__(name: str) -> object:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        if first is not None:
            import_module(f".{first}", package)
        value = getattr(import_module(f".{module}", package), name)
        setattr(sys.modules[package], name, value)  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *where})

    sys.modules[package].__class__ = _make_keeper(package, where)
    return __getattr__, __dir__


def _make_keeper(package: str, where: dict[str, str]) -> type[types.ModuleType]:
    """A module class that keeps a public name from being replaced by the submodule of
    the same name (a function ``pkg.plan`` beside a module ``pkg/plan.py``): importing a
    submodule sets it on its package, which an eager ``from .api import plan`` used to
    undo afterwards."""

    class Package(types.ModuleType):
        def __setattr__(self, name: str, value: object) -> None:
            if (
                name in where
                and isinstance(value, types.ModuleType)
                and value.__name__ == f"{package}.{name}"
            ):
                return  # the submodule stays in sys.modules; the package's name stays the public one
            super().__setattr__(name, value)

    return Package
