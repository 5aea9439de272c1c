"""`narrows finetune` on a mixture of experts with `--quant nf4`: the experts are stored in
NF4 and the summary says so, the adapter leaves routers and routed experts frozen and says
why, and streamed training (every layer streamed) trains the adapter the resident run does,
both through the fast MoE layer."""

import importlib.util
import json

import pytest
import torch
from safetensors.torch import load_file

from narrows.core.app.cli import main
from narrows.core.testing import mxfp4_folder, tiny_model_folder, write_jsonl

pytestmark = pytest.mark.bnb
ROWS = [{"text": " ".join(f"w{(7 * i + j) % 50}" for j in range(20))} for i in range(12)]


def run(tmp_path, name, budget, extra=(), arch="qwen3_moe", model=None, quant="nf4"):
    """The main job on `model` (default: a tiny `arch` folder) into run folder `name`."""
    model = model or tiny_model_folder(tmp_path / "model", arch)
    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    base = ["--model", str(model), "--data", str(data), "--quant", quant, "--gpu-budget", budget, *extra]
    shape = ["--steps", "2", "--batch", "2", "--seq-len", "32", "--rank", "4", "--eval-rows", "0"]
    code = main(["finetune", *base, *shape, "--no-progress", "--out", str(tmp_path / name)])
    assert code == 0
    folder = tmp_path / name
    return load_file(folder / "adapter_model.safetensors"), json.loads((folder / "summary.json").read_text())


def test_moe_experts_in_nf4_stream_as_they_train_resident(tmp_path, capsys):
    pytest.importorskip("bitsandbytes")
    streamed, summary = run(tmp_path, "streamed", "min")
    said = capsys.readouterr().err
    resident, resident_summary = run(tmp_path, "resident", "off")
    assert summary["stream"]["resident_layers"] == 0
    # the plan's peak in its parts (each a plan field; the layers' weights the rest)
    parts = summary["stream"]["predicted_parts"]
    assert sum(parts.values()) == summary["stream"]["predicted_peak"] and min(parts.values()) >= 0
    assert parts["layer_weights"] > 0 and parts["graph_pool"] == 0  # no CUDA graphs on a CPU
    # the fast MoE layer on both sides: streamed training equal to the same kernels resident
    assert summary["kernels"] == resident_summary["kernels"] == "fast layers: all 3 decoder layers"
    # narrows-lmhead's tiles on the CPU; on CUDA Liger-Kernel's fused loss where it is installed
    fused = torch.cuda.is_available() and importlib.util.find_spec("liger_kernel") is not None
    assert summary["loss_kernels"] == (["liger"] if fused else ["tiles"])
    assert streamed.keys() == resident.keys() and all(torch.equal(streamed[k], resident[k]) for k in streamed)
    layers = 3
    precision = summary["precision"]
    assert precision["nf4_expert_stacks"] == 2 * layers and precision["nf4_linears"] == 4 * layers
    assert {k["kind"] for k in precision["kept_in_float"]} == {"routers", "vectors"}
    assert not any(".experts." in k or ".mlp.gate." in k for k in streamed)
    assert "routers (gate)" in summary["targets"] and "routed experts" in summary["targets"]
    assert "expert stacks" in said and "not adapted: routers" in said


def test_gpt_oss_streams_through_the_fast_layers_as_it_trains_resident(tmp_path):
    """gpt-oss (attention sinks, biased transposed experts, eager attention as transformers
    loads it) with LoRA on its routed experts too: the fast layers on every layer, streamed
    equal to resident, its expert biases named."""
    pytest.importorskip("bitsandbytes")
    extra = ("--targets", "all-linear,experts")
    streamed, summary = run(tmp_path, "streamed", "min", extra, arch="gpt_oss")
    resident, resident_summary = run(tmp_path, "resident", "off", extra, arch="gpt_oss")
    assert summary["kernels"] == resident_summary["kernels"] == "fast layers: all 3 decoder layers"
    assert streamed.keys() == resident.keys() and all(torch.equal(streamed[k], resident[k]) for k in streamed)
    assert len([k for k in streamed if ".experts." in k]) == 3 * 2 * 2  # layers × stacks × (A, B)
    assert summary["precision"]["nf4_expert_stacks"] == 2 * 3
    assert "expert biases" in {k["kind"] for k in summary["precision"]["kept_in_float"]}


