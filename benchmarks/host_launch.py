"""What one matmul costs the host: a 7B step at 8 × 512 tokens is host-bound on the H100
machine, where a torch profile put `aten::mm` at about 80 µs of host time a call
(case `prof_7b_1x512_g8` of `benchmarks/results/h100.jsonl`). This times the host's side alone — calls queued
back to back, the device synchronised once at the end, the queue kept short enough never
to block — for the matmuls a fast layer makes (the base's, the adapters' and their float32
gradients through ``out_dtype``), in this process's cuBLAS settings. Run it with and without
``CUBLAS_WORKSPACE_CONFIG`` (the benchmarks set it; a user's run need not) and with
``--blas cublaslt`` to see which setting costs what.

    python benchmarks/host_launch.py --out /tmp/host_launch_plain.json
    python benchmarks/results.py add h100 /tmp/host_launch_plain.json
    CUBLAS_WORKSPACE_CONFIG=:4096:8 python benchmarks/host_launch.py --out ...
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

TOKENS, HIDDEN, QKV, INTER, RANK = 4096, 3584, 4608, 18944, 16  # Qwen2.5-7B, 8 × 512 tokens


def cases(dev: torch.device) -> dict[str, object]:
    """name -> a call of the shape one 7B fast layer makes."""
    bf = {"device": dev, "dtype": torch.bfloat16}
    n, w = torch.randn(TOKENS, HIDDEN, **bf), torch.randn(QKV, HIDDEN, **bf)
    a, h = torch.randn(3 * RANK, HIDDEN, **bf), torch.randn(TOKENS, 3 * RANK, **bf)
    b, g = torch.randn(QKV, 3 * RANK, **bf), torch.randn(TOKENS, QKV, **bf)
    out = torch.empty(TOKENS, QKV, **bf)
    small = torch.randn(64, 64, **bf)
    return {
        "base n @ W_qkvᵀ": lambda: n.mm(w.t()),
        "adapter n @ A_allᵀ": lambda: n.mm(a.t()),
        "adapter out += h @ B_allᵀ": lambda: out.addmm_(h, b.t()),
        "A's gradient, float32 out": lambda: torch.mm(h.t(), n, out_dtype=torch.float32),
        "input gradient g @ W_qkv": lambda: g.mm(w),
        "64 × 64 mm": lambda: small.mm(small),
        "64 × 64 add_": lambda: small.add_(small),
    }


def host_us(fn, reps: int) -> float:
    """Mean host time of one call, µs: `reps` calls queued, then one synchronisation."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    host = time.perf_counter() - t
    torch.cuda.synchronize()
    return host / reps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=200, help="calls per case (few enough not to fill the queue)")
    ap.add_argument("--blas", choices=("default", "cublas", "cublaslt"), default="default")
    ap.add_argument(
        "--workspace-bytes",
        type=int,
        default=None,
        help="set cuBLAS's workspace through torch.backends.cuda.cublas_workspace_size "
        "(which takes precedence over CUBLAS_WORKSPACE_CONFIG) before the first matmul",
    )
    ap.add_argument("--out", default="benchmarks/results/host_launch.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("host_launch.py times CUDA calls: run it on a GPU machine")
    if args.blas != "default":
        torch.backends.cuda.preferred_blas_library(args.blas)
    if args.workspace_bytes is not None:
        torch.backends.cuda.cublas_workspace_size(args.workspace_bytes)
    dev = torch.device("cuda")
    rows = [{"call": name, "host_us": host_us(fn, args.reps)} for name, fn in cases(dev).items()]
    run = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "blas": args.blas,
        "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "workspace_bytes": args.workspace_bytes,
        "reps": args.reps,
        "rows": rows,
    }
    print(
        f"{run['device']}, torch {run['torch']}, blas {args.blas}, "
        f"CUBLAS_WORKSPACE_CONFIG={run['CUBLAS_WORKSPACE_CONFIG']}\n"
    )
    print("| call | host µs |\n|---|---:|")
    for r in rows:
        print(f"| {r['call']} | {r['host_us']:.1f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(run, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
