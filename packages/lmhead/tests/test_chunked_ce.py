"""Chunked exact cross-entropy against the full-logits reference."""

import pytest
import torch

from narrows.core import LogitMath, ResidentHead
from narrows.lmhead import linear_cross_entropies, linear_cross_entropy, reference_cross_entropy

# fp32: the tiles change only the summation order; bf16: logits and the per-tile gradient
# products are rounded to bf16 like HF's, the sums over tiles are fp32
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2e-2, atol=2e-3)}


def case(n=37, h=24, v=101, dtype=torch.float32, bias=False, seed=0, trainable=False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype).requires_grad_(True)
    head = torch.nn.Linear(h, v, bias=bias).to(dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(v, h, generator=g) * 0.3)
    head.requires_grad_(trainable)
    targets = torch.randint(0, v, (n,), generator=g)
    weights = torch.rand(n, generator=g)
    return hidden, head, targets, weights


def grads(loss, *tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None and t.requires_grad])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_rows,tile_bytes", [(16, 4 * 16 * 5), (101, 1 << 20), (7, 4 * 7 * 1)])
@pytest.mark.parametrize(
    "math",
    [LogitMath(), LogitMath(softcap=4.0), LogitMath(multiply=0.25), LogitMath(divide=8.0)],
    ids=["plain", "softcap", "multiply", "divide"],
)
@pytest.mark.parametrize("bias", [False, True])
def test_loss_and_hidden_gradient_match_the_reference(dtype, head_rows, tile_bytes, math, bias):
    hidden, head, targets, weights = case(dtype=dtype, bias=bias)
    source = ResidentHead.of(head, math=math)
    ours = linear_cross_entropy(hidden, targets, source, weights, head_rows=head_rows, tile_bytes=tile_bytes)
    ref = reference_cross_entropy(hidden, targets, head.weight, head.bias, weights, math)
    assert ours.dtype == torch.float32 and ours.shape == ()
    torch.testing.assert_close(ours, ref, **TOL[dtype])
    (g_ours,), (g_ref,) = grads(ours, hidden), grads(ref, hidden)
    assert g_ours.dtype == dtype
    torch.testing.assert_close(g_ours, g_ref, **TOL[dtype])


def test_a_training_head_gets_its_weight_gradient():
    hidden, head, targets, weights = case(bias=False, trainable=True)
    source = ResidentHead.of(head)
    ours = linear_cross_entropy(hidden, targets, source, weights, head_rows=16, tile_bytes=256)
    ref = reference_cross_entropy(hidden, targets, head.weight, None, weights)
    for a, b in zip(grads(ours, hidden, head.weight), grads(ref, hidden, head.weight)):
        torch.testing.assert_close(a, b, **TOL[torch.float32])


def test_the_incoming_gradient_scales_and_backward_recomputes_the_tiles():
    hidden, head, targets, weights = case()
    source = ResidentHead.of(head)
    (g1,) = grads(linear_cross_entropy(hidden, targets, source, weights), hidden)
    (g3,) = grads(3.0 * linear_cross_entropy(hidden, targets, source, weights), hidden)
    torch.testing.assert_close(g3, 3.0 * g1)
    calls = []

    class Counting(ResidentHead):
        def chunks(self, rows=None):
            calls.append(rows)
            return super().chunks(rows)

    with torch.no_grad():
        linear_cross_entropy(hidden, targets, Counting(head.weight), weights)
    without_grad = len(calls)
    loss = linear_cross_entropy(hidden, targets, Counting(head.weight), weights)
    with_grad = len(calls) - without_grad
    assert with_grad == without_grad > 0  # forward is one log-sum-exp pass either way
    loss.backward()
    assert len(calls) == 2 * without_grad + with_grad  # backward reads the head once more


def test_fp64_reference_bounds_the_bf16_error():
    """bf16 inputs, fp32 accumulation: no worse against fp64 than HF's own bf16 path."""
    hidden, head, targets, weights = case(n=64, h=64, v=300, dtype=torch.bfloat16)
    exact = reference_cross_entropy(hidden.double(), targets, head.weight.double(), None, weights.double())
    ours = linear_cross_entropy(hidden, targets, ResidentHead.of(head), weights, head_rows=64)
    hf = reference_cross_entropy(hidden, targets, head.weight, None, weights)
    assert abs(ours.double() - exact) <= abs(hf.double() - exact) + 1e-3 * abs(exact)


