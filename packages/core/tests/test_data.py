"""Training data: rendering, prompt masking, truncation and the errors that name the line."""

from __future__ import annotations

import pytest

from narrows.core.app.data import (
    IGNORE,
    DataError,
    collate,
    micro_batches,
    open_source,
    read_jsonl,
    tokenize,
    tokenize_rows,
)
from narrows.core.app.data import encode_row as encode_named
from narrows.core.testing import tiny_tokenizer, write_jsonl


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def encode_row(row, tok, seq_len):
    return encode_named(row, tok, seq_len)[1]


def decode_trained(tok, ex):
    return tok.decode([i for i, y in zip(ex.input_ids, ex.labels) if y != IGNORE])


def test_chat_rows_train_every_assistant_turn_and_nothing_else(tok):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "6"},
    ]
    ex = encode_row({"messages": messages}, tok, 512)
    assert tok.decode(ex.input_ids) == tok.apply_chat_template(messages, tokenize=False)
    assert decode_trained(tok, ex) == "4<|im_end|>\n6<|im_end|>\n"


def test_prompt_response_and_text_rows(tok):
    ex = encode_row({"prompt": "Q: hi\nA:", "response": " hello"}, tok, 512)
    assert decode_trained(tok, ex) == " hello<|im_end|>"
    assert ex.labels[: len("Q: hi\nA:")] == (IGNORE,) * len("Q: hi\nA:")
    ex = encode_row({"text": "plain words"}, tok, 512)
    assert ex.labels == ex.input_ids and ex.trainable == len("plain words") - 1


def test_truncation_that_removes_every_trainable_token_is_refused_with_the_line(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "fine"}, {"prompt": "x" * 50, "response": "y"}])
    with pytest.raises(DataError, match=r"d\.jsonl:2: no trainable token: truncation to --seq-len 20"):
        tokenize_rows(read_jsonl(path), tok, 20)


@pytest.mark.parametrize(
    "line,message",
    [
        ('{"text": "ok"', r"d\.jsonl:2: not valid JSON"),
        ("[1, 2]", r"d\.jsonl:2: each line must be a JSON object"),
        ('{"question": "q"}', r"d\.jsonl:2: the row fits no format narrows reads \(it has \['question'\]\)"),
        ('{"prompt": "q"}', r"d\.jsonl:2: a prompt/response row has no 'response' field$"),
        ('{"completion": "a"}', r"d\.jsonl:2: a prompt/completion row has no 'prompt' field"),
        ('{"response": "a"}', r"d\.jsonl:2: a prompt/response row has no 'prompt' field"),
        ('{"prompt": "q", "response": 5}', r"d\.jsonl:2: field 'response' must be a string, got int"),
        ('{"text": "x" "y"}', r"d\.jsonl:2: not valid JSON \(Expecting ',' delimiter at column 14\)"),
        ('{"messages": [{"role": "user", "content": "q"}]}', r"d\.jsonl:2: the chat has no assistant turn"),
        ('{"messages": [{"role": "user"}]}', r"d\.jsonl:2: messages\[0\] must be an object"),
    ],
)
def test_malformed_rows_name_file_and_line(tok, tmp_path, line, message):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "good row"}, line])
    with pytest.raises(DataError, match=message):
        tokenize_rows(read_jsonl(path), tok, 64)


def test_missing_and_empty_files(tmp_path, tok):
    with pytest.raises(DataError, match="no such local file or folder"):
        open_source(str(tmp_path / "nope.jsonl"))
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="has no rows"):
        tokenize(open_source(str(tmp_path / "empty.jsonl")), tok, 64, cache=False)


def test_collate_pads_right_and_masks_padding(tok):
    a, b = encode_row({"text": "abcdef"}, tok, 64), encode_row({"text": "ab"}, tok, 64)
    batch = collate([a, b], tok.pad_token_id)
    assert batch["input_ids"].shape == (2, 6)
    assert batch["attention_mask"][1].tolist() == [1, 1, 0, 0, 0, 0]
    assert batch["labels"][1, 2:].tolist() == [IGNORE] * 4
    assert batch["input_ids"][1, 2:].tolist() == [tok.pad_token_id] * 4


def test_the_data_stream_depends_only_on_seed_and_position(tok):
    examples = tokenize_rows(((f"r{i}", {"text": f"row {i}"}) for i in range(7)), tok, 64)
    whole = micro_batches(examples, 3, seed=5)
    first = [[e.where for e in next(whole)] for _ in range(6)]  # 18 positions: crosses two epoch ends
    resumed = micro_batches(examples, 3, seed=5, start=4)
    assert [[e.where for e in next(resumed)] for _ in range(2)] == first[4:]
    assert sorted(first[0] + first[1] + [first[2][0]]) == [
        f"r{i}" for i in range(7)
    ]  # epoch 0: a permutation
    assert (
        first[2][1:] + first[3] + first[4][:2] != first[0] + first[1] + first[2][:1]
    )  # epoch 1: another one


