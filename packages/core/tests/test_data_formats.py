"""Row formats users bring (ShareGPT, TRL prompt/completion, Alpaca, --columns) and the files
`datasets` reads (parquet, arrow, csv, json, save_to_disk folders): each gives the tokens the
equivalent narrows row gives, and bad input is refused naming the file, row and fields."""

from __future__ import annotations

import copy
import json

import pytest

from narrows.core.app.data import IGNORE, DataError, encode_row, open_source, parse_columns, tokenize
from narrows.core.errors import NarrowsError
from narrows.core.testing import tiny_tokenizer, write_jsonl

datasets = pytest.importorskip("datasets")

CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def plain(tok):
    """The same tokenizer without a chat template."""
    t = copy.deepcopy(tok)
    t.chat_template = None
    return t


def same(tok, row, reference, renames=None):
    name, got = encode_row(row, tok, 512, "r", parse_columns(renames))
    want = encode_row(reference, tok, 512, "r")[1]
    assert (got.input_ids, got.labels) == (want.input_ids, want.labels)
    return name


def trained(tok, row):
    ex = encode_row(row, tok, 512)[1]
    return tok.decode([i for i, y in zip(ex.input_ids, ex.labels) if y != IGNORE])


def test_sharegpt_is_messages_with_its_roles(tok):
    conv = [
        {"from": "system", "value": "be brief"},
        {"from": "human", "value": "2+2?"},
        {"from": "gpt", "value": "4"},
    ]
    assert same(tok, {"conversations": conv}, {"messages": CHAT}) == "sharegpt"
    with pytest.raises(
        DataError, match=r"r: conversations\[1\] is from 'tool'; narrows reads human/gpt/system"
    ):
        encode_row({"conversations": [conv[0], {"from": "tool", "value": "x"}]}, tok, 512, "r")


def test_trl_prompt_completion(tok):
    assert (
        same(tok, {"prompt": "Q:", "completion": " A"}, {"prompt": "Q:", "response": " A"})
        == "prompt/completion"
    )
    # conversational: the whole prompt is context, even its assistant turns; the completion trains
    prompt = [*CHAT, {"role": "user", "content": "and 3+3?"}]
    row = {"prompt": prompt, "completion": [{"role": "assistant", "content": "6"}]}
    assert encode_row(row, tok, 512)[0] == "prompt/completion (conversational)"
    assert trained(tok, row) == "6<|im_end|>\n"
    assert trained(tok, {"messages": row["prompt"] + row["completion"]}) == "4<|im_end|>\n6<|im_end|>\n"
    with pytest.raises(DataError, match="r: its completion has no assistant turn"):
        encode_row({"prompt": CHAT, "completion": [{"role": "user", "content": "x"}]}, tok, 512, "r")


def test_alpaca_with_and_without_a_chat_template(tok, plain):
    row = {"instruction": "Add the numbers.", "input": "2 and 2", "output": "4"}
    user = {"role": "user", "content": "Add the numbers.\n\n2 and 2"}
    assert (
        same(tok, row, {"messages": [user, {"role": "assistant", "content": "4"}]})
        == "alpaca (chat template)"
    )
    assert (
        same(tok, {**row, "system": "be brief"}, {"messages": [CHAT[0], user, CHAT[2]]})
        == "alpaca (chat template)"
    )
    name, ex = encode_row(row, plain, 512)
    assert name == "alpaca (Alpaca prompt)"
    text = plain.decode(ex.input_ids)
    assert text.startswith("Below is an instruction that describes a task, paired with an input")
    assert "### Instruction:\nAdd the numbers.\n\n### Input:\n2 and 2\n\n### Response:\n4" in text
    no_input = plain.decode(encode_row({**row, "input": ""}, plain, 512)[1].input_ids)
    assert "### Input" not in no_input and "a task. Write a response" in no_input
    with pytest.raises(DataError, match="r: an Alpaca row has no 'output' field"):
        encode_row({"instruction": "x"}, tok, 512, "r")
    with pytest.raises(DataError, match="'history'"):
        encode_row({**row, "history": [["a", "b"]]}, tok, 512, "r")


def test_columns_rename_a_datasets_own_names(tok):
    row = {"question": "2+2?", "answer": "4", "id": 7}
    assert (
        same(tok, row, {"prompt": "2+2?", "response": "4"}, "prompt=question, response=answer")
        == "prompt/response"
    )
    with pytest.raises(DataError, match=r"r: --columns names 'answer', which the row does not have"):
        encode_row({"question": "q"}, tok, 512, "r", parse_columns("prompt=question,response=answer"))
    for bad, message in [
        ("prompt", "is not FIELD=COLUMN"),
        ("query=question", "'query' is not a field narrows reads"),
        ("prompt=q,response=q", "column 'q' is given twice"),
    ]:
        with pytest.raises(NarrowsError, match=message):
            parse_columns(bad)


ROWS = [
    {"instruction": f"add {a} and {b}", "input": "", "output": str(a + b)} for a in range(3) for b in range(3)
]


