"""The planner prices a mixture of experts' MLP: its shape read off the modules, and what
its forward keeps for the backward measured against the formula on the CPU."""

from dataclasses import replace

import pytest
import torch

from narrows.core import anatomy_of, moe_blocks, quantize_nf4
from narrows.core.testing import tiny_model
from narrows.stream.planning.memory import (
    MoEShape,
    Shapes,
    layer_work_bytes,
    whole_bytes,
    whole_overlap_bytes,
)
from narrows.stream.planning.steptime import Rates

pytestmark = pytest.mark.bnb
pytest.importorskip("bitsandbytes")

# (arch, config overrides, experts, top-k, intermediate, shared) from the config, independently
CASES = [
    ("qwen3_moe", dict(moe_intermediate_size=64, num_experts=8), 8, 2, 64, 0),
    (
        "qwen2_moe",
        dict(moe_intermediate_size=64, shared_expert_intermediate_size=96, num_experts=8),
        8,
        2,
        64,
        96,
    ),
    ("mixtral", dict(intermediate_size=64, num_local_experts=8), 8, 2, 64, 0),
    ("gpt_oss", dict(intermediate_size=64, num_local_experts=8), 8, 2, 64, 0),
]


def model(arch, overrides):
    return quantize_nf4(tiny_model(arch, hidden_size=128, **overrides))


