"""Long-context features: saved layer inputs offloaded to host memory (offload.py) and the
MLP run over sequence tiles (tiling.py), and how the planner chooses them.

The gates are the same as test_parity.py's: offloaded streamed training is `torch.equal`
to resident training; tiled streamed training is `torch.equal` to the same tiling run
resident, and equal to untiled training within a measured tolerance. Each gate has a
fault-injected twin that proves it can fail.
"""

from __future__ import annotations

import functools
import weakref

import pytest
import torch
from helpers import assert_identical, build, train

import narrows.stream as ns
from narrows.core import anatomy_of
from narrows.core.testing import tiny_batch
from narrows.stream.execution import tiling
from narrows.stream.execution.offload import ActivationOffload
from narrows.stream.execution.tiling import tiled_mlps

NF4 = pytest.param("nf4", marks=pytest.mark.bnb)
TOKENS = 2 * 12  # tiny_batch(): 2 rows of 12 positions, the last row left-padded
INPUT_BYTES = TOKENS * 64 * 4  # one layer's saved input: [2, 12, 64] fp32


@functools.cache
def resident(arch="llama", kind="lora", dropout=0.05, grad_accum=1, base="float", tile=None):
    """The resident reference record (cached: tests only read it)."""
    model = build(arch, base=base, kind=kind, dropout=dropout)
    if tile is not None:
        ns.tile_sequence(model, tile)
    return train(model, steps=2, grad_accum=grad_accum)


def streamed(arch="llama", kind="lora", dropout=0.05, grad_accum=1, base="float", **stream_kwargs):
    model = build(arch, base=base, kind=kind, dropout=dropout)
    return model, train(model, steps=2, grad_accum=grad_accum, stream_kwargs=stream_kwargs)


# ---- activation offload ------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2"])
def test_offload_all_is_identical_to_resident(arch):
    """Every layer's input makes the round trip through a host buffer and training is
    still bit-identical (LoRA dropout, gradient accumulation)."""
    model, got = streamed(arch, grad_accum=2, offload="all")
    n = anatomy_of(model).num_layers
    handle = model.narrows_stream
    assert handle.plan.offloaded == tuple(range(n))
    s = handle.stats
    assert s.act_d2h == s.act_h2d >= 2 * 2 * n * INPUT_BYTES  # 4 micro-steps, every layer out and back
    assert_identical(resident(arch, grad_accum=2), got)


@pytest.mark.bnb
def test_offload_all_is_identical_to_resident_on_nf4():
    """The same with an NF4 base."""
    pytest.importorskip("bitsandbytes")
    model, got = streamed(base="nf4", offload="all")
    assert model.narrows_stream.stats.act_d2h > 0
    assert_identical(resident(base="nf4"), got)


def test_offload_all_and_off_give_the_same_run_and_count_the_bytes():
    """Offloading changes where a saved input waits, not what training computes; the
    statistics count what moved (both ways, the same bytes) and nothing when off."""
    on_model, on = streamed(offload="all")
    off_model, off = streamed(offload="off")
    assert_identical(off, on)
    s_on, s_off = on_model.narrows_stream.stats, off_model.narrows_stream.stats
    assert s_on.act_d2h == s_on.act_h2d >= 2 * 3 * INPUT_BYTES
    assert (
        s_on.act_waits == 2 + 1
    )  # per backward only the last layer's input is not prefetched (+ self-check)
    assert s_off.act_d2h == s_off.act_h2d == s_off.act_waits == 0
    assert off_model.narrows_stream.plan.offloaded == ()
    assert (
        on_model.narrows_stream.plan.d2h_bytes_per_step
        > 0
        == off_model.narrows_stream.plan.d2h_bytes_per_step
    )


@pytest.mark.parametrize("offload", ["all", "off"])
def test_offloaded_inputs_do_not_stay_on_the_device(offload):
    """With the input in host memory the graph no longer holds the device tensor: every
    layer's output (the next layer's input) is freed once the forward has moved on, save
    the last one (the final norm keeps it). Kept on the device, they all live."""
    model = ns.stream(build(), device="cpu", offload=offload)
    outputs = []
    for layer in anatomy_of(model).layers:
        layer.register_forward_hook(lambda m, args, out: outputs.append(weakref.ref(out)))
    loss = model(**tiny_batch()).loss
    alive = [r() is not None for r in outputs]
    assert alive == ([False, False, True] if offload == "all" else [True, True, True])
    loss.backward()


