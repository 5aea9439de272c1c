"""Stream parity on every announced architecture (float and NF4 bases, NF2/NF3 routed
experts, adapter dropout, gradient accumulation), MoE router logits with their aux loss,
and the twin check that guards architectures narrows does not announce."""

import pytest
from helpers import assert_identical, build, train

import narrows.core as nc
import narrows.core.protocol.anatomy as anatomy_module
from narrows.core import fuse_layers
from narrows.core.protocol.verify import _PASSED
from narrows.core.testing import TINY_ARCHITECTURES
from narrows.stream.execution import side_outputs as sideouts

MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
NEW = tuple(
    a for a in TINY_ARCHITECTURES if a not in ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text")
)


def _dropout(arch: str, want: float) -> float:
    """`want`, unless PEFT refuses dropout on this model's targets (fused MoE expert
    parameters in Qwen3-MoE and gpt-oss: lora.ParamWrapper)."""
    try:
        build(arch, dropout=want)
    except ValueError as e:
        assert "lora_dropout" in str(e)
        return 0.0
    return want


@pytest.mark.parametrize("base", ["float", pytest.param("nf4", marks=pytest.mark.bnb)])
@pytest.mark.parametrize("arch", NEW)
def test_streamed_equals_resident(arch, base):
    cfg = dict(arch=arch, base=base, dropout=_dropout(arch, 0.05))
    resident = build(**cfg)
    fuse_layers(
        resident
    )  # the stream's default kernels: the fast layers where they cover it (gpt-oss's eager)
    assert_identical(
        train(resident, steps=2, grad_accum=2),
        train(build(**cfg), steps=2, grad_accum=2, stream_kwargs={}),
    )


@pytest.mark.parametrize("base", ["float", pytest.param("nf4", marks=pytest.mark.bnb)])
@pytest.mark.parametrize("arch", ["phi3", "cohere"])
def test_peft_dora_streamed_equals_resident(arch, base):
    cfg = dict(arch=arch, base=base, kind="dora", dropout=0.05)
    assert_identical(
        train(build(**cfg), steps=2, grad_accum=2),
        train(build(**cfg), steps=2, grad_accum=2, stream_kwargs={}),
    )


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_sdpa_attention_streamed_equals_resident(arch):
    """The default attention (SDPA), not only the eager reference kernel."""

    def sdpa(**cfg):
        model = build(**cfg)
        model.set_attn_implementation("sdpa")
        return model

    cfg = dict(arch=arch, dropout=0.05)
    peft = train(sdpa(**cfg), grad_accum=2)
    assert_identical(peft, train(sdpa(**cfg), grad_accum=2, stream_kwargs={"kernels": "peft"}))
    fast = sdpa(**cfg)
    fuse_layers(fast)  # the default kernels: the fast layers where they cover the architecture
    assert_identical(train(fast, grad_accum=2), train(sdpa(**cfg), grad_accum=2, stream_kwargs={}))


@pytest.mark.bnb
@pytest.mark.parametrize(
    "setting",
    [
        dict(gpu_budget="min"),
        dict(graphs=True, gpu_budget=None),
        dict(graphs=True, gpu_budget="fit"),
        dict(gpu_budget="min", experts="nf3"),
    ],
    ids=["least-budget", "graphs", "whole-graphs", "nf3-experts"],
)
@pytest.mark.parametrize("arch", [*MOE, "glm4_moe", "deepseek_v3"])
def test_fast_moe_layers_streamed_equal_the_same_layers_resident(arch, setting):
    """The fast MoE layer (router, grouped matmuls over NF4 or NF3 experts, Qwen2-MoE's
    shared expert with its adapters' dropout) streamed at the least budget, or replayed as
    graphs (recomputed, or whole: kept from the forward's graph to the backward's) trains
    the bits `fuse_layers` trains resident."""
    setting = dict(setting)
    experts = setting.pop("experts", "nf4")

    def model():
        m = build(arch, base="nf4", experts=experts, dropout=_dropout(arch, 0.05))
        m.set_attn_implementation("sdpa")
        return m

    resident = model()
    assert not fuse_layers(resident).refused
    streamed = model()
    got = train(streamed, grad_accum=2, stream_kwargs=setting)
    assert_identical(train(resident, grad_accum=2), got)
    parts = [
        nc.kernels.fastlayer.FastLayer.of(layer).parts() for layer in streamed.base_model.model.model.layers
    ]
    assert (
        all(p is not None for p in parts) and parts[-1].moe is not None
    )  # (GLM-4-MoE's, DeepSeek's first: dense)
    if setting.get("gpu_budget") == "fit":  # every layer whole, each replayed as its two graphs
        plan, stats = streamed.narrows_stream.plan, streamed.narrows_stream.graphs.stats
        assert len(plan.whole) == len(parts)
        # latent attention's SDPA call (DeepSeek-V3's) records a graph of nodes here (the math
        # path): its layers are named and run their own forward, still the same bits
        why = set(stats.refused.values())
        assert (stats.replays > 0 and not why) or why == {
            "its attention records more than one node (SDPA's math path)"
        }


