"""Loss-stage peak memory of the LM head: the head and
cross-entropy forward + backward on Llama-3.2-3B and Qwen2.5-3B *shapes* (random weights),
for HF's own loss path and narrows.lmhead's variants, side by side in one process.

    python benchmarks/lmhead_memory.py --contexts 512,1024,2048,4096,8192,16384 \
        --fractions 1.0,0.3,0.05 --dtypes fp32,bf16 --topk 100,500,1000 --out results/lmhead_memory.json

Methods: hf (logits, then transformers' ForCausalLMLoss), masked (head only at trainable
positions, full logits there), chunked (tiled exact CE, all positions), masked+chunked,
topk-K (masked + chunked over the union of the targets' K neighbours), and on CUDA, when
installed, liger (Liger-Kernel fused linear CE) and cce (Cut Cross-Entropy, its default
gradient filter). "Peak" is the allocation above what exists before the loss (head
weight, hidden states, labels): the loss stage's own cost. On a CPU it is the growth of
the process's RSS high-water mark. Targets follow a Zipf law over the vocabulary (like
text); the first (1 - fraction) of the positions are prompt (-100).
Each row also reports the loss's relative difference from HF's.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

SHAPES = {  # vocab, hidden, from the configs in benchmarks/configs
    "llama-3.2-3b": (128256, 3072),
    "qwen2.5-3b": (151936, 2048),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def zipf_targets(n: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
    probs = ranks.pow(-1.1)
    perm = torch.randperm(vocab, generator=gen)  # which token gets which rank
    return perm[torch.multinomial(probs / probs.sum(), n, replacement=True, generator=gen)]


class Meter:
    def __init__(self, device: torch.device):
        self.device = device

    def start(self) -> None:
        from narrows.core import reset_peaks
        from narrows.core.memory import host_rss_high_water

        gc.collect()
        reset_peaks(self.device)
        self.base = (
            torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else host_rss_high_water()
        )

    def peak(self) -> int:
        from narrows.core.memory import host_rss_high_water

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self.base
        return host_rss_high_water() - self.base


def make_loss(method: str, weight: torch.Tensor, neighbours: dict[int, torch.Tensor]):
    import narrows.lmhead as lmh
    from narrows.core import ResidentHead

    source = ResidentHead(weight)
    if method == "hf":
        from transformers.loss.loss_utils import ForCausalLMLoss

        return lambda h, y: ForCausalLMLoss(torch.nn.functional.linear(h, weight), y, weight.shape[0])
    if method == "liger":
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        fn = LigerFusedLinearCrossEntropyLoss()
        return lambda h, y: fn(weight, h[0, :-1], y[0, 1:])
    if method == "cce":
        from cut_cross_entropy import linear_cross_entropy

        return lambda h, y: linear_cross_entropy(h, weight, y, shift=True)
    opts = {
        "masked": dict(mask=True, chunked=False),
        "chunked": dict(mask=False, chunked=True),
        "masked+chunked": dict(mask=True, chunked=True),
        "chunked+cce": dict(mask=False, chunked=True, fused="cce"),
        "masked+chunked+cce": dict(mask=True, chunked=True, fused="cce"),
    }.get(method)
    if opts is not None:
        options = lmh.LossOptions(**opts)
        return lambda h, y: lmh.causal_lm_loss(h, y, source, options)
    k = int(method.removeprefix("topk-"))
    options = lmh.LossOptions(mask=True, chunked=True, topk=k)
    return lambda h, y: lmh.causal_lm_loss(h, y, source, options, neighbours=neighbours[k])


def timed(fn, h: torch.Tensor, labels: torch.Tensor, reps: int) -> float | None:
    """Median seconds of `reps` forward+backward passes (after the measured one: warm)."""
    if reps < 1:
        return None
    times = []
    for _ in range(reps):
        h.grad = None
        if h.is_cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn(h, labels).backward()
        if h.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def run(args: argparse.Namespace) -> list[dict]:
    import narrows.lmhead as lmh

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    meter = Meter(device)
    rows = []
    for model in args.models.split(","):
        vocab, hidden = SHAPES[model]
        for dname in args.dtypes.split(","):
            dtype = DTYPES[dname]
            gen = torch.Generator().manual_seed(0)
            weight = (torch.randn(vocab, hidden, generator=gen) * 0.02).to(device, dtype)
            methods = ["hf", "masked", "chunked", "masked+chunked"]
            neighbours = {}
            if device.type == "cuda" or args.topk_on_cpu:
                for k in [int(x) for x in args.topk.split(",") if x]:
                    neighbours[k] = lmh.neighbour_table(weight, k, cache_dir=args.cache)
                    methods.append(f"topk-{k}")
            if device.type == "cuda":
                methods += ["liger", "cce"]
                if dtype != torch.float32:  # narrows dispatching to Cut Cross-Entropy (bf16/fp16 only)
                    methods += ["chunked+cce", "masked+chunked+cce"]
            for ctx in [int(x) for x in args.contexts.split(",")]:
                targets = zipf_targets(ctx, vocab, gen)
                for frac in [float(x) for x in args.fractions.split(",")]:
                    labels = targets.clone()[None].to(device)
                    labels[0, : round(ctx * (1 - frac))] = -100
                    ref = None
                    h0 = torch.randn(1, ctx, hidden, generator=gen).to(
                        device, dtype
                    )  # the same for every method
                    for method in methods:
                        row = {
                            "model": model,
                            "dtype": dname,
                            "context": ctx,
                            "trainable": frac,
                            "method": method,
                        }
                        h = h0.clone().requires_grad_(True)
                        try:
                            fn = make_loss(method, weight, neighbours)
                            meter.start()
                            loss = fn(h, labels)
                            loss.backward()
                            row["peak_bytes"] = meter.peak()
                            row["loss"] = loss.item()
                            row["seconds"] = timed(fn, h, labels, args.time_reps)
                        except ImportError as e:
                            row["error"] = f"not installed: {e.name}"
                        except torch.OutOfMemoryError:
                            row["error"] = "OOM"
                        except Exception as e:  # a baseline library refusing a shape/dtype
                            row["error"] = f"{type(e).__name__}: {str(e)[:100]}"
                        if method == "hf" and "loss" in row:
                            ref = row
                        if ref is not None and "loss" in row:
                            row["loss_rel_diff"] = abs(row["loss"] - ref["loss"]) / abs(ref["loss"])
                            row["peak_vs_hf"] = row["peak_bytes"] / ref["peak_bytes"]
                            if row.get("seconds") and ref.get("seconds"):
                                row["time_vs_hf"] = row["seconds"] / ref["seconds"]
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                        del h
                        loss = None
                    del h0
            del weight
    return rows


def table(rows: list[dict]) -> str:
    gib = 2**30
    out = [
        f"{'model':<13}{'dtype':<6}{'ctx':>6}{'train':>7}  {'method':<19}{'peak GiB':>9}{'vs HF':>8}"
        f"{'ms':>9}{'vs HF':>7}{'loss rel diff':>14}"
    ]
    for r in rows:
        if "error" in r:
            out.append(
                f"{r['model']:<13}{r['dtype']:<6}{r['context']:>6}{r['trainable']:>7.0%}  {r['method']:<19}  {r['error']}"
            )
            continue
        vs = r.get("peak_vs_hf")
        diff = r.get("loss_rel_diff")
        ms = f"{1e3 * r['seconds']:.1f}" if r.get("seconds") else "-"
        tvs = f"{r['time_vs_hf']:.2f}" if r.get("time_vs_hf") else "-"
        out.append(
            f"{r['model']:<13}{r['dtype']:<6}{r['context']:>6}{r['trainable']:>7.0%}  {r['method']:<19}"
            f"{r['peak_bytes'] / gib:>9.3f}{(f'{vs:.3f}' if vs is not None else '-'):>8}{ms:>9}{tvs:>7}"
            f"{(f'{diff:.1e}' if diff is not None else '-'):>14}"
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama-3.2-3b,qwen2.5-3b")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--contexts", default="512,1024,2048")
    ap.add_argument("--fractions", default="1.0,0.3,0.05")
    ap.add_argument("--topk", default="100,500,1000")
    ap.add_argument("--topk-on-cpu", action="store_true", help="build neighbour tables on the CPU (slow)")
    ap.add_argument("--cache", default=None, help="neighbour table cache (default ~/.cache/narrows)")
    ap.add_argument(
        "--time-reps",
        type=int,
        default=3 if torch.cuda.is_available() else 0,
        help="timed forward+backward repetitions per row (default 3 on CUDA, 0 on CPU)",
    )
    ap.add_argument("--out", default="benchmarks/results/lmhead_memory.json")
    args = ap.parse_args()
    rows = run(args)
    print()
    print(table(rows))
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": device, "args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
