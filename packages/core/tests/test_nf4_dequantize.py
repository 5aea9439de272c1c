"""The one door to a bitsandbytes NF4 weight's float copy (`narrows.core.quant.dequantize`):
the PyTorch reference against bitsandbytes' own `dequantize_4bit`, the Triton kernel against
the reference (under Triton's CPU interpreter here) and against bitsandbytes on CUDA, bit for
bit, double-quantised or not, in each float dtype; and the door's choice between them."""

import pytest
import torch

from narrows.core.quant import dequantize as dq

pytestmark = pytest.mark.bnb
F = pytest.importorskip("bitsandbytes.functional")

# (shape, double-quantised): whole and partial kernel tiles, nested blocks cut short
CASES = [((64, 128), True), ((96, 320), True), ((33, 64), False), ((24, 4160), True)]


def quantised(shape, nested, dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(shape, generator=g) * 0.02).to(dtype).to(device)
    return F.quantize_4bit(w, blocksize=64, compress_statistics=nested, quant_type="nf4")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape,nested", CASES)
def test_the_reference_is_bitsandbytes_bit_for_bit(shape, nested, dtype):
    packed, qs = quantised(shape, nested, dtype)
    got = dq.dequantize_nf4_reference(packed, qs)
    assert got.dtype == dtype and got.shape == shape
    assert torch.equal(got, F.dequantize_4bit(packed, qs))


def test_the_reference_fails_where_the_offset_or_a_nibble_is_misread():
    """Two faults the comparison above must catch, checked against it."""
    packed, qs = quantised((64, 128), True, torch.float32)
    bnb = F.dequantize_4bit(packed, qs)
    swapped = ((packed & 15) << 4) | (packed >> 4)  # low nibble first
    assert not torch.equal(dq.dequantize_nf4_reference(swapped, qs), bnb)
    qs.offset = qs.offset + 1e-3
    assert not torch.equal(dq.dequantize_nf4_reference(packed, qs), bnb)


def test_the_door_takes_bitsandbytes_off_cuda_and_writes_into_out():
    packed, qs = quantised((96, 320), True, torch.bfloat16)
    out = torch.empty(96, 320, dtype=torch.bfloat16)
    assert dq.dequantize_nf4(packed, qs, out=out) is out
    assert torch.equal(out, F.dequantize_4bit(packed, qs))
    with pytest.raises(ValueError, match="impl"):
        dq.dequantize_nf4(packed, qs, impl="cuda")


_INTERPRETED = """
import torch
import bitsandbytes.functional as F
from narrows.core.quant import dequantize as dq
from narrows.core.quant.nf4_kernel import dequantize_nf4_triton
for seed, (shape, nested) in enumerate(%r):
    for dtype in (torch.float32, torch.float16):  # one weight a store; a pair a 32-bit word
        g = torch.Generator().manual_seed(seed)
        w = (torch.randn(shape, generator=g) * 0.02).to(dtype)
        packed, qs = F.quantize_4bit(w, blocksize=64, compress_statistics=nested, quant_type="nf4")
        got = dequantize_nf4_triton(packed, qs)
        assert torch.equal(got, dq.dequantize_nf4_reference(packed, qs)), (shape, dtype)
print("ok")
"""


def test_the_kernel_decodes_as_the_reference_under_tritons_interpreter():
    """The kernel's indexing (which nibble is which weight, the block's scale, the nested
    block's, the last partial tile, a pair's halves in a 32-bit word), float32 and float16
    out: the interpreter rounds to bf16 by truncation, so bf16 is left to CUDA."""
    pytest.importorskip("triton")
    from narrows.core.testing import under_triton_interpreter

    done = under_triton_interpreter(_INTERPRETED % (CASES,))
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape,nested", [*CASES, ((2048, 4096), True), ((128, 768, 2048), True)])
def test_cuda_kernel_is_bitsandbytes_bit_for_bit(shape, nested, dtype):
    pytest.importorskip("triton")
    packed, qs = quantised(shape, nested, dtype, device="cuda")
    want = F.dequantize_4bit(packed, qs)
    assert torch.equal(dq.dequantize_nf4(packed, qs, impl="triton"), want)
    out = torch.empty_like(want)
    assert dq.dequantize_nf4(packed, qs, out=out) is out and torch.equal(out, want)
    assert dq._fits_kernel(packed, qs, None)  # the door takes the kernel on CUDA
