"""Where rows come from: a local JSONL file (read here, line by line), any other file the
`datasets` library reads by its extension (parquet, arrow, csv, json), or a folder written
by ``datasets.save_to_disk``. Only local paths: nothing is fetched from a hub.

Rows are read one at a time (`datasets` streams the files, or maps the saved Arrow
files), so a large corpus is never held in memory as Python objects.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

from ...io.fingerprint import data_fingerprint
from .formats import DataError

__all__ = ["BUILDERS", "Source", "open_source", "read_jsonl"]

# extension -> the datasets builder that reads it
BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv", ".json": "json"}


def read_jsonl(path: str | os.PathLike) -> Iterator[tuple[str, dict]]:
    """``(where, row)`` for every non-blank line; a malformed line is an error naming it."""
    path = Path(path).expanduser()
    with open(path, encoding="utf-8") as f, _utf8(path):
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise DataError(f"{where}: each line must be a JSON object, got {type(row).__name__}")
            yield where, row


@contextmanager
def _utf8(path: Path, parsed_elsewhere: bool = False) -> Iterator[None]:
    """A text file that is not UTF-8 becomes a DataError naming its first bad byte. With
    `parsed_elsewhere` (a file `datasets` parses, whose readers report a bad byte in words of
    their own), any error but a DataError is checked for one."""
    try:
        yield
    except DataError:
        raise
    except Exception as e:
        if not (isinstance(e, UnicodeDecodeError) or parsed_elsewhere):
            raise
        said = _not_utf8(path)
        if said is None:
            if isinstance(e, UnicodeDecodeError):
                said = f"{path} is not UTF-8 text ({e.reason}); {_resave(path)}"
            else:
                raise
        raise DataError(said) from None


def _not_utf8(path: Path) -> str | None:
    """Where `path` first fails to decode as UTF-8 and how to fix it (None: it decodes). Found
    by reading it again line by line: a decoder's position is within its buffer, not the file."""
    offset = 0
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as e:
                return (
                    f"{path}:{n}: not UTF-8 (byte 0x{raw[e.start]:02x} at byte offset {offset + e.start} "
                    f"of the file, {e.reason}); {_resave(path)}"
                )
            offset += len(raw)
    return None


def _resave(path: Path) -> str:
    return (
        f"narrows reads text data as UTF-8: re-save the file as UTF-8, e.g. for Latin-1 text "
        f"iconv -f latin1 -t utf-8 {path} > {path.with_suffix('.utf8' + path.suffix)}"
    )


@dataclass(frozen=True)
class Source:
    """A local dataset: `path`, its `kind` (jsonl, a datasets builder, or saved), the split."""

    path: Path
    kind: str
    split: str | None = None

    def rows(self) -> Iterator[tuple[str, dict]]:
        if self.kind == "jsonl":
            yield from read_jsonl(self.path)
            return
        with _utf8(self.path, parsed_elsewhere=True) if self.kind in ("csv", "json") else nullcontext():
            for i, row in enumerate(self._dataset()):
                yield f"{self.path} [row {i}]", row

    def identity(self) -> list:
        """What the tokenised cache is keyed on: the path (row names in messages carry it)
        and every file's content (`data_fingerprint`): never times, which a copy or a
        ``touch -r`` can set back over changed content."""
        return [self.kind, self.split, str(self.path.resolve()), data_fingerprint(self.path)]

    def _dataset(self):
        datasets = _datasets(self.path)
        if self.kind == "saved":
            ds = datasets.load_from_disk(str(self.path))  # maps the saved Arrow files
            return ds[self.split] if self.split is not None else ds
        # CSV cells stay text as written (no guessed numbers, no empty cell turned None)
        options = {}
        if self.kind == "csv":
            with open(self.path, newline="", encoding="utf-8") as f, _utf8(self.path):
                header = next(csv.reader(f), [])
            text = datasets.Features({name: datasets.Value("string") for name in header})
            options = {"features": text, "keep_default_na": False}
        # streamed from the file itself: no converted copy in the datasets cache
        return datasets.load_dataset(
            self.kind, data_files=str(self.path), split="train", streaming=True, **options
        )


def _datasets(path: Path):
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"reading {path} needs the datasets library: pip install 'narrows-core[data]' "
            "(or give a JSONL file)"
        ) from None
    return datasets


def _saved_splits(path: Path) -> list[str] | None:
    """The splits of a ``save_to_disk`` folder ([] for a single Dataset), None if it is not one."""
    if (path / "dataset_dict.json").is_file():
        return list(json.loads((path / "dataset_dict.json").read_text())["splits"])
    if (path / "state.json").is_file() and (path / "dataset_info.json").is_file():
        return []
    return None


def open_source(text: str, split: str | None = None, flag: str = "--data") -> Source:
    """The local dataset `text` names, checked (exists, readable kind, split) before any row
    is read; every problem is a DataError saying how to fix it."""
    split_flag = "--data-split" if flag == "--data" else "--eval-split"
    path = Path(text).expanduser()
    if not path.exists():
        raise DataError(
            f"{flag} {text}: no such local file or folder. narrows reads local data only and never "
            "downloads one: save a hub dataset once with datasets.load_dataset(NAME).save_to_disk(FOLDER) "
            "where it can be reached, then give the folder"
        )
    if path.is_dir():
        splits = _saved_splits(path)
        if splits is None:
            raise DataError(
                f"{flag} {text}: a folder must be one written by datasets' save_to_disk (it has no "
                "dataset_dict.json or state.json); give a data file instead"
            )
        if not splits:
            if split is not None:
                raise DataError(f"{flag} {text} holds one dataset, not several splits: drop {split_flag}")
            return Source(path, "saved")
        if split is None and len(splits) > 1:
            raise DataError(f"{flag} {text} holds the splits {splits}: choose one with {split_flag}")
        split = split if split is not None else splits[0]
        if split not in splits:
            raise DataError(f"{split_flag} {split}: {text} holds the splits {splits}")
        return Source(path, "saved", split)
    if split is not None:
        raise DataError(f"{split_flag} chooses a split of a save_to_disk folder; {text} is a file: drop it")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return Source(path, "jsonl")
    if suffix not in BUILDERS:
        raise DataError(
            f"{flag} {text}: narrows reads .jsonl, {', '.join(BUILDERS)} files or a save_to_disk "
            f"folder, not {suffix or 'a file without an extension'}"
        )
    _datasets(path)
    return Source(path, BUILDERS[suffix])
