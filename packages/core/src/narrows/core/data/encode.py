"""Token ids and labels of one row, in whichever format it comes (`formats`).

Masked positions carry label -100, as transformers' losses expect. The causal shift means
label 0 never trains, so a row trains only if some label after the first is not -100;
rows that lose all their trainable tokens to `seq_len` are refused, naming the row.
"""

from __future__ import annotations

from dataclasses import dataclass

from .formats import Chat, DataError, Pair, Text, normalize

__all__ = ["IGNORE", "Example", "encode_row"]

IGNORE = -100


@dataclass(frozen=True)
class Example:
    """One training sequence. `segments`: the lengths of the examples a packed sequence
    holds, in order (empty: one unpacked example)."""

    input_ids: tuple[int, ...]
    labels: tuple[int, ...]
    where: str  # "file:line", for messages about this row
    segments: tuple[int, ...] = ()

    @property
    def trainable(self) -> int:
        return sum(1 for y in self.labels[1:] if y != IGNORE)


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _chat(tokenizer, chat: Chat, where: str) -> tuple[list[int], list[int]]:
    messages = chat.messages
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{where}: a chat row needs a tokenizer with a chat template; this one has none "
                        "(use 'prompt'/'response' rows instead)")  # fmt: skip
    if not any(m["role"] == "assistant" for m in messages[chat.train_from :]):
        what = "its completion" if chat.train_from else "the chat"
        raise DataError(f"{where}: {what} has no assistant turn, so nothing would train")
    ids, labels, done = [], [], ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or i < chat.train_from:
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


def encode_row(
    row: dict, tokenizer, seq_len: int, where: str = "row", renames: dict[str, str] | None = None
) -> tuple[str, Example]:
    """(format name, example) of one row, truncated to `seq_len`, checked to train."""
    name, shape = normalize(row, where, bool(getattr(tokenizer, "chat_template", None)), renames)
    if isinstance(shape, Chat):
        ids, labels = _chat(tokenizer, shape, where)
    elif isinstance(shape, Pair):
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        prompt, answer = _ids(tokenizer, shape.prompt), _ids(tokenizer, shape.response) + eos
        ids, labels = prompt + answer, [IGNORE] * len(prompt) + answer
    else:
        assert isinstance(shape, Text)
        ids = _ids(tokenizer, shape.text)
        labels = list(ids)
    ex = Example(tuple(ids[:seq_len]), tuple(labels[:seq_len]), where)
    if ex.trainable == 0:
        why = (f"truncation to --seq-len {seq_len} cut every trainable token (the row has {len(ids)} tokens)"
               if len(ids) > seq_len else "no token after the first is trainable")  # fmt: skip
        raise DataError(f"{where}: no trainable token: {why}")
    return name, ex
