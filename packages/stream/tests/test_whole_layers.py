"""Resident layers kept whole (no recompute): how the planner picks them, and that a plan
mixing streamed and whole layers still trains `torch.equal` to resident training — with
the fault-injected twins that prove the gates can fail."""

from __future__ import annotations

import functools

import pytest
from helpers import assert_identical, build, train

import narrows.stream as ns
from narrows.core import anatomy_of
from narrows.core.testing import tiny_batch
from narrows.stream.errors import StreamSetupError
from narrows.stream.planning import (
    Shapes,
    input_bytes,
    layer_seconds,
    passes,
    recompute_share,
    step_seconds,
    whole_bytes,
)

SHAPE = {"batch_size": 2, "seq_len": 12, "device": "cpu"}  # tiny_batch(): 2 rows of 12 positions
SIZE = {"batch_size": 2, "seq_len": 12}
N = 6


def _model(dropout=0.05, base="float"):
    # wide layers, short batch: a layer outweighs its activations, so mixed plans exist
    return build(num_hidden_layers=N, dropout=dropout, base=base, hidden_size=128, intermediate_size=512)


def _budgets(model, **kw):
    low = ns.plan(model, None, **SHAPE, **kw).predicted_peak
    high = ns.plan(model, "fit", **SHAPE, **kw).predicted_peak
    step = max(1, (high - low) // 200)
    return [ns.plan(model, b, **SHAPE, **kw) for b in range(low, high + step, step)]


@functools.cache
def _mixed_budget() -> int:
    """A budget whose plan has streamed and whole layers at once."""
    for p in _budgets(_model()):
        if len(p.whole) > 1 and len(p.resident) < N - 1:
            return p.budget
    raise AssertionError("no budget gives a mixed plan")


@functools.cache
def _resident(dropout=0.05, base="float"):
    return train(_model(dropout, base), steps=2, grad_accum=2)


def _seconds(model, p):
    return step_seconds(p.layer_bytes, Shapes.of(anatomy_of(model), 2, 12), len(p.resident), len(p.whole))


def test_planner_spends_a_growing_budget_on_a_faster_step():
    """The predicted step time never grows with the budget; whole layers are resident and
    are the last layers; the predicted peak stays within the budget; with room for
    everything, every layer is whole (plain training without checkpointing). On this
    compute-bound toy, whole layers win over resident-but-recomputed ones."""
    model = _model()
    plans = _budgets(model)
    times = [_seconds(model, p) for p in plans]
    assert times == sorted(times, reverse=True) and times[-1] < times[0]
    for p in plans:
        assert p.predicted_peak <= p.budget
        assert set(p.whole) <= set(p.resident)
        assert p.whole == tuple(range(N - len(p.whole), N))
        assert not p.whole or not p.offloaded
    assert any(len(p.whole) > 0 and len(p.resident) < N for p in plans)
    fit = ns.plan(model, "fit", **SHAPE)
    assert fit.whole == tuple(range(N)) and "6 of 6 layers run without recompute" in str(fit)
    assert ns.plan(model, "fit", **SHAPE, recompute="all").whole == ()


@pytest.mark.parametrize("fast", [False, True])
def test_step_model_prefers_residency_when_copies_are_exposed(fast):
    """A transfer-bound layer (the copy longer than the compute hiding it) is made resident
    before any layer is kept whole; a compute-bound one is kept whole instead."""
    shapes = Shapes.of(anatomy_of(_model()), 1, 512, fast=fast)
    copy_bound = [10**9] * 8  # 25 ms a copy against microseconds of compute
    assert step_seconds(copy_bound, shapes, 2, 0) < step_seconds(copy_bound, shapes, 1, 1)
    tiny = [10**3] * 8
    assert step_seconds(tiny, shapes, 1, 1) < step_seconds(tiny, shapes, 2, 0)


@pytest.mark.parametrize("fast", [False, True])
def test_a_whole_layer_saves_its_recompute(fast):
    """Keeping a layer whole saves what its recompute would run: a whole forward under
    autograd, all but down_proj in a fast layer, whose backward is also cheaper."""
    s = Shapes.of(anatomy_of(_model()), 1, 512, fast=fast)
    tiny = [10**3] * 8  # compute-bound: nothing exposed
    f = layer_seconds(tiny[0], s)[0]
    saved = step_seconds(tiny, s, 1, 0) - step_seconds(tiny, s, 1, 1)
    assert saved == pytest.approx(recompute_share(s) * f)
    whole, recomputed, hiding = passes(s)
    if fast:
        d, i = s.hidden, s.intermediate
        assert recompute_share(s) == pytest.approx((4 * d * d + 2 * d * i) / (4 * d * d + 3 * d * i))
        assert whole < 3 and recomputed < 4 and hiding == pytest.approx(recomputed - 1)
    else:
        assert (whole, recomputed, hiding) == (3, 4, 3)  # PEFT's layers priced as before
    # a copy longer than a forward: what the backward's share hides of it is exposed no more
    g, c = layer_seconds(10**9, s)
    exposed = step_seconds([10**9] * 8, s, 7, 0) - 8 * recomputed * g  # one streamed layer of eight
    assert exposed == pytest.approx(max(0.0, c - g) + max(0.0, c - hiding * g))


def test_whole_layers_cost_what_the_planner_says():
    """Each whole layer holds `whole_bytes` in place of its saved input."""
    model = _model()
    p = ns.plan(model, _mixed_budget(), **SHAPE)
    shapes = Shapes.of(anatomy_of(model), 2, 12)
    k = len(p.offloaded)
    expected = (N - len(p.whole) - k + min(2, k)) * input_bytes(shapes) + len(p.whole) * whole_bytes(shapes)
    assert p.activation_bytes == expected and len(p.whole) > 1


def test_no_whole_layers_when_tiling_or_offloading_everything():
    model = _model()
    assert ns.plan(model, "fit", **SHAPE, seq_tile=8).whole == ()
    assert ns.plan(model, "fit", **SHAPE, offload="all").whole == ()
    assert ns.plan(model, None, **SHAPE).whole == ()


def test_bad_recompute_is_refused():
    with pytest.raises(StreamSetupError, match="recompute='sometimes'"):
        ns.stream(_model(), "fit", device="cpu", recompute="sometimes")


@pytest.mark.parametrize("dropout", [0.0, 0.05])
def test_mixed_plan_is_identical_to_resident(dropout):
    """Streamed, recomputed-resident and whole layers in one model, with LoRA dropout and
    gradient accumulation: bit-identical to resident training."""
    model = _model(dropout)
    got = train(model, steps=2, grad_accum=2, stream_kwargs={"gpu_budget": _mixed_budget(), **SIZE})
    plan = model.narrows_stream.plan
    assert plan.whole and len(plan.resident) < N
    assert_identical(_resident(dropout), got)


@pytest.mark.bnb
def test_mixed_plan_is_identical_to_resident_on_nf4():
    pytest.importorskip("bitsandbytes")
    model = _model(base="nf4")
    budget = next(p.budget for p in _budgets(model) if p.whole and len(p.resident) < N)
    got = train(model, steps=2, grad_accum=2, stream_kwargs={"gpu_budget": budget, **SIZE})
    assert model.narrows_stream.plan.whole
    assert_identical(_resident(base="nf4"), got)


def _count_attention_calls(model) -> list[int]:
    """Calls of each layer's attention (a wrapped forward: the recompute calls no hooks)."""
    calls = [0] * N
    for i, layer in enumerate(anatomy_of(model).layers):
        attn = layer.self_attn

        def counted(*args, i=i, inner=attn.forward, **kwargs):
            calls[i] += 1
            return inner(*args, **kwargs)

        attn.forward = counted
    return calls


def test_whole_layers_run_once_and_the_others_twice():
    """The point of a whole layer: its forward runs once per micro-step; a recomputed one
    runs again in backward."""
    model = _model()
    ns.stream(model, _mixed_budget(), **SHAPE, check=False)
    calls = _count_attention_calls(model)
    model(**tiny_batch(seed=1)).loss.backward()
    whole = set(model.narrows_stream.plan.whole)
    assert calls == [1 if i in whole else 2 for i in range(N)]
    assert model.narrows_stream.stats.waits <= 1  # the first layer's first load; the rest prefetched


def test_disk_tier_layers_and_whole_layers_never_collide():
    """Disk-tier layers are made resident first; whole layers are the last ones; a layer
    in both is counted once."""
    from narrows.stream.planning import make_plan

    model = _model()
    base = ns.plan(model, "fit", **SHAPE)
    shapes = Shapes.of(anatomy_of(model), 2, 12)
    seen_whole_disk = False
    for p in _budgets(model):
        q = make_plan(
            base.layer_bytes,
            fixed_bytes=base.fixed_bytes,
            shapes=shapes,
            budget=p.budget,
            device="cpu",
            disk=(1, N - 1),
        )
        assert len(set(q.resident)) == len(q.resident) and set(q.whole) <= set(q.resident)
        assert q.predicted_peak <= q.budget
        seen_whole_disk |= N - 1 in q.whole and len(q.resident) < N
    assert seen_whole_disk


def test_fast_layers_dropout_masks_are_priced():
    """Fast layers with LoRA dropout keep each adapter's mask for the backward (a whole
    layer until the step's backward, a recomputed one through its backward). The plan
    prices them — found in eval mode too, as a model is often planned before ``.train()`` —
    so with every layer whole the peak is predicted higher by every layer's masks at least,
    and the budget that holds every layer whole without dropout holds fewer with it."""
    from narrows.stream.planning import dropout_mask_bytes

    drop, plain = _model(dropout=0.1).eval(), _model(dropout=0.0)
    for m in (drop, plain):
        m.set_attn_implementation("sdpa")  # the fast layers' attention
    shapes = Shapes.of(anatomy_of(drop), 2, 12, fast=True, dropout=True)
    assert dropout_mask_bytes(shapes) == 2 * 12 * (6 * 128 + 512)  # bool masks: a byte an element
    fit_drop, fit_plain = (ns.plan(m, "fit", **SHAPE) for m in (drop, plain))
    assert len(fit_drop.whole) == len(fit_plain.whole) == N
    assert fit_drop.predicted_peak - fit_plain.predicted_peak >= N * dropout_mask_bytes(shapes)
    budget = fit_plain.predicted_peak
    tight = ns.plan(drop, budget, **SHAPE)
    assert len(tight.whole) < N and tight.predicted_peak <= budget
