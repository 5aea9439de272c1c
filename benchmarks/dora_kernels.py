"""DoRA compose kernels (Triton) against the eager path, and the factored norm against PEFT's.

Compose forward and backward (with the magnitude gradient) at 20 activation shapes (rows x
d_out), bf16 and fp32: median of CUDA-event timings for eager and fused, the speedup, and
the fused kernels' achieved bandwidth against the device's measured copy bandwidth (a
large device-to-device copy in the same run). Two pairs of kernels: `fwd_*`/`bwd_*` time
`compose_forward`/`compose_backward` (inference and the paths below the training
crossover), `train_fwd_*`/`train_bwd_*` time what training runs on CUDA above the
crossover, `compose_forward_dual` (the output and `inner = s·lora + base`) and
`compose_backward_inner` (the backward from `inner` alone), each against its eager twin.
Norm: the row norm of W + s·B·A at 8192 x 8192 for ranks 384/512/768, narrows' factored
norm vs PEFT's dense one (its `get_weight_norm` of the `B @ A` it builds through an
identity), time and working set.

    python benchmarks/dora_kernels.py --out results/dora_kernels.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

ROWS = (512, 2048, 4096, 8192, 16384)
D_OUT = (2048, 4096, 8192, 14336)


def median_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 1 GiB device-to-device copy."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), 10)
    return 2 * src.numel() / (ms / 1e3)


def compose_shape(dname: str, m: int, n: int, reps: int, bandwidth: float) -> dict:
    from narrows.dora.compose import backward_eager, backward_inner_eager, formula, formula_dual
    from narrows.dora.kernels import (
        compose_backward,
        compose_backward_inner,
        compose_forward,
        compose_forward_dual,
    )

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dname]
    base = torch.randn(m, n, device="cuda").to(dtype)
    lora = (torch.randn(m, n, device="cuda") * 0.1).to(dtype)
    g = 1 + 0.01 * torch.randn(n, device="cuda")
    grad = torch.randn(m, n, device="cuda").to(dtype)
    size = base.element_size() * m * n
    r: dict = {"dtype": dname, "rows": m, "d_out": n}
    r["fwd_eager_ms"] = median_ms(lambda: formula(base, lora, g, 0.5), reps)
    r["fwd_fused_ms"] = median_ms(lambda: compose_forward(base, lora, g, 0.5), reps)
    r["bwd_eager_ms"] = median_ms(lambda: backward_eager(grad, base, lora, g, 0.5), reps)
    r["bwd_fused_ms"] = median_ms(lambda: compose_backward(grad, base, lora, g, 0.5), reps)
    r["fwd_speedup"] = r["fwd_eager_ms"] / r["fwd_fused_ms"]
    r["bwd_speedup"] = r["bwd_eager_ms"] / r["bwd_fused_ms"]
    # bytes the fused kernels must move: forward reads 2 and writes 1; backward reads 3, writes 2
    r["fwd_fused_bw_frac"] = 3 * size / (r["fwd_fused_ms"] / 1e3) / bandwidth
    r["bwd_fused_bw_frac"] = 5 * size / (r["bwd_fused_ms"] / 1e3) / bandwidth
    # the training tier: forward writes out and inner; backward reads grad and inner
    inner = compose_forward_dual(base, lora, g, 0.5)[1]
    r["train_fwd_eager_ms"] = median_ms(lambda: formula_dual(base, lora, g, 0.5), reps)
    r["train_fwd_fused_ms"] = median_ms(lambda: compose_forward_dual(base, lora, g, 0.5), reps)
    r["train_bwd_eager_ms"] = median_ms(lambda: backward_inner_eager(grad, inner, g, 0.5, lora.dtype), reps)
    r["train_bwd_fused_ms"] = median_ms(lambda: compose_backward_inner(grad, inner, g, 0.5, lora.dtype), reps)
    r["train_fwd_speedup"] = r["train_fwd_eager_ms"] / r["train_fwd_fused_ms"]
    r["train_bwd_speedup"] = r["train_bwd_eager_ms"] / r["train_bwd_fused_ms"]
    # forward reads 2 and writes 2; backward reads 2 (grad, inner) and writes 2
    r["train_fwd_fused_bw_frac"] = 4 * size / (r["train_fwd_fused_ms"] / 1e3) / bandwidth
    r["train_bwd_fused_bw_frac"] = 4 * size / (r["train_bwd_fused_ms"] / 1e3) / bandwidth
    print(json.dumps(r), flush=True)
    return r


def compose_rows(dtypes, reps: int, bandwidth: float) -> list[dict]:
    return [compose_shape(d, m, n, reps, bandwidth) for d in dtypes for m in ROWS for n in D_OUT]


def geomean(values) -> float:
    return torch.tensor(list(values)).log().mean().exp().item()


def norm_rows(reps: int) -> list[dict]:
    """At 8192 x 8192, bf16 W: PEFT's norm as its DoRA forward computes it (B·A through an
    identity in the adapter dtype, W cast to the adapter dtype, the dense norm) against
    `factored_row_norm`, with ||W||² computed in the call and cached (how the layers run it)."""
    from peft.tuners.lora.dora import DoraLinearLayer

    from narrows.dora import base_row_norm_sq, factored_row_norm

    rows = []
    d = 8192
    w = (torch.randn(d, d, device="cuda") * 0.02).to(torch.bfloat16)
    base_sq = base_row_norm_sq(w)
    for adapter in ("bf16", "fp32"):
        dtype = torch.bfloat16 if adapter == "bf16" else torch.float32
        for rank in (384, 512, 768):
            lora_a = torch.nn.Linear(d, rank, bias=False, device="cuda", dtype=dtype)
            lora_b = torch.nn.Linear(rank, d, bias=False, device="cuda", dtype=dtype)
            torch.nn.init.normal_(lora_b.weight, std=0.01)
            a, b = lora_a.weight.detach(), lora_b.weight.detach()
            peft_layer = DoraLinearLayer(fan_in_fan_out=False)

            @torch.no_grad()
            def peft_norm(la=lora_a, lb=lora_b, layer=peft_layer, dtype=dtype):
                lora_weight = layer.get_lora_weight(la, lb)  # lora_B(lora_A(eye)).T
                return layer.get_weight_norm(w.to(dtype), lora_weight, 2.0)

            r = {"adapter_dtype": adapter, "rank": rank, "shape": [d, d]}
            fns = (
                ("peft", peft_norm),
                ("narrows", lambda a=a, b=b: factored_row_norm(w, a, b, 2.0)),
                ("narrows_cached", lambda a=a, b=b: factored_row_norm(w, a, b, 2.0, base_sq=base_sq)),
            )
            for name, fn in fns:
                fn()  # compile and autotune first: the tuner's own buffers are not the norm's
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                fn()
                torch.cuda.synchronize()
                r[f"{name}_work_bytes"] = torch.cuda.max_memory_allocated() - before
                r[f"{name}_ms"] = median_ms(fn, reps)
            for name in ("narrows", "narrows_cached"):
                r[f"{name}_work_ratio"] = r["peft_work_bytes"] / r[f"{name}_work_bytes"]
                r[f"{name}_speedup"] = r["peft_ms"] / r[f"{name}_ms"]
            rows.append(r)
            print(json.dumps(r), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--skip-compose", action="store_true", help="the norm rows only")
    ap.add_argument("--out", default="benchmarks/results/dora_kernels.json")
    args = ap.parse_args()
    bandwidth = copy_bandwidth()
    print(f"device copy bandwidth {bandwidth / 1e9:.0f} GB/s ({torch.cuda.get_device_name()})")
    compose = [] if args.skip_compose else compose_rows(args.dtypes.split(","), args.reps, bandwidth)
    norms = norm_rows(args.reps)
    print(
        f"\n{'dtype':<6}{'rows':>7}{'d_out':>7}{'fwd eager':>11}{'fused':>8}{'x':>6}{'%copy':>7}"
        f"{'bwd eager':>11}{'fused':>8}{'x':>6}{'%copy':>7}"
    )
    for r in compose:
        print(
            f"{r['dtype']:<6}{r['rows']:>7}{r['d_out']:>7}{r['fwd_eager_ms']:>11.3f}{r['fwd_fused_ms']:>8.3f}"
            f"{r['fwd_speedup']:>6.2f}{100 * r['fwd_fused_bw_frac']:>6.0f}%{r['bwd_eager_ms']:>11.3f}"
            f"{r['bwd_fused_ms']:>8.3f}{r['bwd_speedup']:>6.2f}{100 * r['bwd_fused_bw_frac']:>6.0f}%"
        )
    for dname in [] if args.skip_compose else args.dtypes.split(","):
        sel = [r for r in compose if r["dtype"] == dname]
        fwd, bwd = geomean(r["fwd_speedup"] for r in sel), geomean(r["bwd_speedup"] for r in sel)
        print(
            f"{dname}: geometric mean speedup fwd {fwd:.2f}x, bwd {bwd:.2f}x; "
            f"largest shape fwd {100 * sel[-1]['fwd_fused_bw_frac']:.0f}% of copy bandwidth"
        )
        fwd, bwd = geomean(r["train_fwd_speedup"] for r in sel), geomean(r["train_bwd_speedup"] for r in sel)
        print(
            f"{dname} training tier (dual forward, backward from inner): geometric mean speedup fwd {fwd:.2f}x, "
            f"bwd {bwd:.2f}x; largest shape fwd {100 * sel[-1]['train_fwd_fused_bw_frac']:.0f}%, "
            f"bwd {100 * sel[-1]['train_bwd_fused_bw_frac']:.0f}% of copy bandwidth"
        )
    print(
        f"\n{'A,B':>5}{'rank':>5}{'PEFT ms':>9}{'ours ms':>9}{'x':>6}{'cached':>8}{'x':>6}"
        f"{'PEFT MiB':>10}{'ours MiB':>10}{'ratio':>7}{'cached':>8}{'ratio':>7}"
    )
    for r in norms:
        print(
            f"{r['adapter_dtype']:>5}{r['rank']:>5}{r['peft_ms']:>9.3f}{r['narrows_ms']:>9.3f}"
            f"{r['narrows_speedup']:>6.2f}{r['narrows_cached_ms']:>8.3f}{r['narrows_cached_speedup']:>6.2f}"
            f"{r['peft_work_bytes'] / 2**20:>10.1f}{r['narrows_work_bytes'] / 2**20:>10.1f}"
            f"{r['narrows_work_ratio']:>7.1f}{r['narrows_cached_work_bytes'] / 2**20:>8.1f}"
            f"{r['narrows_cached_work_ratio']:>7.1f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "device": torch.cuda.get_device_name(),
                "copy_bandwidth": bandwidth,
                "compose": compose,
                "norm": norms,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
