"""The finetune loop's loss normalisation under gradient accumulation.

`narrows finetune` calls the model with ``num_items_in_batch`` = the trainable tokens of the
whole optimizer step, so each micro-batch's loss is its summed per-token cross-entropy
divided by that total (transformers' convention): the accumulated gradient is the gradient
of one mean over every trainable token of the step, whatever the micro-batches' sizes. A
loop that dropped the argument would sum per-micro-batch means instead: a different loss
and gradient — yet still deterministic and resumable, and AdamW's first update is nearly
scale-free, so the CLI tests would not notice. This test runs one real step in-process and
checks the logged loss and the gradient handed to the optimizer against an independent
computation.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_pre_hook

import narrows.core.app.finetune.job as finetune_mod
from narrows.core.app.finetune import FinetuneConfig, finetune
from narrows.core.testing import tiny_model_folder, write_jsonl

# prompt/response rows: only the response (and EOS) trains, so the micro-batches below hold
# very different numbers of trainable tokens (and padding, and masked prompts)
ROWS = [
    {"prompt": "3+4=", "response": "7"},
    {"prompt": "12*34=", "response": "twelve times thirty-four is 408"},
    {"prompt": "Name a colour: ", "response": "red"},
    {"prompt": "1+1=", "response": "the sum of one and one is two, of course"},
]
RANK = 4


def _step_one(tmp_path, monkeypatch) -> tuple[FinetuneConfig, list[dict], dict, float]:
    """One optimizer step of `narrows finetune` (batch 2, grad-accum 2) in-process: the
    micro-batches the model received, the initial adapter weights with the accumulated
    gradients at the first optimizer step, and the logged loss."""
    folder = tiny_model_folder(tmp_path / "model")
    cfg = FinetuneConfig.of(
        model=str(folder),
        data=str(write_jsonl(tmp_path / "train.jsonl", ROWS)),
        rank=RANK,
        dropout=0.0,
        steps=1,
        batch=2,
        grad_accum=2,
        seq_len=64,
        lmhead="off",
        dtype="float32",
        out=str(tmp_path / "run"),
    )
    inputs: list[dict] = []
    at_step: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    built = {}
    build = finetune_mod.build_model

    def build_and_watch(*args, **kwargs):
        model = build(*args, **kwargs)
        built["model"] = model

        def record(module, args, kwargs):
            if not at_step:  # micro-batches of the first optimizer step only
                inputs.append(
                    {k: kwargs[k].detach().clone() for k in ("input_ids", "attention_mask", "labels")}
                )

        model.register_forward_pre_hook(record, with_kwargs=True)
        return model

    def before_step(optimizer, args, kwargs):
        if not at_step:
            for name, p in built["model"].named_parameters():
                if p.requires_grad:
                    at_step[name] = (p.detach().clone(), p.grad.detach().clone())

    monkeypatch.setattr(finetune_mod, "build_model", build_and_watch)
    handle = register_optimizer_step_pre_hook(before_step)
    try:
        finetune(cfg, progress=False)
    finally:
        handle.remove()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = next(r["loss"] for r in rows if r.get("step") == 1 and "loss" in r)
    return cfg, inputs, at_step, logged


def test_accumulated_loss_is_one_mean_over_every_trainable_token_of_the_step(tmp_path, monkeypatch):
    cfg, inputs, at_step, logged = _step_one(tmp_path, monkeypatch)
    assert len(inputs) == cfg.training.grad_accum
    counts = [int((mb["labels"][:, 1:] != -100).sum()) for mb in inputs]
    assert len(set(counts)) == len(counts), f"micro-batches must differ in trainable tokens: {counts}"
    assert at_step and any(g.abs().sum() > 0 for _, g in at_step.values())

    # independent reference: the same base and LoRA at the step's initial adapter weights,
    # loss = (sum of per-token CE over the step's trainable tokens) / (their number)
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(cfg.base.model, dtype=torch.float32)
    ref = get_peft_model(
        base,
        LoraConfig(
            r=RANK, lora_alpha=2 * RANK, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
        ),
    )
    params = {n: p for n, p in ref.named_parameters() if p.requires_grad}
    assert params.keys() == at_step.keys()
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(at_step[name][0])
    ref.train()
    total = torch.zeros(())
    for mb in inputs:
        logits = ref(input_ids=mb["input_ids"].cpu(), attention_mask=mb["attention_mask"].cpu()).logits
        labels = mb["labels"].cpu()[:, 1:]
        total = total + F.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum"
        )
    loss = total / sum(counts)
    loss.backward()

    mean_of_means = "(a loop without num_items_in_batch sums per-micro-batch means instead)"
    assert logged == pytest.approx(loss.item(), rel=1e-5), mean_of_means
    for name, p in params.items():
        got = at_step[name][1].cpu()
        assert torch.allclose(got, p.grad, rtol=1e-4, atol=1e-7), (
            f"{name}: accumulated gradient is not that of the step's token mean, max diff "
            f"{(got - p.grad).abs().max().item():.3g} {mean_of_means}"
        )