# --- a long row is cut before it is tokenised, to the same tokens -------------------------


@pytest.fixture(scope="module")
def merging():
    """A byte-level BPE with merges (GPT-2's pre-split, whose whitespace rule looks ahead) and
    tokens up to dozens of characters long (runs of one letter), so a cut can reach the window."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from narrows.core.testing.folders import CHATML

    specials = ["<|im_start|>", "<|im_end|>", "<pad>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    rng = random.Random(0)
    corpus = [long_text(rng, 2000) for _ in range(40)] + ["a" * n for n in range(1, 300)]
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<pad>")
    fast.chat_template = CHATML
    return fast


WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "mat",
    "12345",
    "3.14",
    "é",
    "日本語",
    "!",
    "?",
    "\n",
    "  ",
    "\t",
    " ",
    "==",
]


def long_text(rng, chars: int) -> str:
    parts, n = [], 0
    while n < chars:
        w = "a" * rng.randint(20, 400) if rng.random() < 0.1 else rng.choice(WORDS)
        w += " " * rng.choice([0, 1, 1, 1, 3])
        parts.append(w)
        n += len(w)
    return "".join(parts)


def long_rows(seed: int, chars: int) -> dict[str, dict]:
    import random

    rng = random.Random(seed)

    def t(n=chars):
        return long_text(rng, n)

    return {
        "text": {"text": t()},
        "pair": {"prompt": t(50), "response": t()},
        "pair-long-prompt": {"prompt": t(), "response": t()},
        "messages": {
            "messages": [
                {"role": "system", "content": t(40)},
                {"role": "user", "content": t(300)},
                {"role": "assistant", "content": t()},
                {"role": "user", "content": t()},
            ]
        },
        "alpaca": {"instruction": t(30), "input": t(60), "output": t()},
    }


def window(row, tok, seq_len):
    try:
        ex = encode_row(row, tok, seq_len)
    except DataError as e:
        return str(e).split(" (the row has")[0]  # the count differs: a cut row's is a lower bound
    return ex.input_ids, ex.labels


@pytest.mark.parametrize("chat_template", [True, False])
def test_a_long_row_keeps_the_tokens_of_tokenising_it_whole(merging, chat_template):
    import copy

    tok = merging
    if not chat_template:  # alpaca becomes a prompt/response pair; messages need a template
        tok = copy.deepcopy(merging)
        tok.chat_template = None
    seen = 0
    for seed in range(3):
        for name, row in long_rows(seed, 6000).items():
            if name == "messages" and not chat_template:
                continue
            whole = encode_row(row, tok, 10**9)  # nothing cut: the reference
            assert len(whole.input_ids) > 200  # the window ends inside the row for most lengths
            for seq_len in (1, 5, 37, 200, 900):
                want = (whole.input_ids[:seq_len], whole.labels[:seq_len])
                if not any(y != IGNORE for y in want[1][1:]):
                    want = f"row: no trainable token: truncation to --seq-len {seq_len} cut every trainable token"
                assert window(row, tok, seq_len) == want, (seed, name, seq_len)
                seen += 1
    assert seen > 50


class Spy:
    """The tokenizer, counting the characters each call is given (or renders)."""

    def __init__(self, tok):
        self.tok, self.most = tok, 0

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def __call__(self, text, **kwargs):
        self.most = max(self.most, len(text))
        return self.tok(text, **kwargs)

    def apply_chat_template(self, messages, **kwargs):
        self.most = max(self.most, sum(len(m["content"]) for m in messages))
        out = self.tok.apply_chat_template(messages, **kwargs)
        self.most = max(self.most, len(out))
        return out


def test_a_multi_megabyte_row_is_never_given_to_the_tokenizer_whole(merging):
    """What one call sees does not grow with the row: the same for 1 MB and 4 MB rows."""
    seq_len = 64
    most = {}
    for megabytes in (1, 4):
        big = long_text(__import__("random").Random(1), megabytes << 20)
        for name, row in {
            "text": {"text": big},
            "pair": {"prompt": "q", "response": big},
            "messages": {
                "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": big}]
            },
        }.items():
            spy = Spy(merging)
            ex = encode_row(row, spy, seq_len)
            assert len(ex.input_ids) == seq_len
            most[name, megabytes] = spy.most
    for name in ("text", "pair", "messages"):
        assert most[name, 1] == most[name, 4] < 100 * seq_len, most
