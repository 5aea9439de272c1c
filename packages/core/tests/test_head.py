"""The LM-head hook: resident chunks, the chunked logits consumer, attaching a source."""

import pytest
import torch

from narrows.core import (
    HeadSource,
    NarrowsError,
    ResidentHead,
    anatomy_of,
    attach_head_source,
    chunked_logits,
    head_source,
)
from narrows.core.testing import tiny_model


def test_resident_chunks_cover_the_vocabulary_as_views():
    head = torch.nn.Linear(16, 50, bias=True)
    src = ResidentHead.of(head)
    assert isinstance(src, HeadSource) and src.trainable_weight is head.weight
    seen = []
    for sl, w, b in src.chunks(12):
        assert w.data_ptr() == head.weight[sl].data_ptr() and torch.equal(b, head.bias[sl].detach())
        seen += list(range(sl.start, sl.stop))
    assert seen == list(range(50))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [7, 64, None])
def test_chunked_logits_match_the_one_matmul_head(dtype, rows):
    torch.manual_seed(0)
    head = torch.nn.Linear(32, 64, bias=False).to(dtype).requires_grad_(False)
    hidden = torch.randn(2, 5, 32, dtype=dtype, requires_grad=True)
    ref = head(hidden)
    (ref.float().square().sum()).backward()
    g_ref, hidden.grad = hidden.grad, None
    out = chunked_logits(hidden, ResidentHead.of(head), rows)
    assert out.shape == ref.shape and out.dtype == dtype
    # a GEMM of another width may pick another kernel, and the input gradient is summed
    # over vocabulary chunks (in fp32): equal up to floating-point summation order
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out, ref, **tol)
    (out.float().square().sum()).backward()
    torch.testing.assert_close(hidden.grad, g_ref, **tol)


def test_chunked_logits_refuse_a_training_head():
    head = torch.nn.Linear(8, 10)
    with pytest.raises(NarrowsError, match="frozen head only"):
        chunked_logits(torch.randn(3, 8), ResidentHead.of(head))


def test_head_source_is_resident_unless_one_is_attached():
    model = tiny_model("gemma2")
    src = head_source(model)
    assert isinstance(src, ResidentHead) and src.weight is anatomy_of(model).head.weight
    assert src.math.softcap == model.config.final_logit_softcapping
    assert head_source(tiny_model("llama")).math.identity
    attach_head_source(model, "sentinel")  # type: ignore[arg-type]
    assert head_source(model) == "sentinel"


def test_a_head_that_is_not_linear_is_refused_clearly():
    with pytest.raises(NarrowsError, match="not a plain linear layer"):
        ResidentHead.of(torch.nn.Sequential())


def test_a_head_sweep_computes_each_key_once_in_filing_order():
    """Filings with equal keys in a row go to their compute in one call; `finish` is
    applied to each loss after; the sweep is empty and the model clean afterwards."""
    from narrows.core import head_sweep, sharing_head_pass

    model = tiny_model("llama")
    calls = []

    def compute(inputs):
        calls.append(list(inputs))
        return [torch.tensor(float(x)) for x in inputs]

    with sharing_head_pass(model) as sweep:
        assert head_sweep(model) is sweep
        with pytest.raises(RuntimeError, match="already active"), sharing_head_pass(model):
            pass
        sweep.file("a", 1, compute)
        sweep.file("a", 2, compute, lambda v: v * 10)
        sweep.file("b", 3, compute)
        sweep.file("a", 4, compute)
        assert len(sweep) == 4
        got = sweep.losses()
    assert [float(v) for v in got] == [1.0, 20.0, 3.0, 4.0]
    assert calls == [[1, 2], [3], [4]]
    assert len(sweep) == 0 and head_sweep(model) is None
