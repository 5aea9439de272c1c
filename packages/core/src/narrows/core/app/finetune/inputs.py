"""What a run trains on, by content: the model and data it started with, recorded in
``config.json`` (paths and fingerprints), and checked again when it resumes.

A resumed run finds the same files or refuses, naming what changed; ``--override``
continues on changed files and records it; a moved file named anew with its flag is
accepted when its content is the one recorded. The embedded default is fingerprinted too.

why: docs/design.md#run-inputs
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from ...errors import NarrowsError
from ...io.fingerprint import data_fingerprint, differences, model_fingerprint, unsampled
from ...sizes import format_bytes
from .config import FinetuneConfig

__all__ = [
    "INPUTS",
    "InputCheck",
    "absolute",
    "absolute_inputs",
    "check_inputs",
    "record_inputs",
    "require_inputs",
]

# config field -> (flag, what it is, how it is fingerprinted)
INPUTS = {
    "model": ("--model", "model", model_fingerprint),
    "data": ("--data", "training data", data_fingerprint),
    "eval_data": ("--eval-data", "held-out data", data_fingerprint),
}
_LOUD = 256 << 20  # inputs larger than this say that they are being hashed


def absolute_inputs(cfg: FinetuneConfig) -> FinetuneConfig:
    """`cfg` with the paths of a new run made absolute (from the directory it is started in),
    so that its config names the same files wherever it is resumed from."""
    named = {name: cfg.settings()[name] for name in INPUTS}
    return cfg.replace(**{name: absolute(value) for name, value in named.items() if value is not None})


def absolute(text: str) -> str:
    """A path as config.json records it: absolute, from the directory the command runs in."""
    return str(Path(text).expanduser().absolute())


def _where(cfg: FinetuneConfig, name: str) -> Path | None:
    """The file behind an input field; the embedded default's files when it is unset."""
    value = cfg.settings()[name]
    if value is not None:
        return Path(value)
    if cfg.base.model is None and name in ("model", "data"):
        from .. import bundled

        return bundled.smollm2_gguf() if name == "model" else bundled.gsm8k_file()
    return None


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _fingerprint(name: str, path: Path, loud: bool) -> dict:
    size = _size(path)
    if loud and size > _LOUD:
        print(
            f"narrows: hashing {INPUTS[name][1]} {path} ({format_bytes(size)}) to record what the run trains on",
            file=sys.stderr,
            flush=True,
        )
    return INPUTS[name][2](path)


def record_inputs(cfg: FinetuneConfig, *, loud: bool = True) -> dict:
    """``{field: {"path", "fingerprint"}}`` of every input the run has (config.json's "inputs")."""
    out = {}
    for name in INPUTS:
        path = _where(cfg, name)
        if path is not None:
            out[name] = {"path": str(path), "fingerprint": _fingerprint(name, path, loud)}
    return out


@dataclass
class InputCheck:
    """What `check_inputs` found: the inputs to record, moves and overridden changes for
    the history entry, and lines to print."""

    inputs: dict
    moved: dict  # field -> [old path, new path]: same content
    changed: dict  # field -> what differed (applied with --override)
    notes: list[str]


def require_inputs(folder: Path, cfg: FinetuneConfig) -> None:
    """Refuse a resume whose inputs are not where `cfg` names them, saying how to name a new
    place (`NarrowsError`)."""
    for name, (flag, what, _) in INPUTS.items():
        path = _where(cfg, name)
        if path is None or path.exists():
            continue
        hint = f"if it moved, name its new place: narrows finetune --resume {folder} {flag} NEW_PATH"
        if cfg.settings()[name] is None:
            hint = "the embedded default's package is missing or was reinstalled elsewhere: pip install 'narrows-core[default]'"
        raise NarrowsError(
            f"--resume {folder}: the {what} the run trained on, {path}, is not there any more; {hint}"
        )


def check_inputs(folder: Path, cfg: FinetuneConfig, recorded: dict | None, override: bool) -> InputCheck:
    """Find the run's inputs again for ``--resume``, where `cfg` names them now (a moved
    input named anew with its flag is in `cfg` already: `resuming.plan_resume`).

    `recorded`: config.json's "inputs" (None: a run from before narrows recorded them).
    Refuses (`NarrowsError`) an input that is gone, or whose content differs from the
    recorded one, unless `override`."""
    require_inputs(folder, cfg)
    check = InputCheck({}, {}, {}, [])
    for name, (flag, what, _) in INPUTS.items():
        old = (recorded or {}).get(name)
        path = _where(cfg, name)
        if path is None:
            continue
        fingerprint = _fingerprint(name, path, True)
        check.inputs[name] = {"path": str(path), "fingerprint": fingerprint}
        if old is None:
            if recorded is not None:
                continue
            check.notes.append(
                f"{flag} {path}: this run started before narrows recorded its inputs' content, so "
                "it cannot tell whether they changed; recorded now"
            )
            continue
        diffs = differences(old["fingerprint"], fingerprint)
        headers_only = unsampled(old["fingerprint"])
        if headers_only and not diffs:
            check.notes.append(
                f"{flag} {path}: recorded before narrows sampled the weights' content, so only the "
                f"size and header of {', '.join(headers_only)} could be compared; sampled and "
                "recorded now"
            )
        if diffs:
            if not override:
                raise NarrowsError(
                    f"--resume {folder}: the {what} changed since the run started ({path}: {'; '.join(diffs)}). "
                    f"The rest of the run would train on other {what} than its checkpoints did. Put the "
                    f"original back, name where it is now with {flag} PATH, or add --override to continue on it "
                    "as it is (recorded in the run's history)"
                )
            check.changed[name] = diffs
            check.notes.append(
                f"{flag} {path} differs from what the run started with ({'; '.join(diffs)}); "
                "continuing on it (--override, recorded in the run's history)"
            )
        if cfg.settings()[name] is not None and os.path.normpath(old["path"]) != os.path.normpath(path):
            check.moved[name] = [old["path"], str(path)]
            if not diffs:
                check.notes.append(
                    f"{flag} now {path}: the same content as {old['path']}, where the run started"
                )
    return check
