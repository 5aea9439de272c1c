"""Tokenised data as flat arrays (`Tokenized`), and their cache.

A corpus tokenised once is kept under ``$NARROWS_CACHE/data/<key>``, the key a hash of
everything the tokens depend on: the data files (path and content hash), the split, the
tokenizer (its vocabulary, merges and chat template), ``--seq-len``, ``--columns`` and this
module's format version. A later run (or another rank) maps the arrays instead of
tokenising again. The arrays hold each token once (int32); `Example` objects are made
per micro-batch, so the corpus is never in memory twice.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from array import array
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch

from ...io.files import atomic_dir, build_lock, cache_dir
from .encode import Example, encode_row
from .formats import DataError
from .sources import Source

__all__ = ["Tokenized", "tokenize", "tokenize_rows", "tokenizer_digest"]

VERSION = 1  # bump when the tokens a row gives change


class Tokenized(Sequence[Example]):
    """Examples as flat arrays: ``ids``/``labels`` (int32, every example end to end) and
    ``starts`` (offsets, one more than examples); `wheres` names each example's row."""

    def __init__(self, ids, labels, starts, wheres: Sequence[str], formats: dict[str, int]) -> None:
        self.ids, self.labels, self.starts = ids, labels, starts
        self.wheres = wheres
        self.formats = formats  # format name -> rows

    @classmethod
    def build(cls, named: Iterable[tuple[str, Example]]) -> Tokenized:
        ids, labels, starts, wheres, formats = array("i"), array("i"), array("q", [0]), [], Counter()
        for name, ex in named:
            ids.extend(ex.input_ids)
            labels.extend(ex.labels)
            starts.append(len(ids))
            wheres.append(ex.where)
            formats[name] += 1
        as_tensor = lambda a, dt: torch.frombuffer(a, dtype=dt) if len(a) else torch.zeros(0, dtype=dt)  # noqa: E731
        return cls(
            as_tensor(ids, torch.int32),
            as_tensor(labels, torch.int32),
            as_tensor(starts, torch.int64),
            wheres,
            dict(formats),
        )

    def __len__(self) -> int:
        return len(self.wheres)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        s, e = int(self.starts[i]), int(self.starts[i + 1])
        return Example(tuple(self.ids[s:e].tolist()), tuple(self.labels[s:e].tolist()), self.wheres[i])

    def lengths(self) -> list[int]:
        return torch.diff(self.starts).tolist()

    def digest(self) -> str:
        h = hashlib.sha256()
        for t in (self.ids, self.labels, self.starts):
            h.update(t.contiguous().numpy().tobytes())
        return h.hexdigest()[:16]

    def describe(self) -> str:
        if len(self.formats) == 1:
            return f"{len(self)} rows, format {next(iter(self.formats))}"
        shown = ", ".join(f"{name} ({n})" for name, n in sorted(self.formats.items(), key=lambda kv: -kv[1]))
        return f"{len(self)} rows, formats {shown}"

    def save(self, folder: Path) -> None:
        torch.save({"ids": self.ids, "labels": self.labels, "starts": self.starts}, folder / "tokens.pt")
        (folder / "rows.json").write_text(json.dumps({"wheres": list(self.wheres), "formats": self.formats}))

    @classmethod
    def load(cls, folder: Path) -> Tokenized:
        arrays = torch.load(folder / "tokens.pt", mmap=True, weights_only=True)  # mapped, not read
        rows = json.loads((folder / "rows.json").read_text())
        return cls(arrays["ids"], arrays["labels"], arrays["starts"], rows["wheres"], rows["formats"])


def tokenize_rows(
    rows: Iterable[tuple[str, dict]], tokenizer, seq_len: int, renames: dict[str, str] | None = None
) -> Tokenized:
    """Every row encoded (`encode_row`) and checked; the first bad row is an error naming it."""
    return Tokenized.build(encode_row(row, tokenizer, seq_len, where, renames) for where, row in rows)


def tokenizer_digest(tokenizer) -> str:
    """A hash of what decides a tokenizer's ids: vocabulary and merges (the fast tokenizer's
    JSON), special tokens and chat template."""
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(repr((tokenizer.eos_token_id, tokenizer.all_special_tokens, tokenizer.chat_template)).encode())
    return h.hexdigest()


def tokenize(
    source: Source, tokenizer, seq_len: int, renames: dict[str, str] | None = None, cache: bool = True
) -> tuple[Tokenized, str]:
    """The source's rows tokenised, from the cache when an earlier run (or rank) made them.
    Returns (examples, how: "cached" or "tokenised")."""
    if not cache:
        return _read(source, tokenizer, seq_len, renames), "tokenised"
    key = hashlib.sha256(
        json.dumps(
            [
                VERSION,
                source.identity(),
                tokenizer_digest(tokenizer),
                seq_len,
                sorted((renames or {}).items()),
            ]
        ).encode()
    ).hexdigest()[:24]
    folder = cache_dir("data") / key
    with build_lock(folder):  # one rank tokenises; the others wait, then map its arrays
        if (folder / "rows.json").is_file():
            return Tokenized.load(folder), f"cached in {folder}"
        tokens = _read(source, tokenizer, seq_len, renames)
        with atomic_dir(folder) as tmp:
            tokens.save(tmp)
    return Tokenized.load(folder), f"tokenised, cached in {folder}"


def _ticking(rows: Iterable[tuple[str, dict]], what: str, every: float = 10.0) -> Iterator[tuple[str, dict]]:
    """`rows` passed through, with a line on stderr every `every` seconds saying how far
    tokenising has got: a large corpus is never silent for long."""
    start = last = time.monotonic()
    n = 0
    for n, row in enumerate(rows, 1):
        yield row
        now = time.monotonic()
        if now - last >= every:
            last = now
            print(
                f"narrows: tokenising {what}: {n} rows in {now - start:.0f} s ({n / (now - start):.0f} rows/s)",
                file=sys.stderr,
                flush=True,
            )


def _read(source: Source, tokenizer, seq_len: int, renames: dict[str, str] | None) -> Tokenized:
    tokens = tokenize_rows(_ticking(source.rows(), str(source.path)), tokenizer, seq_len, renames)
    if not len(tokens):
        raise DataError(f"data {str(source.path)!r} has no rows")
    return tokens
