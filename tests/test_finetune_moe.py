"""`narrows finetune` on a mixture of experts with `--quant nf4`: the experts are stored in
NF4 and the summary says so, the adapter leaves routers and routed experts frozen and says
why, and streamed training (every layer streamed) trains the adapter the resident run does."""

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
    resident, _ = run(tmp_path, "resident", "off")
    assert summary["stream"]["resident_layers"] == 0
    assert streamed.keys() == resident.keys() and all(torch.equal(streamed[k], resident[k]) for k in streamed)
    layers = 3
    precision = summary["precision"]
    assert precision["nf4_expert_stacks"] == 2 * layers and precision["nf4_linears"] == 4 * layers
    assert {k["kind"] for k in precision["kept_in_float"]} == {"routers", "vectors"}
    assert not any(".experts." in k or ".mlp.gate." in k for k in streamed)
    assert "routers (gate)" in summary["targets"] and "routed experts" in summary["targets"]
    assert "expert stacks" in said and "not adapted: routers" in said
