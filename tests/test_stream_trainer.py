"""narrows.stream under transformers.Trainer: the same run as without streaming."""

import pytest
import torch

pytest.importorskip("accelerate")

import narrows.stream as ns
from narrows.core.testing import tiny_batch, tiny_model, with_adapter


class _Rows(torch.utils.data.Dataset):
    def __init__(self, n=8):
        self.rows = []
        for i in range(n):
            b = tiny_batch(batch=1, seq=12, seed=i, pad_last=0)
            self.rows.append({k: v[0] for k, v in b.items()})

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def _train(tmp_path, streamed: bool):
    from transformers import Trainer, TrainingArguments

    model = with_adapter(tiny_model("qwen3"), "lora", dropout=0.05).train()
    if streamed:
        ns.stream(model, device="cpu")
    args = TrainingArguments(
        output_dir=str(tmp_path / ("s" if streamed else "r")),
        max_steps=4,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-2,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        seed=0,
        gradient_checkpointing=True,  # redundant under streaming: must be ignored, not break parity
    )
    trainer = Trainer(model=model, args=args, train_dataset=_Rows())
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, [p.detach().clone() for p in model.parameters() if p.requires_grad]


def test_trainer_streamed_equals_resident(tmp_path):
    r_loss, r_weights = _train(tmp_path, streamed=False)
    s_loss, s_weights = _train(tmp_path, streamed=True)
    assert len(r_loss) == 4 and r_loss == s_loss
    assert all(torch.equal(a, b) for a, b in zip(r_weights, s_weights))


def _train_step_mode(tmp_path, name: str, trainer_cls=None, rows: int = 10, **extra):
    """Three micro-batches per step and 10 rows of batch 1: the epoch's last step has only one."""
    from transformers import Trainer, TrainingArguments

    model = with_adapter(tiny_model("qwen3"), "lora", dropout=0.05).train()
    if trainer_cls is not None:
        ns.stream(model, device="cpu")
    args = TrainingArguments(
        output_dir=str(tmp_path / name),
        num_train_epochs=2,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=3,
        learning_rate=1e-2,
        max_grad_norm=0.5,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        seed=0,
        **extra,
    )
    trainer = (trainer_cls or Trainer)(model=model, args=args, train_dataset=_Rows(rows))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return trainer, losses, [p.detach().clone() for p in model.parameters() if p.requires_grad]


def test_step_mode_trainer_equals_the_plain_trainer(tmp_path):
    """StepModeTrainer on a streamed model: the Trainer's own loop (clipping, scheduler,
    a short last step per epoch) with each step's micro-batches run block-major —
    weights `torch.equal` to the plain Trainer on the resident model."""
    _, r_loss, r_weights = _train_step_mode(tmp_path, "r")
    trainer, s_loss, s_weights = _train_step_mode(tmp_path, "s", ns.StepModeTrainer)
    assert all(torch.equal(a, b) for a, b in zip(r_weights, s_weights))
    assert "block-major" in trainer.step_modes
    assert any(
        m.startswith("sequential (one micro-batch)") for m in trainer.step_modes
    )  # each epoch's last step
    assert s_loss == pytest.approx(r_loss, rel=1e-6)  # the same sum, added in another order


def test_step_mode_trainer_with_the_wrong_divisor_differs(tmp_path, monkeypatch):
    """Fault injection: dividing each loss by gradient_accumulation_steps although the model
    normalised it over the step's tokens (``num_items_in_batch``, which the Trainer passes)
    changes the weights — the divisor the bridge picks is what keeps the run exact."""
    _, _, r_weights = _train_step_mode(tmp_path, "r")
    original = ns.StepTrainer.accumulate
    monkeypatch.setattr(
        ns.StepTrainer, "accumulate", lambda self, batches, divisor=None: original(self, batches, 3)
    )
    _, _, s_weights = _train_step_mode(tmp_path, "s", ns.StepModeTrainer)
    assert not all(torch.equal(a, b) for a, b in zip(r_weights, s_weights))


@pytest.mark.parametrize(("extra", "why"), [({"bf16": True}, "autocast")])
def test_step_mode_trainer_refuses_what_it_cannot_make_exact(tmp_path, extra, why):
    with pytest.raises(ns.StreamSetupError, match=why):
        _train_step_mode(tmp_path, "x", ns.StepModeTrainer, **extra)


def test_step_mode_trainer_refuses_a_custom_loss(tmp_path):
    class Custom(ns.StepModeTrainer):
        def compute_loss(self, model, inputs, **kw):
            return super().compute_loss(model, inputs, **kw) * 2

    with pytest.raises(ns.StreamSetupError, match="compute_loss is overridden"):
        _train_step_mode(tmp_path, "x", Custom)


def test_step_mode_trainer_refuses_moe_router_logits_when_built(tmp_path):
    """A MoE model with its router's aux loss on: refused when the Trainer is built (before
    any gradient), naming the field — it used to die in transformers' load-balancing loss
    at the first block-major step."""
    from transformers import TrainingArguments

    model = with_adapter(tiny_model("qwen2_moe", output_router_logits=True), "lora").train()
    ns.stream(model, device="cpu")
    args = TrainingArguments(
        output_dir=str(tmp_path / "moe"),
        max_steps=1,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=2,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
    )
    with pytest.raises(ns.StreamSetupError, match=r"config\.output_router_logits=True"):
        ns.StepModeTrainer(model=model, args=args, train_dataset=_Rows(4))
    assert all(p.grad is None for p in model.parameters())
