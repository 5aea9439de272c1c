"""CUDA graphs for the layers narrows runs (`graphs=`): on a CPU the same static-buffer
path runs with the body called again in place of a replay, so these tests cover the
plumbing — keys, buffers, results taken out of them, the RNG left untouched by capture —
and the GPU test covers real graphs. Each gate has a fault-injected twin."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from helpers import assert_identical, build, train

import narrows.stream as ns
from narrows.stream.errors import StreamSetupError
from narrows.stream.execution import graphs

N = 4


def _model(base="float", dropout=0.05):
    return build(num_hidden_layers=N, dropout=dropout, base=base)


@functools.cache
def _resident(base="float", dropout=0.05, steps=2):
    return train(_model(base, dropout), steps=steps, grad_accum=2)


def _graphed(base="float", dropout=0.05, steps=2, **kw):
    model = _model(base, dropout)
    kw.setdefault("gpu_budget", None)
    record = train(model, steps=steps, grad_accum=2, stream_kwargs={"graphs": True, **kw})
    return model, record


@pytest.mark.parametrize("base", ["float", "nf4"])
def test_graphed_layers_train_identically_to_resident(base):
    """Every streamed layer's forward and recompute-backward go through graph buffers;
    losses, gradients, weights and AdamW state are `torch.equal` to resident training."""
    if base == "nf4":
        pytest.importorskip("bitsandbytes")
    model, got = _graphed(base)
    assert_identical(_resident(base), got)
    stats = model.narrows_stream.graphs.stats
    assert stats.captured > 0 and stats.replays > 0 and not stats.refused and stats.eager == 0
    # one graph per (layer, device slab, kind, signature): a third step captures nothing new
    more, _ = _graphed(base, steps=3)
    assert more.narrows_stream.graphs.stats.captured == stats.captured


def test_results_left_in_graph_buffers_break_parity(monkeypatch):
    """Fault injection: without taking results out of the shared buffers, the next
    layer's replay overwrites the input a layer saved for its backward."""
    monkeypatch.setattr(graphs, "_take", lambda result: result)
    with pytest.raises((AssertionError, RuntimeError)):  # autograd may notice the overwrite itself
        _, got = _graphed(offload="off")  # saved inputs stay where the layers left them
        assert_identical(_resident(), got)


def test_capture_draws_no_random_numbers_from_the_run(monkeypatch):
    """Fault injection: a warm-up that is not forked moves the generator, so dropout
    masks after it differ from resident training."""
    import contextlib

    monkeypatch.setattr(graphs, "_fork", lambda **kw: contextlib.nullcontext())
    _, got = _graphed()
    with pytest.raises(AssertionError):
        assert_identical(_resident(), got)


def _live_tensors_per_step(steps: int = 4) -> list[int]:
    """How many tensors Python can still reach after each training step."""
    import gc

    from narrows.core.testing import tiny_batch

    model = _model(dropout=0.0)
    ns.stream(model, device="cpu", graphs=True, gpu_budget=None)
    counts = []
    for step in range(steps):
        model(**tiny_batch(seed=step)).loss.backward()
        gc.collect()
        counts.append(sum(isinstance(o, torch.Tensor) for o in gc.get_objects()))
    assert all(b.grad_fn is None for b in model.narrows_stream.graphs._buffers.values())
    return counts


def test_graph_buffers_keep_no_step_alive():
    """The static buffers live across steps; a copy into them must not record autograd
    history, or every step's graph (with the activations it saved) stays reachable."""
    counts = _live_tensors_per_step()
    assert counts[1] == counts[2] == counts[3], counts


def test_a_differentiable_buffer_fill_leaks_every_step(monkeypatch):
    """Fault injection: the fill with grad on (the bug found on the H100, +21 MiB per step
    for four 7B layers) is caught."""

    def leaky(buffers, values):
        for buf, value in zip(buffers, values):
            if buf is not None and buf.data_ptr() != value.data_ptr():
                buf.copy_(value)

    monkeypatch.setattr(graphs, "_fill", leaky)
    with pytest.raises(AssertionError):
        test_graph_buffers_keep_no_step_alive()


