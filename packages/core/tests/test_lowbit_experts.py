"""Fused MoE experts in NF3 and NF2 (narrows' own blockwise codes): the experts compute with
the reference dequantisation of their stacks, the codes and scales are frozen slots, the
rest of core reads them (names, shapes, precision, the planner's bytes), and quantize_nf4
and the block-streamed loader put the routed experts in the scheme asked for while the
linears stay NF4."""

import copy

import pytest
import torch
from torch import nn

import narrows.core as nc
from narrows.core.quant import lowbit
from narrows.core.testing import tiny_batch, tiny_model

MOE = ["qwen3_moe", "mixtral", "gpt_oss", "qwen2_moe"]


def quantized_experts(model):
    return [(name, m) for name, m in model.named_modules() if nc.is_quantized_experts(m)]


def quantize_experts_only(model, scheme):
    """Every experts module of `model` quantised to `scheme`; nothing else (no bitsandbytes)."""
    n = sum(nc.quantize_experts(m, scheme=scheme) for m in list(model.modules()) if nc.expert_names(m))
    assert n > 0
    return model


def with_reference_stacks(reference: nn.Module, quantized: nn.Module) -> nn.Module:
    """`reference` (the float model) with every stack `quantized` holds in NF3/NF2 replaced by
    the PyTorch reference's dequantisation of it."""
    for name, q in quantized_experts(quantized):
        module = reference.get_submodule(name)
        for s, spec in nc.lowbit_stacks(q).items():
            codes, absmax = q.get_parameter(s), q.get_parameter(nc.absmax_name(s))
            getattr(module, s).data.copy_(lowbit.dequantize_reference(codes.data, absmax.data, spec))
    return reference


@pytest.mark.parametrize("scheme", ["nf2", "nf3"])
@pytest.mark.parametrize("arch", MOE)
def test_the_experts_compute_with_the_reference_dequantisation(arch, scheme):
    model = tiny_model(arch)
    reference = copy.deepcopy(model)
    floats = {n: p.shape for n, p in model.named_parameters() if p.dim() == 3}
    quantize_experts_only(model, scheme)
    found = {
        f"{name}.{s}": spec for name, m in quantized_experts(model) for s, spec in nc.lowbit_stacks(m).items()
    }
    assert set(found) == set(floats) and all(spec.scheme == scheme for spec in found.values())
    assert {n: torch.Size(spec.shape) for n, spec in found.items()} == floats
    for name, m in quantized_experts(model):
        for s in nc.lowbit_stacks(m):
            codes, absmax = m.get_parameter(s), m.get_parameter(nc.absmax_name(s))
            assert codes.dtype == torch.uint8 and not codes.requires_grad
            assert absmax.dtype == torch.float32 and not absmax.requires_grad
            assert nc.expert_scheme(m, s) == scheme and nc.expert_shape(m, s) == floats[f"{name}.{s}"]
        assert nc.expert_names(m) == list(
            nc.lowbit_stacks(m)
        )  # still the stacks, for moe_blocks and PEFT's targets
    batch = tiny_batch()
    got = model(**batch)
    want = with_reference_stacks(reference, model)(**batch)
    assert torch.equal(got.logits, want.logits)
    assert all(s not in m.__dict__ for _, m in quantized_experts(model) for s in nc.lowbit_stacks(m))


def test_the_codes_and_scales_are_frozen_slots_the_forward_reads():
    model = quantize_experts_only(tiny_model("qwen3_moe"), "nf2")
    batch = tiny_batch()
    want = model(**batch).logits
    name, experts = quantized_experts(model)[0]
    slots = nc.frozen_slots(experts)
    names = {s.name for s in slots}
    assert {"gate_up_proj", "gate_up_proj_absmax", "down_proj", "down_proj_absmax"} <= names
    with nc.pointed_at(slots, nc.copies(slots, "cpu")):  # moved elsewhere: the same values
        assert torch.equal(model(**batch).logits, want)
    zeroed = [
        torch.zeros_like(t) if s.name.endswith("_absmax") else t for s, t in zip(slots, nc.snapshot(slots))
    ]
    with nc.pointed_at(slots, zeroed):  # the forward reads what the slots hold
        assert not torch.equal(model(**batch).logits, want)
    assert torch.equal(copy.deepcopy(model)(**batch).logits, want)
    state = model.state_dict()
    assert state[f"{name}.gate_up_proj"].dtype == torch.uint8
    assert state[f"{name}.gate_up_proj_absmax"].dtype == torch.float32