def _neighbours_input(monkeypatch):
    """Fault: a layer's backward gets the input its predecessor saved in the same forward."""
    newest: dict[int, object] = {}
    save, fetch = ActivationOffload.save, ActivationOffload.fetch

    def recording_save(self, index, hidden):
        saved = save(self, index, hidden)
        newest[index] = saved
        return saved

    def wrong_fetch(self, saved):
        out = fetch(self, saved)
        other = newest.get(saved.index - 1)
        return other.host().clone() if other is not None and other.shape == saved.shape else out

    monkeypatch.setattr(ActivationOffload, "save", recording_save)
    monkeypatch.setattr(ActivationOffload, "fetch", wrong_fetch)


def _buffer_reused_too_early(monkeypatch):
    """Fault: a host buffer goes back to the pool as soon as it is written, so the next
    layer's input overwrites it before the backward reads it."""
    save = ActivationOffload.save

    def early_give_back(self, index, hidden):
        saved = save(self, index, hidden)
        if saved is not None:
            self._give_back(saved.buffer)
        return saved

    monkeypatch.setattr(ActivationOffload, "save", early_give_back)


@pytest.mark.parametrize("fault", [_neighbours_input, _buffer_reused_too_early])
def test_the_offload_gate_catches_a_wrong_saved_input(monkeypatch, fault):
    """The parity gate above can fail: hand a layer's backward the wrong bytes and the
    gradients differ from resident training."""
    fault(monkeypatch)
    _, got = streamed(offload="all")
    ref = resident()
    assert torch.equal(ref["loss"][0], got["loss"][0])  # the forward is untouched
    assert not all(torch.equal(a, b) for a, b in zip(ref["grad"], got["grad"]))
    with pytest.raises(AssertionError, match="differs"):
        assert_identical(ref, got)


def _two_forwards(stream_kwargs, order):
    """Two forwards (different batch shapes) before any backward, then one summed
    backward ("sum") or one backward each, oldest graph first ("in_turn")."""
    model = build(dropout=0.05)
    torch.manual_seed(0)
    if stream_kwargs is not None:
        ns.stream(model, device="cpu", **stream_kwargs)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    record = {"loss": [], "grad": [], "weight": []}
    for step in range(2):
        a = model(**tiny_batch(seed=10 * step)).loss
        b = model(**tiny_batch(3, 10, seed=10 * step + 1)).loss
        if order == "sum":
            (a + b).backward()
        else:
            a.backward()  # its layers' prefetch finds the newer graph's inputs first
            b.backward()
        record["loss"] += [a.detach(), b.detach()]
        record["grad"] += [p.grad.clone() for p in params]
        opt.step()
        opt.zero_grad()
    record["weight"] = [p.detach().clone() for p in params]
    return model, record


@pytest.mark.parametrize("order", ["sum", "in_turn"])
def test_two_forwards_before_backward_are_identical_to_resident(order):
    """Two graphs' saved inputs live in host memory at once; each backward gets its own."""
    model, got = _two_forwards({"offload": "all"}, order)
    assert model.narrows_stream.stats.act_h2d > 0
    assert_identical(_two_forwards(None, order)[1], got)


@pytest.mark.parametrize("offload", ["off", "all"])
def test_a_retained_graph_is_backwarded_twice_or_refused(offload):
    """`backward(retain_graph=True)` then a second backward through the same graph works
    as resident training does with the inputs kept on the device; with them offloaded
    (their host buffer reused after the first backward) the second is refused, saying how."""

    def run(stream_kwargs):
        model = build(dropout=0.05)
        torch.manual_seed(0)
        if stream_kwargs is not None:
            ns.stream(model, device="cpu", **stream_kwargs)
        out = model(**tiny_batch())
        out.loss.backward(retain_graph=True)
        out.logits.pow(2).mean().backward()
        return {"grad": [p.grad.clone() for p in model.parameters() if p.requires_grad]}

    if offload == "off":
        assert_identical(run(None), run({"offload": offload}))
    else:
        with pytest.raises(RuntimeError, match="offload_inputs='off'"):
            run({"offload": offload})


@pytest.mark.gpu
def test_a_fetch_does_not_overwrite_memory_the_compute_stream_still_reads():
    """The host→device copy of a saved input may land in a block the caching allocator
    just took back from the compute stream; it must wait for the work queued there."""
    from narrows.stream.storage.engine import TransferStats

    dev = torch.device("cuda", torch.cuda.current_device())
    n = 1 << 22
    results = []
    for _ in range(4):  # the first round warms the pinned pool up
        off = ActivationOffload(dev, {0}, copy_stream=torch.cuda.Stream(dev), stats=TransferStats())
        saved = off.save(0, torch.full((n,), 7.0, device=dev))
        torch.cuda.synchronize()
        a = torch.ones(n, device=dev)
        torch.cuda._sleep(200_000_000)  # the compute stream is busy…
        b = a * 2  # …and reads `a` only after that
        del a  # its block goes back to the compute stream's pool
        fetched = off.fetch(saved)
        torch.cuda.synchronize()
        results.append(bool((b == 2).all()) and bool((fetched == 7).all()))
    assert all(results[1:])


