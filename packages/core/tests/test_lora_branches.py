"""`fuse_lora`: each PEFT LoRA linear's branch as one autograd node trains the same bits
as PEFT — loss, logits, every adapter gradient, over two accumulated micro-batches — on
float and NF4 bases, with float32 adapters on a bf16 model (the cast path) and without;
a shared input is cast and saved once; calls the node does not cover go to PEFT. Each
claim has a twin that shows the test would see it broken."""

from __future__ import annotations

import pytest
import torch

import narrows.core.kernels.lora_branches as lora_branches
from narrows.core import LoraBranch, fuse_lora, lora_branch_reference, quantize_nf4, unfuse_lora
from narrows.core.kernels.lora_branches import _FusedForward
from narrows.core.testing import TINY_ARCHITECTURES, tiny_batch, tiny_model, with_adapter


def _model(arch="llama", dtype=torch.bfloat16, base="float", kind="lora", dropout=0.0):
    model = tiny_model(arch, dtype=dtype)
    if base == "nf4":
        model = quantize_nf4(model)
    return with_adapter(model, kind, dropout=dropout).train()


def _run(model, micro_batches=2) -> list[torch.Tensor]:
    """Loss and logits of each micro-batch, then every adapter gradient accumulated."""
    for p in model.parameters():
        p.grad = None
    seen = []
    for seed in range(micro_batches):
        out = model(**tiny_batch(seed=seed + 1))
        (out.loss / micro_batches).backward()
        seen += [out.loss.detach(), out.logits.detach()]
    return seen + [p.grad.clone() for p in model.parameters() if p.requires_grad]


def _branch_nodes(model) -> int:
    """LoraBranch nodes in one forward's graph."""
    loss = model(**tiny_batch()).loss
    seen, stack, count = set(), [loss.grad_fn], 0
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        count += type(fn).__name__ == "LoraBranchBackward"
        stack += [f for f, _ in fn.next_functions]
    return count


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


CASES = [
    ("llama", torch.bfloat16, "float"),  # float32 adapters on bf16: the cast path, adds promoted
    ("qwen2", torch.float32, "float"),  # no cast; biased q/k/v
    pytest.param("llama", torch.bfloat16, "nf4", marks=pytest.mark.bnb),  # Linear4bit: casts, then adds
    pytest.param("qwen2", torch.float32, "nf4", marks=pytest.mark.bnb),
]


