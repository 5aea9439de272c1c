"""``kernels="fast"``: streamed layers run narrows.core's fast layer through the layer
executor, and train the bits resident `fuse_layers` trains — at the smallest footprint,
with whole layers, with offloaded inputs, with dropout, on an NF4 base — while
``kernels="peft"`` (the default) keeps PEFT's bits. Twins: the streamed fast run is not
PEFT's, and a wrong executor gradient shows."""

from __future__ import annotations

import pytest
import torch
from helpers import Dequantizations, assert_identical, build, kept_bytes, train

import narrows.stream as ns
import narrows.stream.execution.fast as fast
from narrows.core import anatomy_of, fuse_layers
from narrows.core.kernels.fastlayer import compute, coverage
from narrows.stream.errors import StreamSetupError


def _sdpa(model):
    for m in model.modules():
        if hasattr(m, "config"):
            m.config._attn_implementation = "sdpa"
    return model


def _build(arch="llama", **kw):
    return _sdpa(build(arch, **kw))


def _resident_fast(arch="llama", **kw):
    model = _build(arch, **kw)
    assert not fuse_layers(model).refused
    return train(model, steps=2, grad_accum=2)


@pytest.mark.parametrize(
    ("arch", "stream_kwargs"),
    [
        ("llama", {}),  # smallest footprint: every layer streamed and recomputed
        ("qwen3", {"gpu_budget": "fit"}),  # the CPU's "fit": layers whole
        ("qwen2", {"offload": "all"}),  # saved inputs in host memory
    ],
)
def test_streamed_fast_layers_train_what_resident_fast_layers_train(arch, stream_kwargs):
    reference = _resident_fast(arch)
    streamed = _build(arch)
    got = train(streamed, steps=2, grad_accum=2, stream_kwargs={"kernels": "fast", **stream_kwargs})
    assert isinstance(streamed.narrows_stream.executor, fast.FastExecutor)
    assert coverage(streamed).refused == {}
    assert_identical(reference, got)
    peft = train(_build(arch), steps=2, grad_accum=2, stream_kwargs={"kernels": "peft"})
    with pytest.raises(AssertionError):  # the twin: PEFT's kernels train other bits
        assert_identical(peft, got)


def test_graphs_replay_the_fast_layers():
    """CUDA graphs (emulated on the CPU) capture the fused forward: resident fast bits."""
    reference = _resident_fast("qwen2", dropout=0.1)
    streamed = _build("qwen2", dropout=0.1)
    got = train(streamed, steps=2, grad_accum=2, stream_kwargs={"kernels": "fast", "graphs": True})
    graphs = streamed.narrows_stream.graphs
    assert graphs.stats.replays > 0 and not graphs.stats.refused
    assert_identical(reference, got)


def test_dropout_is_replayed_in_the_fast_recompute():
    reference = _resident_fast(dropout=0.1)
    streamed = _build(dropout=0.1)
    assert_identical(reference, train(streamed, steps=2, grad_accum=2, stream_kwargs={"kernels": "fast"}))


def test_the_streamed_layers_run_the_fast_entry_points(monkeypatch):
    calls = []
    for name in ("forward", "recompute", "backward"):
        real = getattr(compute, name)
        monkeypatch.setattr(compute, name, lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k))
    train(
        _build(), steps=1, stream_kwargs={"kernels": "fast", "check": False}
    )  # the self-check runs layers too
    assert calls.count("forward") == calls.count("recompute") == calls.count("backward") == 3


def test_a_wrong_fast_gradient_changes_training(monkeypatch):
    reference = _resident_fast()
    real = compute.backward

    def halved(parts, saved, grad, cache=None):
        g_x, grads = real(parts, saved, grad, cache)
        return g_x, [g / 2 for g in grads]

    monkeypatch.setattr(compute, "backward", halved)
    got = train(_build(), steps=2, grad_accum=2, stream_kwargs={"kernels": "fast"})
    with pytest.raises(AssertionError):
        assert_identical(reference, got)


@pytest.mark.bnb
def test_nf4_fast_layers_held_dequantise_twice_and_match_resident():
    pytest.importorskip("bitsandbytes")
    reference = _resident_fast(base="nf4")
    streamed = _build(base="nf4")
    got = train(streamed, steps=2, grad_accum=2, stream_kwargs={"kernels": "fast", "hold_weights": True})
    assert_identical(reference, got)
    model = _build(base="nf4")
    ns.stream(model, device="cpu", kernels="fast", hold_weights=True)
    from narrows.core.testing import tiny_batch

    with Dequantizations() as seen:
        model(**tiny_batch(seq=12, seed=0)).loss.backward()
    assert seen.count == 2 * 7 * 3


def test_a_layer_the_fast_layer_does_not_cover_runs_pefts_kernels():
    eager = build("llama")  # eager attention: refused, runs as with kernels="peft"
    got = train(eager, steps=1, stream_kwargs={"kernels": "fast"})
    assert_identical(train(build("llama"), steps=1, stream_kwargs={}), got)


