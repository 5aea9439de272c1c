"""Where one fast decoder layer's device time goes: by kind of kernel, and every matmul by
its shapes with the rate it reached — so a step's gap to its compute floor can be split
into the big matmuls' own rate, the adapters' small matmuls, dequantisation and the rest.

One layer of a real shape (random NF4 weights, LoRA r16 on all seven projections,
non-zero B), a batch of T tokens, on CUDA: the streamed layer's two passes as a step runs
them — the forward (its weights dequantised once), then the recompute and the backward
sharing one dequantisation — several times under torch.profiler, reported per pass. No
copies run beside it: this is the layer alone, the part of a step the host link does not
touch.

    python benchmarks/layer_profile.py --case qwen2.5-72b:4096:512 --out $OUT/layer_profile_72b.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

MATMULS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::_mm_dtype", "aten::mm.dtype")


def flops(name: str, shapes: list) -> float | None:
    """2·M·K·N from a matmul op's recorded input shapes (the last two 2-D ones)."""
    mats = [s for s in shapes if isinstance(s, list | tuple) and len(s) == 2]
    if len(mats) < 2:
        return None
    (m, k), (k2, n) = mats[-2], mats[-1]
    return 2.0 * m * k * n if k == k2 else None


def profile_passes(fwd, back, reps: int) -> dict:
    """`reps` forwards and `reps` recompute + backwards under the profiler: device time per
    pass by kind of kernel, and every matmul (op, shapes) with its count and rate."""
    from stream_qlora import device_categories
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for label, fn in (("forward", fwd), ("recompute_backward", back)):
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as tmp:
            trace = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(trace))
            kinds = device_categories(json.loads(trace.read_text()))
        per = {k: round(v / reps, 6) for k, v in kinds["device_s_by_kind"].items()}
        mats, ops = [], []
        for e in prof.key_averages(group_by_input_shape=True):
            dev = getattr(e, "self_device_time_total", 0) / 1e6
            if e.key not in MATMULS:
                if dev > 0:
                    ops.append(
                        [e.key, [s for s in e.input_shapes if s], e.count / reps, round(dev / reps, 6)]
                    )
                continue
            f = flops(e.key, e.input_shapes)
            calls = e.count / reps
            mats.append(
                {
                    "op": e.key,
                    "shapes": [s for s in e.input_shapes if s],
                    "calls": calls,
                    "s_per_pass": round(dev / reps, 6),
                    "tflops": round(f * e.count / dev / 1e12, 1) if f and dev else None,
                    "flop_per_pass": f * calls if f else None,
                }
            )
        mats.sort(key=lambda r: -r["s_per_pass"])
        matmul_flop = sum(r["flop_per_pass"] or 0 for r in mats)
        out[label] = {
            "device_s_by_kind": per,
            "device_s": round(sum(per.values()), 6),
            "matmul_flop": matmul_flop,
            "matmul_s": round(sum(r["s_per_pass"] for r in mats), 6),
            "matmuls": mats,
            "other_kernels": [[k, round(v / reps, 6)] for k, v in kinds["other_kernels_top"]],
            "other_ops": sorted(ops, key=lambda r: -r[3])[:24],  # [op, shapes, calls, device s] a pass
        }
    return out


def totals(row: dict, layers: int) -> dict:
    """One layer's two passes summed, against their floor at 800 TFLOP/s, by kind of kernel
    and with the adapters' rank-r matmuls (a dimension of 64 or less) apart; and the same
    for the model's `layers` (what the layers of a step cost with nothing beside them)."""
    passes = [row["forward"], row["recompute_backward"]]
    device = sum(p["device_s"] for p in passes)
    floor = sum(row["floor_s_at_800"].values())
    kinds: dict[str, float] = {}
    for p in passes:
        for k, v in p["device_s_by_kind"].items():
            kinds[k] = round(kinds.get(k, 0.0) + v, 6)
    adapters = sum(
        r["s_per_pass"]
        for p in passes
        for r in p["matmuls"]
        if min(min(s) for s in r["shapes"] if len(s) == 2) <= 64
    )
    return {
        "model_layers": layers,
        "floor_tflops": 800,
        "layer_device_s": device,
        "layer_floor_s_at_800": floor,
        "layer_over_floor": device / floor,
        "layer_s_by_kind": kinds,
        "layer_adapter_matmuls_s": adapters,
        "layers_device_s": device * layers,
        "layers_floor_s_at_800": floor * layers,
        "layers_flop": floor * 800e12 * layers,
    }


