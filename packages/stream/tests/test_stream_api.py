import logging

import pytest
import torch
from helpers import build, train

import narrows.stream as ns
from narrows.core import UnsupportedArchitectureError, anatomy_of, frozen_slots, snapshot
from narrows.core.testing import tiny_batch


def test_plan_moves_nothing_and_reports():
    model = build()
    before = [t.data_ptr() for t in snapshot(frozen_slots(model))]
    p = ns.plan(model, None, device="cpu")
    assert [t.data_ptr() for t in snapshot(frozen_slots(model))] == before
    assert p.resident == () and p.pool_slabs == 2 and p.prefetch == 1
    assert p.h2d_bytes_per_step > 0 and p.predicted_peak > p.fixed_bytes
    text = str(p)
    assert "predicted peak" in text and "host→device per step" in text
    assert p.as_dict()["streamed"] == [0, 1, 2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the size then comes from the device")
def test_a_cuda_plan_counts_the_two_threads_cublas_workspaces():
    """The forward's thread and the autograd engine's each take a cuBLAS workspace from
    the allocator and keep it (two 32 MiB blocks on the H100; uncounted, a 7B step-mode
    run went 40 MB over its plan)."""
    model = build()
    gpu, cpu = ns.plan(model, None, device="cuda:0"), ns.plan(model, None, device="cpu")
    assert gpu.fixed_bytes - cpu.fixed_bytes == 2 * 32 * 2**20


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_predicted_transfer_is_the_measured_steady_state(prefetch):
    """Weights both ways of a step, and every layer's saved input out and back (the
    smallest footprint offloads them all): what the plan predicts is what moves."""
    model = build(num_hidden_layers=7)
    ns.stream(model, device="cpu", prefetch=prefetch, batch_size=2, seq_len=12)  # tiny_batch's shape
    handle = model.narrows_stream
    assert handle.plan.offloaded == tuple(range(7))
    moved, out = [], []
    for seed in range(3):
        s = handle.stats
        before = (s.bytes_h2d + s.act_h2d, s.act_d2h)
        model(**tiny_batch(seed=seed)).loss.backward()
        moved.append(s.bytes_h2d + s.act_h2d - before[0])
        out.append(s.act_d2h - before[1])
    assert moved[1] == moved[2] == handle.plan.h2d_bytes_per_step
    assert out[1] == out[2] == handle.plan.d2h_bytes_per_step > 0
    # only the last layer's input is fetched without a prefetch (and layer 0's in the self-check)
    assert handle.stats.act_waits == 1 + 3


def test_budget_too_small_names_the_minimum():
    model = build()
    minimum = ns.plan(model, None, device="cpu", prefetch=0).predicted_peak
    with pytest.raises(ns.BudgetTooSmallError, match="at least") as e:
        ns.plan(model, minimum - 1, device="cpu")
    assert "one streamed layer" in str(e.value)
    assert ns.plan(model, minimum, device="cpu").pool_slabs == 1  # exactly the minimum: no prefetch


def test_fit_on_cpu_keeps_everything_resident_and_sizes_parse():
    model = build(num_hidden_layers=8)
    assert ns.plan(model, "fit", device="cpu").resident == tuple(range(8))
    assert ns.plan(model, "64GiB", device="cpu").pool_slabs == 0
    p = ns.plan(model, None, device="cpu", offload="off")
    spread = ns.plan(model, p.predicted_peak + 3 * max(p.layer_bytes), device="cpu").resident
    assert (
        len(spread) == 3 and spread == tuple(sorted(spread)) and spread[0] > 0
    )  # spread, not packed at one end
    with pytest.raises(ValueError, match="12GiB"):
        ns.plan(model, "lots", device="cpu")


def test_nothing_trains_is_refused():
    model = build().requires_grad_(False)
    with pytest.raises(ns.StreamSetupError, match="get_peft_model"):
        ns.stream(model, device="cpu")


def test_unsupported_architecture_is_refused():
    import transformers

    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64)
    )
    with pytest.raises(UnsupportedArchitectureError, match="register_architecture"):
        ns.stream(model, device="cpu")


def test_streaming_twice_and_moving_are_refused():
    model = ns.stream(build(), device="cpu")
    with pytest.raises(ns.StreamSetupError, match="already streamed"):
        ns.stream(model, device="cpu")
    assert model.to("cpu") is model  # what Trainer does: a no-op
    with pytest.raises(ns.StreamSetupError, match="cannot be moved or cast"):
        model.to(torch.bfloat16)


def test_layers_live_in_host_slabs_and_embedding_rows_are_gathered_on_host():
    model = ns.stream(build("llama"), device="cpu")
    handle = model.narrows_stream
    anat = anatomy_of(model)
    for store, layer in zip(handle.stores, anat.layers):
        views = {t.data_ptr() for t in store.host_views}
        assert {s.tensor.data_ptr() for s in frozen_slots(layer)} == views  # parked between calls
    assert handle.host_embedding
    tied = ns.stream(build("qwen2"), device="cpu")  # tied head: the embedding goes with the head
    assert not tied.narrows_stream.host_embedding


def test_checkpointing_is_redundant_and_said_so(caplog):
    model = build()
    model.gradient_checkpointing_enable()
    with caplog.at_level(logging.WARNING, logger="narrows.stream"):
        ns.stream(model, device="cpu")
        model.gradient_checkpointing_enable()
    assert "redundant" in caplog.text and "ignored" in caplog.text
    assert not anatomy_of(model).model.is_gradient_checkpointing


def test_checkpointing_on_gives_the_same_training():
    resident = train(build(dropout=0.05))
    model = build(dropout=0.05)
    model.gradient_checkpointing_enable()
    from helpers import assert_identical

    assert_identical(resident, train(model, stream_kwargs={}))


def test_inference_without_grad_streams_too():
    model = build("gemma2")
    batch = tiny_batch()
    model.eval()
    with torch.no_grad():
        ref = model(**batch).logits
    ns.stream(model, device="cpu")
    loads = model.narrows_stream.stats.loads
    with torch.no_grad():
        got = model(**batch).logits
    assert torch.equal(ref, got)
    assert model.narrows_stream.stats.loads > loads


def test_self_check_refuses_a_broken_replay(monkeypatch):
    import contextlib

    from narrows.stream.execution import remat

    monkeypatch.setattr(remat.rng, "replay", lambda state: contextlib.nullcontext())
    with pytest.raises(ns.SelfCheckError, match="check=False"):
        ns.stream(build(dropout=0.2), device="cpu")
    ns.stream(build(dropout=0.2), device="cpu", check=False)  # the documented override
