"""The overlap audit (`StreamHandle.profiling`): every layer use timed, copies the compute
waited for counted as exposed, and the plan redone with the measured rates. On the CPU
copies are synchronous, which makes "exposed" checkable exactly."""

from __future__ import annotations

import pytest
import torch
from helpers import build
from test_whole_layers import SHAPE
from test_whole_layers import _model as wide_model

import narrows.stream as ns
from narrows.core.testing import tiny_batch
from narrows.stream.checks.profile import Profile

N = 4


def _profiled(prefetch: bool = True):
    model = build(num_hidden_layers=N, dropout=0.0)
    ns.stream(model, None, device="cpu")
    if not prefetch:
        model.narrows_stream.engine.prefetch = lambda index: None  # every layer copied when acquired
    model(**tiny_batch()).loss.backward()  # warm
    with model.narrows_stream.profiling() as prof:
        model(**tiny_batch(seed=1)).loss.backward()
    assert model.narrows_stream.engine.profiler is None
    return prof


def test_every_layer_use_is_timed():
    prof = _profiled()
    assert sorted(prof.layers) == list(range(N))
    for t in prof.layers.values():
        assert t.uses == 2 and t.forward_uses == 1 and t.forward > 0 and t.backward > 0
    total = prof.totals
    assert total.copy > 0 and total.exposed <= total.copy + 1e-9
    assert total.forward + total.backward + total.exposed <= prof.seconds + 1e-6
    text = str(prof)
    assert "exposed copy" in text and text.count("streamed") == N
    d = prof.as_dict()
    assert len(d["layers"]) == N and 0 <= d["exposed_fraction"] <= 1


def test_a_copy_made_when_the_layer_is_needed_is_all_exposed():
    """Without prefetch each layer is copied inside its own use, before its compute: the
    whole copy is waited for. (Timing the use from after the copy would report none.)"""
    prof = _profiled(prefetch=False)
    for t in prof.layers.values():
        assert t.copy > 0
    total = prof.totals
    assert total.exposed == pytest.approx(total.copy, rel=1e-9)


FAST, SLOW = ns.Rates(h2d=1e15, forward_s=1e-3), ns.Rates(h2d=1e3, forward_s=1e-3)


def _plans_that_differ(model):
    """The first budget whose plan depends on the rates: (fast-copy plan, slow-copy plan)."""
    low, high = ns.plan(model, None, **SHAPE).predicted_peak, ns.plan(model, "fit", **SHAPE).predicted_peak
    for budget in range(low, high, max(1, (high - low) // 200)):
        fast, slow = (ns.plan(model, budget, **SHAPE, rates=r) for r in (FAST, SLOW))
        if (fast.resident, fast.whole) != (slow.resident, slow.whole):
            return fast, slow
    raise AssertionError("no budget where the rates matter")


def test_measured_rates_can_change_the_plan():
    """With slow copies, memory a fast machine spends on a whole layer (its recompute
    saved) buys another resident layer instead (its copies saved)."""
    fast, slow = _plans_that_differ(wide_model())
    assert len(slow.resident) - len(slow.whole) > len(fast.resident) - len(fast.whole)


def test_advice_says_what_the_planner_would_change():
    now, other = _plans_that_differ(wide_model())
    prof = Profile(torch.device("cpu"), now, replan=lambda rates: other)
    streamed = now.streamed[0]
    prof.layers[streamed] = ns.LayerTimes(
        streamed, forward=0.004, copy=0.001, copied_bytes=10**6, uses=2, forward_uses=2
    )
    assert prof.rates() == ns.Rates(h2d=1e9, forward_s=0.002)
    assert f"would keep {len(other.resident)} layers resident (now {len(now.resident)})" in prof.advice()
    prof.replan = lambda rates: now
    assert prof.advice().endswith("the plan stands")


@pytest.mark.gpu
def test_profile_on_cuda_times_copies_with_events():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = build(num_hidden_layers=N, dropout=0.0)
    ns.stream(model, None, device="cuda")
    batch = {k: v.cuda() for k, v in tiny_batch().items()}
    model(**batch).loss.backward()
    with model.narrows_stream.profiling() as prof:
        model(**batch).loss.backward()
    assert sorted(prof.layers) == list(range(N))
    total = prof.totals
    assert total.copy > 0 and 0 <= total.exposed <= prof.seconds
    assert all(t.uses == 2 and t.forward > 0 and t.backward > 0 for t in prof.layers.values())
