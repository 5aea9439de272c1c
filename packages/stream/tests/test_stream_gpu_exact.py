"""On CUDA with deterministic kernels, layers large enough that a transfer race would show.

The tiny models of `test_stream_gpu.py` copy a layer in microseconds, so a copy the compute
stream forgot to wait for has usually finished anyway. Here a Llama layer is ~93 MB of bf16
(several ms over PCIe) against well under a millisecond of compute at 1024 tokens: a missing
``slab.ready`` wait, a wrong prefetch index or a slab left pointing at the previous layer
makes the streamed run read a half-copied or wrong layer, and `torch.equal` against the
resident run fails (`test_gate_catches_a_missing_copy_wait` shows it does). With SDPA and
``deterministic=True`` the resident reference is itself reproducible, which is checked too.
"""

from __future__ import annotations

import copy
import functools
import gc
import os

import pytest
import torch
from helpers import assert_identical, build

import narrows.stream as ns
from narrows.core import deterministic, fuse_layers
from narrows.core.testing import tiny_batch, with_adapter

# cuBLAS reads its workspace setting once, when it starts: set it before any test touches CUDA
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
VOCAB = 1024
_IDS = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.02)
LLAMA = dict(
    _IDS,
    hidden_size=2048,
    intermediate_size=5504,
    num_hidden_layers=6,
    num_attention_heads=16,
    num_key_value_heads=8,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
LLAMA_SEQ = 1024
QWEN2 = dict(
    _IDS,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)


@pytest.fixture(autouse=True)
def _restore_determinism():
    """`deterministic=True` switches process-wide state: restore it after each test."""
    cudnn = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn
    gc.collect()  # a streamed model holds itself in cycles (its refusing `.to`): free its pinned slabs now
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@functools.cache
def _pristine(arch: str):
    """A seeded random bf16 model built on the CPU with SDPA attention, LoRA r8 on every
    linear layer (lora_B randomised), dropout 0.05, in train mode. Built once per module:
    random init of the Llama's 280M parameters takes seconds on the CPU."""
    import transformers as tf

    cfg = tf.LlamaConfig(**LLAMA) if arch == "llama" else tf.Qwen2Config(**QWEN2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    assert model.config._attn_implementation == "sdpa"
    return with_adapter(model, "lora", rank=8, dropout=0.05).train()


def _model(arch: str):
    """A fresh copy of the pristine model (training and streaming both change a model)."""
    return copy.deepcopy(_pristine(arch))


@pytest.fixture(scope="module", autouse=True)
def _drop_pristine_models():
    yield
    _pristine.cache_clear()


def _train(
    model, *, seq: int, steps: int = 2, grad_accum: int = 2, stream_kwargs: dict | None = None, tamper=None
) -> dict[str, list[torch.Tensor]]:
    """Seeded AdamW loop, resident (``model.to(DEVICE)``) or streamed (`stream_kwargs`), under
    deterministic kernels. Returns on the CPU: per-micro-step losses, gradients before each
    step, final adapter weights and AdamW state. `tamper(model)` runs after `stream`."""
    torch.manual_seed(0)
    if stream_kwargs is None:
        deterministic(True)
        model.to(DEVICE)
        fuse_layers(model)  # the stream's default kernels: the fast layers where they cover a layer
    else:
        ns.stream(model, device=DEVICE, seq_len=seq, deterministic=True, **stream_kwargs)
        if tamper is not None:
            tamper(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    record: dict[str, list[torch.Tensor]] = {"loss": [], "grad": [], "weight": [], "adam": []}
    for step in range(steps):
        for micro in range(grad_accum):
            batch = tiny_batch(batch=1, seq=seq, vocab=VOCAB, seed=100 * step + micro)
            loss = model(**{k: v.to(DEVICE) for k, v in batch.items()}).loss / grad_accum
            loss.backward()
            record["loss"].append(loss.detach().cpu())
        record["grad"] += [p.grad.detach().cpu() for p in params]
        opt.step()
        opt.zero_grad()
    record["weight"] = [p.detach().cpu() for p in params]
    record["adam"] = [v.cpu() for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    return record


def _reference(record: dict[str, list[torch.Tensor]]) -> dict[str, list[torch.Tensor]]:
    """A resident record fit to compare against: finite (NaN never equals itself), trained."""
    assert all(torch.isfinite(x).all() for x in record["loss"] + record["grad"]), "reference not finite"
    assert any(g.any() for g in record["grad"]), "reference has no gradient"
    return record


@pytest.fixture(scope="module")
def llama_resident():
    """The resident Llama run every streamed variant must equal (computed once)."""
    return _reference(_train(_model("llama"), seq=LLAMA_SEQ))


def _check_streamed(model, *, resident: tuple[int, ...], prefetch: int) -> None:
    """The run really streamed: the plan asked for, pinned host slabs, copies and prefetch hits."""
    handle = model.narrows_stream
    plan = handle.plan
    assert plan.resident == resident, plan
    assert plan.prefetch == prefetch and plan.pool_slabs == prefetch + 1, plan
    streamed = [s for s in handle.stores if s.resident_views is None]
    assert len(streamed) == len(plan.streamed) > 0
    if torch.device(DEVICE).type == "cuda":
        assert handle.engine.copy_stream is not None
        assert all(s.host.is_pinned() for s in handle.stores)
    stats = handle.stats
    assert stats.loads > 0 and stats.bytes_h2d > 0
    if prefetch > 0:
        assert stats.hits > 0, stats  # prefetched slabs were used, not reloaded


# ---- 1. transfer races on large layers ---------------------------------------------------


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_every_layer_streamed_is_exact(prefetch, llama_resident):
    """gpu_budget=None: all 6 layers stream through prefetch + 1 device slabs; losses,
    gradients, adapter weights and AdamW state equal the resident run bit for bit."""
    model = _model("llama")
    streamed = _train(model, seq=LLAMA_SEQ, stream_kwargs={"gpu_budget": None, "prefetch": prefetch})
    _check_streamed(model, resident=(), prefetch=prefetch)
    assert torch.are_deterministic_algorithms_enabled()
    assert_identical(llama_resident, streamed)


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_partial_residency_is_exact(prefetch, llama_resident):
    """A budget with room for two resident layers beyond the slabs: layers 1 and 4 stay on
    the device, 0, 2, 3 and 5 stream (prefetching past a resident layer) — still exact."""
    model = _model("llama")
    p = ns.plan(model, None, device=DEVICE, seq_len=LLAMA_SEQ, prefetch=prefetch, offload="off")
    budget = p.predicted_peak + 2 * max(p.layer_bytes)  # every saved input kept, two resident layers
    streamed = _train(model, seq=LLAMA_SEQ, stream_kwargs={"gpu_budget": budget, "prefetch": prefetch})
    _check_streamed(model, resident=(1, 4), prefetch=prefetch)
    assert_identical(llama_resident, streamed)


@pytest.mark.parametrize("wait", [True, False], ids=["event-waited", "wait-dropped"])
def test_slow_copies_are_waited_for_and_the_gate_catches_a_missing_wait(llama_resident, wait):
    """Every copy delayed as on a slow link: with the engine's wait, still exact; with the
    compute stream no longer waiting for a slab's copy (``slab.ready`` dropped after every
    load), the streamed run reads the slab's previous layer and differs — the gate has teeth."""
    if torch.device(DEVICE).type != "cuda":
        pytest.skip("no copy stream to race on this device")

    def slow_copies(model):
        engine = model.narrows_stream.engine
        load = engine._load

        def load_without_event(index, slab):
            # a slow link (a consumer board's PCIe): the copy starts ~20 ms late, so a compute
            # stream that does not wait for it reads the slab's previous layer
            with torch.cuda.stream(engine.copy_stream):
                torch.cuda._sleep(40_000_000)
            load(index, slab)
            if not wait:
                slab.ready = None  # acquire() now skips wait_event: compute overtakes the copy

        engine._load = load_without_event

    streamed = _train(_model("llama"), seq=LLAMA_SEQ, stream_kwargs={"prefetch": 0}, tamper=slow_copies)
    if wait:
        assert_identical(llama_resident, streamed)
    else:
        with pytest.raises(AssertionError):
            assert_identical(llama_resident, streamed)


def _slow_fetches(offload_of, wait: bool, *, cycles: int):
    """A tamper for `_train`: each host→device copy of `offload_of(model)` (an
    `ActivationOffload`) starts after `cycles` of sleep on its copy stream, as on a slow link;
    without `wait` the compute stream no longer waits for it."""

    def tamper(model):
        offload = offload_of(model)
        start = offload.start_fetch

        def delayed(saved):
            with torch.cuda.stream(offload.copy_stream):
                torch.cuda._sleep(cycles)
            start(saved)

        def fetch_without_wait(saved):
            if saved.fetched is None:
                delayed(saved)
            out, saved.fetched = saved.fetched, None
            return out

        offload.start_fetch = delayed
        if not wait:
            offload.fetch = fetch_without_wait

    return tamper


@pytest.mark.parametrize("wait", [True, False], ids=["event-waited", "wait-dropped"])
def test_offloaded_inputs_come_back_exact_and_the_gate_catches_a_missing_wait(llama_resident, wait):
    """Every layer's saved input goes to pinned host memory and back (offload="all"), each
    host→device copy delayed as on a slow link: with the compute stream waiting for it,
    exact; without that wait the recompute reads a half-copied input and the run differs."""
    if torch.device(DEVICE).type != "cuda":
        pytest.skip("no copy stream to race on this device")

    model = _model("llama")
    tamper = _slow_fetches(lambda m: m.narrows_stream.offload, wait, cycles=40_000_000)
    streamed = _train(model, seq=LLAMA_SEQ, stream_kwargs={"offload": "all"}, tamper=tamper)
    stats = model.narrows_stream.stats
    assert model.narrows_stream.plan.offloaded == tuple(range(LLAMA["num_hidden_layers"]))
    assert stats.act_d2h == stats.act_h2d > 0
    if wait:
        assert_identical(llama_resident, streamed)
    else:
        with pytest.raises(AssertionError):
            assert_identical(llama_resident, streamed)


@pytest.mark.parametrize("wait", [True, False], ids=["event-waited", "wait-dropped"])
def test_kept_attention_comes_back_exact_and_the_gate_catches_a_missing_wait(llama_resident, wait):
    """Every layer's attention (q, k, v, output, LSE) kept in pinned host memory from the
    forward (keep_attention=True), each copy back delayed as on a slow link: with the
    compute stream waiting for it, exact; without that wait the backward reads a
    half-copied tensor and the run differs."""
    if torch.device(DEVICE).type != "cuda":
        pytest.skip("no copy stream to race on this device")

    model = _model("llama")
    tamper = _slow_fetches(lambda m: m.narrows_stream.executor.attention.offload, wait, cycles=20_000_000)
    streamed = _train(model, seq=LLAMA_SEQ, stream_kwargs={"keep_attention": True}, tamper=tamper)
    assert model.narrows_stream.plan.kept_attention == tuple(range(LLAMA["num_hidden_layers"]))
    if wait:
        assert_identical(llama_resident, streamed)
    else:
        with pytest.raises(AssertionError):
            assert_identical(llama_resident, streamed)


def test_sequence_tiles_streamed_equal_the_same_tiles_resident():
    """The MLP in tiles of 384 tokens (not a divisor of 1024), every input offloaded, LoRA
    dropout, gradient accumulation: streamed == the same tiling resident, bit for bit."""
    resident = _reference(_train(ns.tile_sequence(_model("llama"), 384), seq=LLAMA_SEQ))
    model = _model("llama")
    streamed = _train(model, seq=LLAMA_SEQ, stream_kwargs={"seq_tile": 384, "offload": "all"})
    assert model.narrows_stream.plan.tile_tokens == 384
    assert_identical(resident, streamed)


# ---- 2. deterministic SDPA parity --------------------------------------------------------


@pytest.mark.parametrize("seq", [512, 4096])
def test_sdpa_qwen2_streamed_equals_resident(seq):
    """Qwen2 (attention biases, tied embedding kept on the device) with SDPA under
    deterministic kernels, short and long sequences: streamed == resident."""
    resident = _reference(_train(_model("qwen2"), seq=seq, grad_accum=1))
    model = _model("qwen2")
    streamed = _train(model, seq=seq, grad_accum=1, stream_kwargs={})
    _check_streamed(model, resident=(), prefetch=1)
    assert_identical(resident, streamed)


@pytest.mark.parametrize(("arch", "seq"), [("qwen2", 4096), ("llama", LLAMA_SEQ)])
def test_resident_reference_is_reproducible(arch, seq, request):
    """Under `narrows.core.deterministic()` two resident runs are torch.equal — the
    condition without which streamed-vs-resident equality could not be asked for."""
    accum = 2 if arch == "llama" else 1
    if arch == "llama":
        first = request.getfixturevalue("llama_resident")  # the reference the race tests use
    else:
        first = _reference(_train(_model(arch), seq=seq, grad_accum=accum))
    torch.use_deterministic_algorithms(False)  # the second run must switch it on again itself
    second = _train(_model(arch), seq=seq, grad_accum=accum)
    assert torch.are_deterministic_algorithms_enabled()
    assert_identical(first, second)


# ---- 3. the start-up path ----------------------------------------------------------------


def test_stream_deterministic_switches_kernels_on():
    """`stream(..., deterministic=True)` leaves deterministic algorithms, deterministic
    cuDNN and cuBLAS's fixed workspace on, and a training step runs under them."""
    torch.use_deterministic_algorithms(False)
    model = build(dtype=torch.bfloat16, dropout=0.05)
    ns.stream(model, device=DEVICE, deterministic=True)
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] in (":4096:8", ":16:8")
    batch = {k: v.to(DEVICE) for k, v in tiny_batch().items()}
    loss = model(**batch).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_stream_leaves_determinism_alone_by_default():
    torch.use_deterministic_algorithms(False)
    ns.stream(build(dtype=torch.bfloat16), device=DEVICE)
    assert not torch.are_deterministic_algorithms_enabled()