def test_a_hooked_layer_runs_eagerly_and_still_identically():
    """A replay would not call Python hooks: a layer with one runs eagerly, says why."""
    model = _model()
    seen = []
    model.base_model.model.model.layers[1].mlp.register_forward_hook(lambda m, a, out: seen.append(1))
    got = train(model, steps=2, grad_accum=2, stream_kwargs={"graphs": True, "gpu_budget": None})
    assert_identical(_resident(), got)
    stats = model.narrows_stream.graphs.stats
    assert "hooks" in stats.refused[1] and set(stats.refused) == {1}
    assert len(seen) == 4  # once per micro-batch forward: the hook saw every call
    assert model.narrows_stream.report()["graphs"]["refused"] == {"1": stats.refused[1]}


@pytest.mark.parametrize("router_logits", [False, True])
def test_moe_layers_are_graphed_while_their_router_logits_are_not_collected(router_logits):
    """transformers hooks an MoE layer's router to collect its logits once a forward asked
    for them: while no forward does, the hook does nothing and the layer is captured; a
    forward that collects them (the router's aux loss) runs eagerly. Both train as resident
    does."""
    pytest.importorskip("bitsandbytes")
    from narrows.core.testing import tiny_batch

    cfg = dict(
        arch="qwen3_moe",
        base="nf4",
        num_hidden_layers=2,
        output_router_logits=router_logits,
        router_aux_loss_coef=0.02,
    )

    def model():
        m = build(**cfg)
        with torch.no_grad():  # an evaluation that asked for them: the recorders are installed
            m(**tiny_batch(), output_router_logits=True)
        assert any(x._forward_hooks for x in m.modules())
        return m

    graphed = model()  # one step of two micro-batches: the second replays what the first captured
    got = train(graphed, steps=1, grad_accum=2, stream_kwargs={"graphs": True, "gpu_budget": None})
    assert_identical(train(model(), steps=1, grad_accum=2), got)
    stats = graphed.narrows_stream.graphs.stats
    assert not stats.refused
    if router_logits:
        assert stats.captured == 0 and stats.eager > 0
    else:
        assert stats.captured > 0 and stats.replays > 0


def test_a_hook_of_another_kind_beside_the_recorders_still_refuses():
    """Fault injection's twin: the recorder check must not pass a hook of another kind."""
    pytest.importorskip("bitsandbytes")
    model = build(arch="qwen3_moe", base="nf4", num_hidden_layers=2)
    model.base_model.model.model.layers[1].mlp.gate.register_forward_hook(lambda m, a, out: None)
    train(model, steps=1, grad_accum=2, stream_kwargs={"graphs": True, "gpu_budget": None})
    assert set(model.narrows_stream.graphs.stats.refused) == {1}


def test_hooks_on_the_layer_itself_run_around_its_replays():
    """The layer's own hooks run around the call narrows replays (as step mode's adapter
    serving does), so they refuse nothing; only its submodules' would be skipped."""
    model = _model()
    seen = []
    model.base_model.model.model.layers[1].register_forward_pre_hook(lambda m, a: seen.append(1))
    got = train(model, steps=2, grad_accum=2, stream_kwargs={"graphs": True, "gpu_budget": None})
    assert_identical(_resident(), got)
    stats = model.narrows_stream.graphs.stats
    assert not stats.refused and stats.replays > 0
    assert len(seen) == 4  # once per micro-batch forward


def test_step_mode_through_graphs_is_identical():
    """Block-major accumulation runs each (layer, micro-batch) through the graphs too."""
    from test_step_mode import resident, stepped

    model, stats, got = stepped(dropout=0.05, graphs=True, gpu_budget=None)
    assert [s.mode for s in stats[1:]] == ["block-major"] * (len(stats) - 1)
    assert_identical(resident(dropout=0.05), got)
    assert model.narrows_stream.graphs.stats.replays > 0


