"""narrows' own DoRA layer (`DoraLinear`, `add_dora`, `save_dora`, `load_dora`): the same
numbers as PEFT's DoRA layers switched to narrows (`use_narrows_dora`), PEFT's adapter
format both ways, and the core adapter-layer contract."""

import json

import pytest
import torch

import narrows.dora as nd
from narrows.core import NarrowsError, adapter_views
from narrows.core.testing import run_contract, tiny_batch, tiny_model, with_adapter


def peft_dora(arch="llama", dropout=0.0):
    model = with_adapter(tiny_model(arch), "dora", dropout=dropout)
    nd.use_narrows_dora(model)
    return model


def peft_name(ours: str) -> str:
    """Our parameter name -> the PEFT model's."""
    module, _, leaf = ours.rpartition(".")
    if leaf == "magnitude":
        return f"base_model.model.{module}.lora_magnitude_vector.default.weight"
    module, _, ab = module.rpartition(".")
    return f"base_model.model.{module}.{ab}.default.{leaf}"


def loss_and_grads(model, seed=1):
    model.train()
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    torch.manual_seed(seed)  # the dropout masks
    loss = model(**tiny_batch()).loss
    return loss.detach(), dict(zip(named, torch.autograd.grad(loss, list(named.values()))))


@pytest.mark.parametrize("arch,dropout", [("llama", 0.0), ("qwen3", 0.0), ("llama", 0.1)])
def test_same_numbers_as_peft_with_use_narrows_dora(tmp_path, arch, dropout):
    reference = peft_dora(arch, dropout)
    reference.save_pretrained(tmp_path)
    ours = nd.load_dora(tiny_model(arch), tmp_path, trainable=True)
    assert len(nd.dora_layers(ours)) == 7 * ours.config.num_hidden_layers
    ref_loss, ref_grads = loss_and_grads(reference)
    loss, grads = loss_and_grads(ours)
    assert torch.equal(loss, ref_loss)
    assert len(grads) == len(ref_grads)
    for name, g in grads.items():
        assert torch.equal(g, ref_grads[peft_name(name)]), name


def test_saved_adapter_loads_in_plain_peft(tmp_path):
    from peft import PeftModel

    model = nd.add_dora(tiny_model("llama"), r=4, alpha=8)
    with torch.no_grad():  # a trained-looking adapter: B non-zero, m off its initial value
        for layer in nd.dora_layers(model).values():
            layer.lora_B.weight.normal_(0, 0.05)
            layer.magnitude.mul_(1.1)
    nd.save_dora(model, tmp_path, base_model_name_or_path="tiny-llama")
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["use_dora"] and config["r"] == 4 and config["lora_alpha"] == 8
    batch = {k: v for k, v in tiny_batch().items() if k != "labels"}
    with torch.no_grad():
        ours = model(**batch).logits
        loaded = PeftModel.from_pretrained(tiny_model("llama"), tmp_path)
        plain = loaded(**batch).logits  # PEFT's own DoRA: its dense norm rounds differently
        nd.use_narrows_dora(loaded)
        switched = loaded(**batch).logits
    torch.testing.assert_close(plain, ours, rtol=1e-5, atol=1e-5)
    assert torch.equal(switched, ours)
    assert not torch.equal(ours, tiny_model("llama")(**batch).logits)


def test_a_fresh_adapter_leaves_the_model_unchanged_and_trains():
    base = tiny_model("llama")
    batch = tiny_batch()
    with torch.no_grad():
        before = base(**batch).logits
    model = nd.add_dora(tiny_model("llama"), r=4, alpha=8, target_modules="all-linear")
    assert not any(isinstance(model.get_submodule(n), nd.DoraLinear) for n in ("lm_head",))
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, before)  # B = 0 and m = ||W||: exactly g = 1
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(trainable) == 3 * 7 * model.config.num_hidden_layers
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    model.train()
    losses = []
    for _ in range(5):
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_adapter_contract(arch):
    model = nd.add_dora(tiny_model(arch), r=4, alpha=8)
    with torch.no_grad():
        for layer in nd.dora_layers(model).values():
            layer.lora_B.weight.normal_(0, 0.05)
    views = list(adapter_views(model))
    assert {v.type.name for v in views} == {"narrows-dora"} and all(v.variant == "dora" for v in views)
    run_contract(model, tiny_batch(), variant="dora")


def test_targets_follow_peft_rules():
    names = lambda m: sorted(nd.dora_layers(m))  # noqa: E731
    m = nd.add_dora(tiny_model("llama"), target_modules=["q_proj", "v_proj"])
    assert names(m) and all(n.endswith(("q_proj", "v_proj")) for n in names(m))
    m = nd.add_dora(tiny_model("llama"), target_modules=r"model\.layers\.0\.mlp\..*")
    assert names(m) == [
        "model.layers.0.mlp.down_proj",
        "model.layers.0.mlp.gate_proj",
        "model.layers.0.mlp.up_proj",
    ]


