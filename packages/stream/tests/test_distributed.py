"""Data parallel over a streamed base with torch.distributed (gloo on the CPU), launched
the way users launch it (`torchrun`): two ranks, each one micro-batch of the global batch,
are `torch.equal` to one process accumulating both micro-batches — dropout included, and
against a *resident* model. narrows' wrapper adds the ranks' gradients in rank order
(`rank_ordered_sum`, at any number of ranks: `test_rank_order.py` in core); torch's own DDP
all-reduces, which for two values is one addition, and DDP's division by the world size
(2) is exact: (g0 + g1) / 2 = g0/2 + g1/2 bit for bit, the sum one process accumulates
(0 + g0/2 + g1/2). A plan made under a process group prices DDP's gradient buckets."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch
from helpers import assert_identical, build

from narrows.core.testing import child_env, mapped_file, mapping_memory, tiny_model_folder

HERE = Path(__file__).parent
WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> Path:
    """One torchrun launch, two ranks: DDP, its fault twin, a diverged rank, and a
    checkpoint folder both ranks load (its cache built by the first)."""
    root = tmp_path_factory.mktemp("ddp")
    out = root / "run"
    tiny_model_folder(root / "model", num_hidden_layers=3)
    env = child_env(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(HERE), *sys.path]))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={WORLD}",
        str(HERE / "ddp_worker.py"),
        str(out),
        str(root / "model"),
        str(root / "cache"),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def _load(out: Path, mode: str) -> list[dict]:
    return [torch.load(f"{out}.{mode}.rank{r}.pt") for r in range(WORLD)]


@pytest.fixture(scope="module")
def reference():
    """One process, one thread like each rank: a CPU matmul's summation order can depend
    on the thread count."""
    from ddp_worker import model, sequential

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return sequential(model(), WORLD)
    finally:
        torch.set_num_threads(threads)


def _as_ranks(ref: dict) -> list[dict]:
    """The reference's losses split the way the ranks see them (rank r: micro-batch r)."""
    return [{**ref, "loss": ref["loss"][r::WORLD]} for r in range(WORLD)]


@pytest.mark.parametrize("wrapper", ["ddp", "plain"])
def test_two_streamed_ranks_equal_one_resident_process_accumulating(ranks, reference, wrapper):
    """`ns.data_parallel`, and torch's own DDP as accelerate and Trainer build it (stream()
    leaves the frozen base out of any DDP)."""
    for got, want in zip(_load(ranks, wrapper), _as_ranks(reference)):
        assert_identical(want, got)


def test_ranks_that_do_not_all_reduce_are_caught(ranks, reference):
    """Fault twin: the same ranks without DDP's gradient all-reduce."""
    with pytest.raises(AssertionError):
        for got, want in zip(_load(ranks, "local"), _as_ranks(reference)):
            assert_identical(want, got)


def test_a_diverged_rank_stops_every_rank_with_its_name(ranks):
    for r in range(WORLD):
        said = Path(f"{ranks}.diverged.rank{r}.txt").read_text()
        assert said.startswith("rank 1 differs from rank 0 in trainable"), said


def test_step_mode_under_data_parallel_is_refused(ranks):
    said = Path(f"{ranks}.diverged.rank0.txt").read_text()
    assert "step mode under data_parallel is not supported yet" in said, said


def test_data_parallel_needs_a_process_group():
    from helpers import build

    import narrows.stream as ns

    with pytest.raises(ns.StreamSetupError, match="init_process_group"):
        ns.data_parallel(build(num_hidden_layers=2))


def _shared(out: Path) -> list[dict]:
    return [torch.load(f"{out}.shared.rank{r}.pt") for r in range(WORLD)]


