"""narrows-lmhead's check for an unannounced architecture (core's `verify`): on the shrunk
twin, the loss narrows-lmhead computes in training equals the model's own loss (and its
eval-mode loss), and so do the adapter gradients, up to summation order — MoE router
logits and their aux loss turned on where the class has them."""

from __future__ import annotations

import torch
from torch import nn

from narrows.core import ArchitectureCheckError, shrunk_twin, side_output_overrides, trainable_parameters

__all__ = ["check_lmhead"]

RTOL = 1e-5  # fp32 twin: summation order and where the logit arithmetic rounds


def _loss_and_grads(model: nn.Module, batch: dict) -> list[torch.Tensor]:
    torch.manual_seed(0)
    loss = model(**batch).loss
    grads = torch.autograd.grad(loss, list(trainable_parameters(model).values()), allow_unused=True)
    return [loss.detach(), *(torch.zeros(()) if g is None else g for g in grads)]  # unused: a vision tower


def check_lmhead(model: nn.Module) -> None:
    from .api import apply

    twin = shrunk_twin(model, dropout=0.0, **side_output_overrides(model))
    vocab = twin.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, 12), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100
    batch = {"input_ids": ids, "labels": labels}
    own = _loss_and_grads(twin.train(), batch)
    apply(twin)
    ours = _loss_and_grads(twin, batch)
    with torch.no_grad():
        evaluated = twin.eval()(**batch).loss
    twin.train()
    names = ["loss", *trainable_parameters(twin)]
    for name, a, b in zip(names, own, ours):
        if not torch.allclose(a.double(), b.double(), rtol=RTOL, atol=1e-7):
            raise ArchitectureCheckError(
                f"narrows-lmhead's training {name if name == 'loss' else 'gradient of ' + name} differs from the "
                f"model's own (max {(a.double() - b.double()).abs().max().item():.3g}): the model computes its "
                "logits in a way narrows does not declare"
            )
    if not torch.allclose(evaluated.double(), ours[0].double(), rtol=RTOL):
        raise ArchitectureCheckError(
            f"train-mode loss {ours[0].item():.6f} and eval-mode loss {evaluated.item():.6f} disagree"
        )
