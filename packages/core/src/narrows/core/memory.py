"""One way to measure memory, used by every benchmark and the CLI: peak CUDA memory
(allocated and reserved, from the caching allocator) and the process's host RSS
high-water mark. Byte sizes (``"12GiB"``) are `sizes`' and re-exported here."""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch

from .sizes import format_bytes, parse_bytes

__all__ = [
    "MemoryPeaks",
    "format_bytes",
    "host_rss_bytes",
    "host_rss_high_water",
    "measure_peaks",
    "parse_bytes",
    "read_peaks",
    "reset_peaks",
]


def host_rss_bytes() -> int:
    """Current resident set size of this process."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:  # not Linux: the high-water mark is the best we have
        return host_rss_high_water()


def host_rss_high_water() -> int:
    """Peak resident set size of this process since start (or since the last reset_peaks
    on Linux, where /proc/self/clear_refs can reset it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def _cuda_device(device: torch.device | str | int | None) -> torch.device | None:
    if not torch.cuda.is_available():
        return None
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    return device if device.type == "cuda" else None


def reset_peaks(device: torch.device | str | int | None = None, *, host: bool = True) -> None:
    """Start a new measurement window: CUDA peak stats and (on Linux, with `host`) the RSS
    high-water mark. Resetting the host mark also hides earlier peaks from the process's
    own exit accounting (``/usr/bin/time -v``), so a run that reports its whole-process
    peak passes ``host=False``."""
    dev = _cuda_device(device)
    if dev is not None:
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    if not host:
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


@dataclass
class MemoryPeaks:
    """Peaks in bytes. CUDA fields are 0 when no CUDA device is in play."""

    cuda_allocated: int = 0
    cuda_reserved: int = 0
    host_rss: int = 0
    device: str = "cpu"
    extra: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)

    def __str__(self) -> str:
        parts = [f"host RSS {format_bytes(self.host_rss)}"]
        if self.device != "cpu":
            parts.insert(
                0,
                f"{self.device} allocated {format_bytes(self.cuda_allocated)}, "
                f"reserved {format_bytes(self.cuda_reserved)}",
            )
        return "peak " + ", ".join(parts)


def read_peaks(device: torch.device | str | int | None = None) -> MemoryPeaks:
    """Peaks since the last reset_peaks (CUDA) / high-water mark (host)."""
    dev = _cuda_device(device)
    peaks = MemoryPeaks(host_rss=host_rss_high_water())
    if dev is not None:
        torch.cuda.synchronize(dev)
        peaks.cuda_allocated = torch.cuda.max_memory_allocated(dev)
        peaks.cuda_reserved = torch.cuda.max_memory_reserved(dev)
        peaks.device = str(dev)
    return peaks


@contextmanager
def measure_peaks(device: torch.device | str | int | None = None) -> Iterator[MemoryPeaks]:
    """``with measure_peaks() as p: ...`` — `p` holds the peaks of the block once it exits."""
    peaks = MemoryPeaks()
    reset_peaks(device)
    try:
        yield peaks
    finally:
        got = read_peaks(device)
        peaks.cuda_allocated, peaks.cuda_reserved = got.cuda_allocated, got.cuda_reserved
        peaks.host_rss, peaks.device = got.host_rss, got.device