def test_fast_is_the_default_and_a_tiled_mlp_with_dropout_is_named_where_it_runs_pefts_kernels():
    model = _build()
    ns.stream(model, device="cpu")
    assert isinstance(model.narrows_stream.executor, fast.FastExecutor)
    assert str(model.narrows_stream.kernels) == "fast layers: all 3 decoder layers"
    tiled = _build()
    ns.stream(tiled, device="cpu", seq_tile=4)
    assert str(tiled.narrows_stream.kernels) == "fast layers: all 3 decoder layers"
    dropped = _build(dropout=0.1)
    ns.stream(dropped, device="cpu", seq_tile=4)
    assert "sequence tiles with LoRA dropout" in dropped.narrows_stream.kernels


@pytest.mark.parametrize("stream_kwargs", [{}, {"gpu_budget": "fit"}, {"offload": "all"}])
def test_a_tiled_mlp_streams_what_the_same_tiles_train_resident(stream_kwargs):
    """Sequence tiles in the fast layer: streamed == resident with the same tiling (bits);
    against untiled fast layers, equal up to summation order, not in bits (the twin)."""
    from narrows.stream import tile_sequence

    def resident(tile):
        model = _build("qwen2")
        if tile:
            tile_sequence(model, tile)
        assert not fuse_layers(model).refused
        return train(model, steps=2, grad_accum=2, widths=(12, 9))

    tiled = resident(10)  # two rows a batch: five positions a tile, the last one shorter
    streamed = _build("qwen2")
    got = train(
        streamed,
        steps=2,
        grad_accum=2,
        widths=(12, 9),
        stream_kwargs={"kernels": "fast", "seq_tile": 10, **stream_kwargs},
    )
    assert streamed.narrows_stream.plan.tile_tokens == 10 and not coverage(streamed).refused
    assert_identical(tiled, got)
    untiled = resident(None)
    for name in ("loss", "grad"):
        for a, b in zip(untiled[name], got[name]):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)
    with pytest.raises(AssertionError):
        assert_identical(untiled, got)


def test_a_tiled_mlp_runs_its_forward_twice_a_step_not_three_times(monkeypatch):
    """Each tile's gate/up/SwiGLU: once in the forward, once in the backward (the recompute
    stops at the MLP's input) — 2 x tiles x layers a step."""
    from narrows.core.kernels.fastlayer import compute

    calls = []
    real = compute.swiglu
    monkeypatch.setattr(compute, "swiglu", lambda g, u: calls.append(g.shape[0]) or real(g, u))
    model = _build("llama")
    ns.stream(model, device="cpu", kernels="fast", seq_tile=8)  # 2 rows of 12: 4 positions a tile
    calls.clear()  # the set-up's self-check ran a forward
    train(model, steps=1)
    assert calls == [8, 8, 8] * 3 * 2, calls


def test_an_unknown_kernels_value_is_refused():
    with pytest.raises(StreamSetupError, match="kernels='triton'"):
        ns.stream(_build(), device="cpu", kernels="triton")
    with pytest.raises(StreamSetupError, match="lora_dtype='bf16'"):
        ns.stream(_build(), device="cpu", lora_dtype="bf16")


def _bf16(dropout=0.0):
    """A bf16 base with float32 adapters (float32 LoRA differs from bf16 LoRA only there)."""
    model = _build("qwen2", dtype=torch.bfloat16, dropout=dropout)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    return model


def test_float32_lora_streams_what_it_trains_resident():
    """``lora_dtype="float32"``: streamed (the smallest footprint, dropout replayed) equals
    resident `fuse_layers(lora_dtype=torch.float32)`, and not the default bf16 LoRA; the plan
    prices its float32 temporaries; with PEFT's kernels it is refused."""
    resident = _bf16(dropout=0.1)
    assert "LoRA in float32" in str(fuse_layers(resident, lora_dtype=torch.float32))
    reference = train(resident, steps=2, grad_accum=2)
    streamed = _bf16(dropout=0.1)
    got = train(streamed, steps=2, grad_accum=2, stream_kwargs={"kernels": "fast", "lora_dtype": "float32"})
    assert "LoRA in float32" in streamed.narrows_stream.kernels
    assert_identical(reference, got)
    low = train(_bf16(dropout=0.1), steps=2, grad_accum=2, stream_kwargs={"kernels": "fast"})
    with pytest.raises(AssertionError):
        assert_identical(low, got)
    model = _bf16()
    wide, fast = (
        ns.plan(model, "fit", device="cpu", batch_size=2, seq_len=64, **kw)
        for kw in ({"lora_dtype": "float32"}, {})
    )
    assert wide.work_bytes > fast.work_bytes  # its float32 temporaries
    with pytest.raises(StreamSetupError, match="the fast layers' option"):
        ns.stream(_bf16(), device="cpu", kernels="peft", lora_dtype="float32")


