"""Fast decoder layers (`narrows.core.fuse_layers`) in bf16 against a float64 reference,
beside PEFT's own bf16 path.

One decoder layer of a real shape (default Qwen2.5-7B's, `configs/`), seeded random bf16
weights (linears ~ N(0, 0.02) as `_models.py` draws them; RMSNorm weights ~ 1 + N(0, 0.1),
not all ones, so the rounding of the weight's multiply is exercised), LoRA r16 (alpha 32)
on all seven projections with PEFT's float32 adapters, A ~ U(±1/√in) and B ~ N(0, 0.02)
(not zero, so every adapter's path shows), bf16 activations x ~ N(0, ``--x-std``²) of
batch × seq tokens and an output gradient ~ N(0, 1). Three computations of the same layer, forward and
backward through the output's gradient:

* ``ref``: the PEFT model in float64 — weights, adapters, activations, the rotary tables
  (from the model's own float32 angles) and SDPA's math kernel all float64;
* ``peft``: the unfused PEFT layer in bf16 with float32 adapters, as PEFT runs it;
* ``fast``: the same model after `fuse_layers` (LoRA in bf16 on tensor cores from the
  float32 masters; Liger-Kernel's RMSNorm, RoPE and SwiGLU on CUDA when installed). On CUDA
  with Liger in use it runs once more with ``NARROWS_LIGER=0`` (``fast·torch``: the PyTorch
  references of the element-wise ops); and once with ``lora_dtype=torch.float32`` (the
  adapters in PEFT's float32 arithmetic inside the fast layer).

For the layer output, the input gradient and each adapter's A and B gradients it reports
the relative error ``‖x − ref‖ / ‖ref‖`` (Frobenius, in float64) of ``peft`` and ``fast``
and their ratio fast / peft (the aim: ≤ 1.5).

Then each piece alone, each against float64 arithmetic on the same bf16 inputs:

* RMSNorm, RoPE, SwiGLU (forward, and the backward of every input that trains through it)
  as HF computes them in bf16 (the model's own norm module, ``apply_rotary_pos_emb``,
  ``ACT2FN[act](gate) * up``; autograd for the backward) beside
  `narrows.core.kernels.fastlayer.ops`' PyTorch references and, on CUDA with Liger-Kernel, the
  kernels the fast layer runs (``ops.kernels_in_use``); ratio = the kernel in use / HF.
* each group of linears (Q/K/V, O, gate/up, down) with its adapters: PEFT's modules in bf16
  beside the fast layer's `LinearGroup` forward and backward; ratio = fast / PEFT. Alone,
  from exact bf16 inputs, PEFT's adapter gradients are float32-accurate (its branch runs
  in float32) while the fast layer's carry the bf16 roundings of ``n·Aᵀ``, ``g·B`` and the
  cast masters by design, so their ratio is in the thousands; inside a layer both carry
  the roundings of the activations and gradients upstream, and the layer's ratio is the
  one the aim is about.

The input's scale matters to the layer output's error: with ``--x-std 1`` and weights of
N(0, 0.02) each sub-layer's update is as large as the residual, whereas in a trained
model's middle layers the residual stream dominates; ``--x-std 16`` weighs the roundings
of the residual sums (h1 = x + o(·), out = h1 + down(·)) as there.

``--nf4`` quantises the base linears to NF4 first (`narrows.core.quantize_nf4`); the
reference then multiplies by the dequantised weights (what both bf16 paths multiply by,
dequantised to bf16 by bitsandbytes) in float64, so the errors are the arithmetic's, not
the quantisation's.

A layer-level error of the fast layer above 1.5 × PEFT's is printed as a miss; the script
exits 0 either way (a measurement, not a test: `test_fastlayer.py` holds the bar).

    python benchmarks/fast_accuracy.py                              # CUDA: Qwen2.5-7B's layer, 2 x 512
    python benchmarks/fast_accuracy.py --nf4 --out benchmarks/results/fast_accuracy_nf4.json
    python benchmarks/fast_accuracy.py --model qwen3-8b             # built in (configs/ has no Qwen3)
    python benchmarks/fast_accuracy.py --model llama-3.2-3b
    python benchmarks/fast_accuracy.py --model tiny-qwen3 --seq 64  # CPU smoke (tiny-llama, tiny-qwen2, ...)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import platform
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).parent))
from _models import TARGETS as PROJECTIONS
from _models import add_lora, load_config

from narrows.core import anatomy_of, fuse_layers, quantize_nf4
from narrows.core.kernels.fastlayer import ops, parts_of

GROUPS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}

# Qwen3-8B's published shape (configs/ holds no Qwen3): per-head Q/K norms, head_dim 128
QWEN3_8B = dict(
    model_type="qwen3",
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=False,
    hidden_act="silu",
    attention_bias=False,
    attention_dropout=0.0,
)


# the layer ------------------------------------------------------------------------------


def layer_config(name: str):
    """A one-layer config of `name`: ``tiny-<arch>`` (narrows.core.testing), ``qwen3-8b``,
    or a file of `configs/` (or a path to a .json), as `_models.load_config` reads it."""
    if name.startswith("tiny-"):
        from narrows.core.testing import tiny_config

        cfg = tiny_config(name.removeprefix("tiny-"))
    elif name == "qwen3-8b":
        from transformers import AutoConfig

        cfg = AutoConfig.for_model(**QWEN3_8B)
    else:
        cfg = load_config(name)
    cfg.num_hidden_layers = 1
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:1]
    cfg.vocab_size = 256  # the embedding and head are never run: only the decoder layer is
    if getattr(cfg, "pad_token_id", None) is not None and cfg.pad_token_id >= cfg.vocab_size:
        cfg.pad_token_id = 0
    return cfg


@torch.no_grad()
def build(cfg, *, seed: int, device: torch.device, nf4: bool, rank: int, b_std: float):
    """(peft_bf16, ref_float64): the same one-layer PEFT model twice."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(shape) -> Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32)

    for name, p in model.named_parameters():
        p.copy_(1 + 0.1 * randn(p.shape) if "norm" in name else 0.02 * randn(p.shape))
    decoder = anatomy_of(model).decoder
    with torch.device(device):  # its inverse frequencies are computed, not loaded
        decoder.rotary_emb = type(decoder.rotary_emb)(config=model.config)
    ref_base = copy.deepcopy(model)
    if nf4:
        import bitsandbytes.functional as bf

        from narrows.core.quant.nf4 import is_nf4_linear

        quantize_nf4(model, compute_dtype=torch.bfloat16, device=device)
        dense = dict(ref_base.named_modules())
        for name, m in model.named_modules():
            if is_nf4_linear(m):
                w = bf.dequantize_4bit(m.weight.data, m.weight.quant_state)
                dense[name].weight.copy_(w.reshape(dense[name].weight.shape))
    model = add_lora(model, rank=rank)  # float32 adapters (PEFT's autocast of a bf16 base)
    for name, p in model.named_parameters():
        if "lora_A" in name:
            p.uniform_(-1, 1, generator=gen).div_(math.sqrt(p.shape[1]))
        elif "lora_B" in name:
            p.copy_(b_std * randn(p.shape))
    ref = add_lora(ref_base, rank=rank)
    adapters = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert adapters.keys() == {k for k in ref.state_dict() if "lora_" in k}
    ref.load_state_dict(adapters, strict=False)
    ref.to(torch.float64)
    for m in (model, ref):
        m.train()  # dropout is 0: train mode only as training runs it
        m.config.use_cache = False
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if "lora_" in n)
    return model, ref


