"""Row formats: what users' datasets look like, each mapped to one of three shapes narrows
tokenises (`Chat`, `Pair`, `Text`).

Recognised from the row's fields, in this order: ``messages``, ``conversations``
(ShareGPT), ``prompt`` + ``response``/``completion``, ``instruction`` + ``output``
(Alpaca), ``text``. `rename` (``--columns``) renames a dataset's columns to these first.

why: docs/design.md#row-formats
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import NarrowsError

__all__ = ["FIELDS", "Chat", "Pair", "Text", "normalize", "parse_columns"]

# every field a row format reads, for --columns
FIELDS = (
    "messages",
    "conversations",
    "prompt",
    "response",
    "completion",
    "instruction",
    "input",
    "output",
    "system",
    "text",
)

SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}

# Stanford Alpaca's prompt, for tokenizers without a chat template
ALPACA = (
    "Below is an instruction that describes a task{with_input}. Write a response that appropriately completes "
    "the request.\n\n### Instruction:\n{instruction}\n\n{input}### Response:\n"
)


class DataError(NarrowsError):
    """A data row that cannot train; the message names the file and row."""


@dataclass(frozen=True)
class Chat:
    """Messages rendered with the chat template; assistant turns from `train_from` on train."""

    messages: list
    train_from: int = 0


@dataclass(frozen=True)
class Pair:
    """Prompt then response, concatenated; the response (and EOS) trains."""

    prompt: str
    response: str


@dataclass(frozen=True)
class Text:
    text: str


def parse_columns(text: str | None) -> dict[str, str]:
    """``"prompt=question,response=answer"`` -> ``{"question": "prompt", "answer": "response"}``
    (the dataset's column -> the field narrows reads)."""
    if not text:
        return {}
    renames: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        field, eq, column = (s.strip() for s in part.partition("="))
        if not (eq and field and column):
            raise NarrowsError(f"--columns {text!r}: {part!r} is not FIELD=COLUMN, e.g. prompt=question")
        if field not in FIELDS:
            raise NarrowsError(
                f"--columns {text!r}: {field!r} is not a field narrows reads; use one of {list(FIELDS)}"
            )
        if column in renames:
            raise NarrowsError(f"--columns {text!r}: column {column!r} is given twice")
        renames[column] = field
    return renames


def rename(row: dict, renames: dict[str, str], where: str) -> dict:
    if not renames:
        return row
    missing = [c for c in renames if c not in row]
    if missing:
        raise DataError(
            f"{where}: --columns names {missing[0]!r}, which the row does not have (it has {sorted(row)})"
        )
    out = {k: v for k, v in row.items() if k not in renames}
    out.update({field: row[column] for column, field in renames.items()})
    return out


def _string(row: dict, field: str, where: str) -> str:
    value = row[field]
    if not isinstance(value, str):
        raise DataError(f"{where}: field {field!r} must be a string, got {type(value).__name__}")
    return value


def _messages(value, field: str, where: str) -> list:
    if not isinstance(value, list):
        raise DataError(f"{where}: {field!r} must be a list of {{role, content}} objects")
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise DataError(f"{where}: {field}[{i}] must be an object with string 'role' and 'content'")
    return value


def _sharegpt(value, where: str) -> list:
    if not isinstance(value, list):
        raise DataError(f"{where}: 'conversations' must be a list of {{from, value}} objects")
    messages = []
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("from"), str) and isinstance(m.get("value"), str)):
            raise DataError(f"{where}: conversations[{i}] must be an object with string 'from' and 'value'")
        role = SHAREGPT_ROLES.get(m["from"])
        if role is None:
            raise DataError(
                f"{where}: conversations[{i}] is from {m['from']!r}; narrows reads "
                f"{'/'.join(SHAREGPT_ROLES)} turns"
            )
        messages.append({"role": role, "content": m["value"]})
    return messages


def _alpaca(row: dict, where: str, chat: bool) -> tuple[str, Chat | Pair]:
    for field in ("instruction", "output"):
        if field not in row:
            raise DataError(f"{where}: an Alpaca row has no {field!r} field")
    instruction, output = _string(row, "instruction", where), _string(row, "output", where)
    extra = row.get("input") or ""
    if not isinstance(extra, str):
        raise DataError(f"{where}: field 'input' must be a string, got {type(extra).__name__}")
    if row.get("history"):
        raise DataError(f"{where}: Alpaca 'history' (earlier turns) is not read; write the row as 'messages'")
    if chat:
        messages = [{"role": "system", "content": _string(row, "system", where)}] if row.get("system") else []
        user = f"{instruction}\n\n{extra}" if extra else instruction
        return "alpaca (chat template)", Chat(
            [*messages, {"role": "user", "content": user}, {"role": "assistant", "content": output}]
        )
    if row.get("system"):
        raise DataError(f"{where}: an Alpaca 'system' field needs a tokenizer with a chat template")
    prompt = ALPACA.format(
        with_input=", paired with an input that provides further context" if extra else "",
        instruction=instruction,
        input=f"### Input:\n{extra}\n\n" if extra else "",
    )
    return "alpaca (Alpaca prompt)", Pair(prompt, output)


def normalize(
    row: dict, where: str, chat: bool, renames: dict[str, str] | None = None
) -> tuple[str, Chat | Pair | Text]:
    """(format name, shape) of one row; `chat`: the tokenizer has a chat template."""
    row = rename(row, renames or {}, where)
    if "messages" in row:
        return "messages", Chat(_messages(row["messages"], "messages", where))
    if "conversations" in row:
        return "sharegpt", Chat(_sharegpt(row["conversations"], where))
    if "prompt" in row or "response" in row or "completion" in row:
        answer = "completion" if "completion" in row else "response"
        for field in ("prompt", answer):
            if field not in row:
                raise DataError(f"{where}: a prompt/{answer} row has no {field!r} field")
        if isinstance(row["prompt"], list):  # TRL's conversational prompt/completion
            prompt = _messages(row["prompt"], "prompt", where)
            return f"prompt/{answer} (conversational)", Chat(
                prompt + _messages(row[answer], answer, where), train_from=len(prompt)
            )
        return f"prompt/{answer}", Pair(_string(row, "prompt", where), _string(row, answer, where))
    if "instruction" in row or "output" in row:
        return _alpaca(row, where, chat)
    if "text" in row:
        return "text", Text(_string(row, "text", where))
    raise DataError(
        f"{where}: the row fits no format narrows reads (it has {sorted(row)}): give 'messages', "
        "ShareGPT 'conversations', 'prompt' with 'response' or 'completion', Alpaca 'instruction'/"
        "'output', or 'text'; or map your columns with --columns, e.g. prompt=question,response=answer"
    )
