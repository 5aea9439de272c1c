"""Checking an architecture narrows does not announce, on its shrunk twin, before training it.

`ensure_architecture(model, *checks)`: announced architectures pass at once; an
unannounced one is accepted for the process once every named check passes on its twin,
and refused with what differed otherwise. Nothing trains through a difference.

why: docs/design.md#architecture-checks
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from ..errors import UnsupportedArchitectureError
from .anatomy import (
    _ACCEPTING,
    accepting_unannounced,
    anatomy_of,
    is_announced,
    mark_verified,
    unwrap_model,
)
from .head import head_source
from .twin import shrunk_twin

__all__ = [
    "ArchitectureCheckError",
    "ensure_architecture",
    "register_architecture_check",
    "verify_architecture",
]

log = logging.getLogger("narrows")

Check = Callable[[nn.Module], None]  # gets the user's model, builds twins itself, raises on a difference
_CHECKS: dict[str, Check] = {}
_PASSED: set[tuple[str, str]] = set()  # (model_type, check) that passed in this process


class ArchitectureCheckError(AssertionError):
    """What a twin check found different (raised by checks, reported by `verify_architecture`)."""


def register_architecture_check(name: str, check: Check) -> None:
    """Add (or replace) the check a package runs on twins of unannounced architectures."""
    _CHECKS[name] = check


def _model_type(model: nn.Module) -> str:
    return str(getattr(getattr(unwrap_model(model), "config", None), "model_type", None))


def verify_architecture(model: nn.Module, *checks: str) -> list[str]:
    """Run the named checks (default: every registered one) on twins of `model`; return
    the names that passed, or raise `UnsupportedArchitectureError` saying what differed.
    Passing accepts the model type for the rest of the process."""
    names = list(checks) or sorted(_CHECKS)
    unknown = [n for n in names if n not in _CHECKS]
    if unknown:
        raise ValueError(f"no architecture check named {unknown}; registered: {sorted(_CHECKS)}")
    model_type = _model_type(model)
    with accepting_unannounced():
        try:
            shrunk_twin(model)  # the twin must build before anything can be checked
        except Exception as e:
            raise UnsupportedArchitectureError(
                f"narrows could not build a shrunk twin of {type(unwrap_model(model)).__name__} "
                f"(model_type={model_type!r}) to check it: {type(e).__name__}: {e}. Announced architectures "
                "need no twin; register this one with narrows.core.register_architecture to take responsibility."
            ) from e
        for name in names:
            if (model_type, name) in _PASSED:
                continue
            try:
                _CHECKS[name](model)
            except Exception as e:  # a check that cannot even run on the twin refuses as well
                what = str(e) if isinstance(e, ArchitectureCheckError) else f"{type(e).__name__}: {e}"
                raise UnsupportedArchitectureError(
                    f"narrows does not announce model_type={model_type!r} and its shrunk twin failed the "
                    f"{name!r} check: {what}. narrows will not train it: the result could differ from what the model "
                    "itself computes or from resident training. Report it with `narrows doctor` output."
                ) from e
            _PASSED.add((model_type, name))
    mark_verified(model_type)
    return names


def ensure_architecture(model: nn.Module, *checks: str) -> None:
    """Nothing for an announced architecture (or inside a twin check); otherwise
    `verify_architecture` with the checks that are registered, once per process."""
    model_type = _model_type(model)
    if is_announced(model_type) or _ACCEPTING.get():
        return
    wanted = [c for c in checks if c in _CHECKS]
    if all((model_type, c) in _PASSED for c in wanted) and wanted:
        return
    log.warning(
        "narrows: model_type=%r is not announced; checking it on a shrunk twin (%s)",
        model_type,
        ", ".join(wanted),
    )
    verify_architecture(model, *wanted)
    log.warning("narrows: model_type=%r passed %s on its twin; proceeding", model_type, ", ".join(wanted))


# ---- core's own check -------------------------------------------------------------------
def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if a.shape != b.shape or not torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-5):
        diff = (a.double() - b.double()).abs().max().item() if a.shape == b.shape else "shape"
        raise ArchitectureCheckError(f"{what} (max difference {diff})")


def check_head(model: nn.Module) -> None:
    """The head hook (weight, bias, LogitMath) gives the model's own logits, train and eval."""
    twin = shrunk_twin(model, dropout=None)
    anat = anatomy_of(twin)
    vocab = anat.config.vocab_size
    ids = (torch.arange(12) * 7 + 3).remainder(vocab).unsqueeze(0)
    source = head_source(twin)
    for mode in ("eval", "train"):
        getattr(twin, mode)()
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            hidden = anat.decoder(input_ids=ids).last_hidden_state
            torch.manual_seed(0)
            logits = twin(input_ids=ids).logits
        raw = nn.functional.linear(hidden, *next((w, b) for _, w, b in source.chunks(vocab)))
        _close(
            source.math(raw.float()),
            logits.float(),
            f"the head hook's logits differ from the model's own in {mode} mode: the model does something "
            "between its last hidden state and its logits that narrows does not declare",
        )


register_architecture_check("head", check_head)