@pytest.mark.bnb
@pytest.mark.parametrize(("arch", "experts"), [("qwen3_moe", "nf2"), ("gpt_oss", "nf3")])
def test_low_bit_experts_streamed_at_the_least_budget_equal_resident(arch, experts):
    """NF4 linears and NF2 / NF3 routed experts (their codes and scales moved as slots),
    every layer streamed."""
    cfg = dict(arch=arch, base="nf4", experts=experts, dropout=_dropout(arch, 0.05))
    streamed = build(**cfg)
    record = train(streamed, steps=2, grad_accum=2, stream_kwargs={"gpu_budget": "min"})
    assert streamed.narrows_stream.plan.resident == ()
    assert any(nc.lowbit_stacks(m) for m in streamed.modules())
    resident = build(**cfg)
    fuse_layers(resident)  # the stream's default kernels (gpt-oss's eager layers: the fast ones)
    assert_identical(train(resident, steps=2, grad_accum=2), record)


@pytest.mark.bnb
def test_streamed_fast_moe_layers_hold_one_dequantised_stack_at_a_time():
    """A streamed layer's forward dequantises gate/up's stack, then down's; its recompute
    gate/up's alone (it stops before the down projection); its backward down's, then
    gate/up's: five a layer and micro-batch, each freed before the next is dequantised."""
    from narrows.core.testing import watch_expert_stacks

    def dequantisations(steps: int):  # (stream's start-up checks run the layers too)
        streamed = build("qwen3_moe", base="nf4", experts="nf3")
        streamed.set_attn_implementation("sdpa")
        with watch_expert_stacks() as watch:
            train(streamed, steps=steps, stream_kwargs={"gpu_budget": "min"})
        assert streamed.narrows_stream.plan.resident == ()
        return watch

    layers = len(build("qwen3_moe").base_model.model.model.layers)
    one, three = dequantisations(1), dequantisations(3)
    assert three.names - one.names == {"gate_up_proj": 2 * 3 * layers, "down_proj": 2 * 2 * layers}
    assert three.most_alive == 1


@pytest.mark.parametrize("dropout", [0.0, 0.05])
@pytest.mark.parametrize("arch", MOE)
def test_router_aux_loss_gradient_flows_through_streamed_layers(arch, dropout):
    cfg = dict(
        arch=arch, dropout=_dropout(arch, dropout), output_router_logits=True, router_aux_loss_coef=0.02
    )
    resident = train(build(**cfg), steps=2, grad_accum=2)
    assert_identical(resident, train(build(**cfg), steps=2, grad_accum=2, stream_kwargs={}))


@pytest.mark.bnb
@pytest.mark.parametrize("gpu_budget", [None, "min"])
@pytest.mark.parametrize("arch", MOE)
def test_router_aux_loss_with_the_fast_layers_streamed_equals_resident(arch, gpu_budget):
    """SDPA and the default kernels: every training forward records the router logits, so
    the fast MoE layers give way to the model's own code, streamed as resident; the plan
    sizes that code."""

    def model():
        m = build(arch, base="nf4", dropout=0.05, output_router_logits=True, router_aux_loss_coef=0.02)
        m.set_attn_implementation("sdpa")
        return m

    resident = model()
    assert not fuse_layers(resident).refused  # covered: the layers give way only while recording
    streamed = model()
    got = train(streamed, steps=2, grad_accum=2, stream_kwargs={"gpu_budget": gpu_budget})
    assert_identical(train(resident, steps=2, grad_accum=2), got)
    from narrows.stream.planning.planner import runs_fast

    assert not runs_fast(streamed, streamed.narrows_stream.config)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_router_aux_loss_with_dropout_on_attention_adapters(arch):
    """Where PEFT refuses dropout on fused experts, adapters on attention alone take it."""
    import torch
    from peft import LoraConfig, get_peft_model

    from narrows.core.testing import tiny_model

    def model():
        base = tiny_model(arch, output_router_logits=True, router_aux_loss_coef=0.02)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            m = get_peft_model(base, LoraConfig(r=4, lora_dropout=0.1, target_modules=["q_proj", "v_proj"]))
            for n, p in m.named_parameters():
                if "lora_B" in n:
                    p.data.normal_(0, 0.05)
        return m.train()

    assert_identical(
        train(model(), steps=2, grad_accum=2), train(model(), steps=2, grad_accum=2, stream_kwargs={})
    )