def test_bad_input_is_refused_clearly(tmp_path):
    with pytest.raises(ValueError, match="matches no linear layer"):
        nd.add_dora(tiny_model("llama"), target_modules=["qkv"])
    with pytest.raises(ValueError, match="no DoraLinear"):
        nd.save_dora(tiny_model("llama"), tmp_path / "none")
    with pytest.raises(NarrowsError, match="not a PEFT adapter folder"):
        nd.load_dora(tiny_model("llama"), tmp_path)
    with_adapter(tiny_model("llama"), "lora").save_pretrained(tmp_path / "lora")
    with pytest.raises(NarrowsError, match="without use_dora"):
        nd.load_dora(tiny_model("llama"), tmp_path / "lora")
    nd.save_dora(nd.add_dora(tiny_model("llama", num_hidden_layers=3)), tmp_path / "deep")
    with pytest.raises(NarrowsError, match="base model it was trained on"):
        nd.load_dora(tiny_model("llama", num_hidden_layers=1), tmp_path / "deep")
    with pytest.raises(TypeError, match=r"nn\.Linear or a bitsandbytes"):
        nd.DoraLinear(torch.nn.Embedding(4, 4), r=2, alpha=2)


def test_a_second_add_dora_keeps_the_first_adapters_training():
    model = nd.add_dora(tiny_model("llama"), r=4, target_modules=["q_proj"])
    nd.add_dora(model, r=4, target_modules=["v_proj"])
    layers = nd.dora_layers(model)
    assert any(n.endswith("q_proj") for n in layers) and any(n.endswith("v_proj") for n in layers)
    assert all(m.magnitude.requires_grad and m.lora_A.weight.requires_grad for m in layers.values())
    assert not any(p.requires_grad for n, p in model.named_parameters() if "base_layer" in n or "embed" in n)


@pytest.mark.parametrize("adapter_dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_a_row_of_small_norm_is_divided_by_its_own_norm(adapter_dtype, tol):
    """The norm's ε (`norm_epsilon`) only keeps a zero norm from dividing by zero: a row whose
    norm is small but real (1e-3 here) still gets g = m / ||W + sBA||_row. Checked against the
    fp64 DoRA formula, so a too-large ε (say 1e-1) shows as that row scaled down a hundredfold."""
    torch.manual_seed(0)
    base = torch.nn.Linear(32, 6, bias=False)
    with torch.no_grad():
        base.weight[0] *= 1e-3 / base.weight[0].norm()
    layer = nd.DoraLinear(base, r=2, alpha=4, adapter_dtype=adapter_dtype)
    with torch.no_grad():
        layer.lora_B.weight.normal_(0, 1e-4)  # row 0's composed norm stays near 1e-3
        layer.magnitude.mul_(1.5)
    x = torch.randn(5, 32)
    w, a, b = base.weight.double(), layer.lora_A.weight.double(), layer.lora_B.weight.double()
    composed = w + layer.scaling * b @ a
    assert composed[0].norm() < 2e-3
    direction = composed / composed.norm(dim=1, keepdim=True)
    ref = x.double() @ (layer.magnitude.double()[:, None] * direction).t()
    out = layer(x).double()
    for row in (0, slice(1, None)):  # the small row on its own scale, then the others
        torch.testing.assert_close(
            out[:, row], ref[:, row], rtol=tol, atol=tol * ref[:, row].abs().max().item()
        )


@pytest.mark.parametrize("row_norm", [1e-9, 1e-14])
def test_the_fp32_norm_floor_is_1e_12(row_norm):
    """Where ε decides: a row of norm 1e-9 (above the fp32 floor) is divided by its own norm,
    one of 1e-14 (below it) by ε = 1e-12. The reference is DoRA's formula in fp64 with
    ε = 1e-12, computed here; an ε of 1e-6 scales the first row down a thousandfold, an ε
    of 1e-16 the second up a hundredfold."""
    torch.manual_seed(0)
    base = torch.nn.Linear(32, 6, bias=False)
    with torch.no_grad():
        base.weight[0] *= row_norm / base.weight[0].norm()
    layer = nd.DoraLinear(base, r=2, alpha=4, adapter_dtype=torch.float32)
    with torch.no_grad():
        layer.lora_B.weight.normal_(0, 1e-4)
        layer.lora_B.weight[0].mul_(row_norm)  # row 0's composed norm stays near `row_norm`
        layer.magnitude.mul_(1.5)
    x = torch.randn(5, 32)
    w, a, b = base.weight.double(), layer.lora_A.weight.double(), layer.lora_B.weight.double()
    composed = w + layer.scaling * b @ a
    norm = composed.norm(dim=1, keepdim=True)
    assert 0.5 * row_norm < norm[0].item() < 2 * row_norm
    ref = x.double() @ (layer.magnitude.double()[:, None] * composed / norm.clamp_min(1e-12)).t()
    out = layer(x).double()
    for row in (0, slice(1, None)):  # the small row on its own scale, then the others
        torch.testing.assert_close(
            out[:, row], ref[:, row], rtol=1e-5, atol=1e-5 * ref[:, row].abs().max().item()
        )