def test_a_dropped_graph_returns_its_host_buffers():
    """A forward with grad on whose loss is discarded gives its buffers back when the graph
    dies: the next forwards and the next step reuse the same buffers, none is added."""
    model = build(dropout=0.05)
    ns.stream(model, device="cpu", offload="all")
    off = model.narrows_stream.offload
    model(**tiny_batch(seed=0)).loss.backward()
    pool = sorted(b.data.data_ptr() for b in off.free)
    assert len(pool) == 3  # one per layer
    for seed in range(1, 5):
        loss = model(**tiny_batch(seed=seed)).loss
        assert off.free == []  # all taken from the pool by the live graph
        del loss
        assert sorted(b.data.data_ptr() for b in off.free) == pool
    model(**tiny_batch(seed=9)).loss.backward()
    assert sorted(b.data.data_ptr() for b in off.free) == pool
    assert all(refs == [] for refs in off.live.values())


def test_dropped_graphs_leave_no_bookkeeping_behind():
    """Many discarded forwards do not grow the per-layer bookkeeping (dead entries are
    pruned when the next input is saved)."""
    model = build()
    ns.stream(model, device="cpu", offload="all")
    off = model.narrows_stream.offload
    for seed in range(6):
        model(**tiny_batch(seed=seed)).loss  # noqa: B018 - the graph is dropped on purpose
    assert sum(len(refs) for refs in off.live.values()) <= 3


# ---- sequence tiling ---------------------------------------------------------------------


def _count_tiles(monkeypatch) -> list[int]:
    calls = [0]
    cut = tiling._tile

    def counting(x, s):
        calls[0] += 1
        return cut(x, s)

    monkeypatch.setattr(tiling, "_tile", counting)
    return calls


@pytest.mark.parametrize(
    "kind,tile,grad_accum",
    [
        ("lora", 8, 1),  # 4 positions × 2 rows: 3 tiles, dividing the 12 positions
        ("lora", 10, 2),  # 5 positions: tiles of 5, 5, 2
        ("dora", 10, 1),
    ],
)
def test_tiled_streamed_is_identical_to_the_same_tiling_resident(monkeypatch, kind, tile, grad_accum):
    """seq_tile=N streamed == tile_sequence(model, N) resident, bit for bit (dropout masks
    replayed per tile, padded row, offloaded inputs)."""
    ref = resident(kind=kind, grad_accum=grad_accum, tile=tile)
    calls = _count_tiles(monkeypatch)
    model, got = streamed(kind=kind, grad_accum=grad_accum, seq_tile=tile)
    assert model.narrows_stream.plan.tile_tokens == tiled_mlps(model) == tile
    assert calls[0] > 0  # the MLPs really ran in tiles
    assert_identical(ref, got)


@pytest.mark.bnb
def test_tiled_streamed_is_identical_to_the_same_tiling_resident_on_nf4():
    """The same with an NF4 base."""
    pytest.importorskip("bitsandbytes")
    _, got = streamed(base="nf4", seq_tile=8)
    assert_identical(resident(base="nf4", tile=8), got)


@pytest.mark.parametrize("tile", [TOKENS, 1000])
def test_a_tile_of_at_least_the_tokens_is_a_no_op(tile):
    """An MLP whose input fits one tile runs untiled: equal to untiled training exactly,
    dropout masks included (a real tiling would draw different ones)."""
    model = ns.tile_sequence(build(dropout=0.05), tile)
    assert tiled_mlps(model) == tile
    assert_identical(resident(), train(model, steps=2))


def test_a_tiling_that_runs_differs_from_untiled_with_dropout():
    """The converse of the no-op: the tiled reference is not secretly untiled."""
    with pytest.raises(AssertionError, match="loss"):
        assert_identical(resident(), resident(tile=8))


