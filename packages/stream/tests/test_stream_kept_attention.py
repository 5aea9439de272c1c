"""``keep_attention``: streamed fast layers keep their attention in host memory from the forward
for the backward, run no attention in the recompute, and train the bits resident fast layers
train; the planner keeps it at long context only, and says why not elsewhere."""

from __future__ import annotations

import dataclasses
import functools

import pytest
from helpers import assert_identical, build, train

import narrows.stream as ns
import narrows.stream.execution.kept_attention as kept_attention
from narrows.core import anatomy_of, fuse_layers
from narrows.core.kernels.fastlayer import compute
from narrows.stream.planning import planned_shapes
from narrows.stream.planning.attention import keep_attention


def _build(arch="llama", **kw):
    model = build(arch, **kw)
    for m in model.modules():
        if hasattr(m, "config"):
            m.config._attn_implementation = "sdpa"
    return model


def _resident_fast(arch="llama", **kw):
    model = _build(arch, **kw)
    assert not fuse_layers(model).refused
    return train(model, steps=2, grad_accum=2)


class _Sdpa:
    """Counts the fast layers' attention calls."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = compute.F.scaled_dot_product_attention

        def counted(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(compute.F, "scaled_dot_product_attention", counted)


@pytest.mark.parametrize(
    ("arch", "kw", "stream_kwargs"),
    [
        ("llama", {}, {}),
        ("qwen3", {"dropout": 0.1}, {}),  # per-head norms (Q/K/V recomputed), dropout replayed
        ("qwen2", {}, {"offload": "all"}),  # inputs in host memory too
        ("mistral", {}, {"seq_tile": 4}),  # the MLP in sequence tiles
        # latent attention (q_b's, kv_b's adapters' side alone recomputed); values as wide as
        # keys, for the CPU's one-node SDPA, and dense MLPs (all-linear would adapt a router)
        ("deepseek_v3", {"dropout": 0.1, "v_head_dim": 48, "first_k_dense_replace": 3}, {}),
    ],
)
def test_kept_attention_trains_what_resident_fast_layers_train(arch, kw, stream_kwargs, monkeypatch):
    if "seq_tile" in stream_kwargs:  # tiles sum in another order than untiled: the twin is tiled too
        reference = train(
            _build(arch, **kw),
            steps=2,
            grad_accum=2,
            stream_kwargs={"kernels": "fast", "keep_attention": False, **stream_kwargs},
        )
    else:
        reference = _resident_fast(arch, **kw)
    streamed = _build(arch, **kw)
    sdpa = _Sdpa(monkeypatch)
    monkeypatch.setattr(kept_attention, "MIN_BYTES", 0)  # the tiny model's tensors go to host memory too
    fetched = []
    real_get = kept_attention._Packed.get
    monkeypatch.setattr(kept_attention._Packed, "get", lambda self: fetched.append(1) or real_get(self))
    got = train(
        streamed,
        steps=2,
        grad_accum=2,
        stream_kwargs={"kernels": "fast", "keep_attention": True, "check": False, **stream_kwargs},
    )
    handle = streamed.narrows_stream
    layers = len(handle.plan.layer_bytes)
    assert handle.plan.kept_attention == tuple(range(layers))
    assert sdpa.calls == layers * 4  # the forwards' only: no recompute ran attention
    assert len(fetched) >= layers * 4 * 5  # q, k, v, output, LSE of every call, back from host memory
    assert_identical(reference, got)


def test_the_backward_reads_the_bytes_kept_in_host_memory(monkeypatch):
    """Kept tensors that came back wrong would change training: the backward reads them."""
    reference = _resident_fast()
    monkeypatch.setattr(kept_attention, "MIN_BYTES", 0)
    real = kept_attention._Packed.get
    monkeypatch.setattr(kept_attention._Packed, "get", lambda self: real(self) * 0.5)
    got = train(_build(), steps=2, grad_accum=2, stream_kwargs={"kernels": "fast", "keep_attention": True})
    with pytest.raises(AssertionError):
        assert_identical(reference, got)


def test_each_backward_reads_its_own_calls_attention(monkeypatch):
    """Two micro-batches of other lengths in one step: each layer's backward gets its own call's
    attention back (the newest kept), not an earlier one's."""
    monkeypatch.setattr(kept_attention, "MIN_BYTES", 0)
    reference = _build()
    fuse_layers(reference)
    want = train(reference, steps=2, grad_accum=3, widths=(12, 7, 9))
    got = train(
        _build(),
        steps=2,
        grad_accum=3,
        widths=(12, 7, 9),
        stream_kwargs={"kernels": "fast", "keep_attention": True, "offload": "all"},
    )
    assert_identical(want, got)