def base_flop(parts, tokens: int) -> dict[str, float]:
    """A forward's matmul FLOPs by linear (and, in a mixture of experts, by routed stack:
    each token's k experts), adapters and attention's products aside."""
    flop = {
        p.name: 2.0 * tokens * p.weight.shape[0] * p.weight.shape[1]
        for grp in parts.groups
        for p in grp.linears
    }
    moe = parts.moe
    if moe is not None:
        hidden, width = moe.router.shape[1], moe.intermediate
        flop["gate_up (routed)"] = 2.0 * tokens * moe.top_k * hidden * 2 * width
        flop["down (routed)"] = 2.0 * tokens * moe.top_k * width * hidden
    return flop


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default="qwen2.5-72b:4096:512", help="model:tokens:seq")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument(
        "--experts", action="store_true", help="a mixture of experts: LoRA on its routed experts too"
    )
    ap.add_argument("--out", default="benchmarks/results/layer_profile.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("layer_profile.py profiles CUDA kernels: run it on a GPU")
    from fast_memory import one_layer

    from narrows.core import anatomy_of
    from narrows.core.kernels.fastlayer import compute, kernels_in_use, parts_of

    name, tokens, seq = args.case.split(":")
    tokens, seq = int(tokens), int(seq)
    device = torch.device("cuda")
    model, cfg = one_layer(name, device, dropout=args.dropout, experts=args.experts)
    anat = anatomy_of(model)
    parts = parts_of(anat.layers[0])
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens // seq, seq, cfg.hidden_size, device=device, dtype=torch.bfloat16, generator=gen)
    pos = torch.arange(seq, device=device).expand(tokens // seq, -1)
    cos, sin = anat.decoder.rotary_emb(x, pos)
    g = torch.randn_like(x)

    def fwd():
        compute.forward(parts, x, cos, sin, None, {})

    def back():
        cache: dict = {}
        compute.backward(parts, compute.recompute(parts, x, cos, sin, None, cache), g, cache)

    passes = profile_passes(fwd, back, args.reps)
    flop = base_flop(parts, tokens)
    fwd_flop = sum(flop.values())
    back_flop = 2 * fwd_flop - sum(f for n, f in flop.items() if n.startswith("down"))  # no down recompute
    row = {
        "case": args.case,
        "dropout": args.dropout,
        "experts_lora": args.experts,
        "kernels": kernels_in_use(device),
        "base_flop": flop,
        "floor_s_at_800": {"forward": fwd_flop / 800e12, "recompute_backward": back_flop / 800e12},
        **passes,
    }
    from _models import load_config

    row["totals"] = totals(row, load_config(name).num_hidden_layers)
    for label in ("forward", "recompute_backward"):
        p = passes[label]
        print(f"{label}: device {p['device_s'] * 1e3:.2f} ms  {p['device_s_by_kind']}")
        for r in p["matmuls"][:14]:
            print(
                f"   {r['op']:<14} {r['shapes']!s:<44} x{r['calls']:<4g} {r['s_per_pass'] * 1e3:7.3f} ms"
                f"  {r['tflops']} TFLOP/s"
            )
        for k, shapes, n, v in p["other_ops"]:
            print(f"   {v * 1e3:7.3f} ms  x{n:<3g} {k} {str(shapes)[:90]}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    Path(args.out).write_text(json.dumps({**info, "rows": [row]}, indent=1))


if __name__ == "__main__":
    main()
