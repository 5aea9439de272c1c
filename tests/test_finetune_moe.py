"""`narrows finetune` on a mixture of experts with `--quant nf4`: the experts are stored in
NF4 and the summary says so, the adapter leaves routers and routed experts frozen and says
why, and streamed training (every layer streamed) trains the adapter the resident run does,
both through the fast MoE layer."""

import json

import pytest
import torch
from safetensors.torch import load_file

from narrows.core.app.cli import main
from narrows.core.testing import tiny_model_folder, write_jsonl

pytestmark = pytest.mark.bnb
ROWS = [{"text": " ".join(f"w{(7 * i + j) % 50}" for j in range(20))} for i in range(12)]


def run(tmp_path, name, budget):
    model = tiny_model_folder(tmp_path / "model", "qwen3_moe")
    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    base = ["--model", str(model), "--data", str(data), "--quant", "nf4", "--gpu-budget", budget]
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
    # the fast MoE layer on both sides: streamed training equal to the same kernels resident
    assert summary["kernels"] == resident_summary["kernels"] == "fast layers: all 3 decoder layers"
    assert summary["loss_kernels"] == ["tiles"]  # narrows-lmhead's tiles (no fused library on the CPU)
    assert streamed.keys() == resident.keys() and all(torch.equal(streamed[k], resident[k]) for k in streamed)
    layers = 3
    precision = summary["precision"]
    assert precision["nf4_expert_stacks"] == 2 * layers and precision["nf4_linears"] == 4 * layers
    assert {k["kind"] for k in precision["kept_in_float"]} == {"routers", "vectors"}
    assert not any(".experts." in k or ".mlp.gate." in k for k in streamed)
    assert "routers (gate)" in summary["targets"] and "routed experts" in summary["targets"]
    assert "expert stacks" in said and "not adapted: routers" in said


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
