"""`narrows.lmhead.apply` against the model's own loss, on tiny models of every architecture."""

import pytest
import torch

import narrows.lmhead as lmh
from narrows.core import anatomy_of
from narrows.core.testing import TINY_ARCHITECTURES, tiny_batch, tiny_model, with_adapter

# fp32 tiny models: the only difference from HF's loss is the summation order
TOL = dict(rtol=2e-5, atol=2e-6)
OPTIONS = [dict(mask=True, chunked=True), dict(mask=True, chunked=False), dict(mask=False, chunked=True)]


def batch(seed=1):
    """Rows with different numbers of trainable tokens (prompt lengths 2 and 7)."""
    b = tiny_batch(seed=seed)
    b["labels"][1, :7] = -100
    return b


def loss_and_grads(model, **kwargs):
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    loss = model(**batch(), **kwargs).loss
    return loss.detach(), torch.autograd.grad(loss, params)


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES[:6])  # every architecture: test_lmhead_architectures.py
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "+".join(k for k, v in o.items() if v) or "plain")
def test_same_loss_and_adapter_gradients_as_hf(arch, opts):
    ref_loss, ref_grads = loss_and_grads(with_adapter(tiny_model(arch), "lora"))
    model = lmh.apply(with_adapter(tiny_model(arch), "lora"), head_rows=40, **opts)
    loss, grads = loss_and_grads(model)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, **TOL)


def test_num_items_in_batch_reduction_matches_hf():
    """The Trainer's gradient-accumulation reduction: a sum over a given token count."""
    n = torch.tensor(40)
    ref, _ = loss_and_grads(with_adapter(tiny_model("qwen2"), "lora"), num_items_in_batch=n)
    ours, _ = loss_and_grads(lmh.apply(with_adapter(tiny_model("qwen2"), "lora")), num_items_in_batch=n)
    torch.testing.assert_close(ours, ref, **TOL)


def test_a_trainable_head_trains_through_the_chunked_loss():
    def build():
        m = with_adapter(tiny_model("llama"), "lora")
        anatomy_of(m).head.weight.requires_grad_(True)
        return m

    ref_loss, ref_grads = loss_and_grads(build())
    loss, grads = loss_and_grads(lmh.apply(build(), head_rows=64))
    torch.testing.assert_close(loss, ref_loss, **TOL)
    assert len(grads) == len(ref_grads)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, **TOL)


def test_no_trainable_token_is_a_clear_error():
    model = lmh.apply(with_adapter(tiny_model("llama"), "lora")).train()
    b = tiny_batch()
    b["labels"][:, 1:] = -100  # only the first label survives, and no position predicts it after the shift
    with pytest.raises(lmh.NoTrainableTokensError, match="no trainable token"):
        model(**b)


def test_eval_mode_keeps_the_full_forward_unless_asked():
    model = lmh.apply(with_adapter(tiny_model("llama"), "lora")).eval()
    out = model(**batch())
    assert out.logits is not None and out.logits.shape[-1] == 256
    lean = lmh.apply(lmh.remove(model), eval_logits=False).eval()
    with torch.no_grad():
        out2 = lean(**batch())
    assert out2.logits is None
    torch.testing.assert_close(out2.loss, out.loss, **TOL)


def test_remove_restores_the_model_forward_and_double_apply_is_refused():
    model = with_adapter(tiny_model("llama"), "lora")
    lmh.apply(model)
    with pytest.raises(ValueError, match="already applied"):
        lmh.apply(model)
    lmh.remove(model).train()
    assert model(**batch()).logits is not None


def _autocast_grads(lmhead: bool):
    model = with_adapter(tiny_model("llama"), "lora").train()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(0))
    if lmhead:
        lmh.apply(model)
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**batch()).loss
    return loss.detach(), torch.autograd.grad(loss, params)


def test_under_autocast_the_backward_recomputes_as_the_forward_ran(monkeypatch):
    """Under bf16 autocast the chunked loss's backward recomputes the logits, and takes
    their gradient matmuls, under the forward's autocast settings — as HF's loss under
    autocast differentiates them. Without that (the fault twin) the softmax comes from
    fp32 logits the forward never saw, and the adapter gradients move by about 1e-2."""
    import contextlib

    from narrows.lmhead import chunked

    ref_loss, ref_grads = _autocast_grads(False)
    loss, grads = _autocast_grads(True)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, **TOL)
    monkeypatch.setattr(chunked, "ambient_as", lambda state: contextlib.nullcontext())
    _, bad = _autocast_grads(True)
    assert max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(bad, ref_grads)) > 1e-3
