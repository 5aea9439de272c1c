"""Top-k softmax approximation: the neighbour table, its cache, the vocabulary subset."""

import pytest
import torch

import narrows.lmhead as lmh
import narrows.lmhead.topk as topk_mod
from narrows.core import ResidentHead
from narrows.core.testing import tiny_batch, tiny_model, with_adapter


def test_table_rows_start_with_the_token_and_hold_its_nearest_by_cosine(tmp_path):
    g = torch.Generator().manual_seed(0)
    e = torch.randn(50, 8, generator=g)
    e[7] = e[3] * 5  # same direction: cosine 1, a tie with token 3 itself
    table = lmh.neighbour_table(e, 6, cache_dir=tmp_path, budget_bytes=4 * 50 * 9)  # 9-row tiles
    assert table.dtype == torch.int32 and table.shape == (50, 6)
    assert torch.equal(table[:, 0], torch.arange(50, dtype=torch.int32))
    assert table[3, 1] == 7 and table[7, 1] == 3
    n = torch.nn.functional.normalize(e, dim=1)
    sim = n @ n.t()
    for i in range(50):
        want = sim[i].clone()
        want[i] = torch.inf
        assert set(table[i].tolist()) == set(want.topk(6).indices.tolist())


def test_table_is_cached_by_content(tmp_path, monkeypatch):
    e = torch.randn(40, 8)
    first = lmh.neighbour_table(e, 5, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("neighbours-*-k5.pt"))) == 1 and not list(tmp_path.glob("*.tmp"))
    computed = []
    real = topk_mod._compute
    monkeypatch.setattr(topk_mod, "_compute", lambda *a: computed.append(1) or real(*a))
    assert torch.equal(lmh.neighbour_table(e.clone(), 5, cache_dir=tmp_path), first)
    assert computed == []  # same content: read from the cache
    lmh.neighbour_table(e + 1, 5, cache_dir=tmp_path)
    assert computed == [1]  # another matrix is another key
    with pytest.raises(ValueError, match="between 1 and the vocabulary size 40"):
        lmh.neighbour_table(e, 41, cache_dir=tmp_path)


def test_subset_holds_every_target_and_the_loss_is_ce_over_it():
    g = torch.Generator().manual_seed(1)
    head = torch.nn.Linear(16, 60, bias=False).requires_grad_(False)
    table = topk_mod._compute(head.weight, 4, 1 << 20, torch.device("cpu"))
    targets = torch.randint(0, 60, (9,), generator=g)
    ids = lmh.vocabulary_subset(targets, table)
    assert torch.equal(ids, torch.unique(table[targets].long()))
    assert torch.isin(targets, ids).all()
    hidden = torch.randn(9, 16, generator=g)
    w = torch.full((9,), 1 / 9)
    local = torch.searchsorted(ids, targets)
    ours = lmh.linear_cross_entropy(hidden, local, lmh.subset_head(ResidentHead.of(head), ids), w)
    logits = hidden @ head.weight.t()
    ref = torch.nn.functional.cross_entropy(logits[:, ids], local)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


def test_topk_trains_only_in_training_and_full_vocabulary_k_is_exact(tmp_path):
    def build(**kw):
        return lmh.apply(with_adapter(tiny_model("qwen3"), "lora"), neighbour_cache=tmp_path, **kw)

    exact = build().train()(**tiny_batch()).loss
    full_k = build(topk=256).train()(**tiny_batch()).loss  # the subset is the whole vocabulary
    torch.testing.assert_close(full_k, exact, rtol=1e-6, atol=1e-6)
    approx_model = build(topk=8)
    approx = approx_model.train()(**tiny_batch()).loss
    assert approx < exact  # fewer competitors in the softmax: a smaller loss, an approximation
    with torch.no_grad():
        evaluated = approx_model.eval()(**tiny_batch()).loss
    torch.testing.assert_close(evaluated, exact.detach(), rtol=1e-5, atol=1e-6)  # eval: full softmax
