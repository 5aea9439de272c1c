"""The LM head streamed in vocabulary chunks.

The head lives in pinned host memory and is served through core's `HeadSource` hook from
two device buffers of `rows` vocabulary rows; every consumer of the hook gets the numbers
it would get from the resident head with the same chunk size.

why: docs/design.md#the-streamed-head
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from narrows.core import DEFAULT_HEAD_ROWS, LogitMath

from ..storage.engine import TransferStats


class StreamedHead:
    """A frozen head weight in host memory, served to the device chunk by chunk."""

    trainable_weight = None

    def __init__(
        self,
        weight: Tensor,
        bias: Tensor | None,
        device: torch.device,
        *,
        stats: TransferStats,
        copy_stream: object | None,
        rows: int = DEFAULT_HEAD_ROWS,
        math: LogitMath | None = None,
    ):
        self.vocab_size, self.hidden_size = weight.shape
        self.dtype, self.device, self.math = weight.dtype, device, math or LogitMath()
        self.rows = min(rows, self.vocab_size)
        cuda = device.type == "cuda"
        self.host = weight.detach().to("cpu").contiguous()
        if cuda:
            self.host = self.host.pin_memory()
        self.bias = None if bias is None else bias.detach().to(device)
        self.buffers = [
            torch.empty(self.rows, self.hidden_size, dtype=self.dtype, device=device) for _ in range(2)
        ]
        self.stats, self.copy_stream, self.cuda = stats, copy_stream, cuda
        self._free: list[object | None] = [None, None]  # compute finished reading buffer i

    def _load(self, sl: slice, slot: int) -> object | None:
        n = sl.stop - sl.start
        dst, src = self.buffers[slot][:n], self.host[sl]
        self.stats.loads += 1
        self.stats.bytes_h2d += src.numel() * src.element_size()
        if not self.cuda:
            dst.copy_(src)
            return None
        with torch.cuda.stream(self.copy_stream):
            if self._free[slot] is not None:
                self.copy_stream.wait_event(self._free[slot])
            dst.copy_(src, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.copy_stream)
        return ready

    def gather(self, index: Tensor) -> tuple[Tensor, Tensor | None]:
        """Rows `index` gathered on the host and copied over (a vocabulary subset)."""
        rows = self.host.index_select(0, index.to("cpu"))
        self.stats.loads += 1
        self.stats.bytes_h2d += rows.numel() * rows.element_size()
        w = rows.pin_memory().to(self.device, non_blocking=True) if self.cuda else rows
        return w, None if self.bias is None else self.bias.index_select(0, index.to(self.device))

    def chunks(self, rows: int | None = None) -> Iterator[tuple[slice, Tensor, Tensor | None]]:
        rows = min(rows or self.rows, self.rows)
        slices = [slice(s, min(s + rows, self.vocab_size)) for s in range(0, self.vocab_size, rows)]
        ready = self._load(slices[0], 0)
        for i, sl in enumerate(slices):
            slot = i % 2
            nxt = self._load(slices[i + 1], 1 - slot) if i + 1 < len(slices) else None
            if ready is not None:
                torch.cuda.current_stream(self.device).wait_event(ready)
            yield sl, self.buffers[slot][: sl.stop - sl.start], None if self.bias is None else self.bias[sl]
            if self.cuda:
                self._free[slot] = torch.cuda.Event()
                self._free[slot].record(torch.cuda.current_stream(self.device))
            ready = nxt
