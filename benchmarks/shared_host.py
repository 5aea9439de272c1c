"""Several ranks of one machine, each its own GPU where there are enough (NCCL; gloo
otherwise, so that several ranks may share one GPU): every rank maps one shared host copy
of the frozen base (``from_pretrained(share=True)``, the default under torchrun), against
every rank holding its own (``share=False``), one rank alone, and the peer: answer.ai's
FSDP+QLoRA recipe (FSDP1 FULL_SHARD over the ranks, parameters offloaded to CPU, every
layer checkpointed; `_peers.fsdp_offload`).

Writes a pre-quantised NF4 checkpoint of a real shape, then for each case launches
``torchrun --nproc-per-node R`` of this script. A narrows rank loads the checkpoint with
`narrows.stream.from_pretrained`, adds LoRA r16 on the seven projections, streams at
--budget per GPU ("min": the smallest footprint), wraps it in `data_parallel` and trains
random tokens, one micro-batch of --seq per rank per step. An FSDP rank builds the same
shape's random NF4 model itself (the recipe loads its own; each rank the same seed).
Reported per case:

  tokens_per_s   ranks x seq over the step time (the slowest rank's mean over --steps,
                 after --warmup steps: a CUDA graph is captured at a shape's second step)
  peak_allocated the largest GPU peak of the ranks (the CUDA graphs' pool included)
  machine_used   the largest drop of the machine's MemAvailable while the case ran
                 (sampled every 0.1 s; page-locked pages are not available, shared or not)
  pss_sum        the ranks' proportional set sizes summed after loading (a page mapped by
                 two ranks counts half in each): the host memory the ranks take together
  rss_sum        their resident sets summed (a shared page counts in each rank)

    python benchmarks/shared_host.py --config qwen2.5-32b --budget 12GiB --cases 1:share,2:share,2:fsdp --out r.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

GIB = 2**30
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _kib(path: str, key: str) -> int:
    with open(path) as f:
        return next((int(line.split()[1]) for line in f if line.startswith(key + ":")), 0)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def pinned_bandwidth(gpus: int, nbytes: int = 1 << 30, reps: int = 4) -> float:
    """Host(pinned)→device bytes/s into `gpus` GPUs at once, summed: what the machine's
    host side gives ranks that all stream together."""
    if torch.cuda.device_count() < gpus or gpus == 0:
        return float("nan")
    pairs = [
        (
            torch.empty(nbytes, dtype=torch.uint8, pin_memory=True),
            torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{d}"),
        )
        for d in range(gpus)
    ]
    for _ in range(2):  # the first round warms up
        t = time.perf_counter()
        for _ in range(reps):
            for src, dst in pairs:
                dst.copy_(src, non_blocking=True)
        for d in range(gpus):
            torch.cuda.synchronize(d)
        dt = time.perf_counter() - t
    return gpus * nbytes * reps / dt


def build_narrows(args: argparse.Namespace, dev: torch.device):
    from _models import add_lora

    import narrows.stream as ns

    model = ns.from_pretrained(
        args.folder,
        dtype=torch.bfloat16,
        cache=args.cache,
        share=args.mode == "share",
        host_budget=args.host_budget,
    )
    tiers = model.narrows.tiers
    torch.manual_seed(0)
    model = add_lora(model).train()
    model.config.use_cache = False
    if args.lmhead:  # masked, chunked exact loss: no full logits
        import narrows.lmhead as lmh

        lmh.apply(model)
    budget = None if args.budget == "min" else args.budget
    ns.stream(model, budget, device=dev, seq_len=args.seq, batch_size=1, head=args.head)
    plan = model.narrows_stream.plan
    print(plan, file=sys.stderr)
    ddp = ns.data_parallel(model, device_ids=[dev.index]) if dev.type == "cuda" else ns.data_parallel(model)
    facts = {
        "shared_layers": len(tiers.shared),
        "layers": len(tiers.homes),
        "notes": tiers.notes,
        "resident_layers": len(plan.resident),
        "graphs": plan.graphs,
        "predicted_peak": plan.predicted_peak,
    }
    return model, ddp, facts


def build_fsdp(args: argparse.Namespace, dev: torch.device):
    import _peers
    from _models import add_lora, load_config, random_nf4_model

    from narrows.core import anatomy_of

    model = random_nf4_model(load_config(args.config), work_device=str(dev))
    torch.manual_seed(0)
    model = add_lora(model).train()
    model.config.use_cache = False
    wrapped = _peers.fsdp_offload(model, type(anatomy_of(model).layers[0]), dev.type == "cuda")
    return model, wrapped, {}


def child(args: argparse.Namespace) -> None:
    """One rank."""
    import torch.distributed as dist

    from narrows.core import read_peaks, reset_peaks

    local = int(os.environ["LOCAL_RANK"])
    world = int(os.environ["WORLD_SIZE"])
    own_gpu = torch.cuda.is_available() and torch.cuda.device_count() >= world
    if torch.cuda.is_available():
        dev = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    dist.init_process_group("nccl" if own_gpu else "gloo")
    rank = dist.get_rank()
    t0 = time.perf_counter()
    model, net, facts = (build_fsdp if args.mode == "fsdp" else build_narrows)(args, dev)
    load_s = time.perf_counter() - t0
    dist.barrier()  # every rank loaded: what each one maps now
    after_load = {
        "pss": _kib("/proc/self/smaps_rollup", "Pss") * 1024,
        "rss": _kib("/proc/self/status", "VmRSS") * 1024,
    }
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    vocab = model.config.vocab_size
    losses = []

    def step(i: int) -> None:
        torch.manual_seed(i * world + rank)
        ids = torch.randint(0, vocab, (1, args.seq), device=dev)
        loss = net(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    for i in range(args.warmup):
        step(i)
    sync(dev)
    reset_peaks(dev)
    dist.barrier()
    t = time.perf_counter()
    for i in range(args.warmup, args.warmup + args.steps):
        step(i)
    sync(dev)
    s_per_step = (time.perf_counter() - t) / args.steps
    peaks = read_peaks(dev)
    pool = 0
    stream = getattr(model, "narrows_stream", None)
    if stream is not None and stream.graphs is not None:  # replays allocate from the graphs' pool
        pool = stream.graphs.pool_bytes()
    row = {
        "rank": rank,
        "load_s": load_s,
        "s_per_step": s_per_step,
        "backend": dist.get_backend(),
        "pss_after_load": after_load["pss"],
        "rss_after_load": after_load["rss"],
        "rss_peak": _kib("/proc/self/status", "VmHWM") * 1024,
        "peak_allocated": (peaks.cuda_allocated or 0) + pool if dev.type == "cuda" else None,
        "final_loss": float(losses[-1]),
        **facts,
    }
    every: list = [None] * world
    dist.all_gather_object(every, row)
    if rank == 0:
        Path(args.result).write_text(json.dumps(every))
    dist.destroy_process_group()


def run_case(args: argparse.Namespace, folder: Path, ranks: int, mode: str) -> dict:
    """One torchrun launch, the machine's available memory sampled while it runs."""
    result = args.work / f"case_{ranks}_{mode}.json"
    result.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        __file__,
        "--child",
        "--folder",
        str(folder),
        "--cache",
        str(args.work / "cache"),
        "--mode",
        mode,
        "--seq",
        str(args.seq),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--result",
        str(result),
        "--config",
        args.config,
        "--budget",
        args.budget,
        "--head",
        args.head,
        *(["--lmhead"] if args.lmhead else []),
        *(["--host-budget", args.host_budget] if args.host_budget else []),
    ]
    base = _kib("/proc/meminfo", "MemAvailable") * 1024
    low = [base]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def poll() -> None:
        while proc.poll() is None:
            low[0] = min(low[0], _kib("/proc/meminfo", "MemAvailable") * 1024)
            time.sleep(0.1)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    out, _ = proc.communicate()
    poller.join()
    if proc.returncode != 0 or not result.is_file():
        return {"ranks": ranks, "mode": mode, "error": out[-3000:]}
    rows = json.loads(result.read_text())
    s_per_step = max(r["s_per_step"] for r in rows)
    return {
        "ranks": ranks,
        "mode": mode,
        "backend": rows[0]["backend"],
        "machine_used": base - low[0],
        "pss_sum": sum(r["pss_after_load"] for r in rows),
        "rss_sum": sum(r["rss_after_load"] for r in rows),
        "rss_peak_max": max(r["rss_peak"] for r in rows),
        "rss_peak_sum": sum(r["rss_peak"] for r in rows),
        "load_s": max(r["load_s"] for r in rows),
        "s_per_step": s_per_step,
        "tokens_per_s": ranks * args.seq / s_per_step,
        "peak_allocated": max(r["peak_allocated"] or 0 for r in rows),
        "final_loss": [r["final_loss"] for r in rows],
        "per_rank": rows,
    }


