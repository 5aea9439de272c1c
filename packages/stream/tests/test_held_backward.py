"""4-bit weights held through each recomputed layer's backward, in sequential steps: the
recompute and the input gradient share one dequantised copy (two dequantisations a
micro-batch instead of three), `torch.equal` to resident training — and the planner's
choice of it, priced by the step-time model and counted in the peak."""

from __future__ import annotations

import pytest
import torch
from helpers import Dequantizations, assert_identical, build, train

import narrows.stream as ns
from narrows.core import is_nf4_linear
from narrows.core.testing import tiny_batch

pytestmark = pytest.mark.bnb


def _one_step_dequantisations(hold) -> tuple[int, int]:
    """Dequantisations of one forward + backward of a streamed NF4 model, and its 4-bit linears."""
    pytest.importorskip("bitsandbytes")
    model = build(base="nf4")
    ns.stream(model, device="cpu", batch_size=2, seq_len=12, hold_weights=hold)
    assert model.narrows_stream.plan.held_weights is hold
    with Dequantizations() as seen:
        model(**tiny_batch(seq=12, seed=0)).loss.backward()
    return seen.count, sum(1 for m in model.modules() if is_nf4_linear(m))


def test_a_held_backward_dequantises_each_weight_once():
    """Forward once, backward once per 4-bit linear; the twin without holding dequantises
    in the recompute and again for the input gradient."""
    held, linears = _one_step_dequantisations(True)
    assert linears > 0 and held == 2 * linears
    unheld, _ = _one_step_dequantisations(False)
    assert unheld > held


def test_held_backward_trains_what_resident_training_trains():
    pytest.importorskip("bitsandbytes")
    reference = train(build(base="nf4"), steps=3, grad_accum=2)
    streamed = build(base="nf4")
    got = train(streamed, steps=3, grad_accum=2, stream_kwargs={"hold_weights": True, "offload": "off"})
    assert streamed.narrows_stream.held is not None
    assert_identical(reference, got)


def test_a_wrong_held_copy_changes_training(monkeypatch):
    """Fault injection: held zeros in place of the dequantised weights change the
    gradients — the held copy is what the backward computes with."""
    pytest.importorskip("bitsandbytes")
    import bitsandbytes.functional as bnbf

    reference = train(build(base="nf4"), steps=1)
    real = bnbf.dequantize_4bit
    streamed = build(base="nf4")
    ns.stream(streamed, device="cpu", hold_weights=True)
    monkeypatch.setattr(bnbf, "dequantize_4bit", lambda *a, **k: real(*a, **k).zero_())
    got = train(streamed, steps=1)
    with pytest.raises(AssertionError):
        assert_identical(reference, got)


def test_the_planner_holds_where_it_is_predicted_faster_and_fits(monkeypatch):
    """ "auto": off at the smallest footprint; on with room in the budget where the
    step-time model predicts a gain (the buffer then in the plan's reserve and peak);
    off where it predicts none; False and a float base never hold."""
    pytest.importorskip("bitsandbytes")
    from narrows.stream.planning import held_weight_bytes, steptime

    model = build(base="nf4")
    kw = dict(device="cpu", batch_size=2, seq_len=12, recompute="all")  # no layer whole: each one recomputed
    need = held_weight_bytes(model)
    smallest = ns.plan(model, None, **kw)
    assert not smallest.held_weights and "no budget" in smallest.held_choice
    roomy = smallest.predicted_peak + 4 * need
    assert "predicted" in ns.plan(model, roomy, **kw).held_choice  # tiny layers: no dequantisation to save
    whole = ns.plan(model, roomy, **{**kw, "recompute": "auto"})  # room for every layer whole
    assert not whole.held_weights and "nothing is recomputed" in whole.held_choice
    monkeypatch.setattr(steptime, "dequant_seconds", lambda nbytes, s: 1e-6)  # priced as a real model's
    held = ns.plan(model, roomy, **kw)
    unheld = ns.plan(model, roomy, hold_weights=False, **kw)
    assert held.held_weights and held.held_choice.startswith("on: ") and "held 4-bit weights" in str(held)
    assert held.reserved_bytes == need and held.fixed_bytes == unheld.fixed_bytes + need
    assert not unheld.held_weights and unheld.held_choice == "off (hold_weights=False)"
    floats = ns.plan(build(), roomy, **kw)
    assert not floats.held_weights and not floats.held_choice
    tight = smallest.predicted_peak + need // 2  # the plan fits, the buffer beside it does not
    assert not ns.plan(model, tight, **{**kw, "offload_inputs": "all"}).held_weights


def test_step_mode_shares_the_streamed_layers_buffer():
    """One held buffer per model: a StepTrainer on a model whose plan holds uses it."""
    pytest.importorskip("bitsandbytes")
    model = build(base="nf4")
    ns.stream(model, device="cpu", hold_weights=True, offload="off")
    trainer = ns.StepTrainer(model, lambda ps: torch.optim.AdamW(ps, lr=1e-2), grad_accum=2)
    assert trainer.held is model.narrows_stream.held is not None


def test_held_backward_is_priced_one_dequantisation_less_per_recomputed_layer():
    """Sequential steps: each recomputed layer's backward saves one dequantisation per
    micro-batch; whole layers (no recompute) save none; a float base has none to save."""
    from narrows.stream.planning import Shapes, dequant_seconds, step_seconds

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
    d = dequant_seconds(nf4[0], s)
    plain = step_seconds(nf4, s, 0, 2, micro_batches=3)
    assert d > 0 and step_seconds(nf4, s, 0, 2, micro_batches=3, held=True) == pytest.approx(
        plain - 3 * 6 * d
    )
    floats = [40_000_000] * 8
    assert step_seconds(floats, s, 0, 2, held=True) == step_seconds(floats, s, 0, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_held_backward_on_cuda_is_exact(graphs, dtype):
    """On the GPU (deterministic kernels), dropout on, with CUDA graphs replaying over the
    held copy too: `torch.equal` to resident training that dequantises on every call; in
    eager mode (float32) two dequantisations per linear a step."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("bitsandbytes")
    import os

    from narrows.core import deterministic

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    deterministic(True)
    reference = train(
        build(base="nf4", dropout=0.05, dtype=dtype).cuda(), steps=3, grad_accum=2, device="cuda"
    )
    streamed = build(base="nf4", dropout=0.05, dtype=dtype)
    kw = {"hold_weights": True, "offload": "all", "graphs": graphs}
    got = train(streamed, steps=3, grad_accum=2, device="cuda", stream_kwargs=kw)
    assert streamed.narrows_stream.held is not None
    assert_identical(reference, got)
    if graphs:
        assert streamed.narrows_stream.graphs.stats.replays > 0
    elif dtype == torch.float32:  # bf16 inputs of a few tokens may take bitsandbytes' fused kernel instead
        linears = sum(1 for m in streamed.modules() if is_nf4_linear(m))
        with Dequantizations() as seen:
            streamed(**{k: v.cuda() for k, v in tiny_batch(seq=12, seed=7).items()}).loss.backward()
        assert seen.count == 2 * linears
