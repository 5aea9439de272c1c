"""`narrows finetune --gpu-budget` below what the adapters alone take on the device: refused
before any weight is read, the adapters counted on the model's skeleton with the run's
targets and checked against a count from the config's shapes."""

from __future__ import annotations

import json

import pytest

from narrows.core.app.cli import main
from narrows.core.testing import tiny_model_folder, write_jsonl

pytest.importorskip("narrows.stream")  # --gpu-budget streams the base
ROWS = [{"text": " ".join(f"w{(7 * i + j) % 50}" for j in range(12))} for i in range(8)]


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_a_budget_the_adapters_alone_overflow_is_refused_before_the_model_loads(tmp_path, capsys, arch):
    """The adapters' weights, gradients and AdamW moments (4 + 4 + 8 bytes a parameter, fp32)
    against --gpu-budget, counted on the model's skeleton before any weight is read; the
    count checked against one from the config's shapes. --offload-optimizer leaves 8 bytes."""
    model = tiny_model_folder(tmp_path / "model", arch)
    data = write_jsonl(tmp_path / "train.jsonl", ROWS)
    config = json.loads((model / "config.json").read_text())
    hidden, layers, r = config["hidden_size"], config["num_hidden_layers"], 4
    head = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head, config["num_key_value_heads"] * head
    attention = (hidden + q) + 2 * (hidden + kv) + (q + hidden)  # q, k, v, o: r (in + out) each
    if arch == "llama":  # all-linear: the MLP's three too
        per_layer = attention + 3 * (hidden + config["intermediate_size"])
        targets = "all-linear"
    else:  # attention, and every routed expert's gate_up [2I, H] and down [H, I]
        experts, inter = config["num_local_experts"], config["moe_intermediate_size"]
        per_layer = attention + experts * ((hidden + 2 * inter) + (inter + hidden))
        targets = "all-linear,experts"
    numel = layers * r * per_layer
    args = ["--model", str(model), "--data", str(data), "--rank", str(r), "--targets", targets]
    args += ["--out", str(tmp_path / "run")]
    for flags, per_param in (([], 16), (["--offload-optimizer"], 8)):
        budget = f"{numel * per_param - 1}B"  # one byte short
        code = main(["finetune", *args, "--gpu-budget", budget, *flags])
        err = capsys.readouterr().err
        assert code == 2, err
        assert f"cannot hold the adapters alone: {numel:,} trainable parameters" in err
        assert "loading the model" not in err  # refused before any weight
        assert ("--offload-optimizer" in err) == (not flags)
