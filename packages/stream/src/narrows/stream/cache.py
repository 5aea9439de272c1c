"""The prepared-slab cache: every decoder layer's frozen slab (NF4-quantised or float),
written once into one file, read back by later runs instead of re-quantising — and the
file the disk tier reads from.

Layout: the slabs back to back, each at a 4096-byte aligned offset (page- and O_DIRECT-
aligned), then a JSON footer and a 16-byte trailer (magic, footer length). The footer
holds what makes the file valid for a run: the source checkpoint's identity (file names,
sizes, header hashes, config hash), the settings (dtype, quantisation, block size), the
narrows version, the slot layout of each layer, how to rebuild each 4-bit linear, and a
CRC32 per slab. A file whose trailer is missing (truncated, or a write that died), whose
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

from narrows.core import NarrowsError, SlabEntry, SlabLayout, format_bytes, frozen_slots, is_nf4_linear

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
    """How to rebuild each bitsandbytes 4-bit linear of `layer` from its slots alone."""
    out = {}
    for name, m in layer.named_modules():
        if not is_nf4_linear(m):
            continue
        qs = m.weight.quant_state
        out[name] = {
            "in": m.in_features, "out": m.out_features, "bias": m.bias is not None,
            "shape": list(qs.shape), "blocksize": qs.blocksize, "quant_type": qs.quant_type,
            "dtype": _dtype_name(qs.dtype), "compute_dtype": _dtype_name(m.compute_dtype),
            "nested": bool(qs.nested),
            "nested_blocksize": qs.state2.blocksize if qs.nested else None,
            "nested_dtype": _dtype_name(qs.state2.dtype) if qs.nested else None,
        }  # fmt: skip
    return out


@dataclass(frozen=True)
class CacheLayer:
    offset: int  # in the file
    layout: SlabLayout
    crc: int
    recipe: dict[str, dict[str, Any]]

    def to_json(self) -> dict[str, Any]:
        entries = [[e.name, e.offset, e.nbytes, list(e.shape), list(e.stride), _dtype_name(e.dtype)]
                   for e in self.layout.entries]  # fmt: skip
        return {"offset": self.offset, "nbytes": self.layout.nbytes, "crc32": self.crc, "entries": entries,
                "recipe": self.recipe}  # fmt: skip

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> CacheLayer:
        entries = tuple(
            SlabEntry(n, o, b, tuple(s), tuple(st), getattr(torch, t)) for n, o, b, s, st, t in d["entries"]
        )
        return cls(d["offset"], SlabLayout(entries, d["nbytes"]), d["crc32"], d["recipe"])


class SlabCacheWriter:
    """Appends layer slabs to a temporary file; `commit` writes the footer and renames it."""

    def __init__(self, path: Path, meta: dict[str, Any], *, expected_bytes: int | None = None):
        self.path = Path(path)
        self.meta = meta
        self.layers: list[CacheLayer] = []
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            self.file = open(self.tmp, "wb")  # noqa: SIM115 (kept open across add() calls; commit/abort close it)
        except OSError as e:
            raise NarrowsError(f"cannot write the prepared cache in {self.path.parent}: {e.strerror}. "
                               "Give a writable --cache folder.") from None  # fmt: skip
        if expected_bytes is not None:
            self.check_space(expected_bytes)

    def check_space(self, expected_bytes: int) -> None:
        free = shutil.disk_usage(self.path.parent).free
        if free < expected_bytes:
            self.abort()
            raise NarrowsError(
                f"the prepared cache needs about {format_bytes(expected_bytes)} in {self.path.parent}, which has "
                f"{format_bytes(free)} free. Free space there, or point --cache at a larger disk."
            )

    def add(self, layer: nn.Module, layout: SlabLayout, slab: Tensor) -> CacheLayer:
        offset = self.file.tell()
        try:
            self.file.write(memoryview(slab[: layout.nbytes].numpy()))
            self.file.write(b"\0" * (_align(offset + layout.nbytes) - offset - layout.nbytes))
        except OSError as e:
            self.abort()
            raise NarrowsError(f"writing the prepared cache {self.path} failed after {format_bytes(offset)}: "
                               f"{e.strerror}. Free space there or use another --cache folder.") from None  # fmt: skip
        entry = CacheLayer(offset, layout, crc32(slab[: layout.nbytes]), layer_recipe(layer))
        self.layers.append(entry)
        return entry

    def mapped(self, entry: CacheLayer) -> Tensor:
        """A layer already written, mapped from the file being written (see `map_region`)."""
        self.file.flush()
        return map_region(self.tmp, entry.offset, entry.layout.nbytes)

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
        if layers and layers[-1].offset + layers[-1].layout.nbytes > size - 16 - n:
            return None, "the cache file is truncated"
        return cls(path, meta, layers), ""

    def read_into(self, index: int, buffer: Tensor) -> None:
        """Read layer `index`'s slab into `buffer` (uint8, at least the slab's size)."""
        entry = self.layers[index]
        with open(self.path, "rb", buffering=0) as f:
            f.seek(entry.offset)
            view = memoryview(buffer[: entry.layout.nbytes].numpy())
            got = 0
            while got < len(view):
                n = f.readinto(view[got:])
                if not n:
                    raise NarrowsError(f"{self.path} ended while reading layer {index}; delete it to rebuild")
                got += n

    def verify(self, indices: list[int], read: Callable[[int], Tensor]) -> list[int]:
        """Indices whose slab (as returned by ``read(i)``) fails its CRC; hashed in parallel."""

        def bad(i: int) -> bool:
            return crc32(read(i)[: self.layers[i].layout.nbytes]) != self.layers[i].crc

        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            return [i for i, b in zip(indices, pool.map(bad, indices)) if b]

    def mapped(self, index: int) -> Tensor:
        """Layer `index`'s slab as a read-only memory map of the file (see `map_region`)."""
        e = self.layers[index]
        return map_region(self.path, e.offset, e.layout.nbytes)


def map_region(path: Path, offset: int, nbytes: int) -> Tensor:
    """A read-only memory map of `nbytes` at `offset` (page-aligned) of a file, as a uint8
    tensor: a valid home for the slots of a disk-tier layer that costs no host memory
    until someone reads it. It stays valid when the file is renamed."""
    import numpy as np

    array = np.memmap(path, dtype=np.uint8, mode="r", offset=offset, shape=(nbytes,))
    with _quiet_readonly():
        return torch.from_numpy(array)


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
