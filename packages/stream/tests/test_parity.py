"""The gate: streamed training is bit-identical to resident training (torch.equal on
losses, gradients before every step, adapter weights and AdamW state)."""

import pytest
from helpers import assert_identical, build, train

from narrows.core.testing import TINY_ARCHITECTURES

NF4 = pytest.param("nf4", marks=pytest.mark.bnb)


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES[:6])  # the others: test_architectures.py
@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_every_architecture_nf4_with_dropout(arch, kind):
    pytest.importorskip("bitsandbytes")
    cfg = dict(arch=arch, base="nf4", kind=kind, dropout=0.05)
    assert_identical(train(build(**cfg), grad_accum=2), train(build(**cfg), grad_accum=2, stream_kwargs={}))


@pytest.mark.parametrize("base", ["float", NF4])
@pytest.mark.parametrize("kind", ["lora", "dora"])
@pytest.mark.parametrize("dropout", [0.0, 0.05])
@pytest.mark.parametrize("grad_accum", [1, 4])
def test_matrix_on_llama(base, kind, dropout, grad_accum):
    cfg = dict(base=base, kind=kind, dropout=dropout)
    resident = train(build(**cfg), grad_accum=grad_accum)
    streamed = train(build(**cfg), grad_accum=grad_accum, stream_kwargs={})
    assert_identical(resident, streamed)


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_partial_residency_and_prefetch_depth(prefetch):
    """A budget that keeps some layers resident streams the rest; all give the same run."""
    import narrows.stream as ns

    cfg = dict(arch="mistral", dropout=0.05, num_hidden_layers=6)
    p = ns.plan(build(**cfg), None, device="cpu", prefetch=prefetch, offload="off")
    budget = p.predicted_peak + p.layer_bytes[0]  # room for exactly one resident layer
    streamed_model = build(**cfg)
    streamed = train(
        streamed_model, stream_kwargs={"gpu_budget": budget, "prefetch": prefetch, "offload": "off"}
    )
    plan = streamed_model.narrows_stream.plan
    assert len(plan.resident) == 1 and plan.prefetch == prefetch and plan.pool_slabs == prefetch + 1
    stats = streamed_model.narrows_stream.stats
    assert stats.loads > 0 and stats.bytes_h2d > 0
    assert_identical(train(build(**cfg)), streamed)


def test_many_steps_stay_identical():
    cfg = dict(arch="qwen3", kind="lora", dropout=0.05)
    assert_identical(train(build(**cfg), steps=25), train(build(**cfg), steps=25, stream_kwargs={}))
