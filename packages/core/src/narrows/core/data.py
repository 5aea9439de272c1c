"""Training data: JSONL rows to token ids with the prompt masked, checked before training.

Each line of a JSONL file is one example, in one of three shapes:

- ``{"messages": [{"role": ..., "content": ...}, ...]}`` — a chat, rendered with the
  tokenizer's chat template; every assistant turn trains, everything else is masked;
- ``{"prompt": ..., "response": ...}`` — plain concatenation, the response (and EOS) trains;
- ``{"text": ...}`` — every token trains.

Masked positions carry label -100, as transformers' losses expect. The causal shift means
label 0 never trains, so a row trains only if some label after the first is not -100;
rows that lose all their trainable tokens to `seq_len` are refused with their line number.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from .errors import NarrowsError

__all__ = ["DataError", "Example", "collate", "encode_row", "micro_batches", "read_jsonl", "tokenize_rows"]

IGNORE = -100


class DataError(NarrowsError):
    """A data row that cannot train; the message names the file and line."""


@dataclass(frozen=True)
class Example:
    input_ids: tuple[int, ...]
    labels: tuple[int, ...]
    where: str  # "file:line", for messages about this row

    @property
    def trainable(self) -> int:
        return sum(1 for y in self.labels[1:] if y != IGNORE)


def read_jsonl(path: str | os.PathLike) -> list[tuple[str, dict]]:
    """``[(where, row)]`` for every non-blank line; a malformed line is an error naming it."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(f"data file {str(path)!r} does not exist")
    rows = []
    with open(path, encoding="utf-8") as f:
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
            rows.append((where, row))
    if not rows:
        raise DataError(f"data file {str(path)!r} has no rows")
    return rows


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _chat(tokenizer, messages: list, where: str) -> tuple[list[int], list[int]]:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{where}: a 'messages' row needs a tokenizer with a chat template; this one has none "
                        "(use 'prompt'/'response' rows instead)")  # fmt: skip
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise DataError(f"{where}: messages[{i}] must be an object with string 'role' and 'content'")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: 'messages' has no assistant turn, so nothing would train")
    ids, labels, done = [], [], ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        # the text up to this turn's content (template's generation prompt included), then the turn
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (before.startswith(done) and through.startswith(before)):
            raise DataError(f"{where}: the chat template does not render turns as a growing prefix; "
                            "narrows cannot tell which tokens belong to the assistant")  # fmt: skip
        prompt, answer = _ids(tokenizer, before[len(done) :]), _ids(tokenizer, through[len(before) :])
        ids += prompt + answer
        labels += [IGNORE] * len(prompt) + answer
        done = through
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    if len(full) > len(done):  # trailing non-assistant turns: context only
        tail = _ids(tokenizer, full[len(done) :])
        ids += tail
        labels += [IGNORE] * len(tail)
    return ids, labels


def encode_row(row: dict, tokenizer, seq_len: int, where: str = "row") -> Example:
    """One JSONL row as token ids and labels, truncated to `seq_len`, checked to train."""
    if "messages" in row:
        if not isinstance(row["messages"], list):
            raise DataError(f"{where}: 'messages' must be a list of {{role, content}} objects")
        ids, labels = _chat(tokenizer, row["messages"], where)
    elif "prompt" in row or "response" in row:
        for field in ("prompt", "response"):
            if field not in row:
                hint = (
                    " ('completion' is read as 'response' by other tools: rename it)"
                    if "completion" in row
                    else ""
                )
                raise DataError(f"{where}: a prompt/response row has no {field!r} field{hint}")
            if not isinstance(row[field], str):
                raise DataError(f"{where}: field {field!r} must be a string, got {type(row[field]).__name__}")
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        prompt, answer = _ids(tokenizer, row["prompt"]), _ids(tokenizer, row["response"]) + eos
        ids, labels = prompt + answer, [IGNORE] * len(prompt) + answer
    elif "text" in row:
        if not isinstance(row["text"], str):
            raise DataError(f"{where}: 'text' must be a string")
        ids = _ids(tokenizer, row["text"])
        labels = list(ids)
    else:
        raise DataError(f"{where}: the row has none of the fields 'messages', 'prompt'/'response' or 'text' "
                        f"(it has {sorted(row)})")  # fmt: skip
    ex = Example(tuple(ids[:seq_len]), tuple(labels[:seq_len]), where)
    if ex.trainable == 0:
        why = (f"truncation to --seq-len {seq_len} cut every trainable token (the row has {len(ids)} tokens)"
               if len(ids) > seq_len else "no token after the first is trainable")  # fmt: skip
        raise DataError(f"{where}: no trainable token: {why}")
    return ex


def tokenize_rows(rows: Iterable[tuple[str, dict]], tokenizer, seq_len: int) -> list[Example]:
    return [encode_row(row, tokenizer, seq_len, where) for where, row in rows]


def collate(examples: Sequence[Example], pad_id: int) -> dict[str, Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (-100 on padding)."""
    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids)
        labels[i, :n] = torch.tensor(e.labels)
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def micro_batches(
    examples: Sequence[Example], batch_size: int, seed: int, start: int = 0
) -> Iterator[list[Example]]:
    """Micro-batch `start`, `start`+1, ... of an endless, seeded stream of epochs.

    Epoch e is a permutation drawn from ``random.Random(seed + e)``; micro-batch k holds
    positions ``k*batch_size ... k*batch_size + batch_size - 1`` of the epochs laid end to
    end. The stream depends on nothing but (seed, k), so a resumed run only needs k.
    """
    n = len(examples)
    pos = start * batch_size
    epoch, perm = -1, []
    while True:
        batch = []
        for p in range(pos, pos + batch_size):
            e, i = divmod(p, n)
            if e != epoch:
                epoch, perm = e, random.Random(seed + e).sample(range(n), n)
            batch.append(examples[perm[i]])
        pos += batch_size
        yield batch
