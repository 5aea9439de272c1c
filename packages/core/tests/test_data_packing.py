"""Packing (``--packing``): examples share sequences without seeing each other.

The claim: a packed sequence gives each of its examples the loss that example has alone,
up to summation order (relative 1e-5 in fp32: the attention kernels reduce over another
length). Twins show what the tests catch: positions not restarted, or a forward with a KV
cache (transformers then skips its packed-sequence masks), let examples attend across the
boundary and miss by orders of magnitude more.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from narrows.core.app.data import (
    IGNORE,
    TRAINING,
    DataError,
    Packed,
    check_packing,
    collate,
    open_source,
    pack_bins,
    tokenize,
    tokenize_rows,
)
from narrows.core.testing import mapped_file, tiny_model_folder, tiny_tokenizer, write_jsonl

ROWS = [
    {"prompt": f"question {a}+{b}=", "completion": f"{a + b} words " * (a + 1)}
    for a in range(5)
    for b in range(3)
]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tiny_model_folder(tmp_path_factory.mktemp("m") / "model")
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).train()


@pytest.fixture(scope="module")
def examples(tok):
    return tokenize_rows(((f"r{i}", r) for i, r in enumerate(ROWS)), tok, 64)


def test_best_fit_decreasing():
    assert pack_bins([5, 4, 3, 2, 1], 6) == [[0, 4], [1, 3], [2]]
    lengths = torch.randint(1, 100, (500,), generator=torch.Generator().manual_seed(0)).tolist()
    bins = pack_bins(lengths, 128)
    assert sorted(i for b in bins for i in b) == list(range(500))
    assert all(sum(lengths[i] for i in b) <= 128 for b in bins)
    assert len(bins) <= 1.05 * sum(lengths) / 128 + 1  # nearly full: ~1.8 examples of ~50 per bin
    assert pack_bins(lengths, 128) == bins
    with pytest.raises(ValueError, match="exceeds the capacity"):
        pack_bins([9], 8)


def test_packed_sequences_hold_each_example_once_with_its_first_label_masked(examples):
    packed = Packed(examples, 128)
    seen = []
    for b in range(len(packed)):
        p = packed[b]
        assert len(p.input_ids) <= 128 and sum(p.segments) == len(p.input_ids)
        at = 0
        for i, n in zip(packed.bins[b], p.segments):
            e = examples[i]
            assert p.input_ids[at : at + n] == e.input_ids
            assert p.labels[at : at + n] == (IGNORE, *e.labels[1:])  # nothing predicted across the boundary
            at += n
            seen.append(i)
        assert p.trainable == sum(examples[i].trainable for i in packed.bins[b])
    assert sorted(seen) == list(range(len(examples)))
    batch = collate([packed[0], packed[len(packed) - 1]], 0, 128)
    assert set(batch) == {"input_ids", "position_ids", "labels"}  # no attention mask: positions say it all
    last = packed[len(packed) - 1]
    want = [
        p for n in (*last.segments, 128 - len(last.input_ids)) for p in range(n)
    ]  # padding: its own segment
    assert batch["position_ids"][1].tolist() == want
    assert batch["labels"][1, len(last.input_ids) :].eq(IGNORE).all()


def per_example_losses(model, examples, packed, call):
    """Each example's summed token loss: alone, and inside its packed sequence."""

    def token_losses(batch, **kw):
        logits = model(input_ids=batch["input_ids"], **kw).logits[:, :-1]
        return torch.nn.functional.cross_entropy(
            logits.transpose(1, 2), batch["labels"][:, 1:], reduction="none", ignore_index=IGNORE
        )

    alone = [float(token_losses(collate([e], 0), **TRAINING).sum()) for e in examples]
    inside = [0.0] * len(examples)
    for b in range(len(packed)):
        batch = collate([packed[b]], 0, packed.seq_len)
        losses = token_losses(batch, **call(batch))[0]
        at = 0
        for i, n in zip(packed.bins[b], packed[b].segments):
            inside[i] = float(losses[at : at + n - 1].sum())  # the segment's last token predicts nothing
            at += n
    return torch.tensor(alone, dtype=torch.float64), torch.tensor(inside, dtype=torch.float64)


@torch.no_grad()
def test_each_example_keeps_its_loss_inside_a_packed_sequence(model, examples):
    packed = Packed(examples, 128)
    assert any(len(packed[b].segments) >= 3 for b in range(len(packed)))
    alone, inside = per_example_losses(
        model, examples, packed, call=lambda b: {"position_ids": b["position_ids"], **TRAINING}
    )
    torch.testing.assert_close(inside, alone, rtol=1e-5, atol=0)
    # twins: positions running on (one long sequence), or a KV cache, mix the examples
    for call in (lambda b: TRAINING, lambda b: {"position_ids": b["position_ids"]}):
        _, mixed = per_example_losses(model, examples, packed, call=call)
        assert ((mixed - alone).abs() / alone).max() > 1e-4  # ten times the tolerance, at least


def test_a_model_that_ignores_packed_positions_is_refused(model):
    check_packing(model, torch.device("cpu"), 259)

    class Blind(torch.nn.Module):  # drops the positions, as an architecture without packed masks would
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, position_ids=None, **kw):
            return self.inner(**kw)

    with pytest.raises(
        DataError, match=r"--packing: this model .* lets packed examples attend to each other"
    ):
        check_packing(Blind(model), torch.device("cpu"), 259)
    assert model.training  # the probe left the mode as it found it


def test_tokenised_data_is_cached_mapped_and_keyed(tmp_path, tok, monkeypatch):
    monkeypatch.setenv("NARROWS_CACHE", str(tmp_path / "cache"))
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    first, how = tokenize(open_source(str(path)), tok, 64)
    assert how.startswith("tokenised")
    again, how = tokenize(open_source(str(path)), tok, 64)
    assert how.startswith("cached") and again.digest() == first.digest()
    assert mapped_file(again.ids.data_ptr()).endswith("tokens.pt")  # read in place, not copied
    assert tokenize(open_source(str(path)), tok, 32)[1].startswith("tokenised")  # another --seq-len
    write_jsonl(path, ROWS[:3])  # the file changed
    changed, how = tokenize(open_source(str(path)), tok, 64)
    assert how.startswith("tokenised") and len(changed) == 3
    other = tiny_tokenizer()
    other.chat_template = "{{ messages }}"
    assert tokenize(open_source(str(path)), other, 64)[1].startswith("tokenised")  # another template
