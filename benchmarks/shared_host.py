"""Host memory of several ranks on one machine: every rank maps one shared host copy of the
frozen base (``from_pretrained(share=True)``, the default under torchrun) against every
rank holding its own (``share=False``), and one rank alone.

Writes a pre-quantised NF4 checkpoint of a real shape, then for each case launches
``torchrun --nproc-per-node R`` of this script: each rank loads the checkpoint with
`narrows.stream.from_pretrained`, adds LoRA r16 on the seven projections, streams at the
smallest footprint, wraps it in `data_parallel` (gloo, so that several ranks may share one
GPU on a one-GPU machine) and trains a few steps of random tokens. Reported per case:

  machine_used   the largest drop of the machine's MemAvailable while the case ran
                 (sampled every 0.1 s; page-locked pages are not available, shared or not)
  pss_sum        the ranks' proportional set sizes summed after loading (a page mapped by
                 two ranks counts half in each): the host memory the ranks take together
  rss_sum        their resident sets summed (a shared page counts in each rank)

    python benchmarks/shared_host.py --config qwen2.5-7b --cases 1:share,2:share,2:private --out r.json
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


def child(args: argparse.Namespace) -> None:
    """One rank."""
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model

    import narrows.stream as ns

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ["LOCAL_RANK"])
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", local % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    t0 = time.perf_counter()
    model = ns.from_pretrained(
        args.folder, dtype=torch.bfloat16, cache=args.cache, share=args.mode == "share"
    )
    tiers = model.narrows_tiers
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS))
    ns.stream(model, None, device=dev, seq_len=args.seq)
    ddp = ns.data_parallel(model, device_ids=[dev.index]) if cuda else ns.data_parallel(model)
    load_s = time.perf_counter() - t0
    dist.barrier()  # every rank loaded: what each one maps now
    after_load = {
        "pss": _kib("/proc/self/smaps_rollup", "Pss") * 1024,
        "rss": _kib("/proc/self/status", "VmRSS") * 1024,
    }
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    vocab = model.config.vocab_size
    times = []
    for step in range(args.steps):
        torch.manual_seed(step * world + rank)
        ids = torch.randint(0, vocab, (1, args.seq), device=dev)
        sync(dev)
        t = time.perf_counter()
        ddp(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(dev)
        times.append(time.perf_counter() - t)
    row = {
        "rank": rank, "load_s": load_s, "s_per_step": sorted(times[1:] or times)[len(times[1:] or times) // 2],
        "pss_after_load": after_load["pss"], "rss_after_load": after_load["rss"],
        "rss_peak": _kib("/proc/self/status", "VmHWM") * 1024, "peak_allocated": torch.cuda.max_memory_allocated(dev) if cuda else None,
        "shared_layers": len(tiers.shared), "layers": len(tiers.homes), "notes": tiers.notes,
    }  # fmt: skip
    every: list = [None] * world
    dist.all_gather_object(every, row)
    if rank == 0:
        Path(args.result).write_text(json.dumps(every))
    dist.destroy_process_group()


def run_case(args: argparse.Namespace, folder: Path, ranks: int, mode: str) -> dict:
    """One torchrun launch, the machine's available memory sampled while it runs."""
    result = args.work / f"case_{ranks}_{mode}.json"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", __file__,
           "--child", "--folder", str(folder), "--cache", str(args.work / "cache"), "--mode", mode,
           "--seq", str(args.seq), "--steps", str(args.steps), "--result", str(result)]  # fmt: skip
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
    return {
        "ranks": ranks, "mode": mode, "machine_used": base - low[0],
        "pss_sum": sum(r["pss_after_load"] for r in rows), "rss_sum": sum(r["rss_after_load"] for r in rows),
        "rss_peak_max": max(r["rss_peak"] for r in rows), "load_s": max(r["load_s"] for r in rows),
        "s_per_step": max(r["s_per_step"] for r in rows), "peak_allocated": max(r["peak_allocated"] or 0 for r in rows),
        "shared_layers": [r["shared_layers"] for r in rows], "layers": rows[0]["layers"],
        "notes": [r["notes"] for r in rows],
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="qwen2.5-7b")
    ap.add_argument(
        "--cases",
        default="1:share,1:share,2:share,2:private",
        help="ranks:share|private, in order (the first builds the shared cache: cold)",
    )
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3)
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
    rows = []
    for case in args.cases.split(","):
        ranks, mode = case.split(":")
        rows.append(run_case(args, folder, int(ranks), mode))
        print(json.dumps(rows[-1]), flush=True)
    one = next((r for r in reversed(rows) if r["ranks"] == 1 and "error" not in r), None)  # warm
    print(
        f"\n{args.config}, NF4 checkpoint {folder_bytes(folder) / GIB:.2f} GiB, seq {args.seq}, smallest footprint"
    )
    print(
        "| ranks | host copy | machine used | Pss, all ranks | RSS, all ranks | vs 1 rank | s/step | load s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['ranks']} | {r['mode']} | error | | | | | |")
            continue
        ratio = f"{r['machine_used'] / one['machine_used']:.2f}" if one else ""
        print(f"| {r['ranks']} | {r['mode']} | {r['machine_used'] / GIB:.2f} GiB | {r['pss_sum'] / GIB:.2f} GiB | "
              f"{r['rss_sum'] / GIB:.2f} GiB | {ratio} | {r['s_per_step']:.3f} | {r['load_s']:.1f} |")  # fmt: skip
    meta = {"config": args.config, "seq": args.seq, "checkpoint_bytes": folder_bytes(folder),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