def test_without_side_outputs_the_aux_loss_gradient_would_be_lost(monkeypatch):
    """The mechanism is what makes the MoE test pass: with hooks not carried, it differs."""
    from contextlib import contextmanager

    @contextmanager
    def not_carried(self, *, forward):
        self.originals, self.stand_ins = [], []
        yield

    monkeypatch.setattr(sideouts.SideOutputs, "collecting", not_carried)
    cfg = dict(arch="mixtral", output_router_logits=True, router_aux_loss_coef=0.02)
    with pytest.raises(AssertionError, match="differs"):
        assert_identical(train(build(**cfg), steps=1), train(build(**cfg), steps=1, stream_kwargs={}))


def test_a_streamed_layer_keeps_no_reference_to_its_inner_graph():
    """Carrying side outputs must not keep the layer's inner graph alive: the recorded
    originals would hold every activation the layer saved and undo rematerialisation."""
    import narrows.stream as ns
    from narrows.core.testing import tiny_batch

    model = build("mixtral", output_router_logits=True, router_aux_loss_coef=0.02)
    ns.stream(model, device="cpu", check=False)
    sides = [
        cell.cell_contents
        for layer in nc.anatomy_of(model).layers
        for cell in layer.forward.__closure__
        if isinstance(cell.cell_contents, sideouts.SideOutputs)
    ]
    out = model(**tiny_batch())
    assert len(out.router_logits) == 3 and all(t.grad_fn is not None for t in out.router_logits)
    assert len(sides) == 3 and all(not s.originals and not s.stand_ins for s in sides)
    out.loss.backward()
    assert all(not s.originals and not s.stand_ins for s in sides)


def test_a_hook_that_replaces_an_output_is_refused():
    import narrows.stream as ns

    model = build("llama")
    nc.anatomy_of(model).layers[0].mlp.register_forward_hook(lambda m, a, out: out * 1.0)
    with pytest.raises(ns.StreamSetupError, match="replaces the module's output"):
        train(model, steps=1, stream_kwargs={"check": False})


@pytest.fixture
def forget_verified():
    yield
    anatomy_module._VERIFIED.clear()
    _PASSED.clear()


def _posing(arch: str, name: str, **overrides):
    model = build(arch, dropout=_dropout(arch, 0.05), **overrides)
    model.config.model_type = name
    return model


def test_an_unannounced_architecture_streams_after_its_twin_passes(forget_verified, caplog):
    import narrows.stream as ns

    model = _posing("mixtral", "my_moe")
    ns.stream(model, device="cpu")
    assert "passed head, stream on its twin" in caplog.text and not nc.anatomy_of(model).announced


