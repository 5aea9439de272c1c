"""What the job reports as a step's or an evaluation's peak: CUDA's allocated peak plus
the scratch pool narrows-stream's CUDA graphs replay in (never allocated during a
replay, so the allocator's peak misses it), or what a capture held."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from narrows.core.app.finetune import evaluate
from narrows.core.memory import MemoryPeaks


class Graphs:
    """narrows-stream's LayerGraphs as the job sees it: a pool and a capture's peak."""

    def __init__(self, pool: int, capture_peak: int = 0):
        self.pool, self.capture_peak = pool, capture_peak

    def reset_peak(self):
        self.capture_peak = 0

    def peak_bytes(self, allocated_peak: int) -> int:
        return max(self.capture_peak, allocated_peak + self.pool)


def test_a_cuda_peak_adds_the_graphs_pool(monkeypatch):
    monkeypatch.setattr(evaluate, "read_peaks", lambda device: MemoryPeaks(cuda_allocated=1000, host_rss=5))
    cuda = torch.device("cuda", 0)
    graphed = SimpleNamespace(narrows_stream=SimpleNamespace(graphs=Graphs(pool=24)))
    eager = SimpleNamespace(narrows_stream=SimpleNamespace(graphs=None))
    assert evaluate.measured_peak(graphed, cuda) == 1024
    assert evaluate.measured_peak(eager, cuda) == 1000
    assert evaluate.measured_peak(torch.nn.Linear(1, 1), cuda) == 1000  # not streamed
    assert evaluate.measured_peak(graphed, torch.device("cpu")) == 5  # the host's high-water mark


def test_a_window_that_captured_reports_the_capture_and_a_new_window_forgets_it(monkeypatch):
    monkeypatch.setattr(evaluate, "read_peaks", lambda device: MemoryPeaks(cuda_allocated=1000))
    monkeypatch.setattr(evaluate, "reset_peaks", lambda device, host: None)
    graphs = Graphs(pool=24, capture_peak=1500)
    model = SimpleNamespace(narrows_stream=SimpleNamespace(graphs=graphs))
    cuda = torch.device("cuda", 0)
    assert evaluate.measured_peak(model, cuda) == 1500  # the capture held more than the replays
    evaluate.reset_step_peaks(model, cuda)
    assert evaluate.measured_peak(model, cuda) == 1024  # replays only