# untiled vs tiled in fp32, dropout 0: the parameter gradients are sums over tiles, so they
# differ in summation order only. Measured on these tiny models (3 steps): losses within
# 5e-7 (relative 1e-7), gradients within 3e-7 absolute (largest entries ~1e-2). The bounds
# leave ~3x headroom; AdamW's weights and state are not compared (Adam divides by the
# gradient's running norm, which magnifies ulp differences in near-zero entries).
LOSS_TOL = dict(rtol=1e-6, atol=0.0)
GRAD_TOL = dict(rtol=1e-5, atol=1e-6)


def assert_close_to_untiled(untiled: dict, tiled: dict) -> None:
    for key, tol in (("loss", LOSS_TOL), ("grad", GRAD_TOL)):
        assert len(untiled[key]) == len(tiled[key]) > 0
        for a, b in zip(untiled[key], tiled[key]):
            torch.testing.assert_close(b, a, **tol)


def _drop_last_tile_gradient(monkeypatch):
    """Fault: the tiled backward forgets the last tile (its input and parameter gradients)."""
    backward = tiling._TiledMLP.backward

    def dropping(ctx, grad_out):
        if grad_out is not None:
            (x,) = ctx.saved_tensors
            grad_out = grad_out.clone()
            grad_out[:, ctx.tiles.slices(x)[-1]] = 0
        return backward(ctx, grad_out)

    monkeypatch.setattr(tiling._TiledMLP, "backward", staticmethod(dropping))


@pytest.mark.parametrize("kind,tile", [("lora", 10), ("dora", 8)])
def test_tiled_equals_untiled_up_to_summation_order(kind, tile):
    """Tiled streamed training (fp32, no dropout) matches untiled resident training within
    the tolerance above."""
    _, got = streamed(kind=kind, dropout=0.0, seq_tile=tile)
    assert_close_to_untiled(resident(kind=kind, dropout=0.0), got)


