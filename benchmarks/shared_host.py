"""Several ranks of one machine, each its own GPU where there are enough (NCCL; gloo
otherwise, so that several ranks may share one GPU): data parallel as a user runs it, and
what the ranks' host memory costs. Each case is one torchrun launch of its own:

  stages     the main job with ``--pipeline-stages R``: each rank one block of the layers,
             --micro micro-batches (default: the ranks) of --batch rows a step in flight
             (``--grad-accum``); the step's tokens are --micro × --batch × --seq
  job        the main job, ``torchrun --nproc-per-node R -m narrows.core.app.cli finetune``
             over the folder (``--gpu-budget`` --budget per rank, ``--batch`` --batch rows of
             --seq tokens per rank, ``--packing``, LoRA r16 on the seven projections, the
             default targets): every rank maps one shared host copy, as the job does under
             torchrun. Its step times and peaks are the job's own (metrics.jsonl: the step's
             tokens of every rank over rank 0's wall time; the largest rank's peak)
  share      this script's own loop over ``narrows.stream.from_pretrained(share=True)``
  private    the same, every rank holding its own copy (``share=False``)
  fsdp       answer.ai's FSDP+QLoRA recipe: FSDP1 FULL_SHARD over the ranks, parameters
             offloaded to CPU, every layer checkpointed (`_peers.fsdp_offload`)
  deepspeed  DeepSpeed ZeRO-3 with the parameters offloaded to pinned CPU memory, HF
             gradient checkpointing, torch's AdamW on the GPU (`_peers.deepspeed_zero3`;
             staged by stage_deepspeed.sh)

Writes a pre-quantised NF4 checkpoint of a real shape once. The loops of share/private add
LoRA r16 on the seven projections, stream at --budget per GPU ("min": the smallest
footprint), wrap the model in `data_parallel` and train random tokens, --batch rows of --seq
per rank per step. An FSDP or DeepSpeed rank builds the same shape's random NF4 model itself
(the recipes load their own; each rank the same seed). Reported per case:

  tokens_per_s   every rank's tokens of a step over the step time (the job: the median of its
                 timed steps; the loops: the slowest rank's mean over --steps), after
                 --warmup steps (a CUDA graph is captured at a shape's second step)
  efficiency     tokens_per_s over R times one rank's of the same mode (the table's)
  peak_allocated the largest GPU peak of the ranks (the CUDA graphs' pool included)
  machine_used   the largest drop of the machine's MemAvailable while the case ran
                 (sampled every 0.1 s; page-locked pages are not available, shared or not)
  pss_sum        the ranks' proportional set sizes summed (a page mapped by two ranks counts
                 half in each): the host memory the ranks take together. The loops: after
                 loading; the job: the largest sum sampled while it ran (every process the
                 launch started, its agent included)
  rss_sum        their resident sets summed (a shared page counts in each rank)

and, for the machine, the pinned host→device bandwidth when 1, 2, ... GPUs pull at once.

    python benchmarks/shared_host.py --config qwen2.5-7b --budget 8GiB --batch 8 --seq 512 \
        --cases 1:job,2:job,4:job,2:fsdp,2:deepspeed --out r.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
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
    ns.stream(model, budget, device=dev, seq_len=args.seq, batch_size=args.batch, head=args.head)
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


def build_deepspeed(args: argparse.Namespace, dev: torch.device):
    """ZeRO-3 with the parameters offloaded, HF gradient checkpointing on (its users' way to
    fit a batch of 8): an engine, which runs its own backward and step."""
    import _peers
    from _models import add_lora, load_config, random_nf4_model

    model = random_nf4_model(load_config(args.config), work_device=str(dev))
    torch.manual_seed(0)
    model = add_lora(model).train()
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    return model, _peers.deepspeed_zero3(model, 1, dev.type == "cuda"), {}


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
    build = {"fsdp": build_fsdp, "deepspeed": build_deepspeed}.get(args.mode, build_narrows)
    model, net, facts = build(args, dev)
    load_s = time.perf_counter() - t0
    dist.barrier()  # every rank loaded: what each one maps now
    after_load = {
        "pss": _kib("/proc/self/smaps_rollup", "Pss") * 1024,
        "rss": _kib("/proc/self/status", "VmRSS") * 1024,
    }
    engine = net if args.mode == "deepspeed" else None  # it holds its own optimizer
    if engine is None:
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    vocab = model.config.vocab_size
    losses = []

    def step(i: int) -> None:
        torch.manual_seed(i * world + rank)
        ids = torch.randint(0, vocab, (args.batch, args.seq), device=dev)
        loss = net(input_ids=ids, labels=ids).loss
        if engine is not None:
            engine.backward(loss)
            engine.step()
        else:
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


def _descendants(root: int) -> list[int]:
    """`root` and every process under it."""
    parent: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parent.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += parent.get(pid, [])
    return out


def launch(cmd: list[str], *, tree_every: float = 0.0, timeout: float | None = None) -> dict:
    """`cmd` in a process of its own, the machine's MemAvailable sampled every 0.1 s while it
    runs; with `tree_every`, the Pss and Rss summed over its whole process tree every that
    many seconds too (the largest sums kept)."""
    base = _kib("/proc/meminfo", "MemAvailable") * 1024
    seen = {"low": base, "pss": 0, "rss": 0}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def poll() -> None:
        last = 0.0
        while proc.poll() is None:
            seen["low"] = min(seen["low"], _kib("/proc/meminfo", "MemAvailable") * 1024)
            if tree_every and time.monotonic() - last >= tree_every:
                last = time.monotonic()
                pss = rss = 0
                for pid in _descendants(proc.pid):
                    try:
                        pss += _kib(f"/proc/{pid}/smaps_rollup", "Pss") * 1024
                        rss += _kib(f"/proc/{pid}/status", "VmRSS") * 1024
                    except OSError:  # ended meanwhile
                        pass
                seen["pss"], seen["rss"] = max(seen["pss"], pss), max(seen["rss"], rss)
            time.sleep(0.1)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        out += f"\ntimed out after {timeout} s"
    poller.join()
    return {"returncode": proc.returncode, "output": out, "machine_used": base - seen["low"], **seen}


def torchrun(ranks: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]


def micro(args: argparse.Namespace, ranks: int) -> int:
    """Micro-batches a pipeline step: --micro, or one a stage."""
    return args.micro or ranks


def run_case(args: argparse.Namespace, folder: Path, ranks: int, mode: str) -> dict:
    """One torchrun launch of this script's loop (share, private, fsdp, deepspeed)."""
    result = args.work / f"case_{ranks}_{mode}.json"
    result.unlink(missing_ok=True)
    cmd = [
        *torchrun(ranks),
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
        "--batch",
        str(args.batch),
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
    ran = launch(cmd, timeout=args.timeout)
    if ran["returncode"] != 0 or not result.is_file():
        return {"ranks": ranks, "mode": mode, "error": ran["output"][-3000:]}
    rows = json.loads(result.read_text())
    s_per_step = max(r["s_per_step"] for r in rows)
    return {
        "ranks": ranks,
        "mode": mode,
        "backend": rows[0]["backend"],
        "machine_used": ran["machine_used"],
        "pss_sum": sum(r["pss_after_load"] for r in rows),
        "rss_sum": sum(r["rss_after_load"] for r in rows),
        "rss_peak_max": max(r["rss_peak"] for r in rows),
        "rss_peak_sum": sum(r["rss_peak"] for r in rows),
        "load_s": max(r["load_s"] for r in rows),
        "s_per_step": s_per_step,
        "tokens_per_s": ranks * args.batch * args.seq / s_per_step,
        "peak_allocated": max(r["peak_allocated"] or 0 for r in rows),
        "final_loss": [r["final_loss"] for r in rows],
        "per_rank": rows,
    }


def run_job(args: argparse.Namespace, folder: Path, ranks: int, mode: str = "job") -> dict:
    """The main job under torchrun, as a user launches it; its run folder read back.
    `mode` "stages": with ``--pipeline-stages`` the ranks, `micro` micro-batches a step
    (``--grad-accum``)."""
    import statistics

    from peers import job_data

    total = args.warmup + args.steps
    rows = (micro(args, ranks) if mode == "stages" else ranks) * args.batch
    data = job_data(args.work, args.seq, max(64, rows * (total + 1)))
    run_dir = args.work / f"run_{ranks}_{mode}"
    shutil.rmtree(run_dir, ignore_errors=True)
    argv = ["finetune", "--model", str(folder), "--data", str(data), "--packing"]
    if mode == "stages":
        argv += ["--pipeline-stages", str(ranks), "--grad-accum", str(micro(args, ranks))]
    argv += ["--gpu-budget", args.budget, "--batch", str(args.batch), "--seq-len", str(args.seq)]
    argv += ["--steps", str(total), "--rank", "16", "--alpha", "32", "--lr", "1e-4", "--eval-rows", "0"]
    argv += ["--exact-match", "0", "--save-every", str(total), "--cache", str(args.work / "cache")]
    argv += ["--no-progress", "--out", str(run_dir)]
    argv += ["--host-budget", args.host_budget] if args.host_budget else []
    cmd = [*torchrun(ranks), "-m", "narrows.core.app.cli", *argv]
    row: dict = {"ranks": ranks, "mode": mode, "command": shlex.join(["torchrun", *cmd[3:]])}
    ran = launch(cmd, tree_every=1.0, timeout=args.timeout)
    metrics = run_dir / "metrics.jsonl"
    steps = (
        [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.is_file() else []
    )
    steps = [m for m in steps if "step_s" in m]
    if ran["returncode"] != 0 or len(steps) != total:
        return {**row, "error": f"{len(steps)} of {total} steps logged: " + ran["output"][-3000:]}
    timed = steps[args.warmup :]
    summary = json.loads((run_dir / "summary.json").read_text())
    s_per_step = statistics.median(m["step_s"] for m in timed)
    return {
        **row,
        "backend": "nccl" if summary["device"].startswith("cuda") else "gloo",
        "machine_used": ran["machine_used"],
        "pss_sum": ran["pss"],
        "rss_sum": ran["rss"],
        "load_s": summary["setup_s"],
        "s_per_step": s_per_step,
        "step_s": [m["step_s"] for m in timed],
        "tokens_per_s": statistics.median(m["tokens_per_s"] for m in timed),
        "peak_allocated": max(m["peak_bytes"] for m in timed),
        "final_loss": [timed[-1]["loss"]],
        "plan": summary.get("stream"),
        "stages": summary.get("pipeline_stages"),
        "said": [x[:300] for x in ran["output"].splitlines() if x.startswith("narrows:")][:20],
    }


def table(args: argparse.Namespace, rows: list[dict]) -> str:
    lines = [
        "| ranks | mode | backend | tokens/s | per-GPU efficiency | s/step | peak per GPU | Pss, all ranks "
        "| RSS, all ranks | machine used | load s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['ranks']} | {r['mode']} | error | | | | | | | | |")
            continue
        one = next((o for o in rows if o["ranks"] == 1 and o["mode"] == r["mode"] and "error" not in o), None)
        one = one or next((o for o in rows if o["ranks"] == 1 and "error" not in o), None)
        ratio = f"{r['tokens_per_s'] / (r['ranks'] * one['tokens_per_s']):.0%}" if one else ""
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
        help="ranks:job|stages|share|private|fsdp|deepspeed, in order (the first to share builds the cache: cold)",
    )
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1, help="rows of --seq tokens per rank per step")
    ap.add_argument(
        "--micro", type=int, default=0, help="micro-batches of a stages step (default: the ranks)"
    )
    ap.add_argument("--timeout", type=float, default=900, help="seconds one case may run")
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
        "batch": args.batch,
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
        if int(ranks) > max(1, gpus) and gpus:
            rows.append({"ranks": int(ranks), "mode": mode, "error": f"this machine has {gpus} GPUs"})
        elif mode in ("job", "stages"):
            rows.append(run_job(args, folder, int(ranks), mode))
        else:
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