def test_latent_attention_streams_through_the_fast_layers_as_it_trains_resident(tmp_path):
    """DeepSeek-V3 (multi-head latent attention, grouped sigmoid routing, a dense first
    layer): the fast layers on every layer, streamed equal to resident, its routed experts
    stored in NF4 (two stacks in each of its two MoE layers)."""
    pytest.importorskip("bitsandbytes")
    streamed, summary = run(tmp_path, "streamed", "min", arch="deepseek_v3")
    resident, resident_summary = run(tmp_path, "resident", "off", arch="deepseek_v3")
    assert summary["kernels"] == resident_summary["kernels"] == "fast layers: all 3 decoder layers"
    assert streamed.keys() == resident.keys() and all(torch.equal(streamed[k], resident[k]) for k in streamed)
    assert any("kv_b_proj" in k for k in streamed) and any("q_a_proj" in k for k in streamed)
    assert summary["stream"]["resident_layers"] == 0 and summary["precision"]["nf4_expert_stacks"] == 2 * 2


def test_nf2_experts_on_request_and_refused_without_an_nf4_base(tmp_path, capsys):
    pytest.importorskip("bitsandbytes")
    model = tiny_model_folder(tmp_path / "model", "qwen3_moe")
    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    args = [
        "finetune",
        "--model",
        str(model),
        "--data",
        str(data),
        "--steps",
        "1",
        "--batch",
        "2",
        "--seq-len",
        "32",
    ]
    args += ["--eval-rows", "0", "--no-progress", "--expert-quant", "nf2"]
    assert main([*args, "--out", str(tmp_path / "float")]) == 2
    assert "give --quant nf4 too" in capsys.readouterr().err and not (tmp_path / "float").exists()
    assert main([*args, "--quant", "nf4", "--gpu-budget", "min", "--out", str(tmp_path / "nf2")]) == 0
    precision = json.loads((tmp_path / "nf2" / "summary.json").read_text())["precision"]
    assert precision["expert_stacks"] == {
        "nf2": {"count": 6, "bytes": precision["expert_stacks"]["nf2"]["bytes"]}
    }
    assert precision["nf4_expert_stacks"] == 0 and precision["nf4_linears"] == 12
    assert "NF2: 6 expert stacks" in capsys.readouterr().err


def test_lora_on_routed_experts_streams_as_it_trains_resident_and_loads_in_peft(tmp_path, capsys):
    """``--targets all-linear,experts``: one adapter per expert in PEFT's target_parameters
    format, trained through the fast MoE layer streamed as resident, that
    `PeftModel.from_pretrained` loads onto the unquantised base with the same tensors."""
    pytest.importorskip("bitsandbytes")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    extra = ["--targets", "all-linear,experts"]
    streamed, summary = run(tmp_path, "streamed", "min", extra)
    said = "".join(capsys.readouterr())
    resident, resident_summary = run(tmp_path, "resident", "off", extra)
    assert summary["kernels"] == resident_summary["kernels"] == "fast layers: all 3 decoder layers"
    assert streamed.keys() == resident.keys() and all(torch.equal(streamed[k], resident[k]) for k in streamed)
    experts = [k for k in streamed if ".experts." in k]
    assert len(experts) == 3 * 2 * 2  # layers × stacks × (A, B)
    assert all(streamed[k].abs().sum() > 0 for k in experts if "lora_B" in k)  # trained from zero
    config = tiny_model_folder(tmp_path / "model", "qwen3_moe")  # the same folder (written again)
    e, i, h, r = 4, 64, 64, 4  # the tiny model's experts, intermediate, hidden; --rank
    assert summary["trainable"]["in_routed_experts"] == 3 * e * r * ((h + 2 * i) + (i + h))
    assert "routed experts: mlp.experts.down_proj, mlp.experts.gate_up_proj" in summary["targets"]
    assert "in the routed experts" in said
    assert summary["router_aux_loss"]["on"] is False and "router aux loss           off" in said
    # the run scored on its own NF4 base (the adapters on quantised stacks adopted) and on
    # the float base through PEFT's own path: the same loss, up to the quantisation
    from narrows.core import load_for_inference

    ids = torch.tensor([[5, 9, 12, 7, 30, 2, 8, 11]])
    scored = load_for_inference(None, adapter=tmp_path / "streamed", quant="nf4", dtype="float32")
    nf4_loss = scored.model(input_ids=ids.to(scored.model.device), labels=ids.to(scored.model.device)).loss
    base = AutoModelForCausalLM.from_pretrained(config)
    loaded = PeftModel.from_pretrained(base, str(tmp_path / "streamed"))
    state = {k: v for k, v in loaded.state_dict().items() if "lora_" in k}
    float_loss = loaded(input_ids=ids, labels=ids).loss
    assert torch.isfinite(nf4_loss) and abs(nf4_loss.item() - float_loss.item()) < 0.05 * float_loss.item()
    for key, value in streamed.items():
        match = [
            v for k, v in state.items() if k.replace(".default", "").endswith(key.split("model.", 1)[-1])
        ]
        assert len(match) == 1 and torch.equal(match[0].to(value.dtype), value), key


