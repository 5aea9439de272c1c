"""`choose_step_mode`: block-major accumulation where the step-time model predicts it
faster, sequential otherwise, each time with the reason; and the model's two prices."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import build

import narrows.stream as ns
from narrows.stream.plan import Shapes, step_seconds

G = 4


def streamed(budget=None, **kw):
    model = build(num_hidden_layers=3)
    ns.stream(model, budget, device="cpu", batch_size=2, seq_len=12, **kw)
    return model


@pytest.fixture
def on_cuda(monkeypatch):
    """A CPU-streamed model whose handle says CUDA: the choice reads only the plan, the
    shapes and the device type (no kernel runs)."""

    def make(model):
        handle = model.narrows_stream
        monkeypatch.setattr(handle, "device", torch.device("cuda", 0))
        return model

    return make


def test_a_transfer_bound_plan_runs_block_major_and_says_why(on_cuda):
    use, why = ns.choose_step_mode(on_cuda(streamed()), G, host_available=1 << 40)
    assert use, why
    assert why.startswith(
        "block-major (step mode: each of the 3 streamed layers copied twice a step instead of 8"
    )


@pytest.mark.parametrize(("block", "chosen"), [(0.97, False), (0.9, True)])
def test_block_major_must_be_predicted_five_percent_faster(on_cuda, monkeypatch, block, chosen):
    from narrows.stream import accumulation

    monkeypatch.setattr(
        accumulation, "step_seconds", lambda *a, block_major=False, **k: block if block_major else 1.0
    )
    use, why = ns.choose_step_mode(on_cuda(streamed()), G, host_available=1 << 40)
    assert use is chosen, why


def test_copies_that_hide_behind_compute_stay_sequential(on_cuda):
    fast_link = ns.Rates(h2d=1e30)
    use, why = ns.choose_step_mode(on_cuda(streamed()), G, host_available=1 << 40, rates=fast_link)
    assert not use and "the copies already hide behind the compute" in why


@pytest.mark.parametrize(
    ("case", "said"),
    [
        ("one micro-batch", "one micro-batch a step"),
        ("ranks", "several ranks"),
        ("cpu", "cpu device"),
        ("resident", "every layer resident"),
        ("host", "micro-batches, 72 KiB, in host memory; 1 KiB available"),
        ("embedding", "the embedding trains"),
        ("not streamed", "the base is not streamed"),
    ],
)
def test_what_keeps_accumulation_sequential(on_cuda, case, said):
    model = streamed("fit") if case == "resident" else build(num_hidden_layers=3) if case == "not streamed" \
        else streamed()  # fmt: skip
    if case == "embedding":
        model.get_input_embeddings().weight.requires_grad_(True)
    if case not in ("cpu", "not streamed"):
        on_cuda(model)
    kwargs = {
        "host_available": 1024 if case == "host" else 1 << 40,
        "world_size": 2 if case == "ranks" else 1,
    }
    use, why = ns.choose_step_mode(model, 1 if case == "one micro-batch" else G, **kwargs)
    assert not use and why.startswith("sequential (") and said in why, why


def test_the_step_time_model_prices_block_major_copies_once_a_step():
    """One micro-batch: the two prices agree with each other and with the single-batch
    model; with G, sequential pays each exposed copy G times, block-major once (and hides
    it behind G micro-batches' compute) — never more, and less when copies are exposed."""
    s = Shapes(layers=8, hidden=1024, intermediate=4096, heads=8, vocab=1000, act_bytes=2, batch=1, seq=64,
               eager_attention=False)  # fmt: skip
    layers = [40_000_000] * 8  # a copy well over the compute at 64 tokens
    one = step_seconds(layers, s, 2, 0)
    assert step_seconds(layers, s, 2, 0, micro_batches=1, block_major=True) == one
    seq = step_seconds(layers, s, 2, 0, micro_batches=G)
    block = step_seconds(layers, s, 2, 0, micro_batches=G, block_major=True)
    assert seq == pytest.approx(G * one) and block < seq
    long = dataclasses.replace(s, seq=1 << 16)  # compute hides every copy: the same price
    assert step_seconds(layers, long, 2, 0, micro_batches=G, block_major=True) == pytest.approx(
        step_seconds(layers, long, 2, 0, micro_batches=G)
    )
