"""`narrows finetune` on a real architecture's shape: streamed budgets vs the resident run.

Builds a random-weight model folder of a config's shape (bf16 safetensors + a real
tokenizer with a chat template, SmolLM2's say, or a byte-level one), then runs the real CLI once per
`--gpu-budget` mode in its own process (`off` is the resident baseline: the whole NF4
model on the GPU) on GSM8K chat rows, and reports peak device memory, tokens/s and step
time side by side with ratios to the resident run. Needs CUDA.

With ``--packing both`` each mode runs packed (``--packing``: rows share full ``--seq-len``
sequences) and unpacked (every row padded to its batch), the unpacked run given as many
steps as it takes to see about the same number of tokens, so the held-out losses compare
at equal tokens; tokens/s counts real tokens (no padding) over the steps after the second.

    python benchmarks/finetune_shapes.py --config qwen2.5-7b --tokenizer DIR --modes off,fit,6GiB --steps 20

A mode's suffixes: "-eager" (e.g. 6GiB-eager) runs with --no-cuda-graphs, "-seq" with
--no-step-mode (sequential accumulation), "-step" with --step-mode, "-adapters" with
--offload-adapters (adapters and optimizer state in host memory); without them narrows
chooses, as the job does by default (the summary's reason is in the JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _models import load_config


def build_folder(config_name: str, tokenizer_dir: str | None, folder: Path) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from narrows.core.testing import tiny_tokenizer

    if (folder / "config.json").is_file():
        return folder
    config = load_config(config_name)
    torch.manual_seed(0)
    with torch.device("cuda"):  # random init on the GPU: seconds instead of minutes
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir) if tokenizer_dir else tiny_tokenizer()
    tokenizer.save_pretrained(folder)
    del model
    torch.cuda.empty_cache()
    return folder


def data_stats(folder: Path, train: Path, seq_len: int) -> dict:
    """Mean tokens per training row and the packed sequences' fill, as the job will see them."""
    from transformers import AutoTokenizer

    from narrows.core.app.data import Packed, open_source, tokenize

    examples, _ = tokenize(
        open_source(str(train)), AutoTokenizer.from_pretrained(folder), seq_len, cache=False
    )
    lengths = examples.lengths()
    return {
        "rows": len(lengths),
        "mean_tokens": sum(lengths) / len(lengths),
        "fill": Packed(examples, seq_len).fill(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="qwen2.5-7b")
    ap.add_argument(
        "--tokenizer",
        help="a folder with a tokenizer that has a chat template (default: a byte-level "
        "ChatML tokenizer: the weights are random anyway)",
    )
    ap.add_argument("--modes", default="off,fit,6GiB")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--packing", choices=["off", "on", "both"], default="off")
    ap.add_argument("--work", default="/tmp/finetune_shapes")
    ap.add_argument("--out", default="benchmarks/results/finetune_shapes.json")
    args = ap.parse_args()

    from narrows.core.app.bundled import gsm8k_jsonl

    work = Path(args.work)
    t = time.perf_counter()
    folder = build_folder(args.config, args.tokenizer, work / args.config)
    print(f"model folder {folder} ({time.perf_counter() - t:.0f} s)", flush=True)
    train, held_out = gsm8k_jsonl(work)
    packings = {"off": [False], "on": [True], "both": [True, False]}[args.packing]
    steps = {True: args.steps, False: args.steps}
    if args.packing == "both":  # the unpacked run sees about the tokens the packed one does
        stats = data_stats(folder, train, args.seq_len)
        print(f"data: {stats}", flush=True)
        steps[False] = round(args.steps * stats["fill"] * args.seq_len / stats["mean_tokens"] / args.batch)
    rows = []
    for mode in args.modes.split(","):
        for packing in packings:
            out = work / f"run-{mode}-{'packed' if packing else 'padded'}"
            shutil.rmtree(out, ignore_errors=True)  # a fresh run, not the one an earlier invocation left
            budget, *suffixes = mode.split("-")
            flags = {
                "eager": "--no-cuda-graphs",
                "seq": "--no-step-mode",
                "step": "--step-mode",
                "adapters": "--offload-adapters",
            }
            cmd = [
                sys.executable,
                "-m",
                "narrows.core.app.cli",
                "finetune",
                "--model",
                str(folder),
                "--data",
                str(train),
                "--eval-data",
                str(held_out),
                "--eval-rows",
                "32",
                "--quant",
                "nf4",
                "--gpu-budget",
                budget,
                "--steps",
                str(steps[packing]),
                "--batch",
                str(args.batch),
                "--seq-len",
                str(args.seq_len),
                "--grad-accum",
                str(args.grad_accum),
                "--save-every",
                str(steps[packing]),
                "--no-progress",
                "--out",
                str(out),
                *(["--packing"] if packing else []),
                *(flags[x] for x in suffixes),
            ]
            t = time.perf_counter()
            r = subprocess.run(
                cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1")
            )
            wall = time.perf_counter() - t
            if r.returncode != 0:
                print(f"--gpu-budget {mode} packing {packing} failed:\n{r.stderr[-3000:]}", flush=True)
                rows.append({"mode": mode, "packing": packing, "error": r.stderr[-2000:]})
                continue
            summary = json.loads((out / "summary.json").read_text())
            metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            timed = [m for m in metrics if "step_s" in m]
            step_s = sorted(m["step_s"] for m in timed)
            tokens = [m["tokens_per_s"] * m["step_s"] for m in timed]
            rows.append(
                {
                    "mode": mode,
                    "packing": packing,
                    "steps": steps[packing],
                    "tokens": round(sum(tokens)),
                    "peak_bytes": summary["peak_bytes"],
                    "tokens_per_s": summary["tokens_per_s"],
                    # after the first two steps (allocator and kernel warm-up)
                    "steady_tokens_per_s": sum(tokens[2:]) / sum(m["step_s"] for m in timed[2:]),
                    "median_step_s": step_s[len(step_s) // 2],
                    "first_loss": summary["first_loss"],
                    "last_loss": summary["last_loss"],
                    "eval_loss_before": summary["eval_loss_before"],
                    "eval_loss_after": summary["eval_loss_after"],
                    "setup_s": summary["setup_s"],
                    "wall_s": wall,
                    **{k: v for k, v in summary.get("stream", {}).items() if k.startswith("cuda_graph")},
                    "accumulation": summary.get("stream", {}).get("accumulation"),
                    "grad_accum": args.grad_accum,
                    "predicted_peak": summary.get("stream", {}).get("predicted_peak"),
                    "step_peaks": [m["peak_bytes"] for m in timed],
                    "eval_peak_bytes": summary.get(
                        "eval_peak_bytes"
                    ),  # evaluations run outside the steps' peaks
                    "held": next(
                        (
                            line.split("held 4-bit weights ", 1)[1]
                            for line in r.stderr.splitlines()
                            if "held 4-bit weights " in line
                        ),
                        None,
                    ),  # step mode's dequantised weights
                }
            )
            print(f"--gpu-budget {mode} packing {packing}: {rows[-1]}", flush=True)

    base = next((r for r in rows if r["mode"] == "off" and "error" not in r), None)
    print(
        f"\n{args.config} (random NF4 weights), LoRA r16 all-linear, batch {args.batch} x seq {args.seq_len}, "
        f"{args.steps} steps, {torch.cuda.get_device_name()}"
    )
    print(
        f"{'--gpu-budget':<14} {'packing':>7} {'peak GiB':>9} {'eval GiB':>9} {'vs off':>7} {'step s':>8} {'vs off':>7} "
        f"{'tok/s':>7} {'tokens':>7} {'loss first→last':>18} {'eval after':>10} {'setup s':>8}"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['mode']:<14} {r['packing']!s:>7} failed")
            continue
        mem = r["peak_bytes"] / 2**30
        ev = f"{r['eval_peak_bytes'] / 2**30:.2f}" if r.get("eval_peak_bytes") else "–"
        rm = f"{r['peak_bytes'] / base['peak_bytes']:.2f}" if base else "–"
        rt = f"{r['median_step_s'] / base['median_step_s']:.2f}" if base else "–"
        print(
            f"{r['mode']:<14} {r['packing']!s:>7} {mem:>9.2f} {ev:>9} {rm:>7} {r['median_step_s']:>8.3f} {rt:>7} "
            f"{r['steady_tokens_per_s']:>7.0f} {r['tokens']:>7} {r['first_loss']:>8.4f}→{r['last_loss']:<8.4f} "
            f"{r['eval_loss_after']:>10.4f} {r['setup_s']:>8.0f}"
        )
    for r in rows:
        if r.get("accumulation"):
            print(f"{r['mode']}: accumulation {r['accumulation']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"args": vars(args), "device": torch.cuda.get_device_name(), "rows": rows}, indent=2)
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
