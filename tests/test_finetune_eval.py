"""The job's held-out evaluation runs within the budget the training fits: with
narrows-lmhead, through the exact chunked loss (no [tokens, vocab] logits), not the
model's own forward."""

from __future__ import annotations

import torch

import narrows.core as nc
from narrows.core.app.finetune import FinetuneConfig
from narrows.core.app.finetune.build import head_savings
from narrows.core.app.finetune.evaluate import eval_row
from narrows.core.testing import tiny_batch, tiny_model, with_adapter


def test_the_jobs_evaluation_takes_the_chunked_loss_and_gives_the_models_own():
    model = with_adapter(tiny_model("llama"), "lora")
    with torch.no_grad():  # adapters that change the output, as after training
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(3))
    batch = tiny_batch()
    with torch.no_grad():
        own = model.eval()(**batch)
    nc.apply(model, head_savings(FinetuneConfig.of(lmhead="auto")))
    with torch.no_grad():
        job = model.eval()(**batch)
    assert own.logits is not None and job.logits is None  # no logits built
    torch.testing.assert_close(job.loss, own.loss, rtol=1e-6, atol=1e-6)


def test_an_evaluation_row_has_its_peak_on_cuda_only():
    class Fixed(torch.nn.Module):
        def forward(self, **kwargs):
            return type("Out", (), {"loss": torch.tensor(2.0)})()

    from narrows.core.app.data import Example

    row = eval_row(
        Fixed(), [Example(input_ids=(1, 2, 3), labels=(-100, 2, 3), where="t:1")], 1, 0, torch.device("cpu")
    )
    assert row == {"eval_loss": 2.0}