def test_what_the_planner_and_targets_read_of_low_bit_experts():
    model = tiny_model("mixtral")
    float_bytes = [
        sum(p.numel() * p.element_size() for p in layer.parameters() if p.dim() == 3)
        for layer in nc.anatomy_of(model).layers
    ]
    quantize_experts_only(model, "nf3")
    layers = nc.anatomy_of(model).layers
    assert [nc.dequantized_expert_bytes(layer) for layer in layers] == float_bytes
    assert all(len(list(nc.moe_blocks(layer))) == 1 for layer in layers)
    targets = nc.lora_targets(model)
    assert any("routed experts (down_proj, gate_up_proj)" in f for f in targets.frozen)
    assert "nf3" in repr(layers[0].mlp.experts)


def test_a_bad_scheme_or_a_straddling_stack_is_refused():
    with pytest.raises(ValueError, match="scheme"):
        nc.quantize_experts(tiny_model("qwen3_moe").model.layers[0].mlp.experts, scheme="nf1")
    experts = nn.Module()
    experts.gate_up_proj = nn.Parameter(torch.randn(4, 6, 10))  # 60 weights an expert
    with pytest.raises(nc.NarrowsError, match="straddle"):
        nc.quantize_experts(experts, scheme="nf2")


# --- with NF4 linears (bitsandbytes) ----------------------------------------------------------------
@pytest.mark.bnb
@pytest.mark.parametrize("scheme", ["nf2", "nf3"])
def test_quantize_nf4_keeps_the_linears_nf4_and_puts_routed_experts_in_the_scheme(scheme):
    pytest.importorskip("bitsandbytes")
    model = nc.quantize_nf4(tiny_model("qwen2_moe"), experts=scheme)  # a shared expert: linears
    layers = nc.anatomy_of(model).layers
    shared = [m for layer in layers for n, m in layer.named_modules() if ".shared_expert." in f".{n}."]
    assert shared and all(nc.is_nf4_linear(m) for m in shared if isinstance(m, nn.Linear))
    assert not any(nc.is_nf4_experts(m) for m in model.modules())
    report = nc.precision(model)
    stacks = report.stacks(scheme)
    assert (stacks.count, report.stacks("nf4").count) == (2 * len(layers), 0)
    stored = sum(
        p.numel() * p.element_size()
        for _, m in quantized_experts(model)
        for n, p in m.named_parameters(recurse=False)
        if n in nc.lowbit_stacks(m) or n.endswith("_absmax")
    )
    assert stacks.nbytes == stored == report.expert_bytes
    assert f"{scheme.upper()}: {stacks.count} expert stacks" in str(report) and report.unexplained == ()
    assert report.as_dict()["expert_stacks"] == {scheme: {"count": stacks.count, "bytes": stored}}
    with pytest.raises(ValueError, match="experts="):
        nc.quantize_nf4(tiny_model("qwen3_moe"), experts="nf5")


@pytest.mark.bnb
def test_the_loader_quantises_the_routed_experts_as_quantize_nf4_does(tmp_path):
    pytest.importorskip("bitsandbytes")
    tiny_model("qwen3_moe").save_pretrained(tmp_path)
    got = nc.load_blockwise(tmp_path, dtype=torch.float32, quant="nf4", experts="nf2", device="cpu")
    want = nc.quantize_nf4(nc.load_blockwise(tmp_path, dtype=torch.float32), experts="nf2")
    got_state, want_state = got.state_dict(), want.state_dict()
    assert sorted(got_state) == sorted(want_state)
    assert all(torch.equal(got_state[k], want_state[k]) for k in want_state)
    assert nc.precision(got).stacks("nf2").count == 2 * len(nc.anatomy_of(got).layers)
    with pytest.raises(nc.NarrowsError, match="quant='nf4'"):
        nc.load_blockwise(tmp_path, dtype=torch.float32, experts="nf2")
