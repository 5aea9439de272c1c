"""A user's checkpoint folder, read from its headers: which tensors exist, in which
shard, with which shape and dtype, and how (if at all) it is quantised.

Everything here reads only the safetensors headers (a few KB per shard), so every check
that can refuse a folder — a shard named in the index that is missing, a truncated file,
a quantisation narrows cannot load — runs before a single weight is read. Weights are
then read tensor by tensor through ``safe_open`` (memory-mapped), never a whole shard.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from ..errors import NarrowsError

__all__ = ["BNB_STATS", "CheckpointFolder", "TensorInfo"]

# what transformers writes beside a pre-quantised bitsandbytes 4-bit weight
BNB_STATS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
_BNB_STATE = ("quant_state.bitsandbytes__nf4", "quant_state.bitsandbytes__fp4")
# bytes per element of each safetensors dtype code whose elements are whole bytes
_ITEMSIZE = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
    "C64": 8,
}


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str  # safetensors dtype code: BF16, F32, U8, ...
    shape: tuple[int, ...]
    offset: int  # from the start of the file
    nbytes: int


@dataclass(frozen=True)
class _Shard:
    path: Path
    size: int
    mtime_ns: int  # a weight re-saved in place keeps the header; the modification time moves
    header_sha256: str
    tensors: dict[str, TensorInfo] = field(repr=False)


def _read_header(path: Path) -> _Shard:
    """Parse one safetensors header; a file too short for what it declares is refused."""
    stat = path.stat()
    size = stat.st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise NarrowsError(f"{path} is not a safetensors file (only {size} bytes); re-download it")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, 100 << 20):
            raise NarrowsError(
                f"{path} is truncated or not a safetensors file (header of {n} bytes "
                f"declared, file is {size} bytes); re-download it"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise NarrowsError(f"{path}: unreadable safetensors header ({e}); re-download it") from None
    header.pop("__metadata__", None)
    tensors, end = {}, 0
    for name, meta in header.items():
        start, stop = meta["data_offsets"]
        end = max(end, stop)
        info = TensorInfo(path, meta["dtype"], tuple(meta["shape"]), 8 + n + start, stop - start)
        size_of = _ITEMSIZE.get(info.dtype)  # another dtype is refused when read (loader.read_tensor)
        if size_of is not None and math.prod(info.shape) * size_of != info.nbytes:
            raise NarrowsError(
                f"{path}: tensor {name!r} is declared {info.dtype} of shape {list(info.shape)}, which is "
                f"{math.prod(info.shape) * size_of} bytes, but its data spans {info.nbytes} bytes; the header "
                "does not match the data (an edited or damaged file): re-download or re-save it"
            )
        tensors[name] = info
    if 8 + n + end > size:
        raise NarrowsError(
            f"{path} is truncated: its header declares {8 + n + end} bytes of data, the file has {size}. "
            "Re-download or re-save it."
        )
    return _Shard(path, size, stat.st_mtime_ns, hashlib.sha256(raw).hexdigest(), tensors)


class CheckpointFolder:
    """A Hugging Face model folder: ``config.json`` plus ``model.safetensors`` or shards
    named by ``model.safetensors.index.json``."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path).expanduser()
        config = self.path / "config.json"
        if not config.is_file():
            raise NarrowsError(
                f"{str(self.path)!r} has no config.json; it is not a Hugging Face model folder."
            )
        self.config: dict[str, Any] = json.loads(config.read_text())
        self.shards = [_read_header(p) for p in self._shard_paths()]
        self.tensors: dict[str, TensorInfo] = {}
        for shard in self.shards:
            self.tensors.update(shard.tensors)
        # MXFP4 stacks (gpt-oss's release): each pair of packed tensors stands in `tensors` as
        # the float stack it decodes to; `read_tensor` decodes it
        self.packed: dict[str, tuple[TensorInfo, TensorInfo]] = {}
        if (self.config.get("quantization_config") or {}).get("quant_method") == "mxfp4":
            self._mxfp4_as_float()

    def _mxfp4_as_float(self) -> None:
        """Every ``X_blocks`` [E, out, in/32, 16] (two FP4 codes a byte) with its ``X_scales``
        [E, out, in/32] (a power of two each, E8M0) becomes tensor ``X`` [E, in, out] in bf16,
        the layout transformers' gpt-oss experts hold (its `convert_moe_packed_tensors`)."""
        for name in [n for n in self.tensors if n.endswith("_blocks")]:
            stack = name.removesuffix("_blocks")
            blocks, scales = self.tensors.pop(name), self.tensors.pop(f"{stack}_scales", None)
            if scales is None:
                raise NarrowsError(
                    f"{self.path}: MXFP4 tensor {name!r} has no {stack + '_scales'!r} beside it; the checkpoint "
                    "is incomplete: fetch it again"
                )
            if (
                blocks.dtype != "U8"
                or scales.dtype != "U8"
                or blocks.shape[:-1] != scales.shape
                or len(scales.shape) != 3
            ):
                raise NarrowsError(
                    f"{self.path}: {name!r} {blocks.dtype} {list(blocks.shape)} and its scales {scales.dtype} "
                    f"{list(scales.shape)} are not MXFP4 expert stacks (uint8 [E, out, in/32, 16] and [E, out, in/32])"
                )
            experts, rows, groups = scales.shape
            cols = groups * blocks.shape[-1] * 2
            self.tensors[stack] = TensorInfo(
                blocks.file, "BF16", (experts, cols, rows), -1, experts * rows * cols * 2
            )
            self.packed[stack] = (blocks, scales)

    def _shard_paths(self) -> list[Path]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            names = sorted(set(weight_map.values()))
            missing = [n for n in names if not (self.path / n).is_file()]
            if missing:
                raise NarrowsError(
                    f"{index} names {len(missing)} shard(s) that are not in the folder (first: {missing[0]!r}); "
                    "the download is incomplete: fetch the missing files again."
                )
            return [self.path / n for n in names]
        single = self.path / "model.safetensors"
        if single.is_file():
            return [single]
        others = sorted(self.path.glob("*.safetensors"))
        if others:
            return others
        bins = sorted(self.path.glob("*.bin"))
        hint = (
            " It holds PyTorch .bin files: re-save it with save_pretrained(safe_serialization=True)."
            if bins
            else ""
        )
        raise NarrowsError(f"{self.path} holds no *.safetensors weights.{hint}")

    def check_model_type(self) -> None:
        """Refuse a config.json whose model_type this transformers cannot build, before any
        weight is read (transformers would say so only when building the model)."""
        kind = self.config.get("model_type")
        if kind is None:
            return  # transformers guesses from the folder's name, and says so if it cannot
        import transformers
        from transformers import CONFIG_MAPPING

        if not isinstance(kind, str) or kind not in CONFIG_MAPPING:
            raise NarrowsError(
                f"{self.path / 'config.json'}: model_type {kind!r} is not a model type transformers "
                f"{transformers.__version__} knows. Install a transformers that supports it "
                "(pip install -U transformers), or correct model_type in config.json if it is wrong."
            )

    # --- quantisation --------------------------------------------------------------------
    @cached_property
    def quantization(self) -> dict[str, Any] | None:
        """``quantization_config`` of config.json (None for a float checkpoint)."""
        return self.config.get("quantization_config")

    @cached_property
    def prequantized(self) -> dict[str, str]:
        """Weight name -> its quant-state key, for every bitsandbytes 4-bit weight."""
        out = {}
        for name in self.tensors:
            for tail in _BNB_STATE:
                if name.endswith("." + tail):
                    out[name[: -len(tail) - 1]] = name
        return out

    @property
    def asks_nf4(self) -> bool:
        """config.json asks for bitsandbytes NF4 (transformers would quantise a float folder on load)."""
        q = self.quantization or {}
        return q.get("quant_method") == "bitsandbytes" and bool(q.get("load_in_4bit"))

    def check_quantization(self) -> str | None:
        """ "nf4" when the folder holds pre-quantised NF4 weights, None for float weights;
        anything narrows cannot load is refused."""
        q = self.quantization
        if q is None and not self.prequantized:
            return None
        method = (q or {}).get("quant_method", "bitsandbytes")
        if method == "mxfp4":
            if not self.packed:
                raise NarrowsError(
                    f"{self.path}: config.json says MXFP4 but the folder holds no *_blocks / *_scales pairs; "
                    "fetch the folder again, or remove quantization_config from a float one"
                )
            return None  # its MXFP4 stacks read as the bf16 they decode to, exactly
        if method != "bitsandbytes":
            raise NarrowsError(
                f"{self.path} is quantised with {method!r}; narrows loads float (bf16/fp16/fp32) safetensors, "
                "bitsandbytes 4-bit NF4 checkpoints and gpt-oss's MXFP4 experts. Use the float release of this model."
            )
        if q is not None and (q.get("load_in_8bit") or not q.get("load_in_4bit", True)):
            raise NarrowsError(
                f"{self.path} is a bitsandbytes 8-bit (int8) checkpoint; narrows loads 4-bit NF4 or float "
                "checkpoints. Use the float release (narrows quantises it to NF4 with --quant nf4)."
            )
        for weight, state in self.prequantized.items():
            if not state.endswith("nf4"):
                raise NarrowsError(
                    f"{self.path}: tensor {weight!r} is bitsandbytes FP4; narrows loads NF4 "
                    "(bnb_4bit_quant_type='nf4'). Use an NF4 or a float checkpoint."
                )
            missing = [s for s in ("absmax", "quant_map") if f"{weight}.{s}" not in self.tensors]
            if missing:
                raise NarrowsError(
                    f"{self.path}: 4-bit tensor {weight!r} has no {missing[0]!r} beside it; "
                    "the checkpoint is incomplete"
                )
        if q is not None and q.get("bnb_4bit_quant_type", "nf4") != "nf4":
            raise NarrowsError(
                f"{self.path}: config.json asks for bitsandbytes {q['bnb_4bit_quant_type']!r}; "
                "narrows loads NF4 (bnb_4bit_quant_type='nf4') or float checkpoints."
            )
        return "nf4" if self.prequantized else None

    # --- identity ------------------------------------------------------------------------
    def identity(self) -> dict[str, Any]:
        """What makes this checkpoint this checkpoint: file names, sizes, modification times,
        header hashes and the config. A cache built from it is valid only while this is
        unchanged. (Bytes rewritten in place with the old modification time restored would
        pass; hashing every weight on every start would cost a full read of the checkpoint.)"""
        return {
            "files": [[s.path.name, s.size, s.mtime_ns, s.header_sha256] for s in self.shards],
            "config_sha256": hashlib.sha256(json.dumps(self.config, sort_keys=True).encode()).hexdigest(),
        }