def test_a_graph_is_keyed_by_where_the_layers_adapters_are():
    """Adapters that wait in host memory between uses come back to the device for each:
    a graph captured with them at one address must not replay with them at another."""
    model = _model()
    layer = model.base_model.model.model.layers[0]
    g = graphs.LayerGraphs(torch.device("cpu"), emulate=True)
    h = torch.zeros(2, 3, 8)
    key = lambda: g._key("fwd", 0, layer, [h], (), {}, False)  # noqa: E731
    assert key() is None  # a shape runs eagerly the first time
    before = key()
    assert before is not None and key() == before
    adapter = next(p for p in layer.parameters() if p.requires_grad)
    adapter.data = adapter.data.clone()  # the same values elsewhere
    assert key() != before


def test_bad_graphs_option_is_refused():
    with pytest.raises(StreamSetupError, match="graphs="):
        ns.stream(_model(), device="cpu", graphs="yes")


def test_auto_by_default_and_no_graphs_on_a_cpu():
    """The default is "auto", which leaves a CPU eager: it has no graphs to replay."""
    model = _model()
    ns.stream(model, device="cpu", gpu_budget=1 << 30)
    assert model.narrows_stream.graphs is None and not model.narrows_stream.plan.graphs
    assert "auto: not a CUDA device" in str(model.narrows_stream.plan)
    model = _model()
    ns.stream(model, device="cpu", gpu_budget=1 << 30, graphs=False)
    assert model.narrows_stream.graphs is None and not model.narrows_stream.plan.graphs_choice


WIDTHS = (6, 8, 10, 6, 12, 8, 10, 6)  # micro-batch lengths in turn: four shapes, three repeating


@functools.cache
def _resident_widths():
    return train(_model(), steps=4, grad_accum=2, widths=WIDTHS)


def _graphed_widths(max_shapes: int):
    model = _model()
    ns.stream(model, device="cpu", graphs=True, gpu_budget=None)
    lg = model.narrows_stream.graphs
    lg.max_shapes = max_shapes
    return lg, train(model, steps=4, grad_accum=2, widths=WIDTHS)


def _coherent(lg: graphs.LayerGraphs) -> None:
    """Every kept graph's buffers are the ones the cache holds, and the cache holds no
    buffer that no graph uses."""
    held = {id(b) for b in lg._buffers.values()}
    used = {id(b) for g in lg._graphs.values() for b in (*g.ins, *g.outs) if b is not None}
    assert used <= held, "a kept graph reads or writes a buffer the cache let go (a freed block, on a GPU)"
    assert held <= used, "the cache holds buffers of evicted graphs"


def test_varying_widths_keep_at_most_max_shapes_and_train_identically():
    """Batches of four lengths through a cache of two shapes: each length is captured only
    once it comes round again, the least recently used shape is evicted with its buffers,
    and training stays `torch.equal` to resident training."""
    lg, got = _graphed_widths(max_shapes=2)
    assert_identical(_resident_widths(), got)
    st = lg.stats
    assert st.first_seen > 0 and st.evicted > 0 and st.replays > 0 and st.captured > 0
    assert len({g.shape for g in lg._graphs.values()}) <= 2 and len(lg._shapes) <= 2
    # no sequence-long buffer of an evicted width is left behind
    assert {b.shape[1] for b in lg._buffers.values() if b.dim() == 3} <= {shape[1] for shape in lg._shapes}
    _coherent(lg)
    # the length seen only once (12) was never captured
    assert all(shape[1] != 12 for shape in [*lg._shapes, *(g.shape for g in lg._graphs.values())])


def test_no_eviction_lets_the_cache_grow(monkeypatch):
    """Fault injection: shapes admitted without evicting: the bound is broken."""
    monkeypatch.setattr(graphs.LayerGraphs, "_evict", lambda self, shape: self._shapes.pop(shape))
    lg, _ = _graphed_widths(max_shapes=2)
    assert len({g.shape for g in lg._graphs.values()}) > 2


def test_eviction_of_shared_buffers_is_caught(monkeypatch):
    """Fault injection: an eviction that frees every buffer of the evicted graphs, also those
    the kept graphs share (the adapters' gradients have one shape for all widths)."""

    def careless(self, shape):
        del self._shapes[shape]
        gone = [k for k, g in self._graphs.items() if g.shape == shape]
        ids = {id(b) for k in gone for b in (*self._graphs[k].ins, *self._graphs[k].outs) if b is not None}
        for k in gone:
            del self._graphs[k]
        for k in [k for k, b in self._buffers.items() if id(b) in ids]:
            del self._buffers[k]

    monkeypatch.setattr(graphs.LayerGraphs, "_evict", careless)
    lg, _ = _graphed_widths(max_shapes=2)
    with pytest.raises(AssertionError, match="let go"):
        _coherent(lg)


