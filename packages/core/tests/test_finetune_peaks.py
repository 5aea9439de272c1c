"""What the job reports as a step's or an evaluation's peak: CUDA's allocated peak plus
the scratch pool narrows-stream's CUDA graphs replay in (never allocated during a
replay, so the allocator's peak misses it)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from narrows.core.app.finetune import evaluate
from narrows.core.memory import MemoryPeaks


def test_a_cuda_peak_adds_the_graphs_pool(monkeypatch):
    monkeypatch.setattr(evaluate, "read_peaks", lambda device: MemoryPeaks(cuda_allocated=1000, host_rss=5))
    cuda = torch.device("cuda", 0)
    graphed = SimpleNamespace(narrows_stream=SimpleNamespace(graphs=SimpleNamespace(pool_bytes=lambda: 24)))
    eager = SimpleNamespace(narrows_stream=SimpleNamespace(graphs=None))
    assert evaluate.measured_peak(graphed, cuda) == 1024
    assert evaluate.measured_peak(eager, cuda) == 1000
    assert evaluate.measured_peak(torch.nn.Linear(1, 1), cuda) == 1000  # not streamed
    assert evaluate.measured_peak(graphed, torch.device("cpu")) == 5  # the host's high-water mark


def test_a_window_that_captured_graphs_counts_the_pool_once(monkeypatch):
    """A capture allocates the pool's blocks, which the allocated peak then holds."""
    monkeypatch.setattr(evaluate, "read_peaks", lambda device: MemoryPeaks(cuda_allocated=1000))
    stats = SimpleNamespace(captured=3)
    model = SimpleNamespace(
        narrows_stream=SimpleNamespace(graphs=SimpleNamespace(pool_bytes=lambda: 24, stats=stats))
    )
    cuda = torch.device("cuda", 0)
    assert evaluate.graph_captures(model) == 3
    assert evaluate.measured_peak(model, cuda, captures=3) == 1024  # replays only
    assert evaluate.measured_peak(model, cuda, captures=1) == 1000  # two captured in the window
