"""One rank of `test_trainer_ddp.py`: transformers.Trainer launched by torchrun (gloo on the
CPU) trains the same tiny PEFT model resident, then streamed by narrows-stream."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import narrows.stream as ns
from narrows.core.testing import tiny_batch, tiny_model, with_adapter


class Rows(torch.utils.data.Dataset):
    def __init__(self, n: int = 12):
        self.rows = []
        for i in range(n):
            b = tiny_batch(batch=1, seq=12, seed=i, pad_last=0)
            self.rows.append({k: v[0] for k, v in b.items()})

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


def run(out: str, streamed: bool) -> None:
    from transformers import Trainer, TrainingArguments

    model = with_adapter(tiny_model("qwen3"), "lora", dropout=0.05).train()
    if streamed:
        ns.stream(model, device="cpu")
    args = TrainingArguments(
        output_dir=f"{out}.{int(streamed)}",
        max_steps=3,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        use_cpu=True,
        ddp_backend="gloo",
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        seed=0,
    )
    seen = []

    class Recording(Trainer):  # the rows each rank trains on
        def compute_loss(self, model, inputs, *args, **kwargs):
            seen.append(inputs["input_ids"].tolist())
            return super().compute_loss(model, inputs, *args, **kwargs)

    trainer = Recording(model=model, args=args, train_dataset=Rows())
    trainer.train()
    rank = dist.get_rank()
    torch.save(
        {
            "wrapped": type(trainer.model_wrapped).__name__,
            "loss": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "seen": seen,
            "weight": [p.detach().clone() for p in model.parameters() if p.requires_grad],
        },
        f"{out}.{'streamed' if streamed else 'resident'}.rank{rank}.pt",
    )


if __name__ == "__main__":
    run(sys.argv[1], streamed=False)
    run(sys.argv[1], streamed=True)
    # a rank exiting with the group alive can abort in interpreter teardown (gloo's threads still
    # hold tensors: "terminate called without an active exception", seen once in CI)
    dist.destroy_process_group()
