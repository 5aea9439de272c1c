"""Evaluation of a model larger than the budget: the same random NF4 model (a real
architecture's shape) scored by the lm-eval backend `narrows` streamed within a GPU budget
and fully resident, same requests, one process.

    python benchmarks/eval_streamed.py --model qwen2.5-32b --gpu-budget 8GiB --requests 24 --context 1024 --batch 2

Per mode: tokens/s over `loglikelihood` requests (context + a 16-token continuation, byte
tokenizer, batch size `--batch`) and peak allocated GPU memory, both from the timed pass,
which is lm-eval's own (its log-softmax and sum run in the model's dtype, bf16 here: the
log-likelihoods it returns are rounded to bf16). Then, untimed and after the peak is read,
a second pass over the same requests, same batches and padding, with lm-eval's
`softmax_dtype` set to float64: the model's logits are upcast exactly to float64 and the
log-softmax, the gather and the sum run in float64. Every request's float64
log-likelihood is recorded for both modes (`loglikelihoods`), with the largest absolute
difference between the two modes and whether they are exactly equal (`comparison`); the
timed pass's model-dtype values are kept as `loglikelihoods_model_dtype`.
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


def float64_loglikelihoods(lm, reqs) -> tuple[list[float], list[str]]:
    """Every request's log-likelihood from lm-eval's own loop (same batches, padding and
    continuation slice) with `softmax_dtype=float64`: `F.log_softmax(logits, dtype=float64)`
    upcasts the model's logits exactly, then the gather and the sum stay in float64, and
    lm-eval returns `float(sum)`. Also the dtype(s) of the logits the model produced."""
    seen: set[str] = set()
    model_call = lm._model_call

    def call(*a, **k):
        logits = model_call(*a, **k)
        seen.add(str(logits.dtype))
        return logits

    old = lm.softmax_dtype
    lm.softmax_dtype, lm._model_call = torch.float64, call
    try:
        out = lm.loglikelihood(reqs, disable_tqdm=True)
    finally:
        lm.softmax_dtype = old
        del lm._model_call  # the instance attribute: the class's method again
    return [float(x[0]) for x in out], sorted(seen)


def compare(streamed: list[float], resident: list[float]) -> dict:
    """Per-request float64 comparison of the two modes' log-likelihoods."""
    diffs = [abs(a - b) for a, b in zip(streamed, resident, strict=True)]
    return {
        "requests": len(diffs),
        "max_abs_diff": max(diffs),
        "exactly_equal": streamed == resident,
        "requests_equal": sum(a == b for a, b in zip(streamed, resident, strict=True)),
    }


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
    lm = NarrowsLM(
        pretrained=model,
        tokenizer=tiny_tokenizer(),
        device="cuda",
        batch_size=args.batch,
        gpu_budget=args.gpu_budget if mode == "streamed" else None,
        max_length=args.context + 64,
    )
    reqs = make_requests(args.requests, args.context)
    lm.loglikelihood(reqs[: args.batch], disable_tqdm=True)  # warm-up (kernels, allocator)
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = lm.loglikelihood(reqs, disable_tqdm=True)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = read_peaks("cuda").cuda_allocated  # before the float64 pass, which holds more
    tokens = sum(len(lm.tok_encode(r.arguments[0] + r.arguments[1])) for r in reqs)
    handle = getattr(lm.narrows.model, "narrows_stream", None)
    precise, logits_dtypes = float64_loglikelihoods(lm, reqs)
    row = {
        "mode": mode,
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "peak_allocated": peak,
        "build_seconds": build,
        "plan": str(handle.plan) if handle else None,
        "logits_dtype": logits_dtypes,
        "loglikelihoods": precise,
        "loglikelihoods_model_dtype": [float(x[0]) for x in out],
    }
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
    ap.add_argument("--deterministic", action="store_true", help="narrows.core.deterministic() first")
    ap.add_argument("--out", default="benchmarks/results/eval_streamed.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("eval_streamed.py measures GPU memory and speed: run it on a GPU")
    if args.deterministic:
        from narrows.core import deterministic

        deterministic()
    rows = [run("streamed", args), run("resident", args)]
    streamed, resident = rows[0]["loglikelihoods"], rows[1]["loglikelihoods"]
    comparison = compare(streamed, resident)
    comparison["max_abs_diff_model_dtype"] = compare(
        rows[0]["loglikelihoods_model_dtype"], rows[1]["loglikelihoods_model_dtype"]
    )["max_abs_diff"]
    gib = 2**30
    print(
        f"\n{args.model} NF4 (random weights), lm-eval loglikelihood, {args.requests} requests x ~{args.context} "
        f"tokens, batch {args.batch}, {torch.cuda.get_device_name()}"
    )
    print(f"{'mode':<10}{'tokens/s':>10}{'vs resident':>13}{'peak GiB':>10}")
    for r in rows:
        r["speed_vs_resident"] = r["tokens_per_s"] / rows[1]["tokens_per_s"]
        print(
            f"{r['mode']:<10}{r['tokens_per_s']:>10.0f}{r['speed_vs_resident']:>13.2f}{r['peak_allocated'] / gib:>10.2f}"
        )
    print(
        f"float64 log-likelihoods, streamed vs resident: {comparison['requests_equal']} of "
        f"{comparison['requests']} requests equal, max |difference| {comparison['max_abs_diff']:.3e} "
        f"(model dtype {rows[0]['logits_dtype']}: {comparison['max_abs_diff_model_dtype']:.3e})"
    )
    if rows[0]["plan"]:
        print(rows[0]["plan"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "args": vars(args),
                "device": torch.cuda.get_device_name(),
                "comparison": comparison,
                "rows": rows,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
