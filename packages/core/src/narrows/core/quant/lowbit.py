"""Blockwise k-bit NormalFloat codes (NF2, NF3; NF4 for comparison) for fused expert stacks.

Invariant: a stack [E, ...] quantised here dequantises to ``levels(k)[code] · absmax``,
multiplied in float32 and rounded once to the stack's dtype — by `dequantize_reference`
and by the Triton kernel (`lowbit_kernel.py`) alike, bit for bit — and each block of
`BLOCK` weights lies inside one expert, so expert e quantised alone gives slice e of the
stack's codes and scales.

The levels are QLoRA's NormalFloat (Dettmers et al., "QLoRA: Efficient Finetuning of
Quantized LLMs", arXiv:2305.14314, section 3) at k bits: quantiles of N(0, 1), 2^(k-1)
of them for the positive half and 2^(k-1) - 1 for the negative one, joined at an exact
zero and scaled to end at -1 and 1. Each block keeps its absolute maximum in float32 (no
double quantisation) and each weight the index of the level nearest its value over the
block's absmax. Storage per weight: k bits of code and 32 / `BLOCK` bits of scale (NF2:
2.5 bits, NF3: 3.5, NF4: 4.5).

Packing: every 8 consecutive codes of an expert form one k-byte little-endian word, code
j in bits [k·j, k·j + k) — 4 codes a byte for NF2, 8 codes in 3 bytes for NF3 (a code may
straddle two bytes), 2 a byte for NF4 (low nibble first, unlike bitsandbytes). A block of
64 weights is then 8·k whole bytes, so blocks, and experts, start on a byte.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import NarrowsError
from ..optional import is_available, require

__all__ = [
    "BLOCK",
    "SCHEMES",
    "LowbitStack",
    "dequantize",
    "dequantize_reference",
    "normal_float_levels",
    "pack",
    "quantize",
    "triton_available",
    "unpack",
]

BLOCK = 64  # weights per absmax: QLoRA's block size
SCHEMES = {"nf2": 2, "nf3": 3, "nf4": 4}  # scheme name -> bits a code
_CHUNK = 1 << 24  # weights quantised or dequantised at once by the PyTorch paths (bounds their temporaries)


@functools.cache
def _levels(bits: int) -> tuple[float, ...]:
    if bits not in SCHEMES.values():
        raise ValueError(f"NormalFloat codes of {bits} bits: narrows builds 2, 3 or 4")
    n = 2**bits
    # The outermost quantile sits at probability `offset`: bitsandbytes' NF4 table (the one
    # QLoRA published) takes 1 - (1/(2·15) + 1/(2·16)) / 2, halfway between the centres of the
    # outermost of 15 and of 16 equal-probability bins; with 2^k for 16 it gives the k-bit type
    # (at k = 4 bitsandbytes' table to within 2.5e-7, its offset being written to 7 digits).
    offset = 1 - (1 / (2 * (n - 1)) + 1 / (2 * n)) / 2
    normal = torch.distributions.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0)
    positive = normal.icdf(torch.linspace(offset, 0.5, n // 2 + 1, dtype=torch.float64)[:-1])
    negative = -normal.icdf(torch.linspace(offset, 0.5, n // 2, dtype=torch.float64)[:-1])
    levels = torch.cat([negative, torch.zeros(1, dtype=torch.float64), positive]).sort().values
    return tuple((levels / levels.max()).float().tolist())


def normal_float_levels(bits: int) -> Tensor:
    """The 2^bits NormalFloat levels, sorted, float32: -1 first, 1 last, one of them 0."""
    return torch.tensor(_levels(bits), dtype=torch.float32)


_ON_DEVICE: dict[tuple[int, torch.device], Tensor] = {}


def _levels_on(bits: int, device: torch.device) -> Tensor:
    """The levels on `device`, made once per device (a later call copies nothing, so it may
    run inside a CUDA graph's capture once an eager call has run)."""
    key = (bits, device)
    if key not in _ON_DEVICE:
        _ON_DEVICE[key] = normal_float_levels(bits).to(device)
    return _ON_DEVICE[key]


def _check(bits: int, block: int) -> None:
    if bits not in SCHEMES.values():
        raise ValueError(f"NormalFloat codes of {bits} bits: narrows builds 2, 3 or 4")
    if block <= 0 or block % 8:
        raise ValueError(
            f"block size {block}: a block must be a positive multiple of 8 weights (one packed word)"
        )


@dataclass(frozen=True)
class LowbitStack:
    """What turns a stack's codes and absmax back into the stack: its bits a code, shape,
    dtype and block size. ``recipe()`` is its JSON form (a prepared cache keeps it)."""

    bits: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    block: int = BLOCK

    @property
    def scheme(self) -> str:
        return f"nf{self.bits}"

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def code_bytes(self) -> int:
        return self.numel * self.bits // 8

    @property
    def absmax_bytes(self) -> int:
        return self.numel // self.block * 4

    def recipe(self) -> dict:
        return {
            "scheme": self.scheme,
            "shape": list(self.shape),
            "dtype": str(self.dtype).removeprefix("torch."),
            "block": self.block,
        }

    @classmethod
    def from_recipe(cls, recipe: dict) -> LowbitStack:
        return cls(
            SCHEMES[recipe["scheme"]],
            tuple(recipe["shape"]),
            getattr(torch, recipe["dtype"]),
            recipe["block"],
        )

    def check(self, codes: Tensor, absmax: Tensor) -> None:
        """Raise NarrowsError unless `codes` and `absmax` can hold this stack: uint8 codes
        [E, n·bits/8] and float32 absmax [E, n/block], both contiguous."""
        _check(self.bits, self.block)
        if absmax.dtype != torch.float32:
            raise NarrowsError(
                f"a {self.scheme} expert stack's absmax is {absmax.dtype}, not float32: something cast the "
                "model's float parameters (model.to(dtype)?) after quantisation; quantise after casting"
            )
        experts = self.shape[0]
        per_expert = self.numel // experts
        want_codes = (experts, per_expert * self.bits // 8)
        want_absmax = (experts, per_expert // self.block)
        if (
            codes.dtype != torch.uint8
            or tuple(codes.shape) != want_codes
            or tuple(absmax.shape) != want_absmax
        ):
            raise NarrowsError(
                f"a {self.scheme} stack {list(self.shape)} needs uint8 codes {list(want_codes)} and absmax "
                f"{list(want_absmax)}; got {codes.dtype} {list(codes.shape)} and {list(absmax.shape)}"
            )
        if not (codes.is_contiguous() and absmax.is_contiguous()):
            raise NarrowsError(f"a {self.scheme} stack's codes and absmax must be contiguous")


def pack(codes: Tensor, bits: int) -> Tensor:
    """Codes (integers below 2^bits) [..., n], n a multiple of 8 → uint8 [..., n·bits/8]."""
    lead = codes.shape[:-1]
    groups = codes.reshape(*lead, -1, 8).to(torch.int32)  # (..., n/8, 8)
    shifts = bits * torch.arange(8, dtype=torch.int32, device=codes.device)
    words = (groups << shifts).sum(-1)  # disjoint bit fields: the sum is their OR; < 2^24
    byte_shifts = 8 * torch.arange(bits, dtype=torch.int32, device=codes.device)
    packed = (words[..., None] >> byte_shifts) & 0xFF  # (..., n/8, bits), little-endian
    return packed.to(torch.uint8).reshape(*lead, -1)


def unpack(packed: Tensor, bits: int) -> Tensor:
    """The inverse of `pack`: uint8 [..., m] → codes uint8 [..., m·8/bits]."""
    lead = packed.shape[:-1]
    words = packed.reshape(*lead, -1, bits).to(torch.int32)  # (..., m/bits, bits)
    byte_shifts = 8 * torch.arange(bits, dtype=torch.int32, device=packed.device)
    words = (words << byte_shifts).sum(-1)  # (..., m/bits)
    shifts = bits * torch.arange(8, dtype=torch.int32, device=packed.device)
    codes = (words[..., None] >> shifts) & (2**bits - 1)  # (..., m/bits, 8)
    return codes.to(torch.uint8).reshape(*lead, -1)


def quantize(stack: Tensor, bits: int, *, block: int = BLOCK) -> tuple[Tensor, Tensor]:
    """`stack` [E, ...] as (codes uint8 [E, n·bits/8], absmax float32 [E, n/block]), n the
    weights of one expert: each weight's code names the level nearest its value over its
    block's absmax (a value halfway between two levels, as float32 sees it, takes the lower;
    an all-zero block has absmax 0 and zero codes). An expert whose weights are not whole
    blocks is refused: its last block would straddle the next expert."""
    _check(bits, block)
    if stack.dim() < 2:
        raise ValueError(f"quantize takes a stack [experts, ...]; got shape {list(stack.shape)}")
    experts, per_expert = stack.shape[0], stack[0].numel()
    if per_expert % block:
        raise NarrowsError(
            f"a stack {list(stack.shape)}: one expert's {per_expert} weights are not a multiple of the "
            f"block size {block}, so its blocks would straddle two experts"
        )
    levels = _levels_on(bits, stack.device)
    midpoints = (levels[1:] + levels[:-1]) / 2
    blocks = stack.reshape(experts, per_expert // block, block)
    codes = torch.empty(experts, per_expert * bits // 8, dtype=torch.uint8, device=stack.device)
    absmax = torch.empty(experts, per_expert // block, dtype=torch.float32, device=stack.device)
    step = max(1, _CHUNK // per_expert)
    for start in range(0, experts, step):
        x = blocks[start : start + step].float()  # (e, blocks, block)
        scale = x.abs().amax(-1)
        absmax[start : start + step] = scale
        normalised = x / torch.where(scale > 0, scale, 1.0)[..., None]
        index = torch.bucketize(normalised, midpoints, out_int32=True)  # nearest level; ties go down
        codes[start : start + step] = pack(index.reshape(index.shape[0], -1), bits)
    return codes, absmax


def dequantize_reference(codes: Tensor, absmax: Tensor, stack: LowbitStack) -> Tensor:
    """The stack `codes` and `absmax` encode, in PyTorch (any device): the spec the Triton
    kernel is held to."""
    stack.check(codes, absmax)
    experts = stack.shape[0]
    out = torch.empty(stack.shape, dtype=stack.dtype, device=codes.device)
    flat = out.view(experts, -1)
    levels = _levels_on(stack.bits, codes.device)
    step = max(1, _CHUNK // flat.shape[1])
    for start in range(0, experts, step):
        index = unpack(codes[start : start + step], stack.bits).to(torch.int32)
        values = levels[index].view(index.shape[0], -1, stack.block) * absmax[start : start + step, :, None]
        flat[start : start + step] = values.view(index.shape[0], -1)  # one rounding to the dtype
    return out


@functools.cache
def _kernel():
    """The Triton kernel's module (`lowbit_kernel`), or None where Triton is missing or does
    not import (the reference then serves CUDA too)."""
    if not is_available("triton"):
        return None
    try:
        from . import lowbit_kernel
    except Exception:
        return None
    return lowbit_kernel


def triton_available() -> bool:
    """Whether the Triton kernel can run (it runs on CUDA tensors)."""
    return _kernel() is not None


def dequantize(codes: Tensor, absmax: Tensor, stack: LowbitStack, *, impl: str = "auto") -> Tensor:
    """The stack `codes` and `absmax` encode: by the Triton kernel (``impl="triton"``; on CUDA
    where Triton is installed, by default) or the PyTorch reference (``"torch"``), with the
    same bits either way."""
    if impl == "auto":
        impl = "triton" if codes.is_cuda and triton_available() else "torch"
    if impl == "torch":
        return dequantize_reference(codes, absmax, stack)
    if impl != "triton":
        raise ValueError(f"impl={impl!r}: 'auto', 'torch' or 'triton'")
    stack.check(codes, absmax)
    kernel = _kernel()
    if kernel is None:
        require("triton", "the Triton dequantisation of NF2/NF3 expert stacks")  # says how to install it
        from . import lowbit_kernel as kernel  # installed but failing: let its import error show
    return kernel.dequantize_triton(codes, absmax, _levels_on(stack.bits, codes.device), stack)
