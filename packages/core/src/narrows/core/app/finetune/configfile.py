"""A run's settings read from JSON, checked by name and type, one reader for every file:
``narrows finetune --config FILE`` and a run folder's ``config.json``.

Flat or grouped layouts read into one `FinetuneConfig`; anything wrong with the file is a
`NarrowsError` naming the file and the field. Imports no torch.

why: docs/design.md#config-files
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import NarrowsError
from .config import GROUPS, SETTINGS, FinetuneConfig, leaves

__all__ = ["FORMAT", "RunFile", "check_settings", "read_config_file", "read_run_file"]

FORMAT = "narrows-finetune-run/1"

# fields a --config file does not set: the ranks a run had are the launcher's to say
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


def check_settings(saved: object, where: str) -> dict[str, Any]:
    """`saved` checked to be FinetuneConfig's settings by name and JSON type, returned flat
    (``{"steps": 200}``): each under its own name, or in its group (``{"training": {"steps":
    200}}``), as files of either layout hold them; `where` (a file, or a flag and a file)
    begins every refusal."""
    if not isinstance(saved, dict):
        raise NarrowsError(
            f'{where}: expected a JSON object of settings, e.g. {{"steps": 200}}, '
            f"found a JSON {type(saved).__name__}"
        )
    flat: dict[str, Any] = {}
    named: dict[str, str] = {}  # setting -> how the file names it (``steps`` or ``training.steps``)
    for key, value in saved.items():
        if key in GROUPS and isinstance(value, dict):
            inner = {f"{key}.{name}": name for name in value}
            unknown = sorted(path for path, name in inner.items() if SETTINGS.get(name) != key)
            if unknown:
                known = [f"{key}.{f.name}" for f in dataclasses.fields(GROUPS[key])]
                raise NarrowsError(f"{where}: unknown settings {unknown}; known: {', '.join(known)}")
            entries = [(path, name, value[name]) for path, name in inner.items()]
        else:
            entries = [(key, key, value)]
        for path, name, setting in entries:
            if name in flat:
                raise NarrowsError(f"{where}: {name} is given twice ({named[name]} and {path}): keep one")
            flat[name], named[name] = setting, path
    unknown = sorted(k for k in flat if k not in SETTINGS)
    if unknown:
        dashed = [k for k in unknown if k.replace("-", "_") in SETTINGS]
        hint = f" (write {dashed[0].replace('-', '_')!r}: field names, not flags)" if dashed else ""
        raise NarrowsError(f"{where}: unknown settings {unknown}{hint}; known: {', '.join(sorted(SETTINGS))}")
    fields = {f.name: f for _, f in leaves()}
    for name, value in flat.items():
        kinds = _kinds(str(fields[name].type))  # the annotation as written: "int | None"
        if kinds and not (isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)):
            wanted = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
            raise NarrowsError(f"{where}: {named[name]} = {value!r} should be {wanted}")
    return flat


def _load_json(file: Path, where: str) -> object:
    try:
        return json.loads(file.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise NarrowsError(f"{where}: not readable as JSON: not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise NarrowsError(f"{where}: not readable as JSON ({e})") from None


def read_config_file(path: str) -> dict[str, Any]:
    """The settings `path` holds (a JSON file of settings or a run folder), checked by name
    and type; the file or folder named, and the field, in every refusal."""
    file = Path(path).expanduser()
    if file.is_dir():
        file = file / "config.json"
    try:
        saved = _load_json(file, f"--config {file}")
    except FileNotFoundError:
        raise NarrowsError(
            f"--config {path}: no such file; give a JSON file of settings or a run folder"
        ) from None
    except OSError as e:
        raise NarrowsError(f"--config {file}: cannot be read ({e.strerror})") from None
    if isinstance(saved, dict) and saved.get("format") == FORMAT:
        saved = saved.get("config")
    settings = check_settings(saved, f"--config {file}")
    return {k: v for k, v in settings.items() if k not in _NOT_FROM_FILE}


@dataclass(frozen=True)
class RunFile:
    """A run folder's ``config.json``, checked: the settings as the file holds them now,
    their history, the inputs by content, and `started_with`, the settings the run's last
    start ran with as narrows wrote them (None: the file is from before narrows kept them),
    against which a hand edit of `config` is told apart."""

    config: FinetuneConfig
    history: list[dict]
    inputs: dict | None
    started_with: FinetuneConfig | None


def read_run_file(file: Path) -> RunFile:
    """The run folder's ``config.json`` at `file`, checked field by field (`RunFile`)."""
    where = str(file)
    try:
        saved = _load_json(file, where)
    except OSError as e:
        raise NarrowsError(f"{where}: cannot be read ({e.strerror}); the run's settings are lost") from None
    if not (isinstance(saved, dict) and saved.get("format") == FORMAT):
        # written before settings had a history: the object is the settings themselves
        settings = check_settings(saved, where)
        return RunFile(FinetuneConfig.from_dict(settings, where), [], None, None)
    if "config" not in saved:
        raise NarrowsError(
            f"{where}: no \"config\" (the run's settings); the file is damaged: put back the run's "
            "own config.json, or start a new run with --out"
        )
    config = FinetuneConfig.from_dict(check_settings(saved["config"], f"{where}: config"), where)
    history = saved.get("history", [])
    if not (isinstance(history, list) and all(isinstance(e, dict) for e in history)):
        raise NarrowsError(f"{where}: history should be a list of objects, one per start of the run")
    inputs = saved.get("inputs")
    if inputs is not None and not isinstance(inputs, dict):
        raise NarrowsError(f"{where}: inputs should be an object (the model and data by content)")
    started_with = None
    if history and "config" in history[-1]:
        last = f"{where}: history[{len(history) - 1}].config"
        started_with = FinetuneConfig.from_dict(check_settings(history[-1]["config"], last), last)
    return RunFile(config, history, inputs, started_with)