def _adapter_key(name: str) -> str:
    """``...self_attn.q_proj.lora_A.default.weight`` -> ``q_proj.A``."""
    parts = name.split(".")
    i = next(i for i, s in enumerate(parts) if s in ("lora_A", "lora_B"))
    return f"{parts[i - 1]}.{parts[i][-1]}"


def layer_pass(model, x: Tensor, g: Tensor, pos: Tensor) -> dict[str, Tensor]:
    """The layer's output, the input's gradient and every adapter's gradient."""
    anat = anatomy_of(model)
    layer, rotary = anat.layers[0], anat.decoder.rotary_emb
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    x = x.detach().requires_grad_()
    cos, sin = rotary(x, pos)
    out = layer(x, attention_mask=None, position_ids=pos, position_embeddings=(cos, sin))
    out = out[0] if isinstance(out, tuple) else out
    grads = torch.autograd.grad(out, [x, *(p for _, p in named)], g)
    return {
        "output": out.detach(),
        "d_input": grads[0],
        **{_adapter_key(n): t for (n, _), t in zip(named, grads[1:])},
    }


# errors ---------------------------------------------------------------------------------


def rel(got: Tensor | Sequence[Tensor], ref: Tensor | Sequence[Tensor]) -> float:
    """``‖got − ref‖ / ‖ref‖`` over one tensor or several laid end to end, in float64."""
    got = [got] if isinstance(got, Tensor) else list(got)
    ref = [ref] if isinstance(ref, Tensor) else list(ref)
    num = sum(float((a.double() - b.double()).pow(2).sum()) for a, b in zip(got, ref))
    den = sum(float(b.double().pow(2).sum()) for b in ref)
    return math.sqrt(num / den)