@pytest.mark.parametrize(("arch", "dtype", "base"), CASES)
def test_fused_linears_train_bit_identically(arch, dtype, base):
    if base == "nf4":
        pytest.importorskip("bitsandbytes")
    model = _model(arch, dtype, base)
    linears = sum(1 for m in model.modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer"))
    ref = _run(model)
    assert fuse_lora(model) == linears > 0
    assert _branch_nodes(model) == linears
    assert _same(ref, _run(model))
    assert unfuse_lora(model) == linears and _branch_nodes(model) == 0
    assert _same(ref, _run(model))


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_every_architecture_trains_the_same_bits_fused(arch):
    """bf16 models with PEFT's float32 adapters (the shared cast) on every architecture
    narrows announces: MoE experts, fused projections, parallel residuals included."""
    model = _model(arch, torch.bfloat16)
    ref = _run(model)
    assert fuse_lora(model) > 0
    assert _same(ref, _run(model))


def test_fused_linears_under_gradient_checkpointing():
    """transformers' checkpointing recomputes each layer in the backward (in autograd's
    thread): the casts are made and shared again there, and the bits stay PEFT's."""
    model = _model("llama", torch.bfloat16)
    ref = _run(model)
    model.gradient_checkpointing_enable()
    fuse_lora(model)
    assert _same(ref, _run(model))


def test_the_reference_is_what_peft_computes():
    """`lora_branch_reference` against a PEFT layer's own forward, both forms."""
    model = _model("llama", torch.bfloat16)
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    x = torch.randn(2, 5, q.in_features, dtype=torch.bfloat16)
    a, b, s = q.lora_A["default"].weight, q.lora_B["default"].weight, q.scaling["default"]
    with torch.no_grad():
        assert torch.equal(q(x), lora_branch_reference(q.base_layer(x), x, a, b, s, promote=True))
        assert torch.equal(
            LoraBranch.apply(q.base_layer(x), x, x.to(a.dtype), a, b, s, True),
            lora_branch_reference(q.base_layer(x), x, a, b, s, promote=True),
        )


def test_adding_before_the_cast_is_seen():
    """Twin: running PEFT's lora.Linear as if it cast before adding (Linear4bit's order)
    changes the bits, and the test sees it."""
    model = _model("llama", torch.bfloat16)
    ref = _run(model)
    fuse_lora(model)
    for m in model.modules():
        if isinstance(m.__dict__.get("forward"), _FusedForward):
            m.forward.promote = False
    assert not _same(ref, _run(model))


def test_a_backward_without_the_scale_is_seen(monkeypatch):
    """Twin: a backward that forgets the scaling changes the adapter gradients."""
    model = _model("llama", torch.bfloat16)
    ref = _run(model)
    fuse_lora(model)
    original = LoraBranch.backward

    def unscaled(ctx, grad):
        ctx.scaling = 1.0
        return original(ctx, grad)

    monkeypatch.setattr(LoraBranch, "backward", staticmethod(unscaled))
    got = _run(model)
    assert _same(ref[:4], got[:4]) and not _same(ref, got)  # same forward, other gradients


def _saved_bytes(model) -> int:
    """Bytes of the distinct non-parameter tensors one forward saves for backward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**tiny_batch()).loss.backward()
    return sum(seen.values())


def test_a_shared_input_is_cast_and_saved_once(monkeypatch):
    """Float32 adapters on bf16: q/k/v share one float32 copy of their input, gate/up
    another — three copies fewer per layer than PEFT saves. Twin: casting per linear
    saves what PEFT saves."""
    model = _model("llama", torch.bfloat16)
    cfg = model.config
    batch = tiny_batch()
    tokens = batch["input_ids"].numel()
    peft = _saved_bytes(model)
    fuse_lora(model)
    fused = _saved_bytes(model)
    assert peft - fused == cfg.num_hidden_layers * 3 * tokens * cfg.hidden_size * 4
    monkeypatch.setattr(lora_branches, "_cast_once", lambda x, dtype: x.to(dtype))
    assert _saved_bytes(model) == peft


@pytest.mark.parametrize("frozen", ["lora_A", "lora_B"])
def test_frozen_adapter_weights_save_no_more_than_peft(frozen):
    """A matmul keeps its input only where its weight trains: with lora_A (or lora_B)
    frozen PEFT keeps no cast input (no low-rank input), and neither does the node."""
    model = _model("llama", torch.bfloat16)
    for name, p in model.named_parameters():
        if frozen in name:
            p.requires_grad_(False)
    ref, peft = _run(model), _saved_bytes(model)
    fuse_lora(model)
    assert _same(ref, _run(model))
    assert _saved_bytes(model) == peft if frozen == "lora_A" else _saved_bytes(model) < peft


def test_inference_mode_and_pickling():
    """Inference tensors carry no version counter: each call casts anew, same outputs.
    A pickled fused model loads back, still fused."""
    import io

    model = _model("llama", torch.bfloat16)
    batch = tiny_batch()
    with torch.inference_mode():
        ref = model(**batch).logits
    fuse_lora(model)
    with torch.inference_mode():
        assert torch.equal(ref, model(**batch).logits)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert _branch_nodes(loaded) == _branch_nodes(model) > 0
    with torch.inference_mode():
        assert torch.equal(ref, loaded(**batch).logits)


def test_a_fused_model_is_freed_with_its_last_reference():
    """The fused forward holds its module weakly: no reference cycle keeps a deleted model
    (and its device memory) alive until the garbage collector runs."""
    import gc
    import weakref

    model = _model("llama", torch.float32)
    fuse_lora(model)
    gone = weakref.ref(model)
    gc.disable()
    try:
        del model
        assert gone() is None
    finally:
        gc.enable()


def test_hooks_keep_peft_s_forward():
    """A backward hook on an adapter's module, or a forward something else replaced on the
    linear (accelerate's hooks), keeps that linear on PEFT's path: the hooks still run."""
    model = _model("llama", torch.bfloat16)
    attn = model.base_model.model.model.layers[0].self_attn
    fired = []
    attn.q_proj.lora_A["default"].register_full_backward_hook(lambda *args: fired.append(1))
    original = attn.k_proj.forward
    attn.k_proj.forward = lambda x, *a, **k: original(x, *a, **k)
    linears = sum(1 for m in model.modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer"))
    assert fuse_lora(model) == linears - 1  # k_proj left alone
    assert _branch_nodes(model) == linears - 2  # q_proj's calls go to PEFT
    model(**tiny_batch()).loss.backward()
    assert fired


@pytest.mark.parametrize("why", ["dropout", "dora", "autocast", "disabled", "two adapters"])
def test_calls_the_node_does_not_cover_go_to_peft(why):
    model = _model(
        "llama",
        torch.float32,
        kind="dora" if why == "dora" else "lora",
        dropout=0.1 if why == "dropout" else 0.0,
    )
    if why == "two adapters":
        from peft import LoraConfig

        model.add_adapter("other", LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
        model.base_model.set_adapter(["default", "other"])
    fuse_lora(model)
    if why == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert _branch_nodes(model) == 0
    elif why == "disabled":
        with model.disable_adapter():
            assert _branch_nodes(model) == 0
    else:
        assert _branch_nodes(model) == 0


def test_summing_the_shared_inputs_gradient_in_float32_is_seen(monkeypatch):
    """Twin: the naive sharing — one differentiable float32 cast that q/k/v (gate/up)
    all read, so their input gradients add up in float32 before one cast back — changes
    the bits. Each node returning its own, cast, at PEFT's moment is what keeps them."""
    model = _model("llama", torch.bfloat16)
    ref = _run(model)
    fuse_lora(model)
    casts: dict[int, torch.Tensor] = {}

    def shared_cast(x, dtype):
        key = id(x)
        if key not in casts or casts[key][0] is not x:
            casts[key] = (x, x.to(dtype))
        return casts[key][1]

    class Through:
        @staticmethod
        def apply(result, x, xa, *rest):
            return LoraBranch.apply(result, xa, xa, *rest)

    monkeypatch.setattr(lora_branches, "_cast_once", shared_cast)
    monkeypatch.setattr(lora_branches, "LoraBranch", Through)
    got = _run(model)
    assert _same(ref[:4], got[:4]) and not _same(ref, got)


@pytest.mark.gpu
@pytest.mark.parametrize("base", ["float", pytest.param("nf4", marks=pytest.mark.bnb)])
def test_fused_linears_are_bit_identical_on_cuda(base):
    """cuBLAS picks kernels by operand layout: the node's backward issues PEFT's layouts,
    so the bits hold on the GPU too (deterministic kernels, bf16 model, float32 adapters)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if base == "nf4":
        pytest.importorskip("bitsandbytes")
    import os

    from narrows.core import deterministic

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    deterministic(True)
    model = _model("qwen2", torch.bfloat16, base).cuda()
    batch = {k: v.cuda() for k, v in tiny_batch(seq=96).items()}

    def run():
        for p in model.parameters():
            p.grad = None
        out = model(**batch)
        out.loss.backward()
        return [out.logits.detach()] + [p.grad.clone() for p in model.parameters() if p.requires_grad]

    ref = run()
    assert fuse_lora(model) > 0
    assert _same(ref, run())
