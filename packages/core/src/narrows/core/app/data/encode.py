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
        raise DataError(
            f"{where}: a chat row needs a tokenizer with a chat template; this one has none "
            "(use 'prompt'/'response' rows instead)"
        )
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
            raise DataError(
                f"{where}: the chat template does not render turns as a growing prefix; "
                "narrows cannot tell which tokens belong to the assistant"
            )
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


def _encode(shape: Chat | Pair | Text, tokenizer, where: str) -> tuple[list[int], list[int]]:
    if isinstance(shape, Chat):
        return _chat(tokenizer, shape, where)
    if isinstance(shape, Pair):
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        prompt, answer = _ids(tokenizer, shape.prompt), _ids(tokenizer, shape.response) + eos
        return prompt + answer, [IGNORE] * len(prompt) + answer
    assert isinstance(shape, Text)
    ids = _ids(tokenizer, shape.text)
    return ids, list(ids)


def _cut(shape: Chat | Pair | Text, chars: int) -> tuple[Chat | Pair | Text, bool]:
    """`shape` with every text cut to its first `chars` characters; True if any was cut."""
    if isinstance(shape, Chat):
        messages = [
            {**m, "content": m["content"][:chars]} if isinstance(m.get("content"), str) else m
            for m in shape.messages
        ]
        cut = any(m is not n and len(n["content"]) > chars for m, n in zip(messages, shape.messages))
        return Chat(messages, shape.train_from), cut
    if isinstance(shape, Pair):
        return Pair(shape.prompt[:chars], shape.response[:chars]), max(
            map(len, (shape.prompt, shape.response))
        ) > chars
    return Text(shape.text[:chars]), len(shape.text) > chars


# characters per token the first cut allows (most tokenizers average 3 to 5 on text); a row
# whose kept tokens need more is cut again at twice as many, until the window is settled
_CHARS_PER_TOKEN = 8


def _window(
    shape: Chat | Pair | Text, tokenizer, seq_len: int, where: str
) -> tuple[list[int], list[int], bool]:
    """(ids, labels, whole): the row's tokens, at least its first `seq_len` as tokenising it
    whole gives them, without tokenising a long row whole.

    The window equals the whole row's first `seq_len` tokens; `whole`: no text was cut, so
    the ids are the whole row's.

    why: docs/design.md#tokenising-long-rows
    """
    chars = _CHARS_PER_TOKEN * (seq_len + 1) + 64
    short, cut = _cut(shape, chars)
    if not cut:
        return (*_encode(shape, tokenizer, where), True)
    n = seq_len + 1
    ids, labels = _encode(short, tokenizer, where)
    while True:
        chars *= 2
        short, cut = _cut(shape, chars)
        more_ids, more_labels = _encode(short if cut else shape, tokenizer, where)
        if not cut:
            return more_ids, more_labels, True
        if len(ids) >= n and ids[:n] == more_ids[:n] and labels[:n] == more_labels[:n]:
            return ids, labels, False
        ids, labels = more_ids, more_labels


def encode_row(
    row: dict, tokenizer, seq_len: int, where: str = "row", renames: dict[str, str] | None = None
) -> tuple[str, Example]:
    """(format name, example) of one row, truncated to `seq_len`, checked to train. A row
    longer than that is cut before it is tokenised (`_window`), to the same tokens."""
    name, shape = normalize(row, where, bool(getattr(tokenizer, "chat_template", None)), renames)
    ids, labels, whole = _window(shape, tokenizer, seq_len, where)
    ex = Example(tuple(ids[:seq_len]), tuple(labels[:seq_len]), where)
    if ex.trainable == 0:
        size = f"{len(ids)} tokens" if whole else f"more than {seq_len} tokens"
        why = (
            f"truncation to --seq-len {seq_len} cut every trainable token (the row has {size})"
            if len(ids) > seq_len
            else "no token after the first is trainable"
        )
        raise DataError(f"{where}: no trainable token: {why}")
    return name, ex
