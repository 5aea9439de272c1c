"""narrows-lmhead's training loss is the model's own loss on every announced architecture
(logit scaling, softcapping and head bias included), and train and eval mode agree."""

import pytest
import torch

import narrows.lmhead as lmh
from narrows.core.testing import TINY_ARCHITECTURES, tiny_batch, tiny_model, with_adapter
from narrows.lmhead.twincheck import check_lmhead


def _loss_and_grads(model, batch):
    loss = model(**batch).loss
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True)  # a multimodal model's vision adapters
    return [loss.detach(), *(g for g in grads if g is not None)]


CASES = [(a, {}) for a in TINY_ARCHITECTURES] + [
    (a, {"output_router_logits": True})
    for a in ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "llama4_text")
]


@pytest.mark.parametrize("arch,config", CASES, ids=lambda c: "+router-aux" if c else None)
def test_training_loss_is_the_models_own_loss(arch, config):
    """Router logits on: the model adds its load-balancing loss, and so must narrows."""
    model = with_adapter(tiny_model(arch, **config), "lora").train()
    batch = tiny_batch(vocab=model.config.get_text_config().vocab_size)
    own = _loss_and_grads(model, batch)
    lmh.apply(model)
    ours = _loss_and_grads(model, batch)
    for a, b in zip(own, ours):  # fp32: equal up to summation order
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        evaluated = model.eval()(**batch).loss  # eval mode runs the model's own forward
    torch.testing.assert_close(evaluated, ours[0], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("arch", ["cohere", "granite", "gemma2", "phi"])
def test_the_twin_check_passes_on_scaled_capped_and_biased_heads(arch):
    check_lmhead(with_adapter(tiny_model(arch), "lora"))


@pytest.mark.parametrize("arch", ["cohere", "granite"])
def test_an_undeclared_scale_would_be_caught(arch, monkeypatch):
    """The check can fail: with the architecture's logit arithmetic dropped, it does."""
    from narrows.core import LogitMath
    from narrows.core.protocol import anatomy as anatomy_module

    real = anatomy_module.LogitMath.of
    monkeypatch.setattr(anatomy_module.LogitMath, "of", classmethod(lambda cls, ops, cfg: LogitMath()))
    from narrows.core import ArchitectureCheckError

    with pytest.raises(ArchitectureCheckError, match="differs from the model's own"):
        check_lmhead(with_adapter(tiny_model(arch), "lora"))
    monkeypatch.setattr(anatomy_module.LogitMath, "of", real)
