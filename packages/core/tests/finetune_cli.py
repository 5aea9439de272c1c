"""Helpers of the `narrows finetune` end-to-end tests (`test_finetune_cli.py`,
`test_finetune_cli_interrupted.py`): the real CLI in a subprocess on a tiny model folder, and
what a run leaves in its folder (each test file's module fixture `job` calls `make_job`).
"""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from safetensors.torch import load_file

from narrows.core.testing import child_env, interruptible, tiny_model_folder, write_jsonl

ROWS = [
    {"messages": [{"role": "user", "content": f"{a}+{b}?"}, {"role": "assistant", "content": f"{a + b}"}]}
    for a in range(6)
    for b in range(4)
]


def make_job(tmp_path_factory):
    """A tiny model folder, its train and eval data, and the CLI arguments every run of a test
    file shares: `(root, args)`."""
    root = tmp_path_factory.mktemp("finetune")
    model = tiny_model_folder(root / "model")
    data = write_jsonl(root / "train.jsonl", ROWS[:20])
    evals = write_jsonl(root / "eval.jsonl", ROWS[20:])
    args = [
        "--model",
        str(model),
        "--data",
        str(data),
        "--eval-data",
        str(evals),
        "--rank",
        "4",
        "--dropout",
        "0.1",
        "--batch",
        "2",
        "--grad-accum",
        "2",
        "--seq-len",
        "64",
        "--lr",
        "1e-2",
        "--save-every",
        "2",
        "--no-progress",
    ]
    return root, args


def cli(*args, wait=True):
    cmd = [sys.executable, "-m", "narrows.core.app.cli", "finetune", *args]
    env = child_env()
    if wait:
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, preexec_fn=interruptible
    )


def losses(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r.get("loss"), r.get("eval_loss")) for r in rows]


def adapter(out):
    return load_file(out / "adapter_model.safetensors")


def assert_same_adapter(a, b):
    wa, wb = adapter(a), adapter(b)
    assert wa.keys() == wb.keys() and wa
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