def test_shapes_are_checked():
    hidden, head, targets, weights = case()
    with pytest.raises(ValueError, match=r"\[N, H\]"):
        linear_cross_entropy(hidden[None], targets, ResidentHead.of(head), weights)


class HostLikeSource:
    """A head source that is not a ResidentHead (as a streamed head is): the loss reads it
    vocabulary-chunk-outside, in two passes."""

    trainable_weight = None
    math = LogitMath()

    def __init__(self, weight):
        self.inner = ResidentHead(weight)
        self.vocab_size, self.hidden_size = weight.shape
        self.dtype, self.device = weight.dtype, weight.device

    def chunks(self, rows=None):
        return self.inner.chunks(rows)

    def gather(self, index):
        return self.inner.gather(index)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_tile_orders_give_the_same_bits(dtype):
    hidden, head, targets, weights = case(n=70, dtype=dtype)
    kw = dict(head_rows=16, tile_bytes=4 * 16 * 9)
    a = linear_cross_entropy(hidden, targets, ResidentHead.of(head), weights, **kw)
    b = linear_cross_entropy(hidden, targets, HostLikeSource(head.weight.detach()), weights, **kw)
    assert torch.equal(a, b)
    assert torch.equal(*(torch.autograd.grad(0.3 * x, hidden)[0] for x in (a, b)))


def test_fused_dispatch_falls_back_or_says_why_not():
    from narrows.core import NarrowsError
    from narrows.lmhead import LossOptions, causal_lm_loss

    hidden, head, targets, _ = case()
    labels = torch.cat([torch.tensor([-100]), targets])[None]
    h = torch.cat([hidden, hidden[:1]])[None]
    source = ResidentHead.of(head)
    off = causal_lm_loss(h, labels, source, LossOptions(fused="off"))
    auto = causal_lm_loss(h, labels, source, LossOptions(fused="auto"))  # CPU: the pure-PyTorch tiles
    assert torch.equal(off, auto)
    for library in ("cce", "liger"):  # asked for by name: it or an error saying why not
        with pytest.raises(NarrowsError, match=f"fused='{library}' cannot run here: {library}: "):
            causal_lm_loss(h, labels, source, LossOptions(fused=library))
    with pytest.raises(ValueError, match="fused must be one of"):
        LossOptions(fused="triton")


def test_loss_options_parse_from_their_short_form():
    """``--lmhead``'s text is LossOptions' short form: the parts named are on, the others off."""
    from narrows.lmhead import LossOptions

    assert LossOptions.parse("mask,chunked") == LossOptions()
    assert LossOptions.parse("chunked, topk=1000,fused=off") == LossOptions(
        mask=False, chunked=True, topk=1000, fused="off"
    )
    assert LossOptions.parse("") == LossOptions(mask=False, chunked=False)
    with pytest.raises(ValueError, match="unknown part 'fast'; use mask, chunked, topk=K"):
        LossOptions.parse("mask,fast")
    assert LossOptions.parse("mask,chunked,fused=liger") == LossOptions(fused="liger")
    with pytest.raises(ValueError, match="unknown part 'fused=triton'"):
        LossOptions.parse("fused=triton")
    with pytest.raises(ValueError, match="topk needs an integer"):
        LossOptions.parse("topk=many")


class CountingHostSource(HostLikeSource):
    def __init__(self, weight):
        super().__init__(weight)
        self.passes = 0

    def chunks(self, rows=None):
        self.passes += 1
        return super().chunks(rows)


def _items(count, dtype):
    """`count` micro-batches of different lengths over one head."""
    cases = [case(n=23 + 9 * k, dtype=dtype, seed=k) for k in range(count)]
    head = cases[0][1]
    return head, [(hidden, targets, weights) for hidden, _, targets, weights in cases]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("host", [True, False])