def test_bad_max_shapes_is_refused():
    with pytest.raises(ValueError, match="max_shapes"):
        graphs.LayerGraphs(torch.device("cpu"), max_shapes=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("base", ["float", "nf4"])
def test_cuda_graphs_are_identical_to_resident_eager(base):
    """Real CUDA graphs, dropout drawn inside them: `torch.equal` to
    resident eager training on the same GPU with deterministic kernels. A layer whose
    forward syncs with the host is found in the warm-up and runs eagerly, still identical."""
    if base == "nf4":
        pytest.importorskip("bitsandbytes")
    from narrows.core import deterministic

    deterministic(True)
    ref = train(_model(base).to("cuda"), steps=2, grad_accum=2, device="cuda")
    model = _model(base)
    mlp = model.base_model.model.model.layers[2].mlp
    plain = mlp.forward
    mlp.forward = lambda x: plain(x) + 0 * float(x.sum().item() == 0)  # a host sync: not capturable
    got = train(
        model, steps=2, grad_accum=2, device="cuda", stream_kwargs={"gpu_budget": None, "graphs": True}
    )
    assert_identical(ref, got)
    stats = model.narrows_stream.graphs.stats
    assert stats.replays > 0 and set(stats.refused) == {2} and "waits for the host" in stats.refused[2]


def _between(base: str) -> int:
    """A CUDA budget with a resident layer and the rest streamed, graphs counted."""
    low = ns.plan(_model(base), None, device="cuda", batch_size=2, seq_len=12, offload="off", graphs=True)
    return low.predicted_peak + max(low.layer_bytes)  # one layer more than the smallest: a mix


GRAPH_MIXES = {
    "every layer resident and recomputed": {"gpu_budget": "fit", "recompute": "all"},
    "streamed and resident, inputs kept": {"offload": "off", "recompute": "all"},
    "inputs offloaded, head streamed": {"gpu_budget": None, "offload": "all", "head": "stream"},
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mix", list(GRAPH_MIXES))
@pytest.mark.parametrize("base", ["float", "nf4"])
def test_cuda_graphs_in_every_mix_the_planner_picks(base, mix):
    """The mixes a graphed plan can hold, with dropout: `torch.equal` to resident eager
    training on the same GPU with deterministic kernels."""
    if base == "nf4":
        pytest.importorskip("bitsandbytes")
    from narrows.core import deterministic

    deterministic(True)
    kw = {"gpu_budget": _between(base), "batch_size": 2, "seq_len": 12, **GRAPH_MIXES[mix], "graphs": True}
    ref = train(_model(base).to("cuda"), steps=2, grad_accum=2, device="cuda")
    model = _model(base)
    got = train(model, steps=2, grad_accum=2, device="cuda", stream_kwargs=kw)
    assert_identical(ref, got)
    plan, stats = model.narrows_stream.plan, model.narrows_stream.graphs.stats
    assert plan.graphs and stats.replays > 0 and not stats.refused
    if mix == "streamed and resident, inputs kept":
        assert 0 < len(plan.resident) < N
    if mix == "every layer resident and recomputed":
        assert len(plan.resident) == N and not plan.whole


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_with_peft_dora_and_tiles():
    """PEFT's DoRA layers replayed as graphs, and MLP tiles inside the graphs: equal to the
    same model (the same tiling) resident and eager."""
    from helpers import build

    from narrows.core import deterministic

    deterministic(True)
    ref = train(
        build(num_hidden_layers=N, kind="dora", dropout=0.05).to("cuda"), steps=2, grad_accum=2, device="cuda"
    )
    model = build(num_hidden_layers=N, kind="dora", dropout=0.05)
    got = train(
        model, steps=2, grad_accum=2, device="cuda", stream_kwargs={"gpu_budget": None, "graphs": True}
    )
    assert_identical(ref, got)
    assert model.narrows_stream.graphs.stats.replays > 0
    ref = train(ns.tile_sequence(_model(), 5).to("cuda"), steps=2, grad_accum=2, device="cuda")
    model = _model()
    got = train(
        model,
        steps=2,
        grad_accum=2,
        device="cuda",
        stream_kwargs={"gpu_budget": None, "seq_tile": 5, "graphs": True},
    )
    assert_identical(ref, got)
    assert model.narrows_stream.plan.tile_tokens == 5 and model.narrows_stream.graphs.stats.replays > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("base", ["float", "nf4"])
def test_cuda_graphs_evicted_and_recaptured_train_identically(base):
    """Four batch widths through a cache of two shapes on a real GPU: graphs and buffers
    freed and captured again between steps, `torch.equal` to resident eager training."""
    if base == "nf4":
        pytest.importorskip("bitsandbytes")
    from narrows.core import deterministic

    deterministic(True)
    ref = train(_model(base).to("cuda"), steps=4, grad_accum=2, device="cuda", widths=WIDTHS)
    model = _model(base)
    ns.stream(model, device="cuda", gpu_budget=None, graphs=True)
    lg = model.narrows_stream.graphs
    lg.max_shapes = 2
    got = train(model, steps=4, grad_accum=2, device="cuda", widths=WIDTHS)
    assert_identical(ref, got)
    assert lg.stats.evicted > 0 and lg.stats.replays > 0 and not lg.stats.refused
    _coherent(lg)


def _bf16_qwen3(intermediate: int):
    """A small bf16 Qwen3 for the CUDA pool tests: SDPA's fused kernels (one node, kept: no
    math path), heads wide enough for them."""
    model = build(
        "qwen3",
        dtype=torch.bfloat16,
        hidden_size=512,
        intermediate_size=intermediate,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=64,
    )
    model.set_attn_implementation("sdpa")
    return model


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_what_whole_layers_keep_in_the_pool_is_counted_once():
    """A whole layer's graphs keep its saved tensors in the pool, where CUDA's allocated
    count sees them too: the peak adds only the pool's free bytes, and stays within what
    the allocator reserved from the device (the independent bound). The twin: adding the
    whole pool counts them twice."""
    from narrows.core.testing import tiny_batch

    model = _bf16_qwen3(intermediate=1024)
    ns.stream(model, device="cuda", kernels="fast", graphs=True, gpu_budget="fit")
    g = model.narrows_stream.graphs
    for step in range(3):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        g.reset_peak()
        batch = {k: v.to("cuda") for k, v in tiny_batch(batch=4, seq=256, seed=step).items()}
        model(**batch, use_cache=False).loss.backward()
    torch.cuda.synchronize()
    kept = g.pool_bytes() - g.pool_free_bytes()
    assert not g.stats.refused and g.stats.replays > 0 and kept > 0  # whole layers' states, in the pool
    allocated = torch.cuda.max_memory_allocated()
    assert g.peak_bytes(allocated) == allocated + g.pool_free_bytes() <= torch.cuda.max_memory_reserved()
    assert allocated + g.pool_bytes() == g.peak_bytes(allocated) + kept  # the twin counts `kept` twice


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("budget", ["fit", None], ids=["whole", "streamed"])
def test_a_capture_step_counts_its_warm_ups_once(budget):
    """A shape is captured at its second step. Warm-ups and captures allocate in the pool,
    from every thread (a recompute's backward runs on the autograd engine's): a step that
    captures reports about what a replaying one does (CUDA's allocated peak and the pool's
    scratch, which replays use without allocating), within the allocator's reserved bytes.
    The twin, counting a warm-up's pool blocks beside the pool as well, reported a capturing
    step a layer's working set higher (on the H200, the main job at Qwen3-30B-A3B's shape:
    1.03 GiB above its steady steps)."""
    from narrows.core.testing import tiny_batch

    model = _bf16_qwen3(intermediate=2048)
    ns.stream(model, device="cuda", kernels="fast", graphs=True, gpu_budget=budget)
    g = model.narrows_stream.graphs
    steps = []
    for step in range(3):  # seen, captured, replayed
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        g.reset_peak()
        captured = g.stats.captured
        batch = {k: v.to("cuda") for k, v in tiny_batch(batch=4, seq=512, seed=step).items()}
        model(**batch, use_cache=False).loss.backward()
        torch.cuda.synchronize()
        allocated = torch.cuda.max_memory_allocated()
        steps.append((g.stats.captured - captured, allocated, g.peak_bytes(allocated)))
    (first, _, _), (captures, _, capturing), (later, allocated, replaying) = steps
    assert first == 0 and captures > 0 and later == 0 and not g.stats.refused
    assert replaying == allocated + g.pool_free_bytes() > allocated  # the pool's scratch counted
    said = f"capturing {capturing}, replaying {replaying}, reserved {torch.cuda.memory_reserved()}"
    assert 0.95 * replaying <= capturing <= 1.05 * replaying, said
    assert capturing <= torch.cuda.memory_reserved(), said


def _fast_qwen3(stream_kwargs: dict | None):
    """A tiny Qwen3 with dropping-out adapters in fast layers: fused resident (None), or
    streamed with `stream_kwargs`; the generator seeded."""
    from narrows.core import fuse_layers

    model = build("qwen3", dropout=0.1)
    model.set_attn_implementation("sdpa")
    if stream_kwargs is None:
        fuse_layers(model)
    else:
        ns.stream(model, device="cpu", **stream_kwargs)
    torch.manual_seed(0)
    return model


def _two_in_flight(stream_kwargs: dict | None, check: bool = True) -> list[torch.Tensor]:
    """Two micro-batches' forwards before one backward of their sum: the adapters'
    gradients, on a fast model (whole layers: graphed in `stream_kwargs` with graphs)."""
    from narrows.core.testing import tiny_batch

    model = _fast_qwen3(stream_kwargs)
    for step in range(3):  # the first sees each shape, the second captures, the third replays
        batches = [tiny_batch(seed=10 * step + i) for i in range(2)]
        sum(model(**b, use_cache=False).loss for b in batches).backward()
    if stream_kwargs is not None and check:
        stats = model.narrows_stream.graphs.stats
        assert stats.replays > 0 and stats.eager > 0 and not stats.refused
    return [p.grad.clone() for p in model.parameters() if p.requires_grad]


def test_whole_layers_replay_their_graphs_and_a_second_forward_in_flight_runs_its_own():
    """Whole fast layers run as a forward graph and a backward graph; what the forward
    keeps lives in the graphs' buffers until the backward, so a second forward before it
    runs the layer's own forward: the gradients are resident training's. The twin: without
    the claim, the second forward's replay overwrites what the first kept."""
    graphed = {"kernels": "fast", "graphs": True, "gpu_budget": "fit"}
    reference = _two_in_flight(None)
    assert all(torch.equal(a, b) for a, b in zip(reference, _two_in_flight(graphed)))
    claim = graphs._Claim.__init__
    try:

        def unclaimed(self, owner, whole, index):  # the claim taken away: never busy
            self.graphs, self.whole, self.index, self.held = owner, whole, index, False

        graphs._Claim.__init__ = unclaimed
        got = _two_in_flight(graphed, check=False)
    finally:
        graphs._Claim.__init__ = claim
    assert not all(torch.equal(a, b) for a, b in zip(reference, got))


def test_a_whole_layers_graphs_are_released_when_no_backward_comes():
    """A forward with grad whose loss is never differentiated frees its node: the graphs'
    saved tensors are free again, and the next forward replays."""
    from narrows.core.testing import tiny_batch

    model = build("qwen3")
    model.set_attn_implementation("sdpa")
    ns.stream(model, device="cpu", kernels="fast", graphs=True, gpu_budget="fit")
    for seed in range(3):
        model(**tiny_batch(seed=seed), use_cache=False)  # dropped: no backward
    stats = model.narrows_stream.graphs.stats
    wholes = [g for g in model.narrows_stream.graphs._graphs.values() if isinstance(g, graphs._Whole)]
    assert stats.captured == len(wholes) > 0 and stats.eager == 0 and not any(w.busy for w in wholes)
    assert stats.replays == 2 * len(wholes)  # the second and third forwards, each layer


def test_another_shape_in_flight_runs_eagerly_and_a_rebuilt_layer_recaptures_in_order():
    """While whole layers' graphs of one batch shape hold their state for a backward, graphs
    of other shapes do not replay (their scratch may lie in that state). And a layer whose
    parts were rebuilt (training flags flipped by an evaluation) drops its shape's graphs,
    which are captured again in order: one set of them, and the gradients are resident
    training's."""
    from narrows.core.testing import tiny_batch

    def run(stream_kwargs):
        model = _fast_qwen3(stream_kwargs)
        grads = []
        for step in range(4):
            if step == 2:  # an evaluation: parts rebuilt for eval mode, and again for training
                model.eval()
                with torch.no_grad():
                    model(**tiny_batch(seed=99), use_cache=False)
                model.train()
            model(**tiny_batch(seq=12, seed=step), use_cache=False).loss.backward()  # one shape
            pair = [tiny_batch(seq=w, seed=10 + step) for w in (12, 16)]  # two shapes in flight
            sum(model(**b, use_cache=False).loss for b in pair).backward()
            grads += [p.grad.clone() for p in model.parameters() if p.requires_grad]
        return model, grads

    _, reference = run(None)
    model, got = run({"kernels": "fast", "graphs": True, "gpu_budget": "fit"})
    assert all(torch.equal(a, b) for a, b in zip(reference, got))
    g = model.narrows_stream.graphs
    wholes = [w for w in g._graphs.values() if isinstance(w, graphs._Whole)]
    layers = len(model.narrows_stream.plan.layer_bytes)
    assert g.stats.replays > 0 and g.stats.eager > 0  # the second shape, in flight: eager
    # one set of whole graphs (the first shape's), captured twice: before and after the evaluation
    assert len(wholes) == layers and g.stats.captured == 2 * 2 * layers  # forward and backward each


@pytest.mark.parametrize("budget", ["fit", None], ids=["whole", "streamed"])
def test_graphs_released_for_an_evaluation_are_captured_again_at_the_next_step(budget):
    """`LayerGraphs.released()` drops every graph for a block that runs eagerly in their
    pool (an evaluation); the next training step captures again at once (its shape was
    seen) and replays from then on, gradients equal to resident training's. Refused while
    a whole layer's state waits for its backward."""
    from narrows.core.testing import tiny_batch

    def run(stream_kwargs):
        model = _fast_qwen3(stream_kwargs)
        grads, counts = [], []
        for step in range(4):
            if step == 2:
                g = model.narrows_stream.graphs if stream_kwargs else None
                with g.released() if g else contextlib.nullcontext():
                    assert g is None or not g._graphs
                    model.eval()
                    with torch.no_grad():
                        model(**tiny_batch(seed=99), use_cache=False)
                    model.train()
                if g is not None:
                    assert not g._graphs and g.stats.replays == counts[-1][1]  # none inside
            model(**tiny_batch(seq=12, seed=step), use_cache=False).loss.backward()
            grads += [p.grad.clone() for p in model.parameters() if p.requires_grad]
            if stream_kwargs:
                s = model.narrows_stream.graphs.stats
                counts.append((s.captured, s.replays, s.first_seen))
        return model, grads, counts

    _, reference, _ = run(None)
    model, got, counts = run({"kernels": "fast", "graphs": True, "gpu_budget": budget})
    assert all(torch.equal(a, b) for a, b in zip(reference, got))
    (_, _, seen), (captured, _, _), (again, _, seen_after), (last, replays, _) = counts
    assert captured > 0 and again == 2 * captured  # the step after the release captured at once
    assert seen_after == seen and last == again and replays > 0  # no step ran eagerly for it
    g = model.narrows_stream.graphs
    if budget == "fit":  # whole layers: a forward in flight holds its state
        out = model(**tiny_batch(seq=12, seed=7), use_cache=False)
        with pytest.raises(RuntimeError, match="between training steps"), g.released():
            pass
        out.loss.backward()
