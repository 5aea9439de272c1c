"""On CUDA: pinned host slabs, the copy stream and events, bf16 and NF4 — still bit-identical."""

import pytest
import torch
from helpers import assert_identical, build, chunked_resident, train

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3_text"])
@pytest.mark.parametrize("base", ["bf16", pytest.param("nf4", marks=pytest.mark.bnb)])
@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_cuda_parity(arch, base, kind):
    cfg = dict(
        arch=arch,
        base=base if base == "nf4" else "float",
        kind=kind,
        dropout=0.05,
        dtype=torch.bfloat16,
        num_hidden_layers=6,
    )
    resident_model = build(**cfg).cuda()
    resident = train(resident_model, grad_accum=2, device="cuda")
    streamed_model = build(**cfg)
    streamed = train(streamed_model, grad_accum=2, device="cuda", stream_kwargs={"prefetch": 2})
    assert_identical(resident, streamed)
    handle = streamed_model.narrows_stream
    assert handle.engine.copy_stream is not None
    assert all(s.host.is_pinned() for s in handle.stores)
    assert handle.stats.loads > 0


def test_cuda_partial_residency_parity():
    import narrows.stream as ns

    cfg = dict(arch="mistral", dtype=torch.bfloat16, num_hidden_layers=8, dropout=0.05)
    p = ns.plan(build(**cfg), None, device="cuda", offload="off")
    budget = p.predicted_peak + 3 * max(p.layer_bytes)  # every saved input kept, and three resident layers
    streamed_model = build(**cfg)
    streamed = train(streamed_model, device="cuda", stream_kwargs={"gpu_budget": budget})
    assert len(streamed_model.narrows_stream.plan.resident) == 3
    assert_identical(train(build(**cfg).cuda(), device="cuda"), streamed)


def test_model_already_on_gpu_is_refused():
    import narrows.stream as ns

    with pytest.raises(ns.StreamSetupError, match="already on the GPU"):
        ns.stream(build().cuda(), device="cuda")


@pytest.mark.parametrize("arch", ["qwen2", "gemma2"])
def test_cuda_streamed_head_parity(arch):
    """The head in pinned memory, chunks double-buffered on the copy stream: the same bits
    as the same chunked head resident on the device."""
    cfg = dict(arch=arch, dtype=torch.bfloat16, dropout=0.05)
    resident = train(chunked_resident(build(**cfg).cuda(), 40), grad_accum=2, device="cuda")
    streamed_model = build(**cfg)
    streamed = train(
        streamed_model, grad_accum=2, device="cuda", stream_kwargs={"head": "stream", "head_rows": 40}
    )
    assert_identical(resident, streamed)
    assert streamed_model.narrows_stream.head.host.is_pinned()


_WORKSPACES = """
import threading, torch
from narrows.stream.planning.measure import matmul_workspaces
dev = torch.device("cuda", 0)
a = torch.randn(256, 256, device=dev, requires_grad=True)
b = torch.randn(256, 256, device=dev)
torch.cuda.synchronize()
before = torch.cuda.memory_allocated(dev)
y = a @ b                     # the Python thread's first matmul takes its workspace
y.sum().backward()            # the autograd engine's thread takes its own
del y
torch.cuda.synchronize()
kept = torch.cuda.memory_allocated(dev) - before - a.grad.numel() * 4
print(kept, matmul_workspaces(dev))
"""


def test_the_plan_counts_the_workspaces_cublas_keeps():
    """Measured in a fresh process: what a forward and a backward matmul leave allocated
    beyond their results is what the plan counts for cuBLAS."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _WORKSPACES], capture_output=True, text=True, check=True)
    kept, counted = map(int, out.stdout.split())
    assert kept == counted, out.stdout
