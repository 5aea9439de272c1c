"""The prepared-slab cache: every decoder layer's frozen slab (NF4-quantised or float),
written once into one file, read back by later runs instead of re-quantising — and the
file the disk tier reads from.

Layout: the slabs back to back, each at a 4096-byte aligned offset (page- and O_DIRECT-
aligned), then a JSON footer and a 16-byte trailer (magic, footer length). The footer
holds what makes the file valid for a run: the source checkpoint's identity (file names,
sizes, header hashes, config hash), the settings (dtype, quantisation, block size), the
narrows version, the slot layout of each layer, how to rebuild each 4-bit linear and each
quantised experts module, and a CRC32 per slab. A file whose trailer is missing (truncated, or a write that died), whose
identity or settings differ, or whose slab fails its CRC is refused and rebuilt; it is
never used. The file is written under a temporary name and renamed into place, so an
interrupted or disk-full write leaves nothing that could pass as valid.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from narrows.core import (
    NarrowsError,
    SlabEntry,
    SlabLayout,
    format_bytes,
    frozen_slots,
    is_nf4_linear,
    is_quantized_experts,
    lowbit_stacks,
    nf4_recipe,
)

__all__ = ["FILE_ALIGNMENT", "CacheLayer", "PreparedCache", "SlabCacheWriter", "layer_recipe"]

FILE_ALIGNMENT = 4096
MAGIC = b"NRWSLAB1"
_CHUNK = 64 << 20


def _align(n: int) -> int:
    return -(-n // FILE_ALIGNMENT) * FILE_ALIGNMENT


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def crc32(buffer: Tensor) -> int:
    """CRC32 of a uint8 tensor's bytes (zlib releases the GIL: slabs hash in parallel)."""
    view = memoryview(buffer.numpy())
    crc = 0
    for start in range(0, len(view), _CHUNK):
        crc = zlib.crc32(view[start : start + _CHUNK], crc)
    return crc


def layer_recipe(layer: nn.Module) -> dict[str, dict[str, Any]]:
    """How to rebuild each bitsandbytes 4-bit linear and each quantised experts module of
    `layer` from its slots alone (an experts module's entry has ``stacks``, its NF4 ones,
    and ``lowbit``, its NF3/NF2 ones)."""
    out = {}
    for name, m in layer.named_modules():
        if is_quantized_experts(m):
            out[name] = {
                "stacks": {s: nf4_recipe(m._parameters[s].quant_state) for s in m._nf4_stacks},
                "lowbit": {s: stack.recipe() for s, stack in lowbit_stacks(m).items()},
            }
        if not is_nf4_linear(m):
            continue
        out[name] = {
            "in": m.in_features,
            "out": m.out_features,
            "bias": m.bias is not None,
            "compute_dtype": _dtype_name(m.compute_dtype),
            **nf4_recipe(m.weight.quant_state),
        }
    return out