@contextlib.contextmanager
def torch_ops_only() -> Iterator[None]:
    """`ops` with Liger-Kernel switched off (its documented ``NARROWS_LIGER=0``; the
    cached look-ups cleared so the switch takes, and again on the way out)."""
    before = os.environ.get("NARROWS_LIGER")
    os.environ["NARROWS_LIGER"] = "0"
    ops._liger.cache_clear()
    ops._liger_norm.cache_clear()
    try:
        yield
    finally:
        if before is None:
            del os.environ["NARROWS_LIGER"]
        else:
            os.environ["NARROWS_LIGER"] = before
        ops._liger.cache_clear()
        ops._liger_norm.cache_clear()


# the element-wise ops -------------------------------------------------------------------


def _rms64(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope64(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _autograd(fn, inputs: Sequence[Tensor], g: Tensor) -> list[Tensor]:
    """``[fn(*inputs), d inputs...]`` through autograd, `inputs` as leaves."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    y = fn(*leaves)
    return [y.detach(), *torch.autograd.grad(y, leaves, g)]


def _ours(run) -> dict[str, list[Tensor]]:
    """`run()` with the ops as the fast layer runs them here, and with the PyTorch
    references (the same when no library kernel is in use)."""
    out = {"in use": run()}
    with torch_ops_only():
        out["torch"] = run()
    return out


def op_rows(model, x: Tensor, gen: torch.Generator) -> list[dict]:
    """RMSNorm, RoPE, SwiGLU: HF's bf16 and narrows' ops against float64 on the same inputs."""
    layer = anatomy_of(model).layers[0]
    cfg = model.config
    dev = x.device

    def randn(*shape) -> Tensor:
        return torch.randn(shape, generator=gen, device=dev, dtype=torch.float32).to(torch.bfloat16)

    used = ops.kernels_in_use(dev)
    rows = []

    def add(op: str, names: Sequence[str], ref64: list[Tensor], hf: list[Tensor], ours: dict):
        kernel = used.get(op, "torch")
        for i, q in enumerate(names):
            e_hf, e_use, e_torch = (rel(t[i], ref64[i]) for t in (hf, ours["in use"], ours["torch"]))
            rows.append(
                {
                    "op": op,
                    "quantity": q,
                    "hf_bf16": e_hf,
                    "narrows_torch": e_torch,
                    "narrows_in_use": e_use,
                    "kernel": kernel,
                    "ratio": e_use / e_hf if e_hf else None,
                }
            )

    # RMSNorm over (tokens, hidden), the layer's input norm; the weight is frozen
    norm = layer.input_layernorm
    xs, gs = x.reshape(-1, x.shape[-1]).contiguous(), randn(x.numel() // x.shape[-1], x.shape[-1])
    w, eps = norm.weight.detach(), norm.variance_epsilon
    ref64 = _autograd(lambda t: _rms64(t, w.double(), eps), [xs.double()], gs.double())
    hf = _autograd(norm, [xs], gs)  # its weight is frozen (PEFT), as in the fast layer

    def ours_norm() -> list[Tensor]:
        y, st = ops.rms_norm(xs, w, eps)
        return [y, ops.rms_norm_backward(gs, xs, w, st)]

    add("rms_norm", ("y", "d_x"), ref64, hf, _ours(ours_norm))

    # RoPE on queries (batch, heads, seq, head_dim) with the model's bf16 tables
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    batch, seq = x.shape[:2]
    heads, hd = (
        cfg.num_attention_heads,
        getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
    )
    pos = torch.arange(seq, device=dev).expand(batch, seq)
    cos, sin = anatomy_of(model).decoder.rotary_emb(x, pos)
    q, gq = randn(batch, heads, seq, hd), randn(batch, heads, seq, hd)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    ref64 = _autograd(lambda t: _rope64(t, c.double(), s.double()), [q.double()], gq.double())
    hf = _autograd(lambda t: apply_rotary_pos_emb(t, t, cos, sin)[0], [q], gq)
    add("rope", ("y", "d_x"), ref64, hf, _ours(lambda: [ops.rope(q, c, s), ops.rope_backward(gq, c, s)]))

    # SwiGLU on (tokens, intermediate), with HF's activation
    from transformers.activations import ACT2FN

    act = ACT2FN[cfg.hidden_act]
    tokens, inter = batch * seq, cfg.intermediate_size
    gate, up, ga = randn(tokens, inter), randn(tokens, inter), randn(tokens, inter)
    ref64 = _autograd(lambda a, b: F.silu(a) * b, [gate.double(), up.double()], ga.double())
    hf = _autograd(lambda a, b: act(a) * b, [gate, up], ga)
    add(
        "swiglu",
        ("y", "d_gate", "d_up"),
        ref64,
        hf,
        _ours(lambda: [ops.swiglu(gate, up), *ops.swiglu_backward(ga, gate, up)]),
    )
    return rows


# the linears with their adapters ----------------------------------------------------------


def _modules(model, names: Sequence[str]) -> list[nn.Module]:
    layer = anatomy_of(model).layers[0]
    return [getattr(layer.self_attn if n in PROJECTIONS[:4] else layer.mlp, n) for n in names]


def _peft_group(mods: Sequence[nn.Module], n: Tensor, grads: Sequence[Tensor]) -> dict[str, list[Tensor]]:
    leaf = n.detach().requires_grad_()
    outs = [m(leaf) for m in mods]
    params = [t for m in mods for t in (m.lora_A["default"].weight, m.lora_B["default"].weight)]
    got = torch.autograd.grad(outs, [leaf, *params], list(grads))
    return {
        "out": [o.detach() for o in outs],
        "d_in": [got[0]],
        "d_A": list(got[1::2]),
        "d_B": list(got[2::2]),
    }


def lora_rows(model, ref, x: Tensor, gen: torch.Generator) -> list[dict]:
    """Each group of linears alone: PEFT in bf16 and the fast layer's `LinearGroup`
    against PEFT's modules in float64, on the same bf16 input and output gradients."""
    parts = parts_of(anatomy_of(model).layers[0])
    dev = x.device
    tokens = x.shape[0] * x.shape[1]
    rows = []
    for (group, names), fast_group in zip(GROUPS.items(), parts.groups):
        mods, mods64 = _modules(model, names), _modules(ref, names)
        n = torch.randn(tokens, mods[0].in_features, generator=gen, device=dev).to(torch.bfloat16)
        grads = [
            torch.randn(tokens, m.out_features, generator=gen, device=dev).to(torch.bfloat16) for m in mods
        ]
        ref64 = _peft_group(mods64, n.double(), [t.double() for t in grads])
        peft = _peft_group(mods, n, grads)
        with torch.no_grad():
            outs, state = fast_group.forward(n, fast_group.masks(n))
            d_n, pg = fast_group.backward(grads, state)
        fast = {"out": outs, "d_in": [d_n], "d_A": pg[0::2], "d_B": pg[1::2]}
        for q in ("out", "d_in", "d_A", "d_B"):
            e_p, e_f = rel(peft[q], ref64[q]), rel(fast[q], ref64[q])
            rows.append(
                {
                    "op": f"lora {group}",
                    "quantity": q,
                    "peft_bf16": e_p,
                    "fast": e_f,
                    "ratio": e_f / e_p if e_p else None,
                }
            )
    return rows


# main -----------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model",
        default="qwen2.5-7b",
        help="a file of benchmarks/configs (qwen2.5-7b, llama-3.2-3b, ...), a .json path, qwen3-8b, "
        "or tiny-<arch> (llama, qwen2, qwen3, mistral: narrows.core.testing)",
    )
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--b-std", type=float, default=0.02, help="lora_B ~ N(0, b_std)")
    ap.add_argument(
        "--x-std",
        type=float,
        default=1.0,
        help="the input's scale: a trained model's residual stream is larger than each layer's "
        "update (e.g. 16), which weighs the roundings of the residual sums",
    )
    ap.add_argument("--nf4", action="store_true", help="NF4 base; the reference uses the dequantised weights")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="benchmarks/results/fast_accuracy.json")
    args = ap.parse_args()

    t0 = time.perf_counter()
    dev = torch.device(args.device)
    cfg = layer_config(args.model)
    model, ref = build(cfg, seed=args.seed, device=dev, nf4=args.nf4, rank=args.rank, b_std=args.b_std)
    gen = torch.Generator(device=dev).manual_seed(args.seed + 1)
    shape = (args.batch, args.seq, cfg.hidden_size)
    x = torch.randn(shape, generator=gen, device=dev).mul_(args.x_std).to(torch.bfloat16)
    g = torch.randn(shape, generator=gen, device=dev).to(torch.bfloat16)
    pos = torch.arange(args.seq, device=dev).expand(args.batch, args.seq)

    got = {"ref": layer_pass(ref, x.double(), g.double(), pos), "peft": layer_pass(model, x, g, pos)}
    op_table = op_rows(model, x, gen) + lora_rows(model, ref, x, gen)
    report = fuse_layers(model)
    if report.refused:
        raise SystemExit(f"fast_accuracy: {report}")
    used = ops.kernels_in_use(dev)
    got["fast"] = layer_pass(model, x, g, pos)
    library = "liger" in used.values()
    if library:
        with torch_ops_only():
            got["fast_torch"] = layer_pass(model, x, g, pos)
    fuse_layers(model, lora_dtype=torch.float32)  # the option: the adapters in PEFT's float32 arithmetic
    got["fast_f32"] = layer_pass(model, x, g, pos)

    keys = ["output", "d_input"] + [f"{p}.{m}" for p in PROJECTIONS for m in "AB"]
    layer_table = []
    for k in keys:
        row = {
            "quantity": k,
            "peft_bf16": rel(got["peft"][k], got["ref"][k]),
            "fast": rel(got["fast"][k], got["ref"][k]),
        }
        row["ratio"] = row["fast"] / row["peft_bf16"]
        row["fast_float32_lora"] = rel(got["fast_f32"][k], got["ref"][k])
        if library:
            row["fast_torch_ops"] = rel(got["fast_torch"][k], got["ref"][k])
        layer_table.append(row)
    worst = max(layer_table, key=lambda r: r["ratio"])
    seconds = time.perf_counter() - t0

    device = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu"
    title = (
        f"{args.model}{' NF4' if args.nf4 else ''} decoder layer, hidden {cfg.hidden_size}, "
        f"intermediate {cfg.intermediate_size}, {args.batch} x {args.seq} tokens (x ~ N(0, {args.x_std}²)), LoRA r{args.rank} on all "
        f"seven projections, on {device}; ops: {used}"
    )
    print(f"\n{title}\n\nlayer: relative error vs float64 (‖x − ref‖/‖ref‖)\n")
    extra = " fast·torch ops |" if library else ""
    print(
        f"| quantity | PEFT bf16 | fast |{extra} fast / PEFT | fast, float32 LoRA |\n"
        f"|---|---:|---:|{'---:|' if library else ''}---:|---:|"
    )
    for r in layer_table:
        ft = f" {r['fast_torch_ops']:.3e} |" if library else ""
        print(
            f"| {r['quantity']} | {r['peft_bf16']:.3e} | {r['fast']:.3e} |{ft} {r['ratio']:.2f} | "
            f"{r['fast_float32_lora']:.3e} |"
        )
    verdict = "within" if worst["ratio"] <= 1.5 else "MISSES"
    print(f"\nworst ratio {worst['ratio']:.2f} ({worst['quantity']}): {verdict} the 1.5x aim")

    print("\nops alone: relative error vs float64 on the same bf16 inputs\n")
    print(
        "| op | quantity | HF bf16 | narrows torch | narrows in use (kernel) | in use / HF |\n|---|---|---:|---:|---:|---:|"
    )
    for r in (r for r in op_table if "hf_bf16" in r):
        print(
            f"| {r['op']} | {r['quantity']} | {r['hf_bf16']:.3e} | {r['narrows_torch']:.3e} | "
            f"{r['narrows_in_use']:.3e} ({r['kernel']}) | {r['ratio']:.2f} |"
        )
    print("\n| linears | quantity | PEFT bf16 | fast | fast / PEFT |\n|---|---|---:|---:|---:|")
    for r in (r for r in op_table if "peft_bf16" in r):
        print(f"| {r['op']} | {r['quantity']} | {r['peft_bf16']:.3e} | {r['fast']:.3e} | {r['ratio']:.2f} |")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    import peft
    import transformers

    out.write_text(
        json.dumps(
            {
                "args": vars(args),
                "title": title,
                "device": device,
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "peft": peft.__version__,
                "kernels_in_use": used,
                "config": {
                    k: getattr(cfg, k, None)
                    for k in (
                        "model_type",
                        "hidden_size",
                        "intermediate_size",
                        "num_attention_heads",
                        "num_key_value_heads",
                        "head_dim",
                    )
                },
                "layer": layer_table,
                "worst_layer_ratio": worst["ratio"],
                "worst_layer_quantity": worst["quantity"],
                "within_1_5x": worst["ratio"] <= 1.5,
                "ops": op_table,
                "seconds": seconds,
            },
            indent=2,
        )
    )
    print(f"\n{seconds:.1f} s; wrote {out}")


if __name__ == "__main__":
    main()
