"""The transfer engine's stream protocol, checked on the CPU with fake CUDA streams and
events: before a layer's kernels read its device slab, the compute stream waits for the
event the host→device copy recorded on the copy stream; before a slab is overwritten,
the copy stream waits for the event its previous reader recorded. On a CPU the engine
takes no stream path at all (copies are synchronous), so without these fakes no CPU test
would notice either wait removed; on a GPU,
test_stream_gpu_exact.py::test_slow_copies_are_waited_for_and_the_gate_catches_a_missing_wait
shows the race itself."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from torch import nn

from narrows.stream.storage.engine import TransferEngine, park_layer


class _Log:
    def __init__(self):
        self.entries: list[tuple] = []
        self.current = None  # the stream work is issued on


class _Stream:
    def __init__(self, log: _Log, name: str):
        self.log, self.name = log, name

    def wait_event(self, event: _Event) -> None:
        self.log.entries.append(("wait", self.name, event))


class _Event:
    log: _Log

    def __init__(self, *args, **kwargs):
        self.stream: str | None = None

    def record(self, stream: _Stream) -> None:
        self.stream = stream.name
        self.log.entries.append(("record", stream.name, self))


@pytest.fixture
def engine(monkeypatch):
    """Four streamed layers through two device slabs, the engine believing it is on CUDA."""
    log = _Log()
    compute = _Stream(log, "compute")
    log.current = compute

    @contextmanager
    def on(stream):
        before, log.current = log.current, stream
        try:
            yield
        finally:
            log.current = before

    _Event.log = log
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: log.current)
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8).requires_grad_(False) for _ in range(4)]
    stores = [park_layer(i, layer, f"layers.{i}", pin=False) for i, layer in enumerate(layers)]
    eng = TransferEngine(stores, torch.device("cpu"), pool_size=2, resident=set())
    eng.cuda, eng.copy_stream = True, _Stream(log, "copy")
    eng.log, eng.layers = log, layers
    return eng


def _index_of(entries: list[tuple], entry: tuple) -> int:
    return next(
        i for i, e in enumerate(entries) if e[0] == entry[0] and e[1] == entry[1] and e[2] is entry[2]
    )


def test_the_compute_stream_waits_for_the_copy_before_a_layer_reads_its_slab(engine):
    """Forward order with prefetch (layer i+1 copied while layer i runs), then backward
    order: at every read, the compute stream has waited for the copy event of the slab it
    reads, recorded on the copy stream. (Catches: engine.py's ``wait_event(slab.ready)``
    in `acquire` removed.)"""
    log = engine.log
    order = [(0, 1), (1, 2), (2, 3), (3, None), (3, 2), (2, 1), (1, 0), (0, None)]
    for index, then in order:
        with engine.using(index, then=then):
            slab = engine._holding(index)
            ready = slab.ready
            assert ready is not None and ready.stream == "copy"
            assert engine.layers[index].weight.data_ptr() == slab.buffer.data_ptr()  # reading the slab
            recorded = _index_of(log.entries, ("record", "copy", ready))
            waited = _index_of(log.entries, ("wait", "compute", ready))  # StopIteration: never waited
            assert recorded < waited
            log.entries.append(("read", "compute", index))
    assert engine.stats.hits > 0  # prefetched slabs were read, each after its own wait


def test_a_slab_is_copied_over_only_after_its_last_reader_is_done(engine):
    """The other half: a slab reused for another layer is overwritten on the copy stream
    only after waiting for the event its previous reader's release recorded on the compute
    stream. (Catches: the ``wait_event(slab.free)`` in `_load` removed.)"""
    log = engine.log
    for index in range(4):
        with engine.using(index):
            pass
    frees = [e[2] for e in log.entries if e[0] == "record" and e[1] == "compute"]
    copy_waits = [e[2] for e in log.entries if e[0] == "wait" and e[1] == "copy"]
    assert len(frees) == 4 and copy_waits == frees[:2]  # layers 2 and 3 reuse the slabs of 0 and 1
    for free in copy_waits:
        assert _index_of(log.entries, ("record", "compute", free)) < _index_of(
            log.entries, ("wait", "copy", free)
        )
