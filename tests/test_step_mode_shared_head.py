"""Step mode with narrows-lmhead and a streamed head: the micro-batches of a step share
their passes over the head (core's head sweep), and training is still `torch.equal` to
resident sequential accumulation with the same loss. Each claim has a twin that fails."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import narrows.lmhead as lmh
import narrows.stream as ns
from narrows.core import HeadSweep, loss_working_set
from narrows.core.protocol.handle import state_of
from narrows.core.testing import tiny_batch, tiny_model, with_adapter
from narrows.stream.execution.head import StreamedHead
from narrows.stream.stepmode.blockmajor import HeadSharing

ROWS = 48  # head rows per chunk: the same tiling for the resident and the streamed head
G = 4
STEPS = 2


def _build(arch: str = "qwen2", dropout: float = 0.0, device: str = "cpu") -> torch.nn.Module:
    model = with_adapter(tiny_model(arch), "lora", dropout=dropout).train()
    if device == "cuda":  # the resident reference would go to Cut Cross-Entropy, the streamed head cannot
        return lmh.apply(model.to(torch.bfloat16), head_rows=ROWS, fused="off")
    return lmh.apply(model, head_rows=ROWS)


def _batches(step: int, device: str = "cpu") -> list[dict]:
    return [{k: v.to(device) for k, v in tiny_batch(seed=100 * step + k).items()} for k in range(G)]


def _optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _resident(arch: str, dropout: float = 0.0, device: str = "cpu") -> dict:
    model = _build(arch, dropout, device).to(device)
    torch.manual_seed(0)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = _optimizer(params)
    losses, grads = [], []
    for step in range(STEPS):
        for batch in _batches(step, device):
            loss = model(**batch).loss
            (loss / G).backward()
            losses.append(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        grads += [p.grad.clone() for p in params]
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"loss": losses, "grad": grads, "weight": [p.detach().clone() for p in params]}


def _stepped(arch: str, dropout: float = 0.0, device: str = "cpu", **stream_kw) -> dict:
    model = _build(arch, dropout, device)
    torch.manual_seed(0)
    ns.stream(model, device=device, head="stream", head_rows=ROWS, offload="off", **stream_kw)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = _optimizer(params)
    grads: list[torch.Tensor] = []
    real_step = opt.step
    opt.step = lambda *a, **k: (grads.extend(p.grad.clone() for p in params), real_step(*a, **k))[1]
    trainer = ns.StepTrainer(model, opt, grad_accum=G, max_grad_norm=0.5)
    losses = []
    for step in range(STEPS):
        stats = trainer.step(_batches(step, device))
        # with dropout the first step learns each micro-batch's RNG draws in sequential order
        assert stats.mode == "block-major" or (dropout and step == 0)
        losses += [torch.tensor(v) for v in stats.losses]
    return {"loss": losses, "grad": grads, "weight": [p.detach().clone() for p in params]}


def _count_passes(monkeypatch) -> list[int]:
    passes: list[int] = []
    real = StreamedHead.chunks

    def chunks(self, rows=None):
        passes.append(1)
        return real(self, rows)

    monkeypatch.setattr(StreamedHead, "chunks", chunks)
    return passes


def _same(a: dict, b: dict) -> bool:
    return all(
        len(a[k]) == len(b[k]) and all(torch.equal(x.float(), y.float()) for x, y in zip(a[k], b[k]))
        for k in a
    )


@pytest.mark.parametrize("arch", ["qwen2", "gemma2"])  # untied; tied + softcapping
def test_micro_batches_share_the_head_pass_and_train_identically(arch, monkeypatch):
    want = _resident(arch)
    passes = _count_passes(monkeypatch)
    got = _stepped(arch)
    # the stored losses are float(); compare them as stored
    want["loss"] = [torch.tensor(float(v)) for v in want["loss"]]
    assert _same(want, got)
    # all G micro-batches in one group: one read of the head in forward, one in backward
    assert len(passes) == 2 * STEPS


def test_resident_layers_with_a_streamed_head_step_block_major(monkeypatch):
    """Every layer resident and recomputed, the head streamed: the micro-batches still
    share its passes (the step runs block-major: `_stepped` asserts it), the same bits."""
    want = _resident("qwen2")
    want["loss"] = [torch.tensor(float(v)) for v in want["loss"]]
    passes = _count_passes(monkeypatch)
    assert _same(want, _stepped("qwen2", gpu_budget="fit", recompute="all"))
    assert len(passes) == 2 * STEPS


def test_the_choice_prices_the_streamed_head_per_group(monkeypatch):
    """`choose_step_mode` on a plan with every layer resident: sequential steps read the
    streamed head twice per micro-batch, block-major twice per group — chosen, and said.
    Twins: a loss that cannot share the pass (no working set), or a resident head,
    leaves nothing to gain."""
    model = _build("qwen2")
    ns.stream(
        model, "fit", device="cpu", head="stream", head_rows=ROWS, recompute="all", batch_size=2, seq_len=12
    )
    handle = model.narrows_stream
    monkeypatch.setattr(handle, "device", torch.device("cuda", 0))
    assert not handle.plan.streamed and handle.plan.head_h2d_bytes
    use, why = ns.choose_step_mode(model, G, host_available=1 << 40)
    per, room = loss_working_set(model, 24), handle.plan.work_bytes  # 2 x 12 tokens a micro-batch
    group = min(G, room // per)
    assert group > 1 and use and f"the streamed head read once for every {group} micro-batches" in why, why
    monkeypatch.setattr(state_of(model), "loss_working_set", None)
    assert not ns.choose_step_mode(model, G, host_available=1 << 40)[0]
    monkeypatch.undo()
    plain = _build("qwen2")
    ns.stream(plain, "fit", device="cpu", head_rows=ROWS, recompute="all", batch_size=2, seq_len=12)
    monkeypatch.setattr(plain.narrows_stream, "device", torch.device("cuda", 0))
    assert not plain.narrows_stream.plan.head_h2d_bytes
    assert not ns.choose_step_mode(plain, G, host_available=1 << 40)[0]


def test_with_dropout_the_shared_pass_keeps_every_rng_draw():
    """Adapter dropout: each micro-batch's loss runs from the RNG state the sequential
    order gives it, filed or not."""
    want = _resident("qwen2", dropout=0.1)
    want["loss"] = [torch.tensor(float(v)) for v in want["loss"]]
    assert _same(want, _stepped("qwen2", dropout=0.1))


def test_one_micro_batch_at_a_time_reads_the_head_2g_times(monkeypatch):
    """Twin of the pass count: without sharing the head is read per micro-batch."""
    monkeypatch.setattr(HeadSharing, "group", lambda self, batches: 1)
    passes = _count_passes(monkeypatch)
    _stepped("qwen2")
    assert len(passes) == 2 * G * STEPS


def test_losses_handed_back_in_another_order_change_training(monkeypatch):
    """Twin of the exactness test: the shared losses matched to the wrong micro-batches."""
    real = HeadSweep.losses
    monkeypatch.setattr(HeadSweep, "losses", lambda self: real(self)[::-1])
    want = _resident("qwen2")
    want["loss"] = [torch.tensor(float(v)) for v in want["loss"]]
    assert not _same(want, _stepped("qwen2"))


def test_the_group_fits_the_working_set_the_plan_left(monkeypatch):
    """As many micro-batches share a pass as their losses' working sets fit in the
    plan's; a custom loss_fn, or a head that is not streamed, share nothing."""
    model = _build("qwen2")
    ns.stream(model, device="cpu", head="stream", head_rows=ROWS, offload="off")
    trainer = ns.StepTrainer(model, _optimizer, grad_accum=G)
    micros = [type("M", (), {"batch": b})() for b in _batches(0)]
    handle = model.narrows_stream
    per = loss_working_set(model, 24)  # each batch: 2 x 12 tokens

    def room(nbytes: int) -> None:
        monkeypatch.setattr(handle, "plan", dataclasses.replace(handle.plan, work_bytes=nbytes))

    room(2 * per + per // 2)
    assert trainer._head_group(micros) == 2
    room(per - 1)
    assert trainer._head_group(micros) == 1
    room(10 * per)
    assert trainer._head_group(micros) == G
    # a graphs' pool larger than the plan said takes its excess out of the room
    pool = type("Pool", (), {"pool_bytes": lambda self: handle.plan.graph_bytes + 8 * per})()
    monkeypatch.setattr(handle, "graphs", pool)
    monkeypatch.setattr(handle, "plan", dataclasses.replace(handle.plan, graphs=True))
    assert trainer._head_group(micros) == 2
    monkeypatch.setattr(handle, "graphs", None)
    custom = ns.StepTrainer(model, _optimizer, grad_accum=G, loss_fn=lambda out, b: out.loss)
    assert custom._head_group(micros) == 1
    monkeypatch.setattr(handle, "head", None)
    assert trainer._head_group(micros) == 1


@pytest.mark.gpu
def test_cuda_shared_head_pass_is_exact(monkeypatch):
    """On CUDA (bf16, deterministic kernels): the head streamed from pinned memory on the
    copy stream, read twice a step, the same bits as resident training."""
    import os

    from narrows.core import deterministic

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    deterministic(True)
    want = _resident("qwen2", dropout=0.1, device="cuda")
    want["loss"] = [torch.tensor(float(v)) for v in want["loss"]]
    passes = _count_passes(monkeypatch)
    assert _same(want, _stepped("qwen2", dropout=0.1, device="cuda"))
    assert len(passes) == 2 * G + 2  # the first step learns the RNG draws in sequential order
