"""`choose_step_mode`: block-major accumulation where the step-time model predicts it
faster, sequential otherwise, each time with the reason; and the model's two prices."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import build

import narrows.stream as ns
from narrows.stream.planning import Shapes, dequant_seconds, step_seconds

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
    from narrows.stream.planning import accumulation

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
    model = (
        streamed("fit")
        if case == "resident"
        else build(num_hidden_layers=3)
        if case == "not streamed"
        else streamed()
    )
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
    s = Shapes(
        layers=8,
        hidden=1024,
        intermediate=4096,
        heads=8,
        vocab=1000,
        act_bytes=2,
        batch=1,
        seq=64,
        eager_attention=False,
    )
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


def test_held_weights_price_two_dequantisations_a_step_not_four_per_micro_batch():
    s = Shapes(
        layers=8,
        hidden=1024,
        intermediate=4096,
        heads=8,
        vocab=1000,
        act_bytes=2,
        batch=1,
        seq=512,
        eager_attention=False,
    )
    nf4 = [4_000_000] * 8  # under a byte per parameter: dequantised on every use
    plain = step_seconds(nf4, s, 0, 0, micro_batches=G, block_major=True)
    held = step_seconds(nf4, s, 0, 0, micro_batches=G, block_major=True, held=True)
    d = dequant_seconds(nf4[0], s)
    assert d > 0 and held == pytest.approx(plain - 8 * (3 * G - 2) * d)
    floats = [40_000_000] * 8  # a float base has nothing to dequantise
    assert dequant_seconds(floats[0], s) == 0
    assert step_seconds(floats, s, 0, 0, micro_batches=G, block_major=True, held=True) == step_seconds(
        floats, s, 0, 0, micro_batches=G, block_major=True
    )


def _plan(**kw):
    base = dict(
        device="cuda:0",
        budget=None,
        layer_bytes=(1,),
        resident=(),
        pool_slabs=1,
        prefetch=1,
        fixed_bytes=0,
        activation_bytes=0,
        work_bytes=0,
        predicted_peak=1000,
        h2d_bytes_per_step=0,
    )
    return ns.Plan(**{**base, **kw})


@pytest.mark.parametrize(
    ("plan", "need", "g", "choice", "hold", "said"),
    [
        ({"reserved_bytes": 100}, 100, G, "auto", True, "on: "),
        ({"budget": 1100}, 100, G, "auto", True, "on: "),
        ({"budget": 1099}, 100, G, "auto", False, "stream with grad_accum=G to plan the room"),
        ({}, 100, G, "auto", False, "no budget"),
        ({"reserved_bytes": 100}, 100, 1, "auto", False, "one micro-batch"),
        ({}, 100, 1, True, True, "on: "),
        ({"reserved_bytes": 100}, 100, G, False, False, "hold_weights=False"),
        ({"reserved_bytes": 100}, 0, G, True, False, "no 4-bit weights"),
    ],
)
def test_when_step_mode_holds_the_weights(plan, need, g, choice, hold, said):
    got, why = ns.holds_weights(_plan(**plan), need, g, choice)
    assert got is hold and said in why, why


def test_a_reserve_is_left_free_within_the_budget():
    """The reserve counts in the plan's fixed memory and its peak, so fewer layers stay
    resident under the same budget; negative reserves are refused."""
    model = build(num_hidden_layers=3)
    budget = ns.plan(model, 1 << 40, device="cpu").predicted_peak  # just room for everything kept
    without = ns.plan(model, budget, device="cpu")
    reserve = max(without.layer_bytes)
    kept = ns.plan(model, budget, device="cpu", reserve=reserve)
    assert kept.reserved_bytes == reserve and kept.fixed_bytes == without.fixed_bytes + reserve
    assert kept.predicted_peak <= budget
    assert (len(kept.resident), len(kept.whole)) < (len(without.resident), len(without.whole))
    assert "reserved: held weights, kept attention in flight, step mode's room, or the caller's" in str(kept)
    with pytest.raises(ns.StreamSetupError, match="reserve"):
        ns.plan(model, budget, device="cpu", reserve=-1)


@pytest.mark.bnb
def test_step_mode_reserve_is_the_largest_layers_held_weights(on_cuda):
    pytest.importorskip("bitsandbytes")
    from narrows.core import held_bytes

    model = build(num_hidden_layers=3, base="nf4")
    need = ns.step_mode_reserve(model)
    layers = model.base_model.model.model.layers
    assert need == max(held_bytes(layer) for layer in layers) > 0
    assert ns.step_mode_reserve(build(num_hidden_layers=3)) == 0
    # with G micro-batches: G + 1 layer boundaries of [batch, seq, hidden], from the config
    cfg, emb = model.config, model.get_input_embeddings().weight
    boundary = 2 * 12 * cfg.hidden_size * emb.element_size()
    assert ns.step_mode_reserve(model, G, batch_size=2, seq_len=12) == need + (G + 1) * boundary
    assert ns.step_mode_reserve(model, 1, batch_size=2, seq_len=12) == need
    ns.stream(model, None, device="cpu", batch_size=2, seq_len=12, reserve=need)
    use, why = ns.choose_step_mode(on_cuda(model), G, host_available=1 << 40)
    assert use and "4-bit weights dequantised once per pass" in why, why


def test_block_major_needs_room_for_the_layer_boundaries(on_cuda, monkeypatch):
    """A plan filled to its budget has no room for the G + 1 layer boundaries step mode
    keeps on the device: sequential, and why; the same plan with them reserved (twin)
    runs block-major. `plan=` judges a plan before streaming, the same way."""
    model = on_cuda(streamed())
    handle = model.narrows_stream
    boundaries = (G + 1) * 2 * 12 * model.config.hidden_size * 4  # batch 2 x 12 tokens, fp32
    full = dataclasses.replace(handle.plan, budget=handle.plan.predicted_peak)
    monkeypatch.setattr(handle, "plan", full)
    use, why = ns.choose_step_mode(model, G, host_available=1 << 40)
    assert not use and f"keeps {G + 1} layer boundaries" in why and f"grad_accum={G} to plan that room" in why
    monkeypatch.setattr(handle, "plan", dataclasses.replace(full, reserved_bytes=boundaries))
    assert ns.choose_step_mode(model, G, host_available=1 << 40)[0]
    monkeypatch.setattr(handle, "plan", dataclasses.replace(full, reserved_bytes=boundaries - 1))
    assert not ns.choose_step_mode(model, G, host_available=1 << 40)[0]
    ahead = dataclasses.replace(full, device="cuda:0", reserved_bytes=boundaries)
    use, why = ns.choose_step_mode(
        build(num_hidden_layers=3), G, host_available=1 << 40, plan=ahead, batch_size=2, seq_len=12
    )
    assert use, why


@pytest.mark.bnb
def test_resident_layers_run_block_major_where_their_4bit_weights_are_held(on_cuda, monkeypatch):
    """With every layer resident and recomputed, nothing crosses the link, but sequential
    steps dequantise each 4-bit layer three times per micro-batch: block-major holding
    them (room in the budget) is predicted faster. Twins: the same plan with layers kept
    whole, or a float base, stays sequential."""
    pytest.importorskip("bitsandbytes")
    from narrows.stream.planning import steptime

    # the tiny model's layers are mostly norms and quantisation constants (a byte per
    # parameter): price their dequantisation as a real model's
    monkeypatch.setattr(steptime, "dequant_seconds", lambda nbytes, s: 1e-6)
    model = build(num_hidden_layers=3, base="nf4")
    ns.stream(model, "fit", device="cpu", batch_size=2, seq_len=12, recompute="all")
    assert not model.narrows_stream.plan.streamed and not model.narrows_stream.plan.whole
    use, why = ns.choose_step_mode(on_cuda(model), G, host_available=1 << 40)
    assert use and "4-bit weights dequantised once per pass" in why and "streamed layers" not in why, why
    whole = build(num_hidden_layers=3, base="nf4")
    ns.stream(whole, "fit", device="cpu", batch_size=2, seq_len=12)
    assert whole.narrows_stream.plan.whole
    use, why = ns.choose_step_mode(on_cuda(whole), G, host_available=1 << 40)
    assert not use and "kept whole: block-major would recompute them" in why, why
    plain = streamed("fit", recompute="all")
    use, why = ns.choose_step_mode(on_cuda(plain), G, host_available=1 << 40)
    assert not use and why.endswith(": every layer resident)"), why


def test_the_plan_reserves_room_for_step_mode_only_where_block_major_will_run(monkeypatch):
    """With G micro-batches a step the planner decides the accumulation once: the plan
    with step mode's room (held weights and layer boundaries; no layer whole) is kept
    where block-major is chosen, else the plan for sequential steps. Asked for, the room
    is kept; room that does not fit the budget leaves sequential steps within it. The
    plan records the choice and its reason."""
    from narrows.stream.planning import accumulation

    model = build(num_hidden_layers=3)
    kw = dict(device="cuda:0", batch_size=2, seq_len=32)  # planned for a GPU: no GPU needed
    need = ns.step_mode_reserve(model, 3, batch_size=2, seq_len=32)
    budget = ns.plan(model, None, **kw).predicted_peak + 2 * need
    judged = []

    def choose(answer):
        def judge(model, g, *, world_size=1, plan=None, **kwargs):
            judged.append(plan.reserved_bytes)
            return answer, f"{'block-major' if answer else 'sequential'} (stub)"

        monkeypatch.setattr(accumulation, "choose_step_mode", judge)

    choose(True)
    chosen = ns.plan(model, budget, grad_accum=3, **kw)
    assert judged == [need] and chosen.reserved_bytes == need and not chosen.whole
    assert (chosen.accumulation, chosen.accumulation_choice, chosen.grad_accum) == (
        "block-major",
        "block-major (stub)",
        3,
    )
    assert "block-major (stub)" in str(chosen)
    choose(False)
    declined = ns.plan(model, budget, grad_accum=3, **kw)
    base = ns.plan(model, budget, **kw)  # the plan for sequential steps, the choice recorded on it
    assert declined == dataclasses.replace(base, grad_accum=3, accumulation_choice="sequential (stub)")
    asked = ns.plan(model, budget, grad_accum=3, step_mode=True, **kw)
    assert asked.reserved_bytes == need and asked.accumulation == "block-major" and len(judged) == 2
    off = ns.plan(model, budget, grad_accum=3, step_mode=False, **kw)
    assert (
        off.reserved_bytes == 0 and off.accumulation_choice == "sequential (step mode off: step_mode=False)"
    )
    on_cpu = ns.plan(model, budget, grad_accum=3, step_mode=True, **{**kw, "device": "cpu"})
    assert (
        on_cpu.reserved_bytes == 0 and on_cpu.accumulation == "block-major"
    )  # no device budget to leave room in
    choose(True)
    lo, hi = 1, budget  # the smallest budget that streams: then the room does not fit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            ns.plan(model, mid, **kw)
            hi = mid
        except ns.BudgetTooSmallError:
            lo = mid
    tight = hi + need // 2
    squeezed = ns.plan(model, tight, grad_accum=3, **kw)
    assert squeezed.accumulation == "sequential" and "does not fit the budget" in squeezed.accumulation_choice
    with pytest.raises(ns.BudgetTooSmallError):  # asked for: the budget is too small, said so
        ns.plan(model, tight, grad_accum=3, step_mode=True, **kw)