def test_several_items_in_one_pass_are_each_items_own_bits(dtype, host):
    """One read of a streamed head in forward and one in backward for all items; every
    item's loss and hidden-state gradient equal its own call's (different incoming
    gradients included)."""
    head, items = _items(3, dtype)
    kw = dict(head_rows=16, tile_bytes=4 * 16 * 9)
    scales = (0.25, 1.0, 3.0)
    source = CountingHostSource(head.weight.detach()) if host else ResidentHead.of(head)
    alone = [linear_cross_entropy(h, t, source, w, **kw) for h, t, w in items]
    want = [torch.autograd.grad(c * x, h)[0] for c, x, (h, _, _) in zip(scales, alone, items)]
    passes = getattr(source, "passes", 0)
    together = linear_cross_entropies(items, source, **kw)
    got = torch.autograd.grad([c * x for c, x in zip(scales, together)], [h for h, _, _ in items])
    if host:
        assert source.passes - passes == 2
    assert all(torch.equal(a, b) for a, b in zip(alone, together))
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_items_paired_with_another_items_weights_differ():
    """Twin: the comparison above sees an item computed with another item's data."""
    head, items = _items(2, torch.float32)
    source = HostLikeSource(head.weight.detach())
    (h0, t0, w0), (h1, t1, w1) = items
    swapped = [(h0, t0, w1[: len(w0)]), (h1, t1, w1)]
    assert not torch.equal(
        linear_cross_entropies(swapped, source)[0], linear_cross_entropy(h0, t0, source, w0)
    )


def test_a_training_head_takes_one_item_at_a_time():
    hidden, head, targets, weights = case(trainable=True)
    with pytest.raises(ValueError, match="one item at a time"):
        linear_cross_entropies([(hidden, targets, weights)] * 2, ResidentHead.of(head))
    assert linear_cross_entropies([], ResidentHead.of(head)) == []


@pytest.fixture
def fake_liger(monkeypatch):
    """Liger's functional entry point in PyTorch (it runs on CUDA only): full logits, the
    cross-entropy of each row, rows with `ignore_index` left out, summed or not; yields the
    reductions it was asked for."""
    import importlib.machinery
    import sys
    import types

    from narrows.core.optional import is_available

    calls = []

    def fused(input, weight, target, ignore_index=-100, reduction="mean", softcap=None, chunk_mem_const=1):
        calls.append(reduction)
        keep = target != ignore_index
        nll = torch.nn.functional.cross_entropy(
            (input @ weight.T).float(), torch.where(keep, target, 0), reduction="none"
        )
        nll = torch.where(keep, nll, 0.0)
        return nll.sum() if reduction == "sum" else nll

    functional = types.ModuleType("liger_kernel.transformers.functional")
    functional.liger_fused_linear_cross_entropy = fused
    for name, module in (
        ("liger_kernel", types.ModuleType("liger_kernel")),
        ("liger_kernel.transformers", types.ModuleType("liger_kernel.transformers")),
        ("liger_kernel.transformers.functional", functional),
    ):
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)  # found, as installed
        monkeypatch.setitem(sys.modules, name, module)
    is_available.cache_clear()
    yield calls
    monkeypatch.undo()
    is_available.cache_clear()


@pytest.mark.parametrize("mask", [True, False])
def test_liger_sums_rows_that_weigh_alike_and_the_sum_is_scaled(fake_liger, mask):
    """Where every trainable row weighs the same (`LossRows.scale`), Liger is asked for a
    sum over the rows that count (its forward then computes the gradient; per-row weights
    would run the head again in its backward): loss and gradient equal the weighted rows'
    (the untrained rows, present without `mask`, must be left out, not summed)."""
    from narrows.lmhead.fused import fused_cross_entropy
    from narrows.lmhead.loss import LossOptions, loss_rows

    hidden, head, targets, _ = case()
    labels = torch.cat([torch.tensor([-100]), targets])[None].clone()
    labels[0, 5:12] = -100  # a prompt's rows: no loss
    h = torch.cat([hidden, hidden[:1]])[None]
    rows = loss_rows(h, labels, ResidentHead.of(head), LossOptions(mask=mask))
    trained = rows.weights[rows.weights > 0]
    assert torch.equal(trained, torch.full_like(trained, float(rows.scale)))
    assert (rows.weights == 0).any() != mask  # without mask the untrained rows stay, weighing 0
    source = ResidentHead.of(head)
    summed = fused_cross_entropy(rows.hidden, rows.targets, source, rows.weights, "liger", scale=rows.scale)
    weighed = fused_cross_entropy(rows.hidden, rows.targets, source, rows.weights, "liger")
    assert fake_liger == ["sum", "none"]
    want = reference_cross_entropy(rows.hidden, rows.targets, head.weight, None, rows.weights, LogitMath())
    want_grad = torch.autograd.grad(want, hidden, retain_graph=True)
    for got in (summed, weighed):
        torch.testing.assert_close(got, want, **TOL[torch.float32])
        got_grad = torch.autograd.grad(got, hidden, retain_graph=True)
        torch.testing.assert_close(got_grad, want_grad, **TOL[torch.float32])