def test_ranks_of_one_machine_map_one_host_copy(ranks):
    """Under torchrun every rank's host slabs are the cache file's pages, mapped read-only,
    not copies: each rank's Pss of the file is half its Rss (two sharers). One rank built
    the cache; the other waited for it."""
    got = _shared(ranks)
    for r in got:
        assert r["shared"] == tuple(range(r["layers"])) and r["homes"] == [r["cache"]]
        rss, pss = r["memory"]["Rss"], r["memory"]["Pss"]
        assert rss * 1024 >= r["slab_bytes"]  # every slab's pages are resident (checked by CRC)
        assert pss <= 0.55 * rss, r["memory"]
        # the embedding too: a read-only map of the checkpoint file that holds it
        assert r["embedding"].endswith(".safetensors") and Path(r["embedding"]).parent.name == "model"
    built = [any(n.startswith("this process built") for n in r["notes"]) for r in got]
    assert sorted(built) == [False, True]


def test_ranks_on_the_shared_copy_train_as_one_process_on_its_own(ranks, tmp_path):
    """Two DDP ranks over the shared maps equal one process accumulating both micro-batches
    over a private copy of the same checkpoint (no cache at all)."""
    from ddp_worker import private_copy

    folder = Path(_shared(ranks)[0]["cache"]).parent.parent / "model"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        params = private_copy(str(folder), WORLD)
    finally:
        torch.set_num_threads(threads)
    for r in _shared(ranks):
        assert len(r["weight"]) == len(params) > 0
        assert all(torch.equal(a, b) for a, b in zip(r["weight"], params))


def test_share_needs_a_cache_and_its_twins_fail_the_checks(tmp_path):
    """The twins of the shared-copy checks: a private copy lives in anonymous memory, and
    a map no other process shares fails the Pss check the shared one passes."""
    import narrows.stream as ns
    from narrows.core import NarrowsError

    folder = tiny_model_folder(tmp_path / "model", num_hidden_layers=2)
    with pytest.raises(NarrowsError, match="share=True maps the prepared cache file"):
        ns.from_pretrained(folder, cache=False, share=True)
    own_model = ns.from_pretrained(folder, dtype=torch.float32, cache=tmp_path / "cache", share=False)
    own = own_model.narrows.tiers
    homes = {mapped_file(h.data_ptr()) for h in own.homes}
    assert own.shared == () and homes and str(own.cache.path) not in homes  # anonymous memory
    assert not mapped_file(own_model.get_input_embeddings().weight.data_ptr()).endswith(".safetensors")
    gone = weakref.ref(own)
    del own_model, own  # its cache map too: the file's pages mapped twice here would halve their Pss
    deadline = time.monotonic() + 30  # a loader thread may hold the last reference a moment longer
    while gone() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert gone() is None, "the private model's tiers outlived it"
    alone = ns.from_pretrained(
        folder, dtype=torch.float32, cache=tmp_path / "cache", share=True
    ).narrows.tiers
    assert alone.shared == (0, 1)
    memory = mapping_memory(str(alone.cache.path))
    # the shared check (Pss <= 0.55 Rss) fails for it, counting each page once: this process
    # may map the file twice (mapped again as it grew while being written), which halves
    # each mapping's Pss without any other process sharing it (seen in CI: Pss 300 of Rss
    # 556 kB)
    assert memory["RssLargest"] > 0 and memory["Pss"] > 0.55 * memory["RssLargest"], memory


def test_a_plan_under_several_ranks_prices_the_gradient_buckets(monkeypatch):
    """DDP keeps a copy of every trainable gradient in its buckets, and `rank_ordered_sum`
    gathers one bucket from every rank: the plan's fixed bytes hold both, its report says so."""
    import narrows.stream as ns
    from narrows.core import data_parallel_bytes, trainable_parameters
    from narrows.stream.planning import planner

    model = build(num_hidden_layers=3)
    alone = ns.plan(model, "64MiB", device="cpu")
    monkeypatch.setattr(planner, "data_parallel_ranks", lambda: 4)
    four = ns.plan(model, "64MiB", device="cpu")
    grads = sum(p.numel() * p.element_size() for p in trainable_parameters(model).values())
    assert grads > 0 and (alone.ranks, four.ranks) == (1, 4) and alone.data_parallel_bytes == 0
    assert four.data_parallel_bytes == data_parallel_bytes(grads, 4) == grads + 4 * grads  # buckets < 25 MiB
    assert four.fixed_bytes - alone.fixed_bytes == four.data_parallel_bytes
    assert "DDP's gradient buckets over 4 ranks" in str(four)
