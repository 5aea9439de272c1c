"""`apply(model, *configs)`: narrows' transforms of a model, each given as its package's
config object, applied in the one order that works.

Stages, in order: ``"loss"``, ``"tiles"``, ``"layers"``, ``"residency"`` (with a residency
config, give neither ``"tiles"`` nor ``"layers"``). Packages register their config types
when imported (`register`).

why: docs/design.md#the-order-of-transforms
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["STAGES", "apply", "register"]

STAGES = ("loss", "tiles", "layers", "residency")

_REGISTERED: dict[type, tuple[str, Callable[[nn.Module, Any], nn.Module | None]]] = {}

# the package that registers each stage's configs, for the error that names it
_WHERE = {
    "loss": "narrows.lmhead",
    "tiles": "narrows.stream",
    "layers": "narrows.core",
    "residency": "narrows.stream",
}


def register(config_type: type, stage: str, fn: Callable[[nn.Module, Any], nn.Module | None]) -> None:
    """`apply` runs ``fn(model, config)`` for a config of `config_type`, in `stage`."""
    if stage not in STAGES:
        raise ValueError(f"stage {stage!r}: one of {STAGES}")
    _REGISTERED[config_type] = (stage, fn)


def apply(model: nn.Module, *configs: Any) -> nn.Module:
    """`model` with each config's transform applied, in stage order (see the module doc);
    returns the model. Refused before anything changes: a config of no registered type,
    two of one stage, or tiles or fast layers given beside a residency config."""
    staged: dict[str, Any] = {}
    for config in configs:
        entry = _REGISTERED.get(type(config))
        if entry is None:
            known = ", ".join(sorted(t.__name__ for t in _REGISTERED)) or "none yet"
            raise TypeError(
                f"narrows.core.apply: {type(config).__name__} is not a narrows config (registered: {known}; "
                f"a package registers its configs when imported: {', '.join(sorted(set(_WHERE.values())))})"
            )
        stage = entry[0]
        if stage in staged:
            raise ValueError(
                f"narrows.core.apply: two {stage!r} configs ({type(staged[stage]).__name__}, "
                f"{type(config).__name__}); give one"
            )
        staged[stage] = config
    if "residency" in staged:
        inside = [s for s in ("tiles", "layers") if s in staged]
        if inside:
            raise ValueError(
                f"narrows.core.apply: {type(staged['residency']).__name__} runs its own "
                f"{' and '.join(inside)} (its seq_tile and kernels settings); leave out "
                f"{', '.join(type(staged[s]).__name__ for s in inside)}"
            )
    for stage in STAGES:
        if stage in staged:
            config = staged[stage]
            model = _REGISTERED[type(config)][1](model, config) or model
    return model
