"""A fast layer's attention kept from its forward for its backward (`compute.forward_keeping_attention`):
the recompute then runs no attention and no Q/K/V base matmul, and the layer trains the bits a full
recompute trains."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import narrows.core.kernels.fastlayer.fuse as fuse
from narrows.core.kernels.fastlayer import compute
from narrows.core.testing import tiny_model, with_adapter

FAMILY = ("llama", "qwen2", "qwen3", "mistral")


def _parts(arch: str, dtype: torch.dtype, dropout: float = 0.0):
    model = tiny_model(arch, dtype=dtype)
    for m in model.modules():
        if hasattr(m, "config"):
            m.config._attn_implementation = "sdpa"
    model = with_adapter(model, "lora", dropout=dropout).train()
    for p in model.parameters():  # B is zero at the start: give every adapter a gradient path through it
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.05)
    fuse.fuse_layers(model, recompute=False)
    inner = model.base_model.model.model
    x = torch.randn(2, 12, model.config.hidden_size, dtype=dtype)
    cos, sin = inner.rotary_emb(x, torch.arange(12).unsqueeze(0).expand(2, -1))
    return fuse.parts_or_none(inner.layers[0]), x, cos, sin


def _train(parts, x, cos, sin, kept=None):
    """A recompute (with the RNG its forward drew from) and the backward of a fixed gradient."""
    torch.manual_seed(7)
    saved = compute.recompute(parts, x, cos, sin, None, kept=kept)
    g_out = torch.linspace(-1, 1, x.numel(), dtype=x.dtype).view_as(x)
    g_x, grads = compute.backward(parts, saved, g_out)
    return [g_x, *grads]


class _Counting:
    def __init__(self, monkeypatch):
        self.calls = 0
        real = compute.F.scaled_dot_product_attention

        def counted(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(compute.F, "scaled_dot_product_attention", counted)


@pytest.mark.parametrize("arch", FAMILY)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_kept_attention_trains_the_bits_of_a_recompute(arch, dtype, monkeypatch):
    """Same output, same input and adapter gradients (torch.equal), with no attention run in
    the recompute and, without per-head norms, no Q/K/V output computed."""
    parts, x, cos, sin = _parts(arch, dtype, dropout=0.1)
    torch.manual_seed(7)
    out_ref = compute.forward(parts, x, cos, sin, None)
    ref = _train(parts, x, cos, sin)

    torch.manual_seed(7)
    out, kept = compute.forward_keeping_attention(parts, x, cos, sin, None, compute.OnDevice())
    assert kept is not None
    sdpa = _Counting(monkeypatch)
    qkv_outputs = []
    real_forward = parts.qkv.forward
    monkeypatch.setattr(parts.qkv, "forward", lambda *a, **k: qkv_outputs.append(1) or real_forward(*a, **k))
    got = _train(parts, x, cos, sin, kept=kept)
    assert sdpa.calls == 0
    assert len(qkv_outputs) == (1 if arch == "qwen3" else 0)  # Qwen3's head norms read q and k before them
    assert torch.equal(out, out_ref)
    assert len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got, ref))


def test_the_kept_attention_is_what_the_backward_differentiates():
    """Attention kept from another input gives other gradients: the backward reads the kept
    node (its q, k, v, output), not a recompute of this input's."""
    parts, x, cos, sin = _parts("llama", torch.float32)
    _, kept = compute.forward_keeping_attention(parts, x, cos, sin, None, compute.OnDevice())
    _, other = compute.forward_keeping_attention(parts, x.flip(1), cos, sin, None, compute.OnDevice())
    ref = _train(parts, x, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(_train(parts, x, cos, sin, kept=kept), ref))
    assert not torch.equal(_train(parts, x, cos, sin, kept=other)[0], ref[0])


def test_attention_of_many_nodes_is_not_kept():
    """SDPA's math fallback records a graph of many nodes: nothing is kept, and the recompute
    runs the attention again."""
    parts, x, cos, sin = _parts("llama", torch.float32)
    with sdpa_kernel(SDPBackend.MATH):
        out, kept = compute.forward_keeping_attention(parts, x, cos, sin, None, compute.OnDevice())
        assert kept is None
        assert torch.equal(out, compute.forward(parts, x, cos, sin, None))
