"""What a run's inputs are, by content: fingerprints of a model (HF folder or GGUF file)
and of data files, and the differences between two fingerprints in words.

Data files, GGUF files and a model folder's non-weight files are hashed whole (sha256). A
safetensors shard is fingerprinted by its size, its header's hash and a sampled hash of its
weights: tensors of at most 64 KiB whole, larger ones as 16 blocks of 4 KiB spread evenly
from first to last byte. A change confined to bytes between the samples goes unseen.
Hashes are remembered per process, keyed by inode, size and change time.

why: docs/design.md#fingerprints
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

__all__ = [
    "SAMPLING",
    "data_fingerprint",
    "differences",
    "file_sha256",
    "model_fingerprint",
    "unsampled",
    "weights_sample_sha256",
]

_BLOCK = 1 << 23
_WHOLE = 64 << 20  # non-weight files of a model folder up to this size are hashed whole
SAMPLES, SAMPLE_BYTES = 16, 4096  # blocks hashed of each safetensors tensor, and their size
SAMPLING = f"every tensor whole up to {SAMPLES * SAMPLE_BYTES >> 10} KiB, else {SAMPLES} blocks of {SAMPLE_BYTES >> 10} KiB evenly spread"
_MEMO: dict[tuple, str] = {}


def _remembered(path: str | os.PathLike, kind: str, compute) -> str:
    """`compute(path)`, remembered per file (inode, size, modification and change time)."""
    st = os.stat(path)
    key = (kind, str(Path(path).absolute()), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key not in _MEMO:
        _MEMO[key] = compute(path)
    return _MEMO[key]


def file_sha256(path: str | os.PathLike) -> str:
    """The sha256 of a file's bytes (remembered per inode, size and change time)."""

    def whole(p) -> str:
        digest = hashlib.sha256()
        with open(p, "rb") as f:
            while chunk := f.read(_BLOCK):
                digest.update(chunk)
        return digest.hexdigest()

    return _remembered(path, "sha256", whole)


def weights_sample_sha256(path: str | os.PathLike) -> str:
    """The sha256 of a safetensors file's weights as sampled (`SAMPLING`): for each tensor in
    name order, its name and its bytes whole (up to ``SAMPLES * SAMPLE_BYTES``) or
    ``SAMPLES`` blocks of ``SAMPLE_BYTES`` at evenly spread offsets, first and last block
    included. A file whose header does not parse is hashed whole."""

    def sampled(p) -> str:
        digest = hashlib.sha256()
        with open(p, "rb") as f:
            fd = f.fileno()
            try:
                (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
                header = json.loads(os.pread(fd, n, 8))
                tensors = sorted((k, v["data_offsets"]) for k, v in header.items() if k != "__metadata__")
            except (struct.error, ValueError, TypeError, KeyError, AttributeError):
                return file_sha256(p)
            for name, (begin, end) in tensors:
                digest.update(name.encode() + b"\0")
                start, size = 8 + n + begin, end - begin
                if size <= SAMPLES * SAMPLE_BYTES:
                    digest.update(os.pread(fd, size, start))
                    continue
                for i in range(SAMPLES):
                    digest.update(
                        os.pread(fd, SAMPLE_BYTES, start + i * (size - SAMPLE_BYTES) // (SAMPLES - 1))
                    )
        return digest.hexdigest()

    return _remembered(path, "weights", sampled)


def _head_sha256(path: Path, nbytes: int) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read(nbytes)).hexdigest()


def _safetensors_header(path: Path) -> str:
    """sha256 of the 8-byte length and the JSON header of a safetensors file."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return hashlib.sha256(head).hexdigest()
        (n,) = struct.unpack("<Q", head)
        return hashlib.sha256(head + f.read(min(n, 100 << 20))).hexdigest()


def _files(folder: Path) -> list[Path]:
    return sorted(
        p
        for p in folder.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )


def model_fingerprint(path: str | os.PathLike) -> dict:
    """A GGUF file: its size and sha256. An HF folder: for every file in it, its size and
    sha256 (safetensors shards: the sha256 of their header and of their weights as sampled,
    `weights_sample_sha256`; other files over 64 MiB: of their first 64 MiB)."""
    path = Path(path).expanduser()
    if path.is_file():
        return {
            "kind": "file",
            "files": {path.name: {"size": path.stat().st_size, "sha256": file_sha256(path)}},
        }
    files = {}
    for p in _files(path):
        name, size = str(p.relative_to(path)), p.stat().st_size
        if p.suffix == ".safetensors":
            files[name] = {
                "size": size,
                "header_sha256": _safetensors_header(p),
                "weights_sample_sha256": weights_sample_sha256(p),
            }
        elif size > _WHOLE:
            files[name] = {"size": size, "head_sha256": _head_sha256(p, _WHOLE)}
        else:
            files[name] = {"size": size, "sha256": file_sha256(p)}
    return {"kind": "folder", "files": files, "weights_sampled": SAMPLING}


def data_fingerprint(path: str | os.PathLike) -> dict:
    """A data file, or every file of a ``save_to_disk`` folder: size and sha256 of the bytes."""
    path = Path(path).expanduser()
    if path.is_file():
        return {
            "kind": "file",
            "files": {path.name: {"size": path.stat().st_size, "sha256": file_sha256(path)}},
        }
    files = {
        str(p.relative_to(path)): {"size": p.stat().st_size, "sha256": file_sha256(p)} for p in _files(path)
    }
    return {"kind": "folder", "files": files}


def differences(old: dict, new: dict) -> list[str]:
    """What differs between two fingerprints, one phrase per file ([] when they match).
    A single file compares by content whatever its name (a renamed copy matches). A record
    made before narrows sampled weights compares by what it holds (`unsampled` names them)."""
    if old.get("kind") != new.get("kind"):
        return [f"it was a {old.get('kind')}, it is now a {new.get('kind')}"]
    a, b = old.get("files", {}), new.get("files", {})
    if old.get("kind") == "file" and len(a) == len(b) == 1:
        a, b = {"the file": next(iter(a.values()))}, {"the file": next(iter(b.values()))}
    said = []
    for name in sorted(set(a) | set(b)):
        if name not in b:
            said.append(f"{name} is gone")
        elif name not in a:
            said.append(f"{name} is new")
        else:
            was, now = a[name], {k: v for k, v in b[name].items() if k in a[name]}
            if was == now:
                continue
            if was.get("size") != now.get("size"):
                said.append(f"{name} changed size ({was.get('size')} → {now.get('size')} bytes)")
            elif was.get("header_sha256") != now.get("header_sha256"):
                said.append(f"{name} has another header (tensor names, dtypes or shapes)")
            elif "weights_sample_sha256" in was:
                said.append(f"{name} has other weights under the same header (sampled: {SAMPLING})")
            else:
                said.append(f"{name} has other content (same size, another sha256)")
    return said


def unsampled(old: dict) -> list[str]:
    """The safetensors files of a model fingerprint recorded before narrows sampled their
    weights: only their size and header can be compared."""
    return sorted(
        n
        for n, f in old.get("files", {}).items()
        if "header_sha256" in f and "weights_sample_sha256" not in f
    )