def _tiles_kept_in_the_graph(model, tile: int):
    """Reference tiling without recompute: each MLP runs its tiles in order and autograd
    keeps every tile's graph, so dropout draws what the tiles draw, with no RNG replay."""
    for layer in anatomy_of(model).layers:

        def forward(x, fn=layer.mlp.forward):
            step = max(1, tile // x.shape[0])
            return torch.cat([fn(x[:, s : s + step].contiguous()) for s in range(0, x.shape[1], step)], dim=1)

        layer.mlp.forward = forward
    return model


def test_tiled_backward_replays_each_tiles_dropout():
    """With dropout the recomputed tiles draw the masks their forward drew: tiled training
    matches tiles kept in the graph (parameter gradients summed in another order). The
    streamed-vs-resident gate cannot see this, as both run the same replay."""
    reference = train(_tiles_kept_in_the_graph(build(dropout=0.05), 8), steps=2)
    assert torch.equal(reference["loss"][0], resident(tile=8)["loss"][0])
    assert_close_to_untiled(reference, resident(tile=8))


def test_the_tolerance_catches_a_lost_tile(monkeypatch):
    """The tolerance is tight enough to fail on a real tiling bug."""
    _drop_last_tile_gradient(monkeypatch)
    _, got = streamed(dropout=0.0, seq_tile=10)
    with pytest.raises(AssertionError, match="not close"):
        assert_close_to_untiled(resident(dropout=0.0), got)


def test_an_explicit_tile_longer_than_the_planned_tokens_still_tiles():
    """stream(seq_tile=N) tiles whatever length was planned: a batch longer than the
    planned seq_len (default 512) still runs in tiles of N, as the docstring promises."""
    model = ns.stream(build(), device="cpu", seq_tile=600)
    assert tiled_mlps(model) == 600


@pytest.mark.parametrize("pre", [False, True])
def test_tiling_refuses_an_mlp_with_forward_hooks(pre):
    """A hook inside the MLP would see tiles without their gradient: refused by
    tile_sequence, by stream(seq_tile=...) before anything moves, and at call time."""
    model = build()
    gate = anatomy_of(model).layers[0].mlp.gate_proj
    register = gate.register_forward_pre_hook if pre else gate.register_forward_hook
    handle = register(lambda *args: None)
    with pytest.raises(ns.StreamSetupError, match="forward hooks"):
        ns.tile_sequence(model, 8)
    with pytest.raises(ns.StreamSetupError, match="forward hooks"):
        ns.stream(model, device="cpu", seq_tile=8)
    assert getattr(model, "narrows_stream", None) is None
    handle.remove()
    ns.tile_sequence(model, 8)
    register(lambda *args: None)  # added after tiling: caught when the MLP runs
    with pytest.raises(ns.StreamSetupError, match="forward hooks"):
        model(**tiny_batch())


@pytest.mark.parametrize(
    "kwargs", [{"seq_tile": "bad"}, {"seq_tile": 0}, {"seq_tile": -4}, {"seq_tile": True}, {"offload": "bad"}]
)
def test_bad_long_context_options_are_refused(kwargs):
    """Unknown offload modes and tile sizes are refused, by plan and by stream, before
    anything moves."""
    model = build()
    with pytest.raises(ns.StreamSetupError, match=next(iter(kwargs))):
        ns.plan(model, device="cpu", **kwargs)
    with pytest.raises(ns.StreamSetupError, match=next(iter(kwargs))):
        ns.stream(model, device="cpu", **kwargs)
    assert getattr(model, "narrows_stream", None) is None
    with pytest.raises(ns.StreamSetupError, match="positive"):
        ns.tile_sequence(model, 0)


# ---- the planner -------------------------------------------------------------------------

LONG = dict(device="cpu", seq_len=4096)  # long enough for tiles of 512..2048 tokens


def _minimum(model, **kwargs) -> int:
    """The smallest footprint: one slab, every saved input offloaded."""
    return ns.plan(model, None, prefetch=0, **LONG, **kwargs).predicted_peak


def test_auto_tiles_only_when_the_untiled_working_set_does_not_fit():
    """seq_tile="auto": untiled while the budget holds it; below that the largest power of
    two under the tokens that fits (down to 512); below the 512-token minimum, refused."""
    model = build(num_hidden_layers=4)
    untiled = _minimum(model)
    assert ns.plan(model, untiled, seq_tile="auto", **LONG).tile_tokens is None
    assert ns.plan(model, untiled - 1, seq_tile="auto", **LONG).tile_tokens == 2048  # the largest that fits
    for tile in (2048, 1024, 512):
        need = _minimum(model, seq_tile=tile)
        assert need < untiled
        p = ns.plan(model, need, seq_tile="auto", **LONG)
        assert p.tile_tokens == tile and p.predicted_peak <= need
    with pytest.raises(ns.BudgetTooSmallError):
        ns.plan(model, _minimum(model, seq_tile=512) - 1, seq_tile="auto", **LONG)


def test_too_small_budget_suggests_tiling_only_when_it_would_help():
    """Without seq_tile, a budget that tiling would have met is refused with the hint;
    at a length where no tile is allowed the hint is absent."""
    model = build(num_hidden_layers=4)
    budget = _minimum(model) - 1
    assert ns.plan(model, budget, seq_tile="auto", **LONG).tile_tokens is not None
    with pytest.raises(ns.BudgetTooSmallError, match="seq_tile='auto'"):
        ns.plan(model, budget, **LONG)
    with pytest.raises(ns.BudgetTooSmallError) as e:
        ns.plan(
            model,
            ns.plan(model, None, prefetch=0, device="cpu", seq_len=256).predicted_peak - 1,
            device="cpu",
            seq_len=256,
        )
    assert "seq_tile" not in str(e.value)


@pytest.mark.parametrize("seq_len", [128, 2048])  # one saved input smaller / larger than a layer
def test_auto_offload_spends_a_growing_budget_in_order(seq_len):
    """offload="auto": more budget buys, in this order, a prefetch slab, saved inputs kept
    on the device (the last layers'; the offloaded ones are always range(k)), then resident
    layers — so (prefetch, kept, resident) only grows, lexicographically, until the whole
    model fits. While an input is smaller than a layer, nothing is resident before every
    input is kept."""
    model = build(num_hidden_layers=6)
    n = 6
    low = ns.plan(model, None, prefetch=0, device="cpu", seq_len=seq_len).predicted_peak
    high = ns.plan(model, "fit", device="cpu", seq_len=seq_len, recompute="all").predicted_peak
    step = seq_len * 64 * 4 // 4  # a quarter of one saved input
    rows = []
    for budget in range(low, high + step, step):
        p = ns.plan(model, budget, device="cpu", seq_len=seq_len, recompute="all")
        k = len(p.offloaded)
        assert p.offloaded == tuple(range(k)) and p.predicted_peak <= budget
        assert p.activation_bytes == (n - k + min(2, k)) * seq_len * 64 * 4
        if seq_len == 128 and p.resident:
            assert k == 0
        rows.append((p.prefetch, n - k, len(p.resident)) if p.pool_slabs else "all resident")
    assert rows[0] == (0, 0, 0) and rows[-1] == "all resident"
    ranked = [r for r in rows if r != "all resident"]
    assert ranked == sorted(ranked)
    assert {r[1] for r in ranked} >= {0, 3, n}  # the partially kept regime is reached
