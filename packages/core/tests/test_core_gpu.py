"""The contract on CUDA, and the slab round trip stream builds on: a layer's frozen slots
packed into one pinned host buffer, moved to the device in one copy, read from there."""

import pytest
import torch

from narrows.core import SlabLayout, anatomy_of, assign, frozen_slots, quantize_nf4, snapshot
from narrows.core.testing import forward_backward, run_contract, tiny_batch, tiny_model, with_adapter

pytestmark = pytest.mark.gpu


def _on_cuda(batch):
    return {k: v.cuda() for k, v in batch.items()}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
@pytest.mark.parametrize("kind", ["lora", "dora"])
@pytest.mark.parametrize("base", ["bf16", pytest.param("nf4", marks=pytest.mark.bnb)])
def test_contract_on_cuda(arch, kind, base):
    model = tiny_model(arch, dtype=torch.bfloat16).cuda()
    if base == "nf4":
        quantize_nf4(model)
    run_contract(with_adapter(model, kind), _on_cuda(tiny_batch()), variant=kind)


@pytest.mark.parametrize("base", ["bf16", pytest.param("nf4", marks=pytest.mark.bnb)])
def test_layer_through_pinned_slab_is_bit_identical(base):
    model = tiny_model("llama", dtype=torch.bfloat16).cuda()
    if base == "nf4":
        quantize_nf4(model)
    model = with_adapter(model, "lora")
    batch = _on_cuda(tiny_batch())
    reference = forward_backward(model, batch)
    layer = anatomy_of(model).layers[1]
    slots = frozen_slots(layer)
    originals = snapshot(slots)
    layout = SlabLayout.of(slots)
    host = layout.empty("cpu", pin_memory=True)
    layout.pack(originals, host)  # device -> host once, when the base is parked
    device_slab = layout.empty("cuda")
    device_slab.copy_(host, non_blocking=True)  # the one host -> device copy per layer load
    assign(slots, layout.views(device_slab))
    for s, o in zip(slots, originals):
        if s.kind == "parameter":  # (code tables may be shared with other layers: left alone)
            o.zero_() if o.is_floating_point() else o.bitwise_not_()  # the old storage is unused now
    got = forward_backward(model, batch)
    assert all(torch.equal(a, b) for a, b in zip(reference, got))
