"""narrows-dora's DoRA layers streamed by narrows-stream: bit-identical to resident."""

import pytest
import torch

import narrows.dora as nd
import narrows.stream as ns
from narrows.core.testing import tiny_batch, tiny_model, with_adapter


def run(model, steps=3):
    torch.manual_seed(0)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    record = []
    for step in range(steps):
        for micro in range(2):
            loss = model(**tiny_batch(seed=10 * step + micro)).loss / 2
            loss.backward()
            record.append(loss.detach().clone())
        record += [p.grad.clone() for p in params]
        opt.step()
        opt.zero_grad()
    return record + [p.detach().clone() for p in params]


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_streamed_narrows_dora_equals_resident(arch):
    def build():
        m = with_adapter(tiny_model(arch), "dora", dropout=0.05).train()
        nd.use_narrows_dora(m)
        return m

    resident = run(build())
    streamed = run(ns.stream(build(), device="cpu"))
    assert len(resident) == len(streamed)
    for i, (a, b) in enumerate(zip(resident, streamed)):
        assert torch.equal(a, b), f"tensor {i} differs"
