"""Step mode (`StepTrainer`): block-major gradient accumulation is `torch.equal` to
resident sequential accumulation — with dropout, clipping, a scheduler — and loads each
streamed layer once per forward and once per backward whatever G is. Each gate has a
fault-injected twin that proves it can fail."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import Dequantizations, assert_identical, build

import narrows.stream as ns
from narrows.core import fuse_layers, fuse_lora, is_nf4_linear
from narrows.core.kernels import rng
from narrows.core.testing import tiny_batch
from narrows.stream.errors import StreamSetupError

G = 3
STEPS = 3


def _batches(step: int, g: int = G) -> list[dict]:
    return [tiny_batch(seed=100 * step + k) for k in range(g)]


def _optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _scheduler(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def _record(params, opt, losses):
    return {
        "loss": losses,
        "weight": [p.detach().clone() for p in params],
        "adam": [v.clone() for p in params for v in opt.state[p].values() if torch.is_tensor(v)],
    }


@functools.cache
def resident(
    arch="llama",
    dropout=0.05,
    clip=0.5,
    base="float",
    g=G,
    device="cpu",
    seeded=False,
    dtype=torch.float32,
    fast=False,
):
    """Plain sequential accumulation on the resident model (PEFT's own LoRA forwards; with
    `fast`, SDPA attention and narrows.core's fast layers): the reference."""
    model = _build(arch, dropout=dropout, base=base, dtype=dtype, fast=fast).to(device)
    if fast:
        assert not fuse_layers(model).refused
    torch.manual_seed(0)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = _optimizer(params)
    sched = _scheduler(opt)
    losses, grads = [], []
    for step in range(STEPS):
        for k, batch in enumerate(_batches(step, g)):
            if seeded:  # a loop that seeds every micro-batch (as data-parallel ranks do)
                torch.manual_seed(_seed(step, k))
            loss = model(**{k: v.to(device) for k, v in batch.items()}).loss
            (loss / g).backward()
            losses.append(loss.detach())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        grads += [p.grad.clone() for p in params]  # as the optimizer sees them
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    return {**_record(params, opt, losses), "grad": grads}


def _build(arch: str, *, fast: bool = False, **kw):
    """The test model; `fast`: with SDPA attention, which the fast layers (the stream's
    default kernels) run, and without which the stream keeps PEFT's modules."""
    model = build(arch, **kw)
    if fast:
        model.set_attn_implementation("sdpa")
    return model


def _seed(step: int, micro: int) -> int:
    return 1000 + 10 * step + micro


def stepped(
    arch="llama",
    dropout=0.05,
    clip=0.5,
    base="float",
    g=G,
    device="cpu",
    seeded=False,
    trainer=None,
    dtype=torch.float32,
    fuse=False,
    fast=False,
    **stream_kwargs,
):
    model = _build(arch, dropout=dropout, base=base, dtype=dtype, fast=fast)
    if fuse:
        fuse_lora(model)
    torch.manual_seed(0)
    stream_kwargs.setdefault("offload", "off")
    ns.stream(model, device=device, **stream_kwargs)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = _optimizer(params)
    trainer = ns.StepTrainer(
        model,
        opt,
        grad_accum=g,
        max_grad_norm=clip,
        scheduler=_scheduler(opt),
        loss_fn=lambda out, batch: _keep(out.loss),
        **(trainer or {}),
    )
    losses, grads, stats = [], [], []
    real_step = opt.step

    def capture_grads():
        grads.extend(p.grad.clone() for p in params)

    opt.step = lambda *a, **k: (capture_grads(), real_step(*a, **k))[1]
    model.narrows_step_trainer = trainer
    for step in range(STEPS):
        _seen.clear()
        seeds = [_seed(step, k) for k in range(g)] if seeded else None
        stats.append(trainer.step(_batches(step, g), seeds=seeds))
        losses += [x.detach() for x in _seen[-g:]]  # a redone step computed them twice
    return model, stats, {**_record(params, opt, losses), "grad": grads}


_seen: list[torch.Tensor] = []


def _keep(loss):
    _seen.append(loss)
    return loss


def test_block_major_is_identical_to_sequential_accumulation_without_dropout():
    _, stats, got = stepped(dropout=0.0)
    assert [s.mode for s in stats] == ["block-major"] * STEPS
    assert_identical(resident(dropout=0.0), got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_lora_streams_block_major_bit_identically(dtype):
    """`fuse_lora`'s one-node branches (bf16: float32 adapters, the input cast once per
    shared input), streamed and stepped block-major: the same bits as PEFT's own
    forwards trained resident in sequence."""
    model, stats, got = stepped(dropout=0.0, dtype=dtype, fuse=True)
    assert [s.mode for s in stats] == ["block-major"] * STEPS
    assert any(type(m.__dict__.get("forward")).__name__ == "_FusedForward" for m in model.modules())
    assert_identical(resident(dropout=0.0, dtype=dtype), got)


def test_fast_layers_dropout_draws_are_learned_and_reproduced_block_major():
    """The fast layers draw their masks with dropout's own kernel: the first step records
    those draws, later steps predict them and run block-major, bit-identical to resident
    fast layers."""
    model, stats, got = stepped(dropout=0.05, fast=True)
    assert "fast layers" in model.narrows_stream.kernels
    assert stats[0].mode.startswith("sequential (learning")
    assert [s.mode for s in stats[1:]] == ["block-major"] * (STEPS - 1)
    assert_identical(resident(dropout=0.05, fast=True), got)


def test_block_major_with_dropout_learns_the_rng_draws_then_reproduces_them():
    """The first step runs in sequential order and records each micro-batch's random
    draws; later steps run block-major from predicted RNG states — bit-identical."""
    _, stats, got = stepped(dropout=0.05)
    assert stats[0].mode.startswith("sequential (learning")
    assert [s.mode for s in stats[1:]] == ["block-major"] * (STEPS - 1)
    assert_identical(resident(dropout=0.05), got)


def test_seeded_micro_batches_run_block_major_from_the_first_step():
    """A loop that seeds each micro-batch passes the seeds: every step runs block-major
    (nothing to learn or predict) and equals the same seeded loop run resident."""
    _, stats, got = stepped(dropout=0.05, seeded=True)
    assert [s.mode for s in stats] == ["block-major"] * STEPS
    assert_identical(resident(dropout=0.05, seeded=True), got)
    # twin: the unseeded reference draws other masks
    with pytest.raises(AssertionError):
        assert_identical(resident(dropout=0.05), got)


def test_seeds_are_one_per_micro_batch():
    model = build(dropout=0.05)
    ns.stream(model, device="cpu", offload="off")
    trainer = ns.StepTrainer(model, _optimizer, grad_accum=G)
    with pytest.raises(ValueError, match="one seed per micro-batch"):
        trainer.step(_batches(0), seeds=[1, 2])


def test_wrong_rng_prediction_is_caught_and_the_step_redone(monkeypatch):
    """Fault injection: predictions that skip the draws (each micro-batch assumed to
    start where the previous one did) are caught by the end-state check; the step is
    redone sequentially and the run is still identical."""
    from narrows.stream.stepmode import rng_plan as rngplan

    monkeypatch.setattr(rngplan.RandomOps, "advance", lambda self, state: state)
    _, stats, got = stepped(dropout=0.05)
    assert stats[1].mode == "sequential (RNG draws not predictable)"
    assert_identical(resident(dropout=0.05), got)


def test_without_the_end_state_check_wrong_predictions_change_training(monkeypatch):
    """The twin of the above with the check disabled too: training differs — so the
    check is what keeps the run exact."""
    from narrows.stream.stepmode import blockmajor
    from narrows.stream.stepmode import rng_plan as rngplan

    monkeypatch.setattr(rngplan.RandomOps, "advance", lambda self, state: state)
    monkeypatch.setattr(blockmajor, "same_state", lambda a, b: True)
    _, stats, got = stepped(dropout=0.05)
    assert stats[1].mode == "block-major"
    with pytest.raises(AssertionError):
        assert_identical(resident(dropout=0.05), got)


def test_dropping_the_per_layer_rng_replay_changes_training(monkeypatch):
    """Fault injection: the backward recompute without the saved RNG state draws new
    dropout masks, and the gradients differ."""
    from contextlib import nullcontext

    from narrows.stream.stepmode import blockmajor

    monkeypatch.setattr(blockmajor, "replay", lambda state: nullcontext())
    _, _, got = stepped(dropout=0.05)
    with pytest.raises(AssertionError):
        assert_identical(resident(dropout=0.05), got)


def test_gradient_summation_order_matters(monkeypatch):
    """Fault injection: accumulating the micro-batches' gradients in reverse order is
    caught (floating-point addition is not associative)."""
    from narrows.stream.stepmode.blockmajor import BlockMajorStep

    original = BlockMajorStep.run

    def reversed_order(self, batches, starts, **kwargs):
        ends, losses = original(self, batches[::-1], starts, **kwargs)  # wrong RNG too; order is the point
        return ends, losses

    monkeypatch.setattr(BlockMajorStep, "run", reversed_order)
    _, _, got = stepped(dropout=0.0)
    with pytest.raises(AssertionError):
        assert_identical(resident(dropout=0.0), got)


@pytest.mark.parametrize("arch", ["qwen3", "gemma2"])
def test_block_major_on_other_architectures(arch):
    """Gemma2 alternates sliding-window and global masks per layer: each layer's own
    arguments are captured and replayed."""
    _, stats, got = stepped(arch, dropout=0.05)
    assert stats[-1].mode == "block-major"
    assert_identical(resident(arch, dropout=0.05), got)


def test_block_major_with_every_layer_streamed_and_its_inputs_offloaded():
    """Every layer boundary offloaded to host memory, the smallest footprint (every
    layer streamed): still identical."""
    model, _, got = stepped(dropout=0.05, offload="all")
    assert model.narrows_stream.stats.act_d2h > 0
    assert_identical(resident(dropout=0.05), got)


@pytest.mark.bnb
def test_block_major_on_nf4():
    pytest.importorskip("bitsandbytes")
    _, stats, got = stepped(dropout=0.05, base="nf4")
    assert stats[-1].mode == "block-major"
    assert_identical(resident(dropout=0.05, base="nf4"), got)


@pytest.mark.bnb
@pytest.mark.parametrize("graphs", [False, True])
def test_nf4_weights_dequantised_once_per_pass(graphs):
    """hold_weights=True: each layer's 4-bit weights are dequantised once for the
    forward of all G micro-batches and once for their backward (2 per linear a step, not
    3·G), and training is still identical (graphs=True on the CPU: their buffer path)."""
    pytest.importorskip("bitsandbytes")
    model, stats, got = stepped(dropout=0.0, base="nf4", graphs=graphs, hold_weights=True)
    assert all(s.mode == "block-major" for s in stats)
    assert_identical(resident(dropout=0.0, base="nf4"), got)
    trainer = model.narrows_step_trainer
    assert trainer.held_choice.startswith("on")
    linears = sum(1 for m in model.modules() if is_nf4_linear(m))
    with Dequantizations() as seen:
        trainer.step(_batches(STEPS))
    assert seen.count == 2 * linears
    with Dequantizations() as seen:  # the same step without holding: every call dequantises
        trainer.held = None
        trainer.step(_batches(STEPS + 1))
    assert seen.count >= 2 * G * linears  # forward and recompute, each micro-batch (and most backwards)


@pytest.mark.bnb
def test_a_wrong_held_copy_changes_training(monkeypatch):
    """Fault injection: the held copies are what the layers compute with — held zeros in
    place of the dequantised weights change the training."""
    pytest.importorskip("bitsandbytes")
    import bitsandbytes.functional as bnbf

    real = bnbf.dequantize_4bit
    monkeypatch.setattr(bnbf, "dequantize_4bit", lambda *a, **k: real(*a, **k).zero_())
    _, _, got = stepped(dropout=0.0, base="nf4", hold_weights=True)
    with pytest.raises(AssertionError):
        assert_identical(resident(dropout=0.0, base="nf4"), got)


@pytest.mark.bnb
def test_hold_weights_auto_needs_room_in_the_budget():
    """ "auto" holds only with a budget that has room over the plan; bad values are refused."""
    pytest.importorskip("bitsandbytes")
    model = build(dropout=0.0, base="nf4")
    ns.stream(model, device="cpu", offload="off")
    opt = _optimizer([p for p in model.parameters() if p.requires_grad])
    trainer = ns.StepTrainer(model, opt, grad_accum=G)
    assert trainer.held is None and "no budget" in trainer.held_choice
    with pytest.raises(StreamSetupError, match="hold_weights='yes'"):  # validated with the stream config
        ns.StreamConfig(hold_weights="yes")


@pytest.mark.parametrize("g", [1, 2, 4])
def test_each_layer_is_loaded_once_per_pass_whatever_g(g):
    """Streamed layers cross the link once for the forward of all G micro-batches and
    once for their backward: the bytes per block-major step do not grow with G."""
    model, stats, _ = stepped(dropout=0.0, g=g, prefetch=0)
    layer_bytes = model.narrows_stream.plan.layer_bytes
    per_step = stats[-1].bytes_h2d
    assert per_step <= 2 * sum(layer_bytes)
    if g > 1:
        assert stats[-1].mode == "block-major"
        assert per_step >= 2 * sum(layer_bytes) - 2 * max(layer_bytes)  # all but the slab held at the turns


def test_step_refuses_bad_input():
    model = build(dropout=0.0)
    ns.stream(model, device="cpu")
    trainer = ns.StepTrainer(model, _optimizer, grad_accum=2)
    with pytest.raises(ValueError, match="takes 2 micro-batches"):
        trainer.step(_batches(0, 3))
    with pytest.raises(StreamSetupError, match="grad_accum"):
        ns.StepTrainer(model, _optimizer, grad_accum=0)
    first = next(p for p in model.parameters() if p.requires_grad)
    first.grad = torch.zeros_like(first)
    with pytest.raises(RuntimeError, match="already set"):
        trainer.step(_batches(0, 2))


def test_streams_a_plain_model_itself():
    model = build(dropout=0.0)
    trainer = ns.StepTrainer(model, _optimizer, grad_accum=2, device="cpu", gpu_budget=None)
    assert model.narrows_stream.plan.resident == ()
    stats = trainer.step(_batches(0, 2))
    assert stats.mode == "block-major" and stats.tokens == 2 * 24 and stats.loss > 0


def test_the_predicted_peak_counts_the_boundaries_the_plan_left_out():
    """With no budget nothing is reserved: the trainer's prediction adds the G + 1 layer
    boundaries a block-major step keeps; reserved (twin), they are counted once; one
    micro-batch a step keeps none."""
    boundary = 2 * 12 * build(dropout=0.0).config.hidden_size * 4  # batch 2 x 12 tokens, fp32
    for reserve, g, extra in ((0, G, (G + 1) * boundary), ((G + 1) * boundary, G, 0), (0, 1, 0)):
        model = ns.stream(build(dropout=0.0), device="cpu", batch_size=2, seq_len=12, reserve=reserve)
        trainer = ns.StepTrainer(model, _optimizer, grad_accum=g)
        assert trainer.predicted_peak == model.narrows_stream.plan.predicted_peak + extra, (reserve, g)


def test_rng_restore_and_capture_round_trip():
    state = rng.capture(torch.device("cpu"))
    torch.rand(5)
    rng.restore(state)
    assert torch.equal(rng.capture(torch.device("cpu")).cpu, state.cpu)


@pytest.mark.gpu
@pytest.mark.parametrize("fast", [False, True], ids=["peft-kernels", "fast-layers"])
def test_block_major_on_cuda_with_dropout_and_offloaded_boundaries(fast):
    """On the GPU: Philox dropout states predicted by replay (PEFT's dropout, or the fast
    layers' fused-kernel masks), boundaries through pinned host memory on their own
    streams, deterministic kernels — still bit-identical."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import os

    from narrows.core import deterministic

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    deterministic(True)
    _, stats, got = stepped(dropout=0.05, device="cuda", offload="all", fast=fast)
    assert [s.mode for s in stats][1:] == ["block-major"] * (STEPS - 1)
    assert_identical(resident(dropout=0.05, device="cuda", fast=fast), got)


@pytest.mark.gpu
@pytest.mark.bnb
@pytest.mark.parametrize("graphs", [False, True])
def test_nf4_weights_held_on_cuda_are_exact(graphs):
    """On the GPU, with CUDA graphs replaying over the held copies too: bit-identical to
    resident training that dequantises on every call; in eager mode bitsandbytes
    dequantises twice per linear a step (fp32 weights: its own kernel takes only a few
    tokens, so every call here is one the held copies serve)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("bitsandbytes")
    import os

    from narrows.core import deterministic

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    deterministic(True)
    model, stats, got = stepped(dropout=0.05, device="cuda", base="nf4", graphs=graphs, hold_weights=True)
    assert [s.mode for s in stats][1:] == ["block-major"] * (STEPS - 1)
    assert_identical(resident(dropout=0.05, device="cuda", base="nf4"), got)
    # fused LoRA branches (bf16 model, float32 adapters: the shared cast), same gates
    _, _, fused = stepped(
        dropout=0.0,
        device="cuda",
        base="nf4",
        graphs=graphs,
        dtype=torch.bfloat16,
        fuse=True,
        hold_weights=True,
    )
    assert_identical(resident(dropout=0.0, device="cuda", base="nf4", dtype=torch.bfloat16), fused)
    if graphs:
        assert model.narrows_stream.graphs.stats.replays > 0
    else:
        linears = sum(1 for m in model.modules() if is_nf4_linear(m))
        with Dequantizations() as seen:
            model.narrows_step_trainer.step(_batches(STEPS))
        assert seen.count == 2 * linears


def test_fully_resident_plans_accumulate_sequentially():
    """With every layer resident nothing crosses the link: the step runs in sequential
    order, where the planner's whole layers skip their recompute — and where no layer is
    kept whole, with nothing to dequantise once or head to share."""
    model, stats, got = stepped(dropout=0.05, gpu_budget="fit")
    assert model.narrows_stream.plan.whole
    assert {s.mode for s in stats} == {
        f"sequential (every layer resident, {len(model.narrows_stream.plan.whole)} kept whole: "
        "block-major would recompute them)"
    }
    assert_identical(resident(dropout=0.05), got)
    model, stats, got = stepped(dropout=0.05, gpu_budget="fit", recompute="all")
    assert not model.narrows_stream.plan.whole
    assert {s.mode for s in stats} == {
        "sequential (every layer resident: no copy, dequantisation or head pass to share)"
    }
    assert_identical(resident(dropout=0.05), got)


@pytest.mark.bnb
@pytest.mark.parametrize("dropout", [0.0, 0.05])
def test_resident_nf4_layers_step_block_major_with_their_weights_held(dropout):
    """Every layer resident and recomputed, 4-bit weights held: block-major still pays —
    two dequantisations per linear a step instead of three per micro-batch — and trains
    the same numbers (with dropout, after the first step learns the RNG draws)."""
    pytest.importorskip("bitsandbytes")
    model, stats, got = stepped(
        dropout=dropout, base="nf4", gpu_budget="fit", recompute="all", hold_weights=True
    )
    assert not model.narrows_stream.plan.streamed
    assert [s.mode for s in stats][1:] == ["block-major"] * (STEPS - 1)
    assert_identical(resident(dropout=dropout, base="nf4"), got)
    linears = sum(1 for m in model.modules() if is_nf4_linear(m))
    with Dequantizations() as seen:
        model.narrows_step_trainer.step(_batches(STEPS))
    assert seen.count == 2 * linears


def test_step_mode_plans_no_whole_layers(caplog, monkeypatch):
    """Block-major recomputes every layer: a StepTrainer that streams the model plans with
    recompute="all" (the budget goes to resident layers), and one given a plan with whole
    layers says their memory lies unused (twin: the default plan keeps layers whole)."""
    from narrows.stream.planning import residency as planning

    real = planning.step_seconds
    fast = ns.Rates(h2d=1e18)  # copies free: whole layers pay, streaming costs nothing
    monkeypatch.setattr(
        planning,
        "step_seconds",
        lambda lb, s, r, w, rates=None, graphs=False, **k: real(lb, s, r, w, fast, graphs, **k),
    )
    kw = dict(device="cpu", batch_size=1, seq_len=64, offload="off")
    budget = 2 * ns.plan(build(num_hidden_layers=6), None, **kw).predicted_peak
    own = build(num_hidden_layers=6)
    ns.StepTrainer(own, _optimizer, grad_accum=G, gpu_budget=budget, **kw)
    assert not own.narrows_stream.plan.whole
    given = build(num_hidden_layers=6)
    ns.stream(given, budget, **kw)
    assert given.narrows_stream.plan.whole and given.narrows_stream.plan.streamed
    with caplog.at_level("WARNING", logger="narrows.stream"):
        ns.StepTrainer(given, _optimizer, grad_accum=G)
    assert "recompute='all'" in caplog.text
    assert len(own.narrows_stream.plan.resident) > len(given.narrows_stream.plan.resident)


@pytest.mark.bnb
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_fast_moe_layers_block_major_equal_resident(arch):
    """The fast MoE layers (NF4 experts, Qwen2-MoE's shared expert with dropout) trained
    block-major after the first step's learning pass: bit-identical to resident fast layers."""
    model, stats, got = stepped(arch, dropout=0.05, base="nf4", fast=True)
    assert "fast layers: all" in model.narrows_stream.kernels
    assert [s.mode for s in stats[1:]] == ["block-major"] * (STEPS - 1)
    assert_identical(resident(arch, dropout=0.05, base="nf4", fast=True), got)
