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
