"""narrows-dora's DoRA layers streamed by narrows-stream: bit-identical to resident (tiled: to the same tiling resident)."""

import pytest
import torch
from parity import assert_equal, run

import narrows.dora as nd
import narrows.stream as ns
from narrows.core.testing import tiny_model, with_adapter


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_streamed_narrows_dora_equals_resident(arch):
    def build():
        m = with_adapter(tiny_model(arch), "dora", dropout=0.05).train()
        nd.use_narrows_dora(m)
        return m

    assert_equal(run(build(), grad_accum=2), run(ns.stream(build(), device="cpu"), grad_accum=2))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_streamed_dora_layers_of_narrows_equal_resident(arch):
    """`DoraLinear` (no PEFT) reaches the stream through the core adapter protocol."""

    def build():
        m = nd.add_dora(tiny_model(arch), r=4, alpha=8, dropout=0.05).train()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            for layer in nd.dora_layers(m).values():
                with torch.no_grad():
                    layer.lora_B.weight.normal_(0, 0.05)
        return m

    assert_equal(run(build(), grad_accum=2), run(ns.stream(build(), device="cpu"), grad_accum=2))


def test_narrows_dora_in_sequence_tiles_with_offloaded_inputs_equals_the_same_tiles_resident():
    """narrows-dora's fused DoRA inside MLP tiles (tile 5 does not divide the batch's 12
    positions), every saved input in host memory: equal to the same tiling resident."""

    def build():
        m = with_adapter(tiny_model("llama"), "dora", dropout=0.05).train()
        nd.use_narrows_dora(m)
        return m

    streamed = ns.stream(build(), device="cpu", seq_tile=5, offload="all")
    assert streamed.narrows_stream.plan.tile_tokens == 5
    assert_equal(run(ns.tile_sequence(build(), 5), grad_accum=2), run(streamed, grad_accum=2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_narrows_dora_kernels_replayed_as_cuda_graphs_equal_resident_eager():
    """narrows-dora's fused Triton kernels inside the stream's CUDA graphs, with dropout:
    `torch.equal` to the same model resident and eager (deterministic kernels)."""
    from narrows.core import deterministic

    def build():
        m = with_adapter(tiny_model("llama"), "dora", dropout=0.05).train()
        nd.use_narrows_dora(m)
        return m

    deterministic(True)
    ref = run(build().to("cuda"), grad_accum=2, device="cuda")
    model = ns.stream(build(), None, device="cuda", graphs=True)
    assert_equal(ref, run(model, grad_accum=2, device="cuda"))
    stats = model.narrows_stream.graphs.stats
    assert stats.replays > 0 and not stats.refused
