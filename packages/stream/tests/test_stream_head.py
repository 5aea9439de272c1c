"""The LM head streamed in vocabulary chunks through core's head hook."""

import pytest
import torch
from helpers import assert_identical, build, chunked_resident, train

import narrows.stream as ns
from narrows.core import anatomy_of, head_source
from narrows.core.testing import tiny_batch

ROWS = 48  # tiny vocab is 256: six chunks, the last one short


@pytest.mark.parametrize(
    "arch", ["llama", "gemma2"]
)  # untied; tied (embedding gathered from the same host copy)
@pytest.mark.parametrize("dropout", [0.0, 0.05])
def test_streamed_head_equals_the_same_chunked_head_resident(arch, dropout):
    cfg = dict(arch=arch, dropout=dropout)
    kwargs = {"head": "stream", "head_rows": ROWS}
    streamed_model = build(**cfg)
    streamed = train(streamed_model, grad_accum=2, stream_kwargs=kwargs)
    assert_identical(train(chunked_resident(build(**cfg), ROWS), grad_accum=2), streamed)
    handle = streamed_model.narrows_stream
    assert handle.head is not None and handle.host_embedding
    assert head_source(streamed_model) is handle.head


def test_streamed_head_is_close_to_the_one_matmul_head():
    """Against HF's one-matmul head the difference is summation order (fp32 model, 3 AdamW
    steps at lr 1e-2, whose normalised update amplifies tiny gradient differences)."""
    resident, streamed = train(build()), train(build(), stream_kwargs={"head": "stream", "head_rows": ROWS})
    for key in ("loss", "grad", "weight"):
        for a, b in zip(resident[key], streamed[key]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_head_bytes_leave_the_device_and_enter_the_transfer():
    model = build()
    # saved inputs kept on the device: the transfer is the weights' and the head's alone
    resident_plan = ns.plan(model, device="cpu", offload="off")
    streamed_plan = ns.plan(model, device="cpu", head="stream", head_rows=ROWS, offload="off")
    w = anatomy_of(model).head.weight
    head_bytes = w.numel() * w.element_size()
    buffers = 2 * ROWS * w.shape[1] * w.element_size()
    assert resident_plan.fixed_bytes - streamed_plan.fixed_bytes == head_bytes - buffers
    assert streamed_plan.h2d_bytes_per_step - resident_plan.h2d_bytes_per_step == 2 * head_bytes

    ns.stream(model, device="cpu", head="stream", head_rows=ROWS, offload="off")
    moved = []
    for _ in range(2):  # the second step is the steady state (the self-check warmed the pool)
        before = model.narrows_stream.stats.bytes_h2d
        model(**tiny_batch()).loss.backward()
        moved.append(model.narrows_stream.stats.bytes_h2d - before)
    assert moved[1] == streamed_plan.h2d_bytes_per_step
    report = model.narrows_stream.report()
    assert report["head_streamed"] and report["predicted_h2d_per_step"] == moved[1]
    assert report["measured_peak"] is None  # the CPU is the device: no allocator peak to read
    assert w.device.type == "cpu" and w.data_ptr() == model.narrows_stream.head.host.data_ptr()


def test_a_training_head_cannot_be_streamed():
    model = build()
    anatomy_of(model).head.weight.requires_grad_(True)
    with pytest.raises(ns.StreamSetupError, match="frozen LM head"):
        ns.stream(model, device="cpu", head="stream")
    with pytest.raises(ns.StreamSetupError, match="'resident'"):
        ns.plan(build(), device="cpu", head="chunks")