def table(args: argparse.Namespace, rows: list[dict]) -> str:
    lines = [
        "| ranks | host copy / peer | backend | tokens/s | vs 1 rank | s/step | peak per GPU | Pss, all ranks "
        "| RSS, all ranks | machine used | load s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['ranks']} | {r['mode']} | error | | | | | | | | |")
            continue
        one = next((o for o in rows if o["ranks"] == 1 and o["mode"] == r["mode"] and "error" not in o), None)
        one = one or next((o for o in rows if o["ranks"] == 1 and "error" not in o), None)
        ratio = f"{r['tokens_per_s'] / one['tokens_per_s']:.2f}x" if one else ""
        lines.append(
            f"| {r['ranks']} | {r['mode']} | {r['backend']} | {r['tokens_per_s']:.0f} | {ratio} | "
            f"{r['s_per_step']:.3f} | {r['peak_allocated'] / GIB:.2f} GiB | {r['pss_sum'] / GIB:.2f} GiB | "
            f"{r['rss_sum'] / GIB:.2f} GiB | {r['machine_used'] / GIB:.2f} GiB | {r['load_s']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="qwen2.5-7b")
    ap.add_argument(
        "--cases",
        default="1:share,1:share,2:share,2:private",
        help="ranks:share|private|fsdp, in order (the first to share builds the cache: cold)",
    )
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--budget", default="min", help="narrows' GPU budget per rank: min or a size (12GiB)")
    ap.add_argument("--head", default="resident", choices=["resident", "stream"])
    ap.add_argument("--lmhead", action="store_true", help="narrows.lmhead's masked, chunked exact loss")
    ap.add_argument(
        "--host-budget",
        help="from_pretrained's, per rank (default: 85%% of MemAvailable at start, which "
        "a machine whose memory grows as it is touched reports too low)",
    )
    ap.add_argument("--work", type=Path, default=Path("/tmp/shared_host"))
    ap.add_argument("--out", default="benchmarks/results/shared_host.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    from checkpoints import folder_bytes, write_bnb4

    args.work.mkdir(parents=True, exist_ok=True)
    folder = write_bnb4(args.config, args.work / f"{args.config}-bnb-4bit")
    gpus = torch.cuda.device_count()
    meta = {
        "config": args.config,
        "seq": args.seq,
        "budget": args.budget,
        "head": args.head,
        "lmhead": args.lmhead,
        "host_budget": args.host_budget,
        "steps": args.steps,
        "warmup": args.warmup,
        "checkpoint_bytes": folder_bytes(folder),
        "gpus": gpus,
        "device": torch.cuda.get_device_name() if gpus else "cpu",
        "pinned_bw": {n: pinned_bandwidth(n) for n in range(1, gpus + 1)},
    }
    if gpus:  # the probe's device and pinned host caches back, before the ranks start
        torch.cuda.empty_cache()
        getattr(torch._C, "_host_emptyCache", lambda: None)()
    print(json.dumps(meta), flush=True)
    rows = []
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for case in args.cases.split(","):
        ranks, mode = case.split(":")
        rows.append(run_case(args, folder, int(ranks), mode))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "per_rank"}), flush=True)
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))  # each case as it ends
    print(
        f"\n{args.config}, NF4 checkpoint {folder_bytes(folder) / GIB:.2f} GiB, seq {args.seq}, "
        f"budget {args.budget} per GPU{', narrows.lmhead' if args.lmhead else ''}"
    )
    print(table(args, rows))


if __name__ == "__main__":
    main()