@dataclass(frozen=True)
class CacheLayer:
    """One layer's slab in the file: contiguous at `offset`, or — for a pre-quantised
    checkpoint, whose packed weights and statistics are already in the user's files —
    `parts`: per slab entry, the file (None: this cache file) and offset its bytes are at."""

    offset: int  # in the cache file (-1 when the slab is in parts)
    layout: SlabLayout
    crc: int
    recipe: dict[str, dict[str, Any]]
    parts: tuple[tuple[int, str | None, int], ...] | None = None

    def to_json(self) -> dict[str, Any]:
        entries = [
            [e.name, e.offset, e.nbytes, list(e.shape), list(e.stride), _dtype_name(e.dtype)]
            for e in self.layout.entries
        ]
        return {
            "offset": self.offset,
            "nbytes": self.layout.nbytes,
            "crc32": self.crc,
            "entries": entries,
            "recipe": self.recipe,
            "parts": [list(p) for p in self.parts] if self.parts else None,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> CacheLayer:
        entries = tuple(
            SlabEntry(n, o, b, tuple(s), tuple(st), getattr(torch, t)) for n, o, b, s, st, t in d["entries"]
        )
        parts = tuple(tuple(p) for p in d["parts"]) if d.get("parts") else None
        return cls(d["offset"], SlabLayout(entries, d["nbytes"]), d["crc32"], d["recipe"], parts)

    def end(self) -> int:
        """One past the last byte this layer uses in the cache file."""
        if self.parts is None:
            return self.offset + self.layout.nbytes
        entries = self.layout.entries
        return max((off + entries[k].nbytes for k, f, off in self.parts if f is None), default=0)

    def assemble(self, buffer: Tensor, cache_file: Path, *, drop: bool = False) -> None:
        """Read the slab into `buffer` from wherever its parts are. `drop`: tell the kernel
        the pages will not be needed again (the disk tier's reads should not quietly turn
        into page cache that a smaller machine would not have)."""
        view = memoryview(buffer[: self.layout.nbytes].numpy())
        if self.parts is None:
            _pread_into(cache_file, self.offset, view, drop)
            return
        for k, file, off in self.parts:
            e = self.layout.entries[k]
            if e.nbytes:
                _pread_into(
                    Path(file) if file else cache_file, off, view[e.offset : e.offset + e.nbytes], drop
                )

    def views(self, cache_file: Path) -> list[Tensor]:
        """Memory maps of the slab's bytes where they lie on disk, one tensor per entry."""
        if self.parts is None:
            return self.layout.views(map_region(cache_file, self.offset, self.layout.nbytes))
        ends: dict[str | None, int] = {}  # each file is looked up once per layer, not once per tensor
        for k, file, off in self.parts:
            ends[file] = max(ends.get(file, 0), off + self.layout.entries[k].nbytes)
        whole = {f: _whole_file(Path(f) if f else cache_file, end) for f, end in ends.items()}
        out: list[Tensor] = []
        for k, file, off in self.parts:
            e = self.layout.entries[k]
            if not e.nbytes:
                out.append(torch.empty_strided(e.shape, e.stride, dtype=e.dtype))
                continue
            out.append(whole[file][off : off + e.nbytes].view(e.dtype).as_strided(e.shape, e.stride))
        return out


def _pread_into(path: Path, offset: int, view: memoryview, drop: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        got = 0
        while got < len(view):
            n = os.preadv(fd, [view[got:]], offset + got)
            if n <= 0:
                raise NarrowsError(
                    f"{path} ended while reading a prepared slab; delete the cache to rebuild it"
                )
            got += n
        if drop and hasattr(os, "posix_fadvise"):  # the disk tier: keep the page cache out of it
            os.posix_fadvise(fd, offset, len(view), os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class SlabCacheWriter:
    """Appends layer slabs to a temporary file; `commit` writes the footer and renames it."""

    def __init__(self, path: Path, meta: dict[str, Any]):
        self.path = Path(path)
        self.meta = meta
        self.layers: list[CacheLayer] = []
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            self.file = open(self.tmp, "wb")  # noqa: SIM115 (kept open across add() calls; commit/abort close it)
        except OSError as e:
            raise NarrowsError(
                f"cannot write the prepared cache in {self.path.parent}: {e.strerror}. "
                "Give a writable --cache folder."
            ) from None

    def check_space(self, expected_bytes: int) -> None:
        free = shutil.disk_usage(self.path.parent).free
        if free < expected_bytes:
            self.abort()
            raise NarrowsError(
                f"the prepared cache needs about {format_bytes(expected_bytes)} in {self.path.parent}, which has "
                f"{format_bytes(free)} free. Free space there, or point --cache at a larger disk."
            )

    def add(
        self,
        layer: nn.Module,
        layout: SlabLayout,
        slab: Tensor,
        sources: dict[int, tuple[str, int]] | None = None,
    ) -> CacheLayer:
        """Append a layer's slab. `sources` (entry index -> file, offset) names entries
        whose bytes already lie verbatim in the user's checkpoint: only the others are
        written, and the layer is recorded in parts."""
        offset = self.file.tell()
        parts = None
        try:
            if not sources:
                self.file.write(memoryview(slab[: layout.nbytes].numpy()))
            else:
                parts = []
                for k, e in enumerate(layout.entries):
                    if k in sources:
                        parts.append((k, *sources[k]))
                    else:
                        parts.append((k, None, self.file.tell()))
                        self.file.write(memoryview(slab[e.offset : e.offset + e.nbytes].numpy()))
            end = self.file.tell()
            self.file.write(b"\0" * (_align(end) - end))
        except OSError as e:
            self.abort()
            raise NarrowsError(
                f"writing the prepared cache {self.path} failed after {format_bytes(offset)}: "
                f"{e.strerror}. Free space there or use another --cache folder."
            ) from None
        entry = CacheLayer(
            offset if parts is None else -1,
            layout,
            crc32(slab[: layout.nbytes]),
            layer_recipe(layer),
            tuple(parts) if parts is not None else None,
        )
        self.layers.append(entry)
        return entry

    def views(self, entry: CacheLayer) -> list[Tensor]:
        """A layer already written, mapped where its bytes lie (the file being written, or
        the checkpoint), one tensor per entry."""
        self.file.flush()
        return entry.views(self.tmp)

    def home(self, entry: CacheLayer) -> Tensor | None:
        """A contiguous layer's slab as one map of the file being written (None in parts)."""
        self.file.flush()
        return None if entry.parts else map_region(self.tmp, entry.offset, entry.layout.nbytes)

    def commit(self) -> Path:
        footer = json.dumps({**self.meta, "layers": [e.to_json() for e in self.layers]}).encode()
        try:
            self.file.write(footer)
            self.file.write(MAGIC + struct.pack("<Q", len(footer)))
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            os.replace(self.tmp, self.path)
        except OSError as e:
            self.abort()
            raise NarrowsError(f"writing the prepared cache {self.path} failed: {e.strerror}") from None
        return self.path

    def abort(self) -> None:
        if not self.file.closed:
            self.file.close()
        self.tmp.unlink(missing_ok=True)


class PreparedCache:
    """A prepared-slab file, opened and checked against what the run expects."""

    def __init__(self, path: Path, meta: dict[str, Any], layers: list[CacheLayer]):
        self.path = path
        self.meta = meta
        self.layers = layers

    @classmethod
    def open(cls, path: Path, expect: dict[str, Any]) -> tuple[PreparedCache | None, str]:
        """(cache, "") when the file is valid for `expect` (footer fields that must match),
        else (None, why not). Slab CRCs are checked by `verify` as the slabs are read."""
        path = Path(path)
        if not path.is_file():
            return None, "no prepared cache yet"
        size = path.stat().st_size
        with open(path, "rb") as f:
            if size < 16:
                return None, "the cache file is truncated"
            f.seek(size - 16)
            trailer = f.read(16)
            if trailer[:8] != MAGIC:
                return None, "the cache file is truncated or not a narrows slab cache"
            (n,) = struct.unpack("<Q", trailer[8:])
            if n > size - 16:
                return None, "the cache file is truncated"
            f.seek(size - 16 - n)
            try:
                meta = json.loads(f.read(n))
            except ValueError:
                return None, "the cache footer is damaged"
        for key, value in expect.items():
            if meta.get(key) != value:
                return None, f"its {key} differs from this run's (the source or settings changed)"
        layers = [CacheLayer.from_json(d) for d in meta.pop("layers")]
        if max((e.end() for e in layers), default=0) > size - 16 - n:
            return None, "the cache file is truncated"
        return cls(path, meta, layers), ""

    def read_into(self, index: int, buffer: Tensor) -> None:
        """Read layer `index`'s slab into `buffer` (uint8, at least the slab's size)."""
        self.layers[index].assemble(buffer, self.path)

    def verify(self, indices: list[int], read: Callable[[int], Tensor]) -> list[int]:
        """Indices whose slab (as returned by ``read(i)``) fails its CRC; hashed in parallel."""

        def bad(i: int) -> bool:
            return crc32(read(i)[: self.layers[i].layout.nbytes]) != self.layers[i].crc

        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            return [i for i, b in zip(indices, pool.map(bad, indices)) if b]

    def views(self, index: int) -> list[Tensor]:
        """Layer `index`'s entries as read-only memory maps of where they lie on disk."""
        return self.layers[index].views(self.path)

    def mapped(self, index: int) -> Tensor | None:
        """Layer `index`'s slab as one read-only map of the cache file (None when it is in parts)."""
        e = self.layers[index]
        return None if e.parts else map_region(self.path, e.offset, e.layout.nbytes)


def map_region(path: Path, offset: int, nbytes: int) -> Tensor:
    """A read-only memory map of `nbytes` at `offset` (page-aligned) of a file, as a uint8
    tensor: a valid home for the slots of a disk-tier layer that costs no host memory
    until someone reads it. It stays valid when the file is renamed."""
    return _whole_file(Path(path), offset + nbytes)[offset : offset + nbytes]


_MAPS: dict[tuple[str, int, int], Tensor] = {}


def _whole_file(path: Path, at_least: int) -> Tensor:
    """One read-only map per file (and size: a file still being written is mapped again as it
    grows); thousands of per-tensor maps would each cost an open and a seek."""
    st = path.stat()
    key = (str(path.resolve()), st.st_ino, st.st_size)
    mapped = _MAPS.get(key)
    if mapped is None or mapped.numel() < at_least:
        import numpy as np

        with _quiet_readonly():
            mapped = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="r"))
        _MAPS[key] = mapped
    return mapped


class _quiet_readonly:
    """torch warns that a read-only numpy array becomes a writable tensor; nothing writes it."""

    def __enter__(self) -> None:
        import warnings

        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

    def __exit__(self, *exc: object) -> None:
        self._w.__exit__(*exc)


def frozen_layer_slots(layer: nn.Module, prefix: str = ""):
    """The slots of a loaded base layer, frozen first (a loaded float parameter trains by
    default; in a base narrows streams nothing outside the adapters does)."""
    layer.requires_grad_(False)
    return frozen_slots(layer, prefix=prefix)
