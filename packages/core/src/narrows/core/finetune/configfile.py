"""``narrows finetune --config FILE``: a run's settings from a JSON file instead of a long
command line, as axolotl and torchtune users write theirs. The file holds
`FinetuneConfig`'s fields by name, or is a run folder's own ``config.json`` (its settings,
without their history), so a finished run's settings start the next one."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from ..errors import NarrowsError
from .config import FinetuneConfig
from .rundir import FORMAT

__all__ = ["read_config_file"]

# fields a file does not set: where the run was (a new run names its own --out) is kept,
# but the ranks a run had are the launcher's to say
_NOT_FROM_FILE = ("world_size",)


def _kinds(annotation: str) -> tuple[type, ...]:
    """The JSON types a field's annotation takes (``int | None`` → int, None)."""
    kinds: list[type] = []
    for part in annotation.replace(" ", "").split("|"):
        kinds += {
            "int": [int],
            "float": [int, float],
            "bool": [bool],
            "str": [str],
            "None": [type(None)],
        }.get(part, [])
    return tuple(kinds)


def read_config_file(path: str) -> dict[str, Any]:
    """The settings `path` holds, checked by name and type; the file or folder named, and
    the field, in every refusal."""
    file = Path(path).expanduser()
    if file.is_dir():
        file = file / "config.json"
    try:
        saved = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise NarrowsError(
            f"--config {path}: no such file; give a JSON file of settings or a run folder"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise NarrowsError(f"--config {file}: not readable as JSON ({e})") from None
    if isinstance(saved, dict) and saved.get("format") == FORMAT:
        saved = saved.get("config")
    if not isinstance(saved, dict):
        raise NarrowsError(f'--config {file}: expected a JSON object of settings, e.g. {{"steps": 200}}')
    fields = {f.name: f for f in dataclasses.fields(FinetuneConfig)}
    unknown = sorted(k for k in saved if k not in fields)
    if unknown:
        dashed = [k for k in unknown if k.replace("-", "_") in fields]
        hint = f" (write {dashed[0].replace('-', '_')!r}: field names, not flags)" if dashed else ""
        raise NarrowsError(
            f"--config {file}: unknown settings {unknown}{hint}; known: {', '.join(sorted(fields))}"
        )
    settings = {}
    for name, value in saved.items():
        if name in _NOT_FROM_FILE:
            continue
        kinds = _kinds(str(fields[name].type))  # the annotation as written: "int | None"
        if kinds and not (isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)):
            wanted = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
            raise NarrowsError(f"--config {file}: {name} = {value!r} should be {wanted}")
        settings[name] = value
    return settings