def saved_bytes(module, x) -> int:
    """Bytes of the tensors `module`'s forward saves for its backward (parameters aside)."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(seen.values())


@pytest.mark.parametrize(("arch", "overrides", "experts", "top_k", "width", "shared"), CASES)
def test_the_moe_shape_is_read_off_the_modules(arch, overrides, experts, top_k, width, shared):
    moe = MoEShape.of(anatomy_of(model(arch, overrides)))
    assert (moe.experts, moe.top_k, moe.intermediate, moe.shared) == (experts, top_k, width, shared)
    # both NF4 stacks dequantised: gate and up [E, 2I, H] and down [E, H, I], in float32 here
    assert moe.dequant_bytes == experts * 3 * width * 128 * 4
    # the fast layer holds one at a time: the largest, gate and up's
    assert moe.stack_bytes == experts * 2 * width * 128 * 4
    assert MoEShape.of(anatomy_of(tiny_model("llama"))) is None


@pytest.mark.parametrize(("arch", "overrides", "experts", "top_k", "width", "shared"), CASES)
def test_what_an_moe_mlp_keeps_is_priced_from_above(arch, overrides, experts, top_k, width, shared):
    m = model(arch, overrides)
    anat = anatomy_of(m)
    tokens = 512
    x = torch.randn(1, tokens, 128, requires_grad=True)
    measured = saved_bytes(next(moe_blocks(anat.layers[0])).block, x)
    moe = MoEShape.of(anat)
    priced = tokens * moe.kept(128, 4) + moe.dequant_bytes
    # what is priced, but for the router's few bytes a token (and a shared expert's gate)
    assert 0.97 * measured <= priced <= 1.01 * measured
    # a whole layer keeps it beside its attention's, and one whole layer never meets a recompute
    shapes = Shapes.of(anat, 1, tokens)
    assert shapes.moe == moe and not shapes.dense_mlp
    assert whole_bytes(shapes) > priced
    assert whole_overlap_bytes(shapes) == whole_bytes(shapes)
    assert whole_overlap_bytes(Shapes.of(anatomy_of(tiny_model("llama")), 1, tokens)) == 0


def test_the_fast_layers_attention_with_sinks_is_priced(monkeypatch):
    """gpt-oss's attention with sinks in the fast layer: the widened copies SDPA reads
    (measured from the tensors it gets) are what the planner prices, in a layer's working
    set beside the model's two masks and in what a whole layer keeps; other models price
    none."""
    from narrows.core import fuse_layers
    from narrows.core.kernels.fastlayer import compute
    from narrows.core.testing import tiny_batch

    m = tiny_model("gpt_oss").requires_grad_(False)
    fuse_layers(m)
    seen = []
    real = compute.F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        seen.append(sum(t.numel() * t.element_size() for t in (q, k, v, attn_mask) if t is not None))
        return real(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(compute.F, "scaled_dot_product_attention", spy)
    batch = tiny_batch(seq=12)
    m(**batch)
    b, t = batch["input_ids"].shape
    shapes = Shapes.of(anatomy_of(m), b, t, fast=True)
    assert seen and max(seen) == shapes.sink_copies()
    plain = replace(shapes, sinks=False)
    assert layer_work_bytes(shapes) - layer_work_bytes(plain) == shapes.sink_bytes() > shapes.sink_copies()
    assert whole_bytes(shapes) - whole_bytes(plain) == shapes.sink_copies()
    assert Shapes.of(anatomy_of(tiny_model("qwen3_moe")), b, t, fast=True).sink_bytes() == 0


def test_the_fast_moe_layers_kept_state_is_what_the_planner_prices():
    """The planner's price of a token's MoE state in the fast layer (`MoEShape.fast_kept`)
    against the tensors `narrows.core.kernels.fastlayer.moe` keeps, counted."""
    import torch
    from peft import LoraConfig, get_peft_model

    from narrows.core import anatomy_of
    from narrows.core.kernels.fastlayer import FastLayer, moe
    from narrows.core.testing import tiny_model
    from narrows.stream.planning.memory import MoEShape

    for arch, experts in (("qwen3_moe", False), ("mixtral", False), ("qwen3_moe", True)):
        model = tiny_model(arch).requires_grad_(False)  # the fast layer trains adapters only
        model.config._attn_implementation = "sdpa"
        if experts:  # LoRA on the stacks: the block's input and each adapter's x·Aᵀ kept too
            stacks = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
            model = get_peft_model(
                model, LoraConfig(r=4, target_modules=["q_proj"], target_parameters=stacks)
            )
        parts = FastLayer.of(anatomy_of(model).layers[0]).parts()
        tokens, hidden = 24, model.config.hidden_size
        _, state = moe.forward(parts.moe, torch.randn(tokens, hidden), None, output=False, keep=True)
        kept = [state.probs, state.chosen, state.token, state.back, state.weights, state.h, state.a]
        kept += [t for t in (state.n, *state.z.values()) if t is not None]
        assert len(kept) == (10 if experts else 7)
        counted = sum(t.numel() * t.element_size() for t in kept)
        assert counted == tokens * MoEShape.of(anatomy_of(model)).fast_kept(hidden, 4)


def test_moe_blocks_in_sequence_tiles_are_planned_as_the_models_own_code():
    """The fast layer routes all of a batch's tokens at once and refuses an MoE block in
    tiles, so such a plan sizes the model's own code; a dense model's tiled layers stay fast."""
    from narrows.core.testing import tiny_model
    from narrows.stream import StreamConfig
    from narrows.stream.planning.planner import runs_fast

    for arch, tiled_fast in (("qwen3_moe", False), ("mistral", True)):
        model = tiny_model(arch).requires_grad_(False)
        model.config._attn_implementation = "sdpa"
        assert runs_fast(model, StreamConfig(device="cpu"))
        assert runs_fast(model, StreamConfig(device="cpu", seq_tile=4)) is tiled_fast


def test_a_model_collecting_router_logits_is_planned_as_its_own_code():
    """With the auxiliary loss on, every training forward collects the router logits and
    the fast layers give way to the model's own code: the plan sizes that; the same model
    without the aux loss is planned fast."""
    from narrows.core.testing import tiny_model
    from narrows.stream import StreamConfig
    from narrows.stream.planning.planner import runs_fast

    for collect in (False, True):
        model = tiny_model("qwen3_moe", output_router_logits=collect).requires_grad_(False)
        model.config._attn_implementation = "sdpa"
        assert runs_fast(model, StreamConfig(device="cpu")) is not collect


def test_graphed_moe_layers_are_priced_with_their_pool_beside_the_eager_working_set():
    """Every layer of a mixture of experts replayed as a graph: by default the peak holds
    the pool and an eager working set beside it (a layer may run eagerly while the graphs
    are held: a new batch width, an evaluation)."""
    from narrows.stream.planning import graph_bytes, make_plan, work_bytes

    anat = anatomy_of(model("qwen3_moe", CASES[0][1]))
    s = replace(Shapes.of(anat, 8, 512, fast=True), loss_bytes=1 << 20)
    layers = [1 << 20] * anat.num_layers
    common = dict(fixed_bytes=1 << 24, shapes=s, device="cuda")
    graphed = make_plan(layers, **common, budget=1 << 40, graphs=True, recompute="all")
    assert graphed.graphs and graphed.whole == () and graphed.graph_bytes == graph_bytes(s)
    assert graphed.work_bytes == work_bytes(s)
    parts = graphed.fixed_bytes + graphed.activation_bytes + sum(layers)
    assert graphed.predicted_peak == parts + work_bytes(s) + graph_bytes(s)


def test_without_eager_layers_beside_the_pool_it_holds_the_working_set():
    """With no layer run eagerly beside the graphs' pool (`eager_beside_graphs=False`: one
    batch shape, evaluations in the released pool), the layers' working sets lie in the
    pool and beside it only the loss's; what whole layers keep lies apart from its scratch
    (no overlap with the working set). The eager first step is still covered. Computed
    here from the parts: pricing the eager working set beside the pool, or the overlap,
    fails it."""
    from narrows.stream.planning import graph_bytes, make_plan, work_bytes
    from narrows.stream.planning.memory import GRAPH_MIXED, input_bytes, loss_work_bytes

    anat = anatomy_of(model("qwen3_moe", CASES[0][1]))
    n = anat.num_layers
    s = replace(Shapes.of(anat, 8, 512, fast=True), loss_bytes=1 << 20)
    layers = [1 << 20] * n
    common = dict(fixed_bytes=1 << 24, shapes=s, device="cuda", budget=1 << 40, graphs=True)
    alone = dict(common, eager_beside_graphs=False)
    for recompute, whole in (("all", 0), ("auto", n)):
        beside = make_plan(layers, **common, recompute=recompute)
        p = make_plan(layers, **alone, recompute=recompute)
        # one batch shape's pool: no other shapes' buffers kept
        assert p.whole == beside.whole == tuple(range(n - whole, n)) and p.graph_bytes == graph_bytes(
            s, shapes=1
        )
        kept = whole * whole_bytes(s) + (n - whole) * input_bytes(s)  # every input kept, on the device
        assert p.activation_bytes == kept
        room = max(work_bytes(s), graph_bytes(s, shapes=1) + loss_work_bytes(s))
        assert p.predicted_peak == p.fixed_bytes + kept + room + sum(layers) < beside.predicted_peak
        assert (
            p.predicted_peak
            == p.fixed_bytes + p.activation_bytes + p.work_bytes + p.graph_peak_bytes + sum(layers)
        )
    # whole and recomputed layers both replaying: the states lie among the scratch, and the
    # pool grows by GRAPH_MIXED of a keep (a budget with room for one whole layer and that)
    extra = int(GRAPH_MIXED * whole_bytes(s))
    budget = make_plan(layers, **alone, recompute="all").predicted_peak + whole_bytes(s) + extra
    one = make_plan(layers, **{**alone, "budget": budget})
    assert len(one.whole) == 1 and one.graph_bytes == graph_bytes(s, shapes=1) + extra
    # eager plans, dense layers (the whole ones run their own code), and a stage with two
    # micro-batches in flight keep the working set beside the pool
    for kw in (dict(graphs=False), dict(shapes=replace(s, fast=False)), dict(in_flight=2)):
        assert (
            make_plan(layers, **{**alone, **kw}).predicted_peak
            == make_plan(layers, **{**common, **kw}).predicted_peak
        )


def test_auto_weighs_a_mixture_of_experts_launches_against_the_pools_streamed_layers():
    """A fast MoE layer run eagerly is launch-bound on the host (`MOE_HOST_SECONDS` a
    forward, whatever its size); as graphs it costs the device's time. So a fast MoE model
    takes graphs — its whole layers replayed too — where the pool costs no resident layer,
    and where it does, as long as the streamed layers' exposed copies cost less than the
    launches saved; a dense model's host is not that floor. Each choice says its predicted
    times."""
    from narrows.stream.planning import make_plan
    from narrows.stream.planning.steptime import MOE_HOST_SECONDS, step_seconds

    anat = anatomy_of(model("qwen3_moe", CASES[0][1]))
    n = anat.num_layers
    s = replace(Shapes.of(anat, 8, 512, fast=True), loss_bytes=1 << 20)
    layers = [200 << 20] * n  # weights that outweigh the pool
    common = dict(fixed_bytes=1 << 24, shapes=s, device="cuda:0", eager_beside_graphs=False)
    whole = make_plan(layers, **common, budget=1 << 40, graphs=False)
    assert whole.whole == tuple(range(n))
    auto = make_plan(layers, **common, budget=1 << 40, graphs="auto")
    assert auto.graphs and auto.whole == whole.whole and "with graphs" in auto.graphs_choice
    # eagerly, each whole layer's forward and backward wait for the host's launches
    assert whole.step_seconds >= n * 2.2 * MOE_HOST_SECONDS
    assert auto.step_seconds == step_seconds(layers, s, n, n, graphs=True) < whole.step_seconds
    # a budget where the eager plan keeps every layer but the pool streams some: the model
    # weighs the copies; over a fast link they hide, over a slow one eager wins
    tight = make_plan(layers, **common, budget=1 << 40, graphs=False, recompute="all").predicted_peak
    eager = make_plan(layers, **common, budget=tight, graphs=False)
    streamed = make_plan(layers, **common, budget=tight, graphs=True)
    assert len(eager.resident) == n > len(streamed.resident)
    for rate, graphs in ((1e12, True), (1e8, False)):
        rates = Rates(h2d=rate)
        pick = make_plan(layers, **common, budget=tight, graphs="auto", rates=rates)
        g = make_plan(layers, **common, budget=tight, graphs=True, rates=rates)
        assert pick.graphs is graphs and pick.resident == (g if graphs else eager).resident
        assert f"{g.step_seconds:.3g} s of layer time a step with graphs" in pick.graphs_choice
    # a dense model is no launch floor: its eager whole layers cost the device's time
    dense = replace(s, moe=None)
    assert step_seconds(layers, dense, n, n) == step_seconds(layers, dense, n, n, graphs=True)


def test_the_step_time_model_multiplies_by_a_tokens_experts_and_dequantises_every_one():
    """A token meets its chosen experts and the shared one, so the matmuls are a dense
    MLP's of that width; a dequantisation writes every expert, a dense MLP of all their
    widths. Reading the config's dense `intermediate_size` instead fails both."""
    from narrows.stream.planning import dequant_seconds, layer_seconds, recompute_share
    from narrows.stream.planning.steptime import MOE_HOST_SECONDS

    base = Shapes.of(anatomy_of(model("qwen3_moe", CASES[0][1])), 1, 512, fast=True)
    moe = MoEShape(experts=128, top_k=8, intermediate=96, shared=64, dequant_bytes=0, dense_layers=0)
    s = replace(base, moe=moe, intermediate=4 * base.hidden)
    active = replace(base, moe=None, intermediate=8 * 96 + 64)  # what a token meets
    stored = replace(base, moe=None, intermediate=128 * 96 + 64)  # what the layer holds
    assert dequant_seconds(1, s) == dequant_seconds(1, stored) > dequant_seconds(1, active)
    assert recompute_share(s) == recompute_share(active)
    float_layer = 10**12  # bytes enough that nothing is dequantised
    device = layer_seconds(float_layer, s, graphed=True)[0]  # what the device does
    assert device == pytest.approx(layer_seconds(float_layer, active)[0])
    graphed = layer_seconds(1, s, graphed=True)[0]
    assert graphed == pytest.approx(device + dequant_seconds(1, stored))
    # eagerly, a fast MoE layer waits for the host's launches at least, float or 4-bit
    assert layer_seconds(float_layer, s)[0] == max(device, MOE_HOST_SECONDS)
    assert layer_seconds(1, s)[0] == max(graphed, MOE_HOST_SECONDS)


