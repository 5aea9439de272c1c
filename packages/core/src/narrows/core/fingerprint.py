"""What a run's inputs are, by content: fingerprints of a model (HF folder or GGUF file)
and of data files, and the differences between two fingerprints in words.

A run records these when it starts, so ``--resume`` from any directory finds the same
files or refuses, naming what changed, and a moved file can be named anew when its
content matches. Data files and GGUF files are hashed whole (sha256, read in 8 MiB
blocks: about 1.7 GB/s on a core with SHA extensions, so a 1 GB file costs a second or
two when cached in RAM, its disk read when not). A safetensors shard is identified by
its size and the hash of its header (names, dtypes, shapes, offsets): hashing every
weight of a 70B checkpoint on every start would read 140 GB. Other files of a model
folder (config, index, tokenizer, chat template) are hashed whole.

Hashes are remembered for the life of the process, keyed by the file's inode, size and
change time (which every write moves, whatever the modification time is set back to),
so a file fingerprinted and then read for the token cache is hashed once.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

__all__ = ["data_fingerprint", "differences", "file_sha256", "model_fingerprint"]

_BLOCK = 1 << 23
_WHOLE = 64 << 20  # non-weight files of a model folder up to this size are hashed whole
_MEMO: dict[tuple, str] = {}


def file_sha256(path: str | os.PathLike) -> str:
    """The sha256 of a file's bytes (remembered per inode, size and change time)."""
    st = os.stat(path)
    key = (str(Path(path).absolute()), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key not in _MEMO:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(_BLOCK):
                digest.update(chunk)
        _MEMO[key] = digest.hexdigest()
    return _MEMO[key]


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
    return sorted(p for p in folder.rglob("*") if p.is_file() and not any(
        part.startswith(".") for part in p.relative_to(folder).parts))  # fmt: skip


def model_fingerprint(path: str | os.PathLike) -> dict:
    """A GGUF file: its size and sha256. An HF folder: for every file in it, its size and
    sha256 (safetensors shards: the sha256 of their header; other files over 64 MiB: of
    their first 64 MiB)."""
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
            files[name] = {"size": size, "header_sha256": _safetensors_header(p)}
        elif size > _WHOLE:
            files[name] = {"size": size, "head_sha256": _head_sha256(p, _WHOLE)}
        else:
            files[name] = {"size": size, "sha256": file_sha256(p)}
    return {"kind": "folder", "files": files}


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
    A single file compares by content whatever its name (a renamed copy matches)."""
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
        elif a[name] != b[name]:
            if a[name].get("size") != b[name].get("size"):
                said.append(f"{name} changed size ({a[name].get('size')} → {b[name].get('size')} bytes)")
            elif "header_sha256" in a[name]:
                said.append(f"{name} has another header (tensor names, dtypes or shapes)")
            else:
                said.append(f"{name} has other content (same size, another sha256)")
    return said