@pytest.mark.gpu
@pytest.mark.parametrize("stream_kwargs", [{}, {"gpu_budget": "fit"}, {"graphs": True}, {"seq_tile": 10}])
def test_cuda_streamed_fast_layers_train_what_resident_fast_layers_train(stream_kwargs):
    """bf16 base, float32 adapters, dropout (none with tiles, which refuse it),
    deterministic kernels: torch.equal."""
    from narrows.core import deterministic
    from narrows.stream import tile_sequence

    tile = stream_kwargs.get("seq_tile")

    def model():
        m = _build("qwen2", dtype=torch.bfloat16, dropout=0.0 if tile else 0.05)
        for p in m.parameters():
            if p.requires_grad:
                p.data = p.data.float()
        return m

    deterministic(True)
    try:
        resident = model().cuda()
        if tile:
            tile_sequence(resident, tile)
        assert not fuse_layers(resident).refused
        reference = train(resident, steps=2, grad_accum=2, device="cuda")
        got = train(
            model(),
            steps=2,
            grad_accum=2,
            device="cuda",
            stream_kwargs={"kernels": "fast", "deterministic": True, **stream_kwargs},
        )
        assert_identical(reference, got)
    finally:
        deterministic(False)


@pytest.mark.parametrize("base", ["float", pytest.param("nf4", marks=pytest.mark.bnb)])
def test_the_plan_prices_what_a_fast_layer_keeps(base):
    """With every layer fast, a whole layer is priced by what `forward_keeping` keeps (counted
    here from its tensors, less the input and the rotary tables every layer shares: within
    25% above it) — on a 4-bit base too, whose Q/K/V come out of one stacked matmul — not by
    PEFT's fit; one refused layer (a hook on it) and ``kernels="peft"`` keep PEFT's prices."""
    from narrows.core.kernels.fastlayer import compute, parts_of
    from narrows.stream.planning import Shapes, input_bytes, whole_bytes

    model = _build(
        num_hidden_layers=2,
        hidden_size=256,
        intermediate_size=768,
        num_attention_heads=4,
        num_key_value_heads=2,
        base=base,
    )
    anat = anatomy_of(model)
    batch, seq = 2, 64
    x = torch.randn(batch, seq, 256)
    cos, sin = anat.decoder.rotary_emb(x, torch.arange(seq).expand(batch, -1))
    _, saved = compute.forward_keeping(parts_of(anat.layers[0]), x, cos, sin, None)
    # the adapters' own tensors are not activations
    kept = kept_bytes(saved, x, cos, sin, *model.parameters())
    fast, peft = (
        ns.plan(model, "fit", device="cpu", batch_size=batch, seq_len=seq, kernels=k)
        for k in ("fast", "peft")
    )
    priced = whole_bytes(Shapes.of(anat, batch, seq, fast=True)) - input_bytes(Shapes.of(anat, batch, seq))
    assert kept <= priced <= 1.25 * kept, (kept, priced)
    assert fast.work_bytes < peft.work_bytes and fast.activation_bytes < peft.activation_bytes
    anat.layers[1].mlp.down_proj.base_layer.register_forward_hook(lambda *_: None)  # a layer it refuses
    assert coverage(model).refused
    mixed = ns.plan(model, "fit", device="cpu", batch_size=batch, seq_len=seq)
    assert (mixed.work_bytes, mixed.activation_bytes) == (peft.work_bytes, peft.activation_bytes)


def test_a_tiled_fast_layer_is_priced_by_its_tile():
    """A fast layer whose MLP runs in tiles keeps its hidden-sized working set for every
    token and the MLP's for one tile: priced below the untiled fast layer and below PEFT's
    tiled layer, less for a smaller tile, by the MLP's part alone."""
    import dataclasses

    from narrows.stream.planning import Shapes, layer_work_bytes

    # Qwen2.5-7B's shape, one sequence of 32K tokens
    s = Shapes(
        layers=28,
        hidden=3584,
        intermediate=18944,
        heads=28,
        vocab=152064,
        act_bytes=2,
        batch=1,
        seq=32768,
        eager_attention=False,
        dequant_bytes=2 * 18944 * 3584 * 2,
        fast=True,
        kv_width=512,
    )
    untiled, tiled, smaller = layer_work_bytes(s), layer_work_bytes(s, 2048), layer_work_bytes(s, 1024)
    assert smaller < tiled < untiled < layer_work_bytes(dataclasses.replace(s, fast=False))
    assert tiled < layer_work_bytes(dataclasses.replace(s, fast=False), 2048)
    mlp_part = 1024 * (5 * s.hidden + 3.6 * s.intermediate) * s.act_bytes  # a tile's MLP tensors
    assert tiled - smaller == pytest.approx(mlp_part, abs=1)
    assert layer_work_bytes(s, 32768) == untiled  # a tile as long as the batch: one pass
    # the one device measurement (case fast_memory_tiled_7b of benchmarks/results/h100.jsonl): this
    # shape in 2048-token tiles peaked at 3206743040 bytes; priced above it, within 10%
    assert 3206743040 < tiled < 1.10 * 3206743040
