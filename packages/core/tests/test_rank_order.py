"""`rank_ordered_sum`: four ranks in DDP (torchrun, gloo), one micro-batch each, give the
gradients one process gets accumulating the four micro-batches in rank order, bit for bit;
an all-reduce does not (its twin: values whose float32 sum depends on the order)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from narrows.core.testing import child_env

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from rank_order_worker import ORDER_SENSITIVE, micro_batch, net  # noqa: E402

WORLD = 4


@pytest.fixture(scope="module", params=["sum", "mean"])
def ranked(tmp_path_factory, request) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("order") / "rank0.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}"]
    cmd += [str(HERE / "rank_order_worker.py"), str(out), request.param]
    done = subprocess.run(
        cmd, capture_output=True, text=True, env=child_env(OMP_NUM_THREADS="1"), timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out), request.param


def test_ranks_equal_one_process_accumulating_in_rank_order(ranked):
    got, how = ranked
    model = net()
    for k in range(WORLD):  # autograd adds each micro-batch's gradient to .grad in turn
        loss = model(micro_batch(k)).square().sum()
        (loss / WORLD if how == "mean" else loss).backward()
    want = [p.grad for p in model.parameters()]
    assert got["world"] == WORLD and all(torch.equal(a, b) for a, b in zip(want, got["grads"]))


def test_the_sum_is_in_rank_order_where_an_all_reduce_is_not(ranked):
    got, _ = ranked
    folded = torch.tensor(0.0)
    for v in ORDER_SENSITIVE:
        folded = folded + torch.tensor(v)
    assert folded.item() == 1.0 and torch.equal(got["hooked"], torch.full((5,), 1.0))
    assert not torch.equal(got["reduced"], got["hooked"])  # gloo's ring adds each chunk in its own order
