"""Step mode and MoE router logits: a block-major step computes the loss in one more model
forward whose decoder layers are replaced by their outputs, where no router runs, so the
router's auxiliary loss cannot be collected. Such a model is refused before any gradient
(`StepTrainer`) and never chosen (`choose_step_mode`), each time with the reason; with one
micro-batch a step (sequential order) it trains as resident training does."""

from __future__ import annotations

import pytest
import torch
from helpers import build

import narrows.stream as ns
from narrows.core.testing import tiny_batch
from narrows.stream.stepmode import trainer as stepmode

ROUTER = dict(output_router_logits=True, router_aux_loss_coef=0.02)


def _moe(arch: str, **config):
    model = build(arch, dropout=0.0, **config)
    return ns.stream(model, device="cpu")


def _batches(g: int) -> list[dict]:
    return [tiny_batch(seed=10 + k) for k in range(g)]


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_router_logits_are_refused_before_any_gradient(arch, monkeypatch):
    """Refused when the trainer is built, naming the field, so a caller (narrows finetune)
    can go on in sequential order. Without the refusal the step dies inside transformers'
    load-balancing loss (no router logits collected) — the hole this closes."""
    model = _moe(arch, **ROUTER)
    params = [p for p in model.parameters() if p.requires_grad]
    with pytest.raises(ns.StreamSetupError, match=r"output_router_logits=True, router_aux_loss_coef=0\.02"):
        ns.StepTrainer(model, torch.optim.AdamW(params), grad_accum=2)
    assert all(p.grad is None for p in params)
    monkeypatch.setattr(stepmode, "router_logits_refusal", lambda *a: None)  # the refusal removed
    trainer = ns.StepTrainer(model, torch.optim.AdamW(params), grad_accum=2)
    with pytest.raises(IndexError):
        trainer.step(_batches(2), seeds=[1, 2])  # seeded: block-major from the first step


def test_a_batch_asking_for_router_logits_is_refused_before_any_work():
    """The config leaves them off but the batches ask for them: refused at the step, with
    no gradient written (narrows finetune then goes on in sequence)."""
    model = _moe("qwen2_moe")
    params = [p for p in model.parameters() if p.requires_grad]
    trainer = ns.StepTrainer(model, torch.optim.AdamW(params), grad_accum=2)
    with pytest.raises(ns.StreamSetupError, match="a batch passes output_router_logits=True"):
        trainer.step([{**b, "output_router_logits": True} for b in _batches(2)], seeds=[1, 2])
    assert all(p.grad is None for p in params)


def test_one_micro_batch_a_step_with_router_logits_trains_as_resident():
    """Sequential order runs the whole model: the router loss is there, and equal."""
    resident = build("mixtral", dropout=0.0, **ROUTER)
    streamed = _moe("mixtral", **ROUTER)
    batch = _batches(1)
    got = []
    for model in (resident, streamed):
        params = [p for p in model.parameters() if p.requires_grad]
        torch.manual_seed(0)
        if model is resident:
            out = model(**batch[0])
            assert out.aux_loss is not None and out.aux_loss > 0
            out.loss.backward()
            losses = [out.loss.detach()]
        else:
            losses = ns.StepTrainer(model, None, grad_accum=1).accumulate(batch)[1]
        got.append([*losses, *(p.grad for p in params)])
    assert all(torch.equal(a, b) for a, b in zip(*got, strict=True))


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_step_mode_is_not_chosen_for_router_logits(arch):
    """The plan of an unstreamed model, as narrows finetune's budget planning asks it: the
    same plan without router logits is chosen block-major (the tiny base is transfer-bound
    on a CUDA link), so the router logits alone decide."""
    for config, chosen in (({}, True), (ROUTER, False)):
        model = build(arch, **config)
        plan = ns.plan(model, None, device="cuda:0", batch_size=2, seq_len=12)
        use, why = ns.choose_step_mode(model, 4, plan=plan, host_available=1 << 40, batch_size=2, seq_len=12)
        assert use is chosen, why
    assert why.startswith(
        "sequential (step mode refuses this model: MoE router logits are on (config.output_router_logits=True"
    )
