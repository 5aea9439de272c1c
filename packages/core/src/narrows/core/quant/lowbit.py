"""Blockwise k-bit NormalFloat codes (NF2, NF3; NF4 for comparison) for fused expert stacks,
and MXFP4 stacks kept as a release stores them.

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

MXFP4 (the OCP Microscaling format, gpt-oss's release): 4-bit E2M1 codes, two a byte, the
even weight in the low nibble — NF4's packing — and one E8M0 scale per 32 weights, a uint8
``s`` standing for 2^(s - 127), held as stored (1 byte, where NF codes keep a float32
absmax): 4.25 bits a weight. The release stores a stack [E, in, out] transposed, as
[E, out, in] with the blocks along ``in``, so an MXFP4 `LowbitStack` (``mxfp4=True``) lays
its codes over the stack with its last two dimensions swapped, and dequantising writes each
value to its place in the stack's own layout. Each value, an E2M1 level times a power of
two, is a bf16 value: the stack dequantises exactly.
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
    "FP4_E2M1",
    "MXFP4_BLOCK",
    "SCHEMES",
    "LowbitStack",
    "dequantize",
    "dequantize_reference",
    "e8m0_scales",
    "normal_float_levels",
    "pack",
    "quantize",
    "triton_available",
    "unpack",
]

BLOCK = 64  # weights per absmax: QLoRA's block size
SCHEMES = {"nf2": 2, "nf3": 3, "nf4": 4}  # scheme name -> bits a code
MXFP4_BLOCK = 32  # weights per E8M0 scale
# E2M1 by code: sign in bit 3, then two exponent bits and one mantissa bit
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
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


_ON_DEVICE: dict[tuple[str, torch.device], Tensor] = {}


def _levels_on(scheme: str, device: torch.device) -> Tensor:
    """A scheme's values by code on `device` (NF: the sorted levels; MXFP4: E2M1's table),
    made once per device (a later call copies nothing, so it may run inside a CUDA graph's
    capture once an eager call has run)."""
    key = (scheme, device)
    if key not in _ON_DEVICE:
        table = (
            torch.tensor(FP4_E2M1, dtype=torch.float32)
            if scheme == "mxfp4"
            else normal_float_levels(SCHEMES[scheme])
        )
        _ON_DEVICE[key] = table.to(device)
    return _ON_DEVICE[key]


def e8m0_scales(exponents: Tensor) -> Tensor:
    """E8M0 scale bytes ``s`` as float32 2^(s - 127), exactly (s = 0, 2^-127, is a float32
    subnormal; 255, NaN in the format, does not occur in a release and reads as 2^128 = inf)."""
    bits = exponents.to(torch.int32) << 23  # a float32 of exponent field s and mantissa 0
    return torch.where(exponents == 0, 2.0**-127, bits.view(torch.float32))


def _check(bits: int, block: int) -> None:
    if bits not in SCHEMES.values():
        raise ValueError(f"NormalFloat codes of {bits} bits: narrows builds 2, 3 or 4")
    if block <= 0 or block % 8:
        raise ValueError(
            f"block size {block}: a block must be a positive multiple of 8 weights (one packed word)"
        )


@dataclass(frozen=True)
class LowbitStack:
    """What turns a stack's codes and absmax back into the stack: its bits a code, shape (as
    the model's code sees it), dtype and block size, and whether its codes are MXFP4's (E2M1
    codes, uint8 E8M0 scales, laid over the stack transposed in its last two dimensions).
    ``recipe()`` is its JSON form (a prepared cache keeps it)."""

    bits: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    block: int = BLOCK
    mxfp4: bool = False

    @classmethod
    def of_mxfp4(cls, shape: tuple[int, ...], dtype: torch.dtype) -> LowbitStack:
        """An MXFP4 stack of `shape` [E, in, out] as gpt-oss's release stores it."""
        return cls(4, tuple(shape), dtype, MXFP4_BLOCK, mxfp4=True)

    @property
    def scheme(self) -> str:
        return "mxfp4" if self.mxfp4 else f"nf{self.bits}"

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The shape its codes run over: the stack's, or MXFP4's [E, out, in]."""
        if not self.mxfp4:
            return self.shape
        return (*self.shape[:-2], self.shape[-1], self.shape[-2])

    @property
    def absmax_dtype(self) -> torch.dtype:
        return torch.uint8 if self.mxfp4 else torch.float32

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
        return self.numel // self.block * self.absmax_dtype.itemsize

    def recipe(self) -> dict:
        return {
            "scheme": self.scheme,
            "shape": list(self.shape),
            "dtype": str(self.dtype).removeprefix("torch."),
            "block": self.block,
        }

    @classmethod
    def from_recipe(cls, recipe: dict) -> LowbitStack:
        if recipe["scheme"] == "mxfp4":
            return cls.of_mxfp4(tuple(recipe["shape"]), getattr(torch, recipe["dtype"]))
        return cls(
            SCHEMES[recipe["scheme"]],
            tuple(recipe["shape"]),
            getattr(torch, recipe["dtype"]),
            recipe["block"],
        )

    def check(self, codes: Tensor, absmax: Tensor) -> None:
        """Raise NarrowsError unless `codes` and `absmax` can hold this stack: uint8 codes
        [E, n·bits/8] and absmax [E, n/block] (float32; MXFP4's uint8 exponents), both
        contiguous."""
        _check(self.bits, self.block)
        if self.mxfp4:
            if self.bits != 4 or self.block != MXFP4_BLOCK or len(self.shape) < 3:
                raise NarrowsError(f"an MXFP4 stack is 4-bit codes in blocks of 32 over [E, in, out]: {self}")
            if absmax.dtype != torch.uint8:
                raise NarrowsError(f"an MXFP4 stack's scales are uint8 E8M0 exponents, not {absmax.dtype}")
        elif absmax.dtype != torch.float32:
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
    levels = _levels_on(f"nf{bits}", stack.device)
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
    # where the codes' order puts each value: the stack itself, or MXFP4's transposed view of it
    stored = out.transpose(-1, -2) if stack.mxfp4 else out
    levels = _levels_on(stack.scheme, codes.device)
    per_expert = stack.numel // experts
    step = max(1, _CHUNK // per_expert)
    for start in range(0, experts, step):
        index = unpack(codes[start : start + step], stack.bits).to(torch.int32)
        scale = absmax[start : start + step]
        scale = e8m0_scales(scale) if stack.mxfp4 else scale
        values = levels[index].view(index.shape[0], -1, stack.block) * scale[:, :, None]
        # one rounding to the dtype
        stored[start : start + step] = values.view(index.shape[0], *stack.stored_shape[1:])
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
    return kernel.dequantize_triton(codes, absmax, _levels_on(stack.scheme, codes.device), stack)
