"""Blockwise NormalFloat codes of 2, 3 and 4 bits (`narrows.core.quant.lowbit`): the levels,
the packing, the reference dequantisation against a decoder written another way, each
expert on blocks of its own, the refusals, and the Triton kernel against the reference
(under Triton's CPU interpreter here, on CUDA where there is one)."""

import math
import sys

import pytest
import torch
from torch import Tensor

import narrows.core as nc
from narrows.core.errors import NarrowsError
from narrows.core.quant import lowbit
from narrows.core.quant.lowbit import LowbitStack

BITS = [2, 3, 4]


# --- the levels ---------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", BITS)
def test_levels_are_sorted_normal_quantiles_with_an_exact_zero_and_unit_ends(bits):
    levels = nc.normal_float_levels(bits)
    assert levels.dtype == torch.float32 and levels.shape == (2**bits,)
    assert torch.all(levels[1:] > levels[:-1])
    assert levels[0].item() == -1.0 and levels[-1].item() == 1.0
    assert (levels == 0).sum() == 1
    positive, negative = levels[levels > 0].double(), levels[levels < 0].double()
    assert len(positive) == 2 ** (bits - 1) and len(negative) == 2 ** (bits - 1) - 1  # asymmetric, as NF4
    # read back through the normal CDF (not the quantile function that built them): the
    # positive levels sit at equal steps of probability from the outermost one down to 1/2
    n = 2**bits
    offset = 1 - (1 / (2 * (n - 1)) + 1 / (2 * n)) / 2
    scale = math.sqrt(2) * torch.special.erfinv(torch.tensor(2 * offset - 1, dtype=torch.float64))
    want = torch.linspace(offset, 0.5, n // 2 + 1, dtype=torch.float64)[:-1].flip(0)
    torch.testing.assert_close(torch.special.ndtr(positive * scale), want, rtol=0, atol=1e-6)
    want = torch.linspace(offset, 0.5, n // 2, dtype=torch.float64)[:-1]
    torch.testing.assert_close(torch.special.ndtr(-negative * scale), want, rtol=0, atol=1e-6)


@pytest.mark.bnb
def test_four_bit_levels_are_bitsandbytes_nf4():
    bnb = pytest.importorskip("bitsandbytes")
    table = bnb.functional.get_4bit_type("nf4", device="cpu")
    torch.testing.assert_close(nc.normal_float_levels(4), table, rtol=0, atol=2.5e-7)  # its table: 7 digits


# --- packing --------------------------------------------------------------------------------------
def bit_stream_codes(packed: torch.Tensor, bits: int) -> list[int]:
    """The codes of a packed row read as one little-endian stream of bits: code i is bits
    [bits·i, bits·i + bits), bit n being bit n % 8 of byte n // 8."""
    data = packed.tolist()
    count = len(data) * 8 // bits
    return [
        sum(((data[(bits * i + b) // 8] >> ((bits * i + b) % 8)) & 1) << b for b in range(bits))
        for i in range(count)
    ]


@pytest.mark.parametrize("bits", BITS)
def test_pack_is_a_dense_little_endian_bit_stream_and_unpack_inverts_it(bits):
    torch.manual_seed(bits)
    codes = torch.randint(0, 2**bits, (3, 5, 64), dtype=torch.uint8)
    packed = lowbit.pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, 64 * bits // 8)  # NF2 4 a byte, NF3 8 in 3
    assert torch.equal(lowbit.unpack(packed, bits), codes)
    assert bit_stream_codes(packed[1, 2], bits) == codes[1, 2].tolist()


def test_nf3_packs_eight_codes_in_three_bytes():
    packed = lowbit.pack(torch.arange(8, dtype=torch.uint8), 3)  # 0b111_110_101_100_011_010_001_000
    assert packed.tolist() == [0b10_001_000, 0b1_100_011_0, 0b111_110_10]


# --- quantisation and the reference dequantisation ----------------------------------------------
def stack_of(shape, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return (torch.randn(shape) * 0.02).to(dtype)


def decode_blocks(codes, absmax, bits, block, blocks, dtype):
    """Blocks `blocks` of expert 0 decoded weight by weight in Python: a level times its
    block's absmax (a product of two float32s is exact in a double, so rounding it to
    float32 is float32's own multiply), then rounded to `dtype`."""
    levels = lowbit.normal_float_levels(bits).tolist()
    stream = bit_stream_codes(codes[0], bits)
    out = []
    for b in blocks:
        scale = absmax[0, b].item()
        row = [levels[stream[b * block + i]] * scale for i in range(block)]
        out.append(torch.tensor(row, dtype=torch.float64).to(torch.float32).to(dtype))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", BITS)
def test_the_reference_decodes_as_a_plain_loop_does(bits, dtype):
    stack = stack_of((2, 24, 64), seed=bits, dtype=dtype)
    codes, absmax = lowbit.quantize(stack, bits)
    spec = LowbitStack(bits, tuple(stack.shape), dtype)
    got = lowbit.dequantize_reference(codes, absmax, spec)
    assert got.dtype == dtype and got.shape == stack.shape
    blocks = [0, 7, 23]
    want = decode_blocks(codes, absmax, bits, 64, blocks, dtype)
    assert torch.equal(got[0].reshape(-1, 64)[blocks], want)
    assert torch.equal(lowbit.dequantize(codes, absmax, spec, impl="torch"), got)


@pytest.mark.parametrize("bits", BITS)
def test_each_weight_takes_the_level_nearest_its_scaled_value(bits):
    stack = stack_of((3, 16, 64), seed=10 + bits)
    codes, absmax = lowbit.quantize(stack, bits)
    blocks = stack.reshape(3, -1, 64)
    assert torch.equal(absmax, blocks.abs().amax(-1))
    scaled = blocks / absmax[..., None]
    levels = lowbit.normal_float_levels(bits)
    chosen = levels[lowbit.unpack(codes, bits).long()].reshape(scaled.shape)
    nearest = (scaled[..., None] - levels).abs().amin(-1)
    assert torch.all((scaled - chosen).abs() <= nearest + 1e-6)
    # a block's largest weight is exactly a level times its absmax: ±1
    assert torch.equal(chosen.abs().amax(-1), torch.ones_like(absmax))


def test_a_zero_block_decodes_to_zeros():
    stack = stack_of((2, 4, 64))
    stack[1, 2] = 0
    codes, absmax = lowbit.quantize(stack, 2)
    assert absmax.reshape(2, 4)[1, 2] == 0
    out = lowbit.dequantize_reference(codes, absmax, LowbitStack(2, (2, 4, 64), torch.float32))
    assert torch.equal(out[1, 2], torch.zeros(64))


@pytest.mark.parametrize("bits", BITS)
def test_each_expert_is_quantised_on_blocks_of_its_own(bits):
    stack = stack_of((4, 12, 32), seed=20 + bits)  # 384 weights an expert: 6 blocks
    codes, absmax = lowbit.quantize(stack, bits)
    assert codes.shape == (4, 384 * bits // 8) and absmax.shape == (4, 6)
    for e in range(4):
        alone_codes, alone_absmax = lowbit.quantize(stack[e : e + 1].clone(), bits)
        assert torch.equal(alone_codes[0], codes[e]) and torch.equal(alone_absmax[0], absmax[e])


def test_bad_blocks_and_widths_are_refused():
    with pytest.raises(nc.NarrowsError, match="straddle"):
        lowbit.quantize(torch.randn(4, 6, 10), 2)  # 60 weights an expert, blocks of 64
    for block in (0, -8, 12, 100):
        with pytest.raises(ValueError, match="multiple of 8"):
            lowbit.quantize(torch.randn(2, 8, 64), 2, block=block)
    with pytest.raises(ValueError, match="2, 3 or 4"):
        lowbit.quantize(torch.randn(2, 8, 64), 5)
    with pytest.raises(ValueError, match="2, 3 or 4"):
        nc.normal_float_levels(1)
    _, absmax = lowbit.quantize(torch.randn(2, 8, 64), 3, block=32)  # any multiple of 8 will do
    assert absmax.shape == (2, 16)


def test_operands_that_cannot_hold_the_stack_are_refused():
    stack = stack_of((2, 8, 64))
    codes, absmax = lowbit.quantize(stack, 2)
    spec = LowbitStack(2, (2, 8, 64), torch.float32)
    with pytest.raises(nc.NarrowsError, match="not float32"):
        lowbit.dequantize(codes, absmax.bfloat16(), spec)
    with pytest.raises(nc.NarrowsError, match="needs uint8 codes"):
        lowbit.dequantize(codes, absmax, LowbitStack(3, (2, 8, 64), torch.float32))
    with pytest.raises(ValueError, match="impl"):
        lowbit.dequantize(codes, absmax, spec, impl="cuda")


def test_a_stack_recipe_round_trips_through_json():
    import json

    spec = LowbitStack(3, (4, 128, 64), torch.bfloat16)
    assert LowbitStack.from_recipe(json.loads(json.dumps(spec.recipe()))) == spec
    assert spec.scheme == "nf3" and spec.code_bytes == 4 * 128 * 64 * 3 // 8
    assert spec.absmax_bytes == 4 * 128 * 4


# --- the Triton kernel ----------------------------------------------------------------------------
def test_without_triton_the_reference_serves_and_asking_for_the_kernel_says_what_to_install(monkeypatch):
    from narrows.core import optional

    monkeypatch.setitem(sys.modules, "triton", None)  # as if not installed
    optional.is_available.cache_clear()
    lowbit._kernel.cache_clear()
    try:
        assert not lowbit.triton_available()
        stack = stack_of((2, 8, 64))
        codes, absmax = lowbit.quantize(stack, 3)
        spec = LowbitStack(3, (2, 8, 64), torch.float32)
        assert torch.equal(
            lowbit.dequantize(codes, absmax, spec), lowbit.dequantize_reference(codes, absmax, spec)
        )
        with pytest.raises(nc.MissingDependencyError, match="triton"):
            lowbit.dequantize(codes, absmax, spec, impl="triton")
    finally:
        optional.is_available.cache_clear()
        lowbit._kernel.cache_clear()


_INTERPRETED = """
import torch
from narrows.core.quant import lowbit
torch.manual_seed(0)
stack = torch.randn(3, 40, 64)  # 7680 weights: seven and a half of the kernel's tiles
for bits in (2, 3, 4):
    codes, absmax = lowbit.quantize(stack, bits)
    spec = lowbit.LowbitStack(bits, tuple(stack.shape), torch.float32)
    got = lowbit.dequantize(codes, absmax, spec, impl="triton")
    assert torch.equal(got, lowbit.dequantize_reference(codes, absmax, spec)), bits
for shape in ((3, 64, 30), (2, 96, 130)):  # MXFP4 [E, in, out], stored [E, out, in]: one tile, partial tiles
    per = shape[1] * shape[2]
    codes = torch.randint(0, 256, (shape[0], per // 2), dtype=torch.uint8)
    scales = torch.randint(110, 140, (shape[0], per // 32), dtype=torch.uint8)
    spec = lowbit.LowbitStack.of_mxfp4(shape, torch.float32)
    got = lowbit.dequantize(codes, scales, spec, impl="triton")
    assert torch.equal(got, lowbit.dequantize_reference(codes, scales, spec)), shape
print("ok")
"""


def test_the_kernel_decodes_as_the_reference_under_tritons_interpreter():
    """The Triton kernel run by Triton's CPU interpreter, float32 out: its indexing (a code
    straddling two bytes, the block's scale, the last partial tile, MXFP4's exponents and
    transposed layout) is the reference's.
    (The interpreter rounds to bf16 by truncation, so narrower dtypes are left to CUDA.)"""
    pytest.importorskip("triton")
    from narrows.core.testing import under_triton_interpreter

    done = under_triton_interpreter(_INTERPRETED)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bits", BITS)
def test_cuda_kernel_equals_the_reference(bits, dtype):
    pytest.importorskip("triton")
    stack = stack_of((8, 192, 320), seed=bits, dtype=dtype).cuda()  # not a whole number of tiles
    codes, absmax = lowbit.quantize(stack, bits)
    spec = LowbitStack(bits, tuple(stack.shape), dtype)
    assert lowbit.triton_available()
    got = lowbit.dequantize(codes, absmax, spec)  # auto: the kernel on CUDA
    assert torch.equal(got, lowbit.dequantize_reference(codes, absmax, spec))
    cpu_codes, cpu_absmax = lowbit.quantize(stack.cpu(), bits)  # the same codes quantised on the CPU
    assert torch.equal(cpu_codes, codes.cpu()) and torch.equal(cpu_absmax, absmax.cpu())
    assert torch.equal(got.cpu(), lowbit.dequantize_reference(cpu_codes, cpu_absmax, spec))


def mxfp4_codes(shape: tuple[int, ...], seed: int = 0) -> tuple[Tensor, Tensor]:
    """Random MXFP4 codes and E8M0 scales for a stack of `shape` [E, in, out]."""
    gen = torch.Generator().manual_seed(seed)
    experts, per = shape[0], math.prod(shape[1:])
    codes = torch.randint(0, 256, (experts, per // 2), generator=gen, dtype=torch.uint8)
    scales = torch.randint(1, 255, (experts, per // 32), generator=gen, dtype=torch.uint8)
    return codes, scales


def test_mxfp4_dequantises_to_e2m1_times_a_power_of_two_in_the_stacks_layout():
    """Each weight of an MXFP4 stack is its E2M1 value times 2^(s - 127) (computed here in
    float64 from the format's definition: sign, two exponent bits, one mantissa bit), placed
    at [e, i, o] for code (e, o, i) of the release's layout; every scale the format holds,
    2^-126 … 2^127 (and 0 → 2^-127), comes out exact in float32."""
    shape = (3, 64, 40)  # [E, in, out]
    codes, scales = mxfp4_codes(shape)
    scales[0, :3] = torch.tensor([0, 1, 254], dtype=torch.uint8)
    got = lowbit.dequantize_reference(codes, scales, LowbitStack.of_mxfp4(shape, torch.float32))
    nibbles = torch.stack([codes & 0xF, codes >> 4], -1).reshape(3, -1).long()  # even weight: low nibble
    sign = torch.where(nibbles >= 8, -1.0, 1.0).double()
    field, mantissa = (nibbles >> 1) & 3, (nibbles & 1).double()
    magnitude = torch.where(field == 0, mantissa / 2, (1 + mantissa / 2) * 2.0 ** (field - 1).double())
    power = 2.0 ** (scales.double() - 127).repeat_interleave(32, -1)
    want = (sign * magnitude * power).view(3, 40, 64).transpose(1, 2)
    assert torch.equal(got, want.float())
    bf16 = lowbit.dequantize_reference(codes, scales, LowbitStack.of_mxfp4(shape, torch.bfloat16))
    assert torch.equal(bf16, got.to(torch.bfloat16))  # one rounding, of the exact float32 values
    recipe = LowbitStack.of_mxfp4(shape, torch.bfloat16).recipe()
    assert LowbitStack.from_recipe(recipe) == LowbitStack.of_mxfp4(shape, torch.bfloat16)
    with pytest.raises(NarrowsError, match="uint8 E8M0"):
        lowbit.dequantize_reference(codes, scales.float(), LowbitStack.of_mxfp4(shape, torch.float32))


@pytest.mark.gpu
def test_cuda_kernel_decodes_mxfp4_as_the_reference():
    pytest.importorskip("triton")
    shape = (3, 96, 200)  # not a whole number of the kernel's tiles
    codes, scales = (t.cuda() for t in mxfp4_codes(shape, seed=1))
    spec = LowbitStack.of_mxfp4(shape, torch.bfloat16)
    got = lowbit.dequantize(codes, scales, spec)  # auto: the kernel on CUDA
    assert torch.equal(got, lowbit.dequantize_reference(codes, scales, spec))
    assert torch.equal(got.cpu(), lowbit.dequantize_reference(codes.cpu(), scales.cpu(), spec))