def test_an_unannounced_latent_attention_model_passes_its_twin_check_and_streams_fast(
    forget_verified, caplog
):
    """DeepSeek-V3's layers under a model type narrows does not announce: its twin shrinks
    the latent ranks and head widths together (the rotary tables stay as wide as the rotated
    part of a head) and passes, and the model streams through the fast layers (latent
    attention, a dense first layer, then routed and shared experts) as it trains resident
    through them."""
    import torch
    from peft import LoraConfig, get_peft_model

    from narrows.core.testing import tiny_model

    def model():  # (its rotary part, 32 channels a head, is wider than the twin's head_dim of 16)
        base = tiny_model("deepseek_v3")
        base.set_attn_implementation("sdpa")
        targets = list(nc.lora_targets(base).modules)  # (routers frozen: "all-linear" adapts them)
        base.config.model_type = "my_latent_attention"
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            m = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets))  # (no dropout:
            # the twin check inside `train` draws from the generator the resident run does not)
            for n, p in m.named_parameters():
                if "lora_B" in n:
                    p.data.normal_(0, 0.05)
        return m.train()

    streamed = model()
    got = train(streamed, steps=2, grad_accum=2, stream_kwargs={})
    assert "model_type='my_latent_attention' passed head, stream on its twin" in caplog.text
    parts = [nc.kernels.fastlayer.FastLayer.of(la).parts() for la in nc.anatomy_of(streamed).layers]
    assert all(p is not None and p.latent is not None for p in parts)
    assert parts[0].moe is None and parts[-1].moe is not None
    resident = model()
    assert not fuse_layers(resident).refused  # (accepted in this process once its twin passed)
    assert_identical(train(resident, steps=2, grad_accum=2), got)


def test_an_unannounced_architecture_that_differs_streamed_is_refused(forget_verified, monkeypatch):
    from contextlib import contextmanager

    import narrows.stream as ns

    @contextmanager
    def not_carried(self, *, forward):
        self.originals, self.stand_ins = [], []
        yield

    monkeypatch.setattr(sideouts.SideOutputs, "collecting", not_carried)
    with pytest.raises(
        nc.UnsupportedArchitectureError, match=r"'stream' check: streamed and resident .* gradient"
    ):
        ns.stream(_posing("mixtral", "my_moe"), device="cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_cuda_sdpa_bf16_streamed_equals_resident_under_deterministic_kernels(arch):
    import torch

    before = torch.are_deterministic_algorithms_enabled()
    nc.deterministic()
    try:

        def model():
            m = build(arch, dtype=torch.bfloat16, dropout=_dropout(arch, 0.05))
            # SDPA where transformers has a path for it; eager where it has none (gpt-oss' attention
            # sinks, and Gemma 2's soft-capping since transformers 5.23)
            if getattr(m, "_supports_sdpa", True):
                m.set_attn_implementation("sdpa")
            return m

        resident = model().to("cuda")
        fuse_layers(resident)  # the stream's default kernels (architectures it does not cover: PEFT's)
        assert_identical(
            train(resident, grad_accum=2, device="cuda"),
            train(model(), grad_accum=2, device="cuda", stream_kwargs={"deterministic": True}),
        )
    finally:
        nc.deterministic(before)


CUDA_SETTINGS = {"default plan": {}, "whole layers as graphs": {"graphs": True, "gpu_budget": "fit"}}


@pytest.mark.gpu
@pytest.mark.bnb
@pytest.mark.parametrize("setting", list(CUDA_SETTINGS))
@pytest.mark.parametrize("arch", [*MOE, "gpt_oss", "deepseek_v3"])
def test_cuda_nf4_experts_streamed_equal_resident_under_deterministic_kernels(arch, setting):
    """NF4 expert stacks (dequantised per call, grouped matmuls on CUDA) streamed as resident;
    and whole fast layers replayed as their forward and backward graphs."""
    import torch

    before = torch.are_deterministic_algorithms_enabled()
    nc.deterministic()
    try:

        def model():
            m = build(arch, base="nf4", dtype=torch.bfloat16, dropout=0.05)
            assert any(nc.is_nf4_experts(x) for x in m.modules())
            return m

        resident = model().to("cuda")
        fuse_layers(resident)  # the stream's default kernels (gpt-oss's eager layers: the fast ones)
        streamed = model()
        kw = {"deterministic": True, **CUDA_SETTINGS[setting]}
        assert_identical(
            train(resident, grad_accum=2, device="cuda"),
            train(streamed, grad_accum=2, device="cuda", stream_kwargs=kw),
        )
        if kw.get("graphs") and not streamed.narrows_stream.graphs.stats.refused:
            assert streamed.narrows_stream.graphs.stats.replays > 0
    finally:
        nc.deterministic(before)


@pytest.mark.gpu
def test_cuda_an_unannounced_architecture_passes_its_twin_check_with_deterministic_kernels(forget_verified):
    import torch

    import narrows.stream as ns

    before = torch.are_deterministic_algorithms_enabled()
    try:
        ns.stream(_posing("qwen3", "my_fork"), device="cuda", deterministic=True)
    finally:
        nc.deterministic(before)