def test_expert_targets_are_refused_where_they_cannot_train(tmp_path, capsys):
    pytest.importorskip("bitsandbytes")
    dense = tiny_model_folder(tmp_path / "dense", "qwen3")
    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    args = ["finetune", "--data", str(data), "--steps", "1", "--seq-len", "32", "--no-progress"]
    assert main([*args, "--model", str(dense), "--targets", "q_proj,experts", "--dropout", "0.1"]) == 2
    assert "takes no dropout" in capsys.readouterr().err
    assert main([*args, "--model", str(dense), "--targets", "experts", "--out", str(tmp_path / "d")]) == 2
    assert "has no fused expert stacks" in capsys.readouterr().err and not (tmp_path / "d").exists()


def test_lora_on_routed_experts_resumes_exactly(tmp_path, interrupt_at):
    """Ctrl-C during step 3 of a streamed run with LoRA on the NF4 experts, then --resume:
    the checkpoint's expert adapters (PEFT's target_parameters) and their optimizer state
    come back onto the quantised stacks, and the run ends where the uninterrupted one does."""
    pytest.importorskip("bitsandbytes")
    model = tiny_model_folder(tmp_path / "model", "qwen3_moe")
    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    args = ["finetune", "--model", str(model), "--data", str(data), "--quant", "nf4", "--gpu-budget", "min"]
    args += ["--targets", "experts", "--steps", "4", "--batch", "2", "--seq-len", "32", "--rank", "4"]
    args += ["--eval-rows", "0", "--save-every", "1", "--lr", "1e-2", "--no-progress"]
    assert main([*args, "--out", str(tmp_path / "whole")]) == 0
    interrupt_at(3)
    assert main([*args, "--out", str(tmp_path / "cut")]) == 130
    interrupt_at(None)
    assert main(["finetune", "--resume", str(tmp_path / "cut"), "--no-progress"]) == 0
    whole, cut = (load_file(tmp_path / r / "adapter_model.safetensors") for r in ("whole", "cut"))
    assert whole.keys() == cut.keys() and all(".experts." in k for k in whole)
    assert all(torch.equal(whole[k], cut[k]) for k in whole)


@pytest.mark.parametrize("quant", ["none", "nf4"])
def test_gpt_oss_mxfp4_release_trains_as_the_bf16_stacks_it_stands_for(tmp_path, capsys, quant):
    """A folder in gpt-oss's MXFP4 release format, and a bf16 folder holding the stacks its
    codes stand for (computed from the E2M1 table): the main job trains the same adapter on
    both, bit for bit, streamed. The release's experts stay MXFP4, dequantised each pass, where
    the bf16 folder's stay float (``--quant none``); with ``--expert-quant nf4`` they are decoded
    and quantised again, as the bf16 folder's are. The job says which."""
    pytest.importorskip("bitsandbytes")
    from safetensors.torch import save_file

    want = mxfp4_folder(tmp_path / "mxfp4")
    plain = tiny_model_folder(tmp_path / "bf16", "gpt_oss")
    tensors = load_file(plain / "model.safetensors")
    save_file({**tensors, **want}, plain / "model.safetensors", metadata={"format": "pt"})
    # PEFT makes a float stack's adapters in the stack's dtype and a quantised one's in float32:
    # in bf16 the two bases' initial A would differ by its rounding, so the float base runs in float32
    scheme = ("--expert-quant", "nf4") if quant == "nf4" else ("--dtype", "float32")
    got, summaries = {}, {}
    for name in ("mxfp4", "bf16"):
        extra = ("--targets", "all-linear,experts", *scheme)
        got[name], summaries[name] = run(
            tmp_path, f"run-{name}", "min", extra, model=tmp_path / name, quant=quant
        )
        said = capsys.readouterr().err
        held = "stay MXFP4 as stored" if quant == "none" else "then are quantised again to nf4"
        assert ("6 MXFP4 expert stacks" in said and held in said) == (name == "mxfp4"), said
        assert ("MXFP4: 6 expert stacks" in said) == (name == "mxfp4" and quant == "none"), said
    assert got["mxfp4"].keys() == got["bf16"].keys() and any(".experts." in k for k in got["bf16"])
    assert all(torch.equal(got["mxfp4"][k], got["bf16"][k]) for k in got["bf16"])
    if quant == "none":
        stacks = summaries["mxfp4"]["precision"]["expert_stacks"]
        stored = sum(w.numel() // 2 + w.numel() // 32 for w in want.values())  # codes and E8M0 scales
        assert stacks == {"mxfp4": {"count": 6, "bytes": stored}}, stacks