def test_latent_attention_is_priced_at_its_heads_widths():
    """DeepSeek-V3's ``head_dim`` is its rotary part's alone; the planner counts its queries
    and keys at ``nope + rope`` channels a head and its values at ``v``, on every head (its
    keys and values are expanded from the latent to every head before SDPA). Grouped-query
    models keep their own widths."""
    from narrows.stream.planning.attention import attention_bytes

    anat = anatomy_of(tiny_model("deepseek_v3", v_head_dim=32))  # (the tiny one's mean is its rope's)
    cfg = anat.config
    qk, v, heads = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.num_attention_heads
    assert cfg.head_dim == cfg.qk_rope_head_dim != (qk + v) // 2
    shapes = Shapes.of(anat, 2, 16, fast=True)
    assert 2 * shapes.kv == heads * (qk + v)  # keys and values
    assert attention_bytes(anat, 32, 2) == 32 * (2 * heads * (qk + v) * 2 + heads * 4)  # q, out, k, v; LSE
    llama = anatomy_of(tiny_model("llama")).config
    assert Shapes.of(anatomy_of(tiny_model("llama")), 2, 16).kv == 2 * llama.hidden_size // 4  # 2 of 4 heads


@pytest.mark.parametrize("q_lora_rank", [96, None])
def test_latent_attention_keeps_what_the_planner_prices(q_lora_rank):
    """A whole DeepSeek-V3 layer (latent attention, routed and shared experts) is priced by
    what `forward_keeping` keeps, counted from its tensors less the input and the rotary
    tables: at least that, at most a quarter above. Without `latent_bytes` (q_a's output
    and its norm's, the latent and its norm's, the queries' extra width) it is priced below."""
    import torch
    from helpers import kept_bytes

    from narrows.core.kernels.fastlayer import compute, parts_of
    from narrows.stream.planning.memory import input_bytes

    overrides = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=8, v_head_dim=48)
    overrides.update(q_lora_rank=q_lora_rank, kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=64)
    model = tiny_model("deepseek_v3", **overrides).requires_grad_(False)
    model.config._attn_implementation = "sdpa"
    anat = anatomy_of(model)
    batch, seq = 2, 64
    x = torch.randn(batch, seq, 256)
    cos, sin = anat.decoder.rotary_emb(x, torch.arange(seq).expand(batch, -1))
    _, saved = compute.forward_keeping(parts_of(anat.layers[1]), x, cos, sin, None)  # layer 0 is dense
    assert saved.latent is not None and (saved.latent.q_pre is None) == (q_lora_rank is None)
    kept = kept_bytes(saved, x, cos, sin, *model.parameters())
    shapes = Shapes.of(anat, batch, seq, fast=True)
    priced = whole_bytes(shapes) - input_bytes(Shapes.of(anat, batch, seq))
    assert kept <= priced <= 1.25 * kept, (kept, priced)
    assert whole_bytes(replace(shapes, latent=0)) - input_bytes(Shapes.of(anat, batch, seq)) < kept