def test_the_planner_keeps_attention_at_long_context_only():
    model = _build()
    plan = functools.partial(ns.plan, recompute="all")  # no layer whole: each is recomputed
    short = plan(model, device="cpu", seq_len=16, gpu_budget=1 << 30)
    assert short.kept_attention == () and "of a layer's recompute at 16 tokens" in short.attention_choice
    long = plan(model, device="cpu", seq_len=8192, gpu_budget=8 << 30)
    assert long.kept_attention == tuple(range(len(long.layer_bytes))) and long.attention_choice.startswith(
        "on:"
    )
    assert long.attention_host_bytes > 0 and long.d2h_bytes_per_step >= long.attention_host_bytes
    floor = plan(model, device="cpu", seq_len=8192)
    assert floor.kept_attention == () and "smallest footprint" in floor.attention_choice
    peft = plan(model, device="cpu", seq_len=8192, gpu_budget=8 << 30, kernels="peft")
    assert peft.kept_attention == () and "PEFT's modules" in peft.attention_choice
    graphs = plan(model, device="cpu", seq_len=8192, gpu_budget=8 << 30, graphs=True)
    assert graphs.kept_attention == () and "CUDA graphs" in graphs.attention_choice
    off = plan(model, device="cpu", seq_len=8192, gpu_budget=8 << 30, keep_attention=False)
    assert off.kept_attention == () and "kept attention" in str(off)
    # no room beside a plan with every layer resident: the same plan with the room reserved,
    # one layer fewer resident (asked for at a short sequence, whose attention is smaller than a layer)
    full = plan(model, device="cpu", seq_len=64, gpu_budget=8 << 30, keep_attention=False)
    per_call = (
        plan(model, device="cpu", seq_len=64, gpu_budget=8 << 30, keep_attention=True).predicted_peak
        - full.predicted_peak
    )
    assert 0 < per_call < min(full.layer_bytes) and len(full.resident) == len(full.layer_bytes)
    snug = plan(
        model, device="cpu", seq_len=64, gpu_budget=full.predicted_peak + per_call // 2, keep_attention=True
    )
    assert snug.kept_attention == long.kept_attention and snug.reserved_bytes >= per_call
    assert len(snug.resident) < len(full.resident) and snug.predicted_peak <= snug.budget

    def no_room(extra):
        raise ns.BudgetTooSmallError("no plan holds it")

    at_budget = dataclasses.replace(full, budget=full.predicted_peak)
    cfg = ns.StreamConfig(seq_len=64, keep_attention=True)
    shapes = planned_shapes(model, anatomy_of(model), cfg)
    assert shapes.fast and shapes.act_bytes == 4
    tight = keep_attention(anatomy_of(model), at_budget, no_room, cfg, shapes)
    assert tight.kept_attention == () and "in flight" in tight.attention_choice
    small_host = keep_attention(anatomy_of(model), full, no_room, cfg, shapes, host_available=1000)
    assert small_host.kept_attention == () and "0.977 KiB available" in small_host.attention_choice
    roomier = dataclasses.replace(at_budget, reserved_bytes=at_budget.reserved_bytes + per_call)
    refused = keep_attention(
        anatomy_of(model), at_budget, lambda extra: roomier, cfg, shapes, host_available=1000
    )
    assert refused.reserved_bytes == at_budget.reserved_bytes  # not kept: the plan as it was, no room taken


def test_keep_attention_takes_true_false_or_auto():
    with pytest.raises(ns.StreamSetupError, match="keep_attention"):
        ns.StreamConfig(keep_attention="host")
