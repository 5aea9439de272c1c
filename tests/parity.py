"""The seeded training loop the cross-package parity tests compare runs with."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from narrows.core.testing import tiny_batch


def run(model, *, steps: int = 3, grad_accum: int = 1, device: str = "cpu") -> list[torch.Tensor]:
    """AdamW steps on tiny batches: per-micro-step losses, gradients before every step,
    then the final trainable weights — every tensor a parity gate compares."""
    torch.manual_seed(0)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    record = []
    for step in range(steps):
        for micro in range(grad_accum):
            batch = {k: v.to(device) for k, v in tiny_batch(seed=grad_accum * step + micro).items()}
            loss = model(**batch).loss / grad_accum
            loss.backward()
            record.append(loss.detach().clone())
        record += [p.grad.clone() for p in params]
        opt.step()
        opt.zero_grad()
    return record + [p.detach().clone() for p in params]


def assert_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b) and a
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"tensor {i} differs by {(x.float() - y.float()).abs().max().item()}"


def one_process(args: list[str], out: Path, env: dict[str, str], ranks: int = 2) -> None:
    """The ranks' reference: `narrows` with `args` in one process of its own, accumulating
    `ranks` micro-batches a step (each rank's one), into `out`."""
    cmd = [sys.executable, "-m", "narrows.core.app.cli", *args, "--grad-accum", str(ranks), "--out", str(out)]
    one = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
