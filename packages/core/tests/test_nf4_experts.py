"""Fused MoE experts in NF4: what quantize_nf4 stores, what the experts compute with it,
what it keeps in float and says, and the default LoRA targets of a mixture of experts."""

import copy
import logging

import pytest
import torch
from torch import nn

import narrows.core as nc
from narrows.core.testing import tiny_batch, tiny_model

pytestmark = pytest.mark.bnb
bnb = pytest.importorskip("bitsandbytes")

MOE = ["qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss", "llama4_text"]

# the 16 NF4 levels (QLoRA, arXiv:2305.14314, appendix E), written out: an independent decoder
NF4 = torch.tensor(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171066284,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ]
)


def decode(param) -> torch.Tensor:
    """An NF4 stack decoded in plain PyTorch (no double quantisation): codes, two a byte
    (high nibble first), times each block's absmax."""
    qs = param.quant_state
    packed = param.data.reshape(-1)
    codes = torch.stack([packed >> 4, packed & 0xF], dim=1).reshape(-1).long()
    values = NF4[codes].reshape(-1, qs.blocksize) * qs.absmax.float()[:, None]
    return values.reshape(qs.shape).to(qs.dtype)


def stacks(model):
    return [(name, m) for name, m in model.named_modules() if nc.is_nf4_experts(m)]


def with_dequantized_weights(reference: nn.Module, quantized: nn.Module) -> nn.Module:
    """`reference` (the float model) with every weight quantize_nf4 quantised in `quantized`
    replaced by bitsandbytes' dequantisation of it."""
    qmods = dict(quantized.named_modules())
    for name, module in reference.named_modules():
        q = qmods[name]
        if nc.is_nf4_experts(q):
            for s in q._nf4_stacks:
                p = q._parameters[s]
                getattr(module, s).data.copy_(bnb.functional.dequantize_4bit(p.data, p.quant_state))
        elif nc.is_nf4_linear(q):
            module.weight.data.copy_(bnb.functional.dequantize_4bit(q.weight.data, q.weight.quant_state))
    return reference


@pytest.mark.parametrize("arch", MOE)
def test_every_expert_stack_is_nf4_and_the_experts_compute_with_its_dequantisation(arch):
    model = tiny_model(arch)
    reference = copy.deepcopy(model)
    floats = {n: p.clone() for n, p in model.named_parameters() if p.dim() == 3}
    nc.quantize_nf4(model)
    assert floats, "the tiny model has fused experts"
    found = {f"{name}.{s}" for name, m in stacks(model) for s in m._nf4_stacks}
    assert found == set(floats)
    assert not [n for n, p in model.named_parameters() if p.dim() == 3 and p.is_floating_point()]
    batch = tiny_batch()
    got = model(**batch)
    want = with_dequantized_weights(reference, model)(**batch)
    assert torch.equal(got.logits, want.logits)
    # and the experts' code runs on a copy for the call only: nothing is left behind
    assert all(s not in m.__dict__ for _, m in stacks(model) for s in m._nf4_stacks)


def test_each_expert_is_quantised_on_blocks_of_its_own():
    model = tiny_model("qwen3_moe")
    (name, experts), *_ = stacks(nc.quantize_nf4(copy.deepcopy(model), double_quant=False))
    for s in experts._nf4_stacks:
        float_stack = model.get_submodule(name).get_parameter(s)
        stack = experts._parameters[s]
        assert torch.equal(decode(stack), bnb.functional.dequantize_4bit(stack.data, stack.quant_state))
        for e in range(float_stack.shape[0]):  # expert e alone quantises to the same codes and scales
            alone = bnb.nn.Params4bit(
                float_stack.data[e].clone(),
                requires_grad=False,
                blocksize=64,
                compress_statistics=False,
                quant_type="nf4",
            ).to("cpu")
            assert torch.equal(decode(stack)[e], decode(alone).reshape(float_stack.shape[1:]))
        error = (decode(stack).float() - float_stack.float()).abs()
        assert error.max() <= float_stack.abs().max() * 0.16  # half the widest gap between NF4 levels


def test_a_stack_whose_experts_straddle_blocks_is_refused():
    experts = nn.Module()
    experts.gate_up_proj = nn.Parameter(torch.randn(4, 6, 10))  # 60 weights an expert
    with pytest.raises(nc.NarrowsError, match="straddle"):
        nc.quantize_experts(experts)


def test_nf4_experts_move_copy_and_save_with_their_state():
    model = nc.quantize_nf4(tiny_model("mixtral"))
    batch = tiny_batch()
    want = model(**batch).logits
    assert torch.equal(copy.deepcopy(model)(**batch).logits, want)
    state = model.state_dict()
    name, experts = stacks(model)[0]
    for s in experts._nf4_stacks:
        assert state[f"{name}.{s}"].dtype == torch.uint8
        for key in ("absmax", "quant_map", "nested_absmax", "quant_state.bitsandbytes__nf4"):
            assert f"{name}.{s}.{key}" in state
    slots = {s.name for s in nc.frozen_slots(experts)}
    assert {f"{s}.quant_state.absmax" for s in experts._nf4_stacks} <= slots