def written(tmp_path, kind):
    ds = datasets.Dataset.from_list(ROWS)
    path = tmp_path / f"d.{kind}"
    if kind == "parquet":
        ds.to_parquet(path)
    elif kind == "csv":
        ds.to_csv(path)
    elif kind == "json":  # a JSON array, as Alpaca's own file is
        path.write_text(json.dumps(ROWS))
    elif kind == "arrow":
        ds.save_to_disk(tmp_path / "saved")
        path = next((tmp_path / "saved").glob("*.arrow"))
    elif kind == "saved":
        path = tmp_path / "saved"
        ds.save_to_disk(path)
    return path


@pytest.mark.parametrize("kind", ["parquet", "csv", "json", "arrow", "saved"])
def test_each_file_kind_gives_the_tokens_of_the_jsonl(tmp_path, tok, kind, monkeypatch):
    monkeypatch.setenv("NARROWS_CACHE", str(tmp_path / "cache"))
    want, _ = tokenize(open_source(str(write_jsonl(tmp_path / "d.jsonl", ROWS))), tok, 512, cache=False)
    source = open_source(str(written(tmp_path, kind)))
    got, how = tokenize(source, tok, 512)
    assert how.startswith("tokenised, cached in")
    assert got.describe() == "9 rows, format alpaca (chat template)"
    assert [(e.input_ids, e.labels) for e in got] == [(e.input_ids, e.labels) for e in want]
    assert got[3].where == f"{source.path} [row 3]"
    again, how = tokenize(open_source(str(source.path)), tok, 512)
    assert how.startswith("cached in") and again.digest() == got.digest()


def test_a_bad_row_in_a_parquet_file_names_its_row(tmp_path, tok):
    path = tmp_path / "d.parquet"
    datasets.Dataset.from_list([{"question": "q", "answer": "a"}] * 3).to_parquet(path)
    with pytest.raises(
        DataError, match=r"d\.parquet \[row 0\]: the row fits no format .* \['answer', 'question'\]"
    ):
        tokenize(open_source(str(path)), tok, 512, cache=False)
    got, _ = tokenize(
        open_source(str(path)), tok, 512, parse_columns("prompt=question,response=answer"), cache=False
    )
    assert got.describe() == "3 rows, format prompt/response"


def test_splits_of_a_saved_dataset_dict(tmp_path, tok):
    ds = datasets.Dataset.from_list(ROWS)
    datasets.DatasetDict({"train": ds, "test": ds.select(range(2))}).save_to_disk(tmp_path / "dd")
    with pytest.raises(
        DataError, match=r"--data .*dd holds the splits \['train', 'test'\]: choose one with --data-split"
    ):
        open_source(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"--eval-split dev: .* holds the splits \['train', 'test'\]"):
        open_source(str(tmp_path / "dd"), "dev", flag="--eval-data")
    test, _ = tokenize(open_source(str(tmp_path / "dd"), "test"), tok, 512, cache=False)
    assert len(test) == 2
    one = written(tmp_path, "saved")
    with pytest.raises(DataError, match="holds one dataset, not several splits: drop --data-split"):
        open_source(str(one), "train")


@pytest.mark.parametrize(
    "make,message",
    [
        (
            lambda p: "HuggingFaceH4/ultrachat_200k",
            "no such local file or folder. narrows reads local data only",
        ),
        (lambda p: p.mkdir() or p, "a folder must be one written by datasets' save_to_disk"),
        (lambda p: (p.with_suffix(".txt").write_text("x"), p.with_suffix(".txt"))[1], "not .txt"),
    ],
)
def test_paths_that_are_not_local_datasets(tmp_path, make, message):
    with pytest.raises(DataError, match=message):
        open_source(str(make(tmp_path / "x")))
    with pytest.raises(DataError, match="--data-split chooses a split of a save_to_disk folder"):
        open_source(str(write_jsonl(tmp_path / "d.jsonl", ROWS)), "train")


@pytest.mark.parametrize(
    "name,data",
    [
        ("d.jsonl", '{"text": "fine"}\n\n{"text": "caf\xe9 au lait"}\n'.encode("latin-1")),
        ("d.csv", "prompt,response\nq,a\nqu\xe9,r\xe9ponse\n".encode("latin-1")),
        ("head.csv", "pr\xe9mpt,response\nq,a\n".encode("latin-1")),  # the header narrows reads itself
        ("d.json", json.dumps([{"text": "fine"}, {"text": "caf\xe9"}], ensure_ascii=False).encode("latin-1")),
    ],
)
def test_text_that_is_not_utf8_names_file_line_and_byte(tmp_path, tok, name, data):
    path = tmp_path / name
    path.write_bytes(data)
    bad = data.index(b"\xe9")
    line = data[:bad].count(b"\n") + 1
    with pytest.raises(DataError) as e:
        tokenize(open_source(str(path)), tok, 512, cache=False)
    said = str(e.value)
    assert said.startswith(f"{path}:{line}: not UTF-8 (byte 0xe9 at byte offset {bad} of the file"), said
    assert "re-save the file as UTF-8" in said and f"iconv -f latin1 -t utf-8 {path}" in said
