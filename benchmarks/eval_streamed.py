"""Evaluation of a model larger than the budget: the same random NF4 model (a real
architecture's shape) scored by the lm-eval backend `narrows` streamed within a GPU budget
and fully resident, same requests, one process.

    python benchmarks/eval_streamed.py --model qwen2.5-32b --gpu-budget 8GiB --requests 32 --context 1024

Per mode: tokens/s over `loglikelihood` requests (context + a 16-token continuation, byte
tokenizer, batch size `--batch`), peak allocated GPU memory, and the largest difference of
the per-request loglikelihoods against the resident run.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))


def make_requests(n: int, context: int, seed: int = 0):
    from lm_eval.api.instance import Instance

    rng = random.Random(seed)
    words = [
        "the",
        "of",
        "and",
        "to",
        "in",
        "is",
        "was",
        "for",
        "on",
        "that",
        "with",
        "as",
        "by",
        "at",
        "from",
        "it",
        "his",
        "an",
        "were",
        "are",
        "which",
        "this",
        "be",
    ]

    def text(chars: int) -> str:
        out = []
        while sum(len(w) + 1 for w in out) < chars:
            out.append(rng.choice(words))
        return " ".join(out)[:chars]

    return [Instance("loglikelihood", {}, (text(context), " " + text(15)), i) for i in range(n)]


def run(mode: str, args) -> dict:
    from _models import load_config, random_nf4_model

    from narrows.core import read_peaks, reset_peaks
    from narrows.core.testing import tiny_tokenizer
    from narrows.eval import NarrowsLM

    build = time.perf_counter()
    model = random_nf4_model(load_config(args.model), work_device="cuda")
    build = time.perf_counter() - build
    torch.cuda.empty_cache()
    reset_peaks("cuda")
    lm = NarrowsLM(pretrained=model, tokenizer=tiny_tokenizer(), device="cuda", batch_size=args.batch,
                   gpu_budget=args.gpu_budget if mode == "streamed" else None, max_length=args.context + 64)  # fmt: skip
    reqs = make_requests(args.requests, args.context)
    lm.loglikelihood(reqs[: args.batch], disable_tqdm=True)  # warm-up (kernels, allocator)
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = lm.loglikelihood(reqs, disable_tqdm=True)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = sum(len(lm.tok_encode(r.arguments[0] + r.arguments[1])) for r in reqs)
    handle = getattr(lm.narrows.model, "narrows_stream", None)
    row = {"mode": mode, "seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
           "peak_allocated": read_peaks("cuda").cuda_allocated, "build_seconds": build,
           "plan": str(handle.plan) if handle else None, "loglikelihoods": [x[0] for x in out]}  # fmt: skip
    del lm, model
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-32b")
    ap.add_argument("--gpu-budget", default="8GiB")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--out", default="benchmarks/results/eval_streamed.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("eval_streamed.py measures GPU memory and speed: run it on a GPU")
    rows = [run("streamed", args), run("resident", args)]
    ref = torch.tensor(rows[1]["loglikelihoods"], dtype=torch.float64)
    gib = 2**30
    print(f"\n{args.model} NF4 (random weights), lm-eval loglikelihood, {args.requests} requests x ~{args.context} "
          f"tokens, batch {args.batch}, {torch.cuda.get_device_name()}")  # fmt: skip
    print(f"{'mode':<10}{'tokens/s':>10}{'vs resident':>13}{'peak GiB':>10}{'max |dLL|':>11}")
    for r in rows:
        r["speed_vs_resident"] = r["tokens_per_s"] / rows[1]["tokens_per_s"]
        r["max_abs_diff_vs_resident"] = (
            (torch.tensor(r["loglikelihoods"], dtype=torch.float64) - ref).abs().max().item()
        )
        print(f"{r['mode']:<10}{r['tokens_per_s']:>10.0f}{r['speed_vs_resident']:>13.2f}"
              f"{r['peak_allocated'] / gib:>10.2f}{r['max_abs_diff_vs_resident']:>11.2e}")  # fmt: skip
    if rows[0]["plan"]:
        print(rows[0]["plan"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "device": torch.cuda.get_device_name(),
                                          "rows": rows}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