@pytest.mark.parametrize("experts", ["nf4", "nf2"])
def test_save_pretrained_of_quantised_experts_is_refused_by_name_and_the_adapter_still_saves(
    tmp_path, experts
):
    """transformers' save_pretrained would turn the fused stacks back into per-expert float
    weights (and fail inside, on NF4 codes): it is refused, saying what to save instead.
    PEFT's adapter saving is untouched, and a dense NF4 model saves as before."""
    from peft import LoraConfig, get_peft_model

    model = nc.quantize_nf4(tiny_model("qwen3_moe"), experts=experts)
    with pytest.raises(nc.NarrowsError, match=r"routed experts are held quantised .*Save the float model"):
        model.save_pretrained(tmp_path / "base")
    peft = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    peft.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    nc.quantize_nf4(tiny_model("llama")).save_pretrained(tmp_path / "dense")
    assert (tmp_path / "dense" / "model.safetensors").is_file()


def test_what_stays_in_float_is_named_with_why(caplog):
    model = tiny_model("gpt_oss")
    layer = nc.anatomy_of(model).layers[0]
    layer.extra = nn.Parameter(torch.randn(8, 8))  # a tensor of no kind narrows knows
    with caplog.at_level(logging.INFO, logger="narrows.core"):
        nc.quantize_nf4(model)
    report = nc.precision(model)
    kinds = {k.kind: k for k in report.kept}
    assert set(kinds) == {"other", "routers", "expert biases", "vectors"}
    assert kinds["other"].names == ("model.layers.0.extra",)
    n_layers = len(nc.anatomy_of(model).layers)
    assert report.expert_stacks == 2 * n_layers
    assert len(kinds["expert biases"].names) == 2 * n_layers
    # what the layers hold, counted another way: every parameter is NF4 or in one kind
    quantized = 4 * n_layers + report.expert_stacks  # q, k, v, o and the stacks
    assert report.linears + report.expert_stacks == quantized
    counted = sum(len(k.names) for k in report.kept) + quantized
    assert counted == sum(1 for layer in nc.anatomy_of(model).layers for _ in layer.parameters())
    (record,) = [r for r in caplog.records if r.name == "narrows.core"]
    assert record.levelno == logging.WARNING and "model.layers.0.extra" in record.getMessage()


def test_experts_left_in_float_are_named():
    model = nc.quantize_nf4(tiny_model("qwen3_moe"), filter_fn=lambda name, module: ".experts." not in name)
    (other,) = nc.precision(model).unexplained
    assert {n.rsplit(".", 1)[-1] for n in other.names} == {"gate_up_proj", "down_proj"}
    assert nc.precision(nc.quantize_nf4(tiny_model("qwen3_moe"))).unexplained == ()


# --- the default LoRA targets of a mixture of experts ----------------------------------------------
def test_a_dense_model_adapts_every_linear():
    assert nc.lora_targets(tiny_model("llama")).modules == "all-linear"


@pytest.mark.parametrize("arch", MOE)
def test_moe_targets_leave_routers_and_routed_experts_frozen_and_say_so(arch):
    from peft import LoraConfig, get_peft_model

    model = nc.quantize_nf4(tiny_model(arch))
    targets = nc.lora_targets(model)
    assert {"q_proj", "k_proj", "v_proj", "o_proj"} <= set(targets.modules)
    assert any("routers" in f for f in targets.frozen) and any("routed experts" in f for f in targets.frozen)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=list(targets.modules)))
    adapted = {name for name, m in peft_model.named_modules() if nc.adapter_view(m) is not None}
    routers = {
        f"{b.name}.{r}"
        for layer in nc.anatomy_of(peft_model).layers
        for b in nc.moe_blocks(layer)
        for r in b.routers
    }
    assert adapted and not any(n.endswith(tuple(routers)) or ".experts" in n for n in adapted)
    assert peft_model(**tiny_batch()).loss.isfinite()


def test_names_peft_would_move_onto_the_routed_experts_are_left_out():
    """PEFT 0.21 reads gate_proj on a qwen3_moe model as experts.gate_up_proj: a dense MLP
    layer's gate_proj is then not adapted, and the targets say why."""
    from peft import LoraConfig, get_peft_model

    model = tiny_model("qwen3_moe", mlp_only_layers=[0])
    targets = nc.lora_targets(model)
    config = LoraConfig(r=4, target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"])
    moved = set(get_peft_model(copy.deepcopy(model), config).peft_config["default"].target_parameters or ())
    if not moved:
        pytest.skip("this PEFT moves no module name onto the experts")
    assert not {"gate_proj", "up_proj", "down_proj"} & set(targets.modules)
    assert any("PEFT reads these names" in f for f in targets.frozen)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=list(targets.modules)))
    assert not peft_model.peft_config["default"].target_parameters


def test_a_moe_base_quantised_as_it_loads_refuses_save_pretrained_too(tmp_path):
    from narrows.core.io.models import load_causal_lm
    from narrows.core.testing import tiny_model_folder

    folder = tiny_model_folder(tmp_path / "model", "qwen3_moe")
    model, _ = load_causal_lm(folder, dtype=torch.float32, quant="nf4", device=torch.device("cpu"))
    with pytest.raises(nc.NarrowsError, match="routed experts are held quantised"):
        model.save_pretrained(tmp_path / "base")
