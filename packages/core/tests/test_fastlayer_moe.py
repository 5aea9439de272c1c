"""Fast MoE decoder layers (`narrows.core.kernels.fastlayer.moe`): close to the model's own
code in float32 on Qwen3-MoE, Qwen2-MoE (its shared expert adapted), Mixtral, OLMoE
(Q/K norms over all heads), GLM-4-MoE, gpt-oss (attention sinks, biased experts with a
clamped SwiGLU) and DeepSeek-V3 (multi-head latent attention in each of its layouts, a
KV cache of its latents), the router's gradient included; recompute and keeping train the same bits; quantised experts
dequantised once a pass, one stack at a time; torch's grouped matmul equal to its reference; uncovered
blocks refused with their reason. Each claim has a twin that would show it broken."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from narrows.core import fuse_layers, lora_targets, unfuse_layers
from narrows.core.kernels.fastlayer import grouped, moe, ops, parts_of, why_not
from narrows.core.protocol.expert_adapters import adopt_quantized_experts
from narrows.core.quant.experts import moe_blocks, quantize_experts
from narrows.core.testing import tiny_batch, tiny_model, watch_expert_stacks

MOE = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "glm4_moe", "gpt_oss", "deepseek_v3")
ARCH_EXPERTS = [(a, e) for a in MOE for e in (False, True)]


def arch_ids(v):
    return ("experts" if v else "attention") if isinstance(v, bool) else v


def _model(arch, dtype=torch.float32, dropout=0.0, scheme=None, seed=0, experts=False, limit=0.05, **config):
    """A tiny MoE (its config's fields overridden by `config`) with LoRA on narrows' default
    targets (attention, shared experts), and on the routed experts' stacks with `experts`
    (PEFT's ``target_parameters``); gpt-oss's SwiGLU clamped at `limit` (None: its
    config's), low enough to hold some inputs."""
    model = tiny_model(arch, dtype=dtype, seed=seed, **config)
    model.config._attn_implementation = "eager" if arch == "gpt_oss" else "sdpa"  # (sinks: eager)
    with torch.random.fork_rng(devices=[]), torch.no_grad():  # Q/K norms that are not all ones
        torch.manual_seed(seed)
        for name, p in model.named_parameters():
            if any(f".{n}." in name for n in ("q_norm", "k_norm", "q_a_layernorm", "kv_a_layernorm")):
                p.normal_(1.0, 0.2)
            if name.endswith(("sinks", "_bias", "router.bias")):  # gpt-oss's sinks and biases: not zeros
                p.normal_(0.0, 0.5)
        for module in model.modules():
            if type(module).__name__ == "GptOssExperts" and limit is not None:
                module.limit = limit
        for name, b in model.named_buffers():  # GLM-4-MoE's routing bias, not all zeros
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    if scheme is not None:
        for layer in model.model.layers:
            for block in moe_blocks(layer):
                quantize_experts(block.experts, scheme=scheme)
    targets = lora_targets(model, experts=experts)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        cfg = LoraConfig(
            r=4,
            lora_alpha=8,
            lora_dropout=dropout,
            target_modules=list(targets.modules),
            target_parameters=list(targets.parameters) or None,
        )
        model = get_peft_model(model, cfg)
        adopt_quantized_experts(model)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                with torch.no_grad():
                    p.normal_(0, 0.05)
    model.config.use_cache = False
    return model.train()


def _steps(model, n=2, seed=0, device="cpu"):
    """Losses of `n` micro-batches, then every adapter gradient accumulated."""
    torch.manual_seed(seed)
    for p in model.parameters():
        p.grad = None
    losses = []
    for i in range(n):
        loss = model(**{k: v.to(device) for k, v in tiny_batch(seed=i + 1).items()}).loss
        (loss / n).backward()
        losses.append(loss.detach())
    return losses + [p.grad.clone() for p in model.parameters() if p.requires_grad]


def _float_adapters(model):
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    return model


def _close(a, b, rtol=1e-4, atol=1e-6) -> bool:
    return len(a) == len(b) and all(torch.allclose(x, y, rtol=rtol, atol=atol) for x, y in zip(a, b))


def _equal(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize(("arch", "experts"), ARCH_EXPERTS, ids=arch_ids)
def test_fast_moe_layers_train_what_the_models_code_trains_in_float32(arch, experts):
    """With LoRA on the routed experts too, against PEFT's own path (which folds each
    expert's B·A into its stack)."""
    model = _model(arch, experts=experts)
    own = _steps(model)
    report = fuse_layers(model)
    assert report.fused == [0, 1, 2] and not report.refused
    parts = parts_of(model.base_model.model.model.layers[-1])
    assert parts.moe is not None
    assert (parts.gate_up is not None) == (arch in ("qwen2_moe", "glm4_moe", "deepseek_v3"))  # shared experts
    assert (parts.latent is not None) == (arch == "deepseek_v3")
    assert (parts.sinks is not None) == (parts.moe.clamp is not None) == (arch == "gpt_oss")
    assert sorted(parts.moe.adapters) == (["down_proj", "gate_up_proj"] if experts else [])
    fast = _steps(model)
    assert _close(own, fast)
    assert not _equal(own, fast)  # its own kernels: close, not the same bits
    assert unfuse_layers(model) == 3
    assert _equal(_steps(model), own)


@pytest.mark.parametrize("what", ["sinks", "clamp", "expert biases"])
def test_gpt_oss_without_its_sinks_clamps_or_expert_biases_would_show(monkeypatch, what):
    """Each of gpt-oss's differences from the other families moves the fast layers past the
    tolerance above when it is dropped (the clamps hold some inputs at the tiny limit)."""
    from narrows.core.kernels.fastlayer import compute

    model = _model("gpt_oss")
    own = _steps(model)
    fuse_layers(model)
    assert _close(own, _steps(model))
    if what == "sinks":
        monkeypatch.setattr(
            compute, "_attention_with_sinks", lambda parts, q, k, v, mask: _plain(q, k, v, mask)
        )
    else:
        for layer in model.base_model.model.model.layers:
            p = parts_of(layer).moe
            if what == "clamp":
                p.clamp = (p.clamp[0], 1e9)
            else:
                p.biases = tuple(torch.zeros_like(b) for b in p.biases)
    assert not _close(own, _steps(model))


def _plain(q, k, v, mask):
    """Attention without sinks (the fault `test_gpt_oss_without_...` plants)."""
    groups = q.shape[1] // k.shape[1]
    return torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), attn_mask=mask
    )


# DeepSeek-V3's YaRN, scaled down to max_position_embeddings (4 x 32 = 128), with the mscale
# that widens its softmax scale
_DEEPSEEK_YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=32,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=1.0,
    mscale_all_dim=1.0,
)
LATENT = {
    "low-rank queries": {},
    "plain q_proj": dict(q_lora_rank=None),
    "rotary halves": dict(rope_interleave=False),
    "yarn": dict(rope_parameters=dict(_DEEPSEEK_YARN)),
}


@pytest.mark.parametrize("variant", LATENT)
def test_latent_attention_trains_what_the_models_code_trains_with_dropout(variant):
    """DeepSeek-V3's latent attention with LoRA on each of its linears (q_a, q_b or a plain
    q_proj, kv_a, kv_b, o), their dropout masks drawn in the order PEFT draws them: its
    rotary channels in interleaved pairs or in halves, its softmax scale widened by YaRN's
    mscale. (Without PEFT's order the masks differ and so does every gradient.)"""
    model = _model("deepseek_v3", dropout=0.1, **LATENT[variant])
    own = _steps(model)
    report = fuse_layers(model)
    assert report.fused == [0, 1, 2] and not report.refused
    parts = parts_of(model.base_model.model.model.layers[0])
    latent, config = parts.latent, model.base_model.model.config
    assert parts.moe is None and latent is not None  # the first layer's MLP is dense
    assert (latent.q_b is None) == (variant == "plain q_proj")
    assert latent.interleave == (variant != "rotary halves")
    plain_scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    assert (parts.scaling > 1.2 * plain_scale) == (variant == "yarn")  # mscale² = (0.1·ln 4 + 1)²
    assert all(len(g.adapted) == 1 for g in (parts.qkv, *latent.groups, parts.o))
    assert _close(own, _steps(model))


@pytest.mark.parametrize("fault", ["interleave", "mscale", "latent norm", "shared key gradient"])
def test_latent_attention_without_each_of_its_pieces_would_show(monkeypatch, fault):
    """Each piece of DeepSeek-V3's attention moves the fast layers past the tolerance above
    when it is dropped: the interleaved rotary pairs, YaRN's mscale, the latent's norm, and
    the shared key part's gradient from every head (not one)."""
    from narrows.core.kernels.fastlayer import latent_attention
    from narrows.core.kernels.fastlayer.parts import Norm

    config = dict(rope_parameters=dict(_DEEPSEEK_YARN)) if fault == "mscale" else {}
    model = _model("deepseek_v3", **config)
    own = _steps(model)
    fuse_layers(model)
    assert _close(own, _steps(model))
    for layer in model.base_model.model.model.layers:
        parts = parts_of(layer)
        if fault == "interleave":
            parts.latent.interleave = False
        elif fault == "mscale":
            parts.scaling = (parts.latent.nope + parts.latent.rope) ** -0.5
        elif fault == "latent norm":
            parts.latent.kv_norm = Norm(
                torch.ones_like(parts.latent.kv_norm.weight), parts.latent.kv_norm.eps
            )
    if fault == "shared key gradient":
        original = latent_attention.backward

        def one_head(p, s, gq, gk, gv, *rest):
            gk = gk.clone()
            gk[:, 1:, :, p.nope :] = 0
            return original(p, s, gq, gk, gv, *rest)

        monkeypatch.setattr(latent_attention, "backward", one_head)
    assert not _close(own, _steps(model))


def test_latent_attention_fills_the_cache_transformers_decodes_from(monkeypatch):
    """A prompt through the fast layers leaves in the cache what DeepSeek-V3's own attention
    leaves (the normed latent and the rotated shared key part); decoding, which runs the
    layers' own forward, reads it: the same tokens and scores as the model's own code."""
    from narrows.core.kernels.fastlayer import compute

    model = _model("deepseek_v3").eval()
    ids = tiny_batch(batch=1, pad_last=0)["input_ids"]
    kw = dict(
        max_new_tokens=5, do_sample=False, use_cache=True, output_scores=True, return_dict_in_generate=True
    )
    with torch.no_grad():
        plain = model.generate(ids, **kw)
        fuse_layers(model)
        calls = []
        original = compute.forward
        monkeypatch.setattr(
            compute, "forward", lambda *a, **k: calls.append(k.get("kv")) or original(*a, **k)
        )
        fast = model.generate(ids, **kw)
    assert len(calls) == 3 and all(kv is not None for kv in calls)  # the prompt's layers: fast, cached
    assert torch.equal(plain.sequences, fast.sequences)
    assert _close(plain.scores, fast.scores, rtol=1e-4, atol=1e-5)


def test_clamped_glu_in_row_blocks_computes_autograd_of_its_formula():
    """gpt-oss's clamped SwiGLU, an eighth of the rows at a time (37 rows: a short last
    block), and its gradients: the formula and autograd's of it in float64, inputs on both
    sides of both clamps."""
    gen = torch.Generator().manual_seed(0)
    gate, up, grad = (torch.randn(37, 24, generator=gen) * 2 for _ in range(3))
    alpha, limit = 1.702, 1.0
    g, u = gate.double().requires_grad_(), up.double().requires_grad_()
    gc, uc = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
    want = (uc + 1) * gc * torch.sigmoid(alpha * gc)
    assert torch.allclose(ops.clamped_glu(gate, up, alpha, limit).double(), want, rtol=1e-6, atol=1e-7)
    want.backward(grad.double())
    ops.clamped_glu_backward(grad, gate, up, alpha, limit)  # written over gate and up
    assert torch.allclose(gate.double(), g.grad, rtol=1e-5, atol=1e-6)
    assert torch.allclose(up.double(), u.grad, rtol=1e-5, atol=1e-6)
    assert (g.grad == 0).any() and (u.grad == 0).any()  # the clamps held some inputs


@pytest.mark.parametrize("what", ["router", "shared gate"])
def test_a_lost_routing_gradient_would_show(monkeypatch, what):
    """The adapters below an MoE block get gradient through its routing weights and the
    shared expert's gate too: dropping either moves them past the tolerance above."""
    model = _model("qwen2_moe")
    fuse_layers(model)
    good = _steps(model)
    if what == "router":
        original = moe.backward

        def no_router(p, s, g, cache):
            router, p.router = p.router, torch.zeros_like(p.router)
            try:
                return original(p, s, g, cache)
            finally:
                p.router = router

        monkeypatch.setattr(moe, "backward", no_router)
    else:
        original = moe.shared_gate_backward
        monkeypatch.setattr(
            moe,
            "shared_gate_backward",
            lambda p, gate, s, g: (original(p, gate, s, g)[0], torch.zeros_like(g)),
        )
    assert not _close(good, _steps(model))


def test_layers_give_way_while_transformers_records_their_outputs(monkeypatch):
    """transformers hooks the routers (and attention) once a forward asks for their outputs;
    a hook records only in a forward that asks. While one does (the aux loss), the model's
    own code runs — the same bits as unfused, aux loss included; once no forward asks, the
    fast layers run again with the hooks in place."""
    from narrows.core.kernels.fastlayer import compute

    def model(collect):
        m = _model("qwen3_moe")
        m.base_model.model.config.output_router_logits = collect
        return m

    own = model(True)
    want = _steps(own)
    aux = own(**tiny_batch()).aux_loss
    fused = model(True)
    assert not fuse_layers(fused).refused
    calls = []
    original = compute.forward_keeping
    monkeypatch.setattr(compute, "forward_keeping", lambda *a, **k: calls.append(1) or original(*a, **k))
    assert _equal(_steps(fused), want) and not calls  # every forward recorded: the model's code ran
    assert torch.equal(fused(**tiny_batch()).aux_loss, aux)
    layer = fused.base_model.model.model.layers[0]
    assert any(m._forward_hooks for m in layer.modules())  # the recorders stay installed
    assert why_not(layer) is None  # inert outside a forward that records
    fused.base_model.model.config.output_router_logits = False
    fuse_layers(fused, recompute=False)
    _steps(fused)
    assert calls  # no forward records: the fast layers run


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_the_model_merged_from_expert_adapters_computes_what_the_fast_layers_trained(arch):
    """What a user ships: PEFT's ``merge_and_unload`` of the expert adapters (folded into
    each stack) against the fused layers' forward, whose adapters are ``(x·Aᵀ)·Bᵀ`` per
    expert; both far from the base without the adapters."""
    model = _model(arch, experts=True)
    fuse_layers(model)
    batch = tiny_batch(seed=5)
    with torch.no_grad():
        fused = model(**batch).logits
        with model.disable_adapter():
            base = model(**batch).logits
    unfuse_layers(model)
    merged = model.merge_and_unload()
    with torch.no_grad():
        shipped = merged(**batch).logits
    assert (fused - base).abs().max() > 0.1
    assert torch.allclose(shipped, fused, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "deepseek_v3"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_recompute_trains_the_same_bits_as_keeping(arch, dropout):
    model = _model(arch, dtype=torch.bfloat16, dropout=dropout)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    fuse_layers(model, recompute=False)
    kept = _steps(model, seed=3)
    fuse_layers(model, recompute=True)
    assert _equal(_steps(model, seed=3), kept)


@pytest.mark.parametrize("scheme", ["nf3", pytest.param("nf4", marks=pytest.mark.bnb)])
def test_quantised_experts_are_dequantised_once_a_pass(scheme):
    """With recompute, each block's stacks are dequantised for the forward and once more for
    the recompute and the backward together; the result is close to the model's own code
    on the same codes."""
    model = _model("qwen3_moe", scheme=scheme)
    own = _steps(model, n=1)
    fuse_layers(model, recompute=True)
    with watch_expert_stacks() as watch:
        fast = _steps(model, n=1)
    assert watch.names == {"gate_up_proj": 2 * 3, "down_proj": 2 * 3}
    assert _close(own, fast, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("experts", [False, True], ids=arch_ids)
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_a_kept_layer_holds_one_dequantised_stack_at_a_time(arch, experts):
    """Kept layers (no recompute, no cache) dequantise gate/up's stack, then down's in the
    forward and the other way round in the backward, each freed before the next: a block
    never holds both (the largest alone is what the planner prices)."""
    model = _model(arch, scheme="nf3", experts=experts)
    fuse_layers(model, recompute=False)
    with watch_expert_stacks() as watch:
        _steps(model, n=1)
    assert watch.names == {"gate_up_proj": 2 * 3, "down_proj": 2 * 3}
    assert watch.most_alive == 1


@pytest.mark.parametrize("scheme", ["nf2", pytest.param("nf4", marks=pytest.mark.bnb)])
def test_lora_on_quantised_experts_trains_as_on_their_dequantised_stacks(scheme):
    """PEFT's wrappers over quantised stacks (adopted) compute what PEFT's own path computes
    on the dequantised stacks in float; the fast layer is close to both."""
    model = _model("qwen3_moe", scheme=scheme, experts=True)
    own = _steps(model, n=1)
    plain = _model("qwen3_moe", experts=True)
    for q, f in zip(model.base_model.model.model.layers, plain.base_model.model.model.layers):
        qe, fe = q.mlp.experts.get_base_layer(), f.mlp.experts.get_base_layer()
        for name, stack in zip(
            ("gate_up_proj", "down_proj"), moe.expert_stacks(qe, ("gate_up_proj", "down_proj"))
        ):
            fe._parameters[name].data = stack.clone()
    assert _close(_steps(plain, n=1), own, rtol=1e-5, atol=1e-7)
    fuse_layers(model, recompute=True)
    assert _close(own, _steps(model, n=1), rtol=1e-3, atol=1e-5)


def test_lora_on_experts_recomputes_the_same_bits_as_keeping():
    model = _float_adapters(_model("qwen2_moe", dtype=torch.bfloat16, experts=True))
    fuse_layers(model, recompute=False)
    kept = _steps(model, seed=3)
    fuse_layers(model, recompute=True)
    assert _equal(_steps(model, seed=3), kept)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_matmul_over_rows_computes_its_reference(dtype):
    """An expert adapter's weight gradient: each expert's rows' ``xᵀ @ y``, one expert
    without rows (zeros)."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 32, generator=gen).to(dtype), torch.randn(40, 8, generator=gen).to(dtype)
    ends = torch.tensor([7, 7, 30, 40], dtype=torch.int32)
    got, ref = grouped.grouped_mm_k(x, y, ends), grouped.grouped_mm_k_reference(x, y, ends)
    assert got.shape == ref.shape == (4, 32, 8) and not ref[1].any()
    assert torch.allclose(got.float(), ref.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-4)
    expected = torch.stack(
        [x[:7].t() @ y[:7], torch.zeros(32, 8, dtype=dtype), x[7:30].t() @ y[7:30], x[30:].t() @ y[30:]]
    )
    assert torch.equal(ref, expected)


@pytest.mark.gpu
def test_cuda_grouped_matmuls_compute_their_references_at_any_row_offsets():
    """On CUDA torch's grouped matmuls (over N, and over K: the adapters' gradients) run at
    the adapters' widths with experts' rows starting anywhere, one expert without any."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1000, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    y = torch.randn(1000, 16, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(5, 64, 16, device="cuda", dtype=torch.bfloat16, generator=gen)
    ends = torch.tensor([7, 7, 301, 513, 1000], device="cuda", dtype=torch.int32)
    assert grouped.native(x, y.unsqueeze(0)) and grouped.native(x, w)
    for got, ref in (
        (grouped.grouped_mm_k(x, y, ends), grouped.grouped_mm_k_reference(x, y, ends)),
        (grouped.grouped_mm(x, w, ends), grouped.grouped_mm_reference(x, w, ends)),
    ):
        assert torch.allclose(got.float(), ref.float(), rtol=2e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_matmul_computes_its_reference(dtype):
    """torch's grouped matmul (CPU) against the loop over experts, an expert with no rows
    among them, the weights given transposed as the forward passes them."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 32, generator=gen).to(dtype)
    w = torch.randn(4, 16, 32, generator=gen).to(dtype).transpose(-2, -1)  # [E, K, N] as a view
    ends = torch.tensor([7, 7, 30, 40], dtype=torch.int32)
    assert grouped.native(x, w)
    got, ref = grouped.grouped_mm(x, w, ends), grouped.grouped_mm_reference(x, w, ends)
    assert torch.allclose(got.float(), ref.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)
    expected = torch.cat([x[:7] @ w[0], x[7:30] @ w[2], x[30:] @ w[3]])  # expert 1 has no rows
    assert torch.equal(ref, expected)


def test_uncovered_moe_layers_are_refused_with_their_reason():
    gpt = tiny_model("gpt_oss").requires_grad_(False)
    gpt.config._attn_implementation = "flex_attention"
    assert "load the model with attn_implementation='eager'" in why_not(gpt.model.layers[0])
    gpt.config._attn_implementation = "eager"
    assert why_not(gpt.model.layers[0]) is None
    latent = tiny_model("deepseek_v3").requires_grad_(False)  # (tiny models load eager attention)
    assert "load the model with attn_implementation='sdpa'" in why_not(latent.model.layers[0])
    clipped = _model("olmoe")
    clipped.base_model.model.config.clip_qkv = 8.0
    assert "clip_qkv" in why_not(clipped.base_model.model.model.layers[0])
    hooked = _model("qwen3_moe")
    layers = hooked.base_model.model.model.layers
    layers[1].mlp.gate.register_forward_hook(lambda *a: None)
    assert "router or experts have hooks" in fuse_layers(hooked).refused[1]
    jitter = _model("mixtral")
    jitter.base_model.model.model.layers[0].mlp.jitter_noise = 0.1
    assert "jitter" in why_not(jitter.base_model.model.model.layers[0])
    everything = tiny_model("qwen3_moe")
    everything.config._attn_implementation = "sdpa"
    everything = get_peft_model(everything, LoraConfig(r=4, target_modules="all-linear"))
    assert "LoRA on the router" in why_not(everything.base_model.model.model.layers[0])
    experts = tiny_model("qwen3_moe")
    experts.config._attn_implementation = "sdpa"
    cfg = LoraConfig(r=4, target_modules=["q_proj"], target_parameters=["experts.gate_up_proj"])
    experts = get_peft_model(experts, cfg)
    layer = experts.base_model.model.model.layers[0]
    assert why_not(layer) is None  # one stack adapted: covered
    experts.add_adapter("second", cfg)
    experts.base_model.set_adapter(["default", "second"])
    assert "several active adapters" in why_not(layer)


@pytest.mark.gpu
@pytest.mark.parametrize(("arch", "experts"), ARCH_EXPERTS, ids=arch_ids)
def test_cuda_recompute_trains_the_same_bits_as_keeping(arch, experts):
    """(PEFT takes no dropout on expert stacks: with them, none.)"""
    from narrows.core.protocol.determinism import deterministic

    deterministic(True)
    try:
        model = _model(arch, dtype=torch.bfloat16, dropout=0.0 if experts else 0.1, experts=experts)
        model = _float_adapters(model).cuda()
        fuse_layers(model, recompute=False)
        assert parts_of(model.base_model.model.model.layers[-1]).moe is not None
        kept = _steps(model, seed=3, device="cuda")
        fuse_layers(model, recompute=True)
        assert _equal(_steps(model, seed=3, device="cuda"), kept)
    finally:
        deterministic(False)


@pytest.mark.gpu
@pytest.mark.parametrize(("arch", "experts"), ARCH_EXPERTS, ids=arch_ids)
def test_cuda_bf16_error_is_no_worse_than_the_models_code(arch, experts):
    """The worst relative error (losses, every adapter gradient) against the model's own code
    in float64 (on the CPU, its experts looped: torch's grouped matmul takes no float64): the fast
    layers' bf16 (grouped matmuls on CUDA) over the model's own bf16, averaged over four
    seeds."""

    def error(fuse_it, seed):
        # (gpt-oss at its config's clamp: a tiny one makes the comparison a count of the inputs
        # near it that bf16 rounding moves across, in either code)
        ref = _model(arch, dtype=torch.bfloat16, seed=seed, experts=experts, limit=None).to(torch.float64)
        ref.base_model.model.set_experts_implementation("eager")  # grouped_mm takes no float64
        ref = _steps(ref)
        model = _float_adapters(_model(arch, dtype=torch.bfloat16, seed=seed, experts=experts, limit=None))
        model = model.cuda()
        if fuse_it:
            assert not fuse_layers(model).refused
        got = _steps(model, device="cuda")
        return max(((r - g.double().cpu()).norm() / r.norm()).item() for r, g in zip(ref, got))

    ratios = [error(True, seed) / error(False, seed) for seed in range(4)]
    assert all(r > 0 for r in ratios) and sum(ratios) / len(ratios) <= 1.5, ratios
