"""`narrows.core.apply(model, *configs)`: the packages' transforms, each given as its config,
run in the one order that works whatever order they are given in — the same bits as the
transforms called by hand in that order — and a list it cannot run is refused before
anything changes."""

import pytest
import torch
from parity import assert_equal, run

import narrows.core as nc
import narrows.lmhead as lmh
import narrows.stream as ns
from narrows.core.testing import tiny_model, with_adapter

ROWS = 48


def build(arch="qwen2", dropout=0.0):
    model = tiny_model(arch)
    for m in model.modules():
        if hasattr(m, "config"):
            m.config._attn_implementation = "sdpa"
    return with_adapter(model, "lora", dropout=dropout).train()


def test_streamed_configs_in_any_order_train_what_the_documented_order_trains():
    by_hand = build()
    lmh.apply(by_hand, head_rows=ROWS)  # the loss first: the planner sizes the loss that runs
    ns.stream(by_hand, ns.StreamConfig(device="cpu", head="stream", head_rows=ROWS))
    composed = nc.apply(
        build(),
        ns.StreamConfig(device="cpu", head="stream", head_rows=ROWS),
        lmh.HeadSavings(lmh.LossOptions(head_rows=ROWS)),
    )
    assert composed.narrows_stream is not None and composed.narrows_stream.plan is not None
    assert_equal(run(by_hand), run(composed))


def test_resident_tiles_come_before_the_fast_layers_that_run_them():
    by_hand = build()
    ns.tile_sequence(by_hand, 8)
    report = nc.fuse_layers(by_hand)
    composed = nc.apply(build(), nc.FastLayers(), ns.SequenceTiles(8))  # given in the wrong order
    assert nc.kernels.fastlayer.coverage(composed).fused == report.fused == [0, 1, 2]
    layers = nc.anatomy_of(composed).layers
    assert all(nc.kernels.fastlayer.parts_of(layer).mlp_tile == 8 for layer in layers)
    assert_equal(run(by_hand), run(composed))


def test_a_list_it_cannot_run_is_refused_before_anything_changes():
    model = build()
    forwards = [layer.forward for layer in nc.anatomy_of(model).layers]
    with pytest.raises(TypeError, match="dict is not a narrows config"):
        nc.apply(model, nc.FastLayers(), {"gpu_budget": "min"})
    with pytest.raises(ValueError, match="two 'layers' configs"):
        nc.apply(model, nc.FastLayers(), nc.FastLayers(lora_dtype=torch.float32))
    with pytest.raises(ValueError, match="runs its own tiles and layers"):
        nc.apply(model, ns.StreamConfig(device="cpu"), ns.SequenceTiles(8), nc.FastLayers())
    assert [layer.forward for layer in nc.anatomy_of(model).layers] == forwards
    assert not hasattr(model, "narrows_stream")


def test_the_stages_run_loss_tiles_layers_residency_whatever_order_they_are_given_in(monkeypatch):
    from narrows.core.protocol import compose

    resident = (nc.FastLayers(), ns.SequenceTiles(8), lmh.HeadSavings())  # (importing registers them)
    streamed = (ns.StreamConfig(device="cpu"), lmh.HeadSavings())
    ran = []
    for kind, (stage, _) in list(compose._REGISTERED.items()):
        monkeypatch.setitem(compose._REGISTERED, kind, (stage, lambda m, c, _s=stage: ran.append(_s)))
    nc.apply(build(), *resident)
    nc.apply(build(), *streamed)
    assert ran == ["loss", "tiles", "layers", "loss", "residency"]
