"""Real checkpoint folders on a real machine: the block-streamed loader, the prepared-slab
cache, the disk tier under a host budget, and `narrows finetune` end to end.

Writes random-weight checkpoint folders of real shapes — a bf16 sharded one (what users
download) and a pre-quantised bitsandbytes NF4 one (the ``*-bnb-4bit`` repos, written
layer by layer; every layer holds the same random bytes) — then measures each case in a
fresh process under ``/usr/bin/time -v`` (peak host RSS) with peak VRAM and wall time:

  loader   narrows `load_blockwise` vs transformers' ``from_pretrained(quantization_config=
           BitsAndBytesConfig(nf4, double quant))`` vs the old path (float model loaded
           whole, then `quantize_nf4`); plus a byte-identity check against transformers
  ready    `narrows.stream.from_pretrained` + PEFT LoRA r16 + `stream`, cold (cache built)
           and warm (cache read): time to the first training step, s/step, RSS, VRAM
  disk     the same with a host budget that sends layers to disk vs everything pinned
  finetune `narrows finetune --gpu-budget ...` under /usr/bin/time -v

    python benchmarks/checkpoints.py --parts loader,ready,disk,finetune --config qwen2.5-7b --out r.json
    python benchmarks/checkpoints.py --parts ready,disk --bnb qwen2.5-72b --host-budgets 24GiB,all
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

GIB = 2**30


# --- checkpoint folders ------------------------------------------------------------------
def write_bf16(config_name: str, folder: Path) -> Path:
    from finetune_shapes import build_folder

    return build_folder(config_name, None, folder)


@torch.no_grad()
def write_bnb4(config_name: str, folder: Path, layers: int | None = None) -> Path:
    """A pre-quantised NF4 checkpoint as transformers saves one, written layer by layer."""
    from _models import load_config
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from narrows.core import quantize_nf4
    from narrows.core.testing import tiny_tokenizer

    if (folder / "config.json").is_file():
        return folder
    spec = load_config(config_name).to_dict()
    spec.pop("layer_types", None)  # derived from the depth, which changes here
    config = type(load_config(config_name)).from_dict(
        {**spec, "num_hidden_layers": layers or spec["num_hidden_layers"]}
    )
    n = config.num_hidden_layers
    one = type(config).from_dict({**spec, "num_hidden_layers": 1})
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(one, dtype=torch.bfloat16)
    quantize_nf4(model, compute_dtype=torch.bfloat16, device=dev)
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    layer = {
        k.removeprefix("model.layers.0."): v for k, v in state.items() if k.startswith("model.layers.0.")
    }
    rest = {k: v for k, v in state.items() if not k.startswith("model.layers.")}
    del model
    folder.mkdir(parents=True, exist_ok=True)
    weight_map, per_shard = {}, 4
    shards = [list(range(i, min(i + per_shard, n))) for i in range(0, n, per_shard)]
    total = len(shards) + 1
    for s, idx in enumerate(shards):
        name = f"model-{s + 1:05d}-of-{total:05d}.safetensors"
        tensors = {f"model.layers.{i}.{k}": v.clone() for i in idx for k, v in layer.items()}
        save_file(tensors, folder / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    name = f"model-{total:05d}-of-{total:05d}.safetensors"
    save_file(rest, folder / name, metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(rest, name))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    q = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    config.quantization_config = q.to_dict()
    config.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


# --- one measured process ------------------------------------------------------------------
def child(args: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    torch.cuda.reset_peak_memory_stats()
    out: dict = {"case": args.child}
    if args.child in ("narrows", "transformers", "old", "identical"):
        from narrows.core.io.loader import load_blockwise

        if args.child == "narrows":
            model = load_blockwise(args.folder, dtype=torch.bfloat16, quant="nf4", device="cuda")
        elif args.child == "old":
            from transformers import AutoModelForCausalLM

            from narrows.core import quantize_nf4

            model = AutoModelForCausalLM.from_pretrained(args.folder, dtype=torch.bfloat16)
            quantize_nf4(model, compute_dtype=torch.bfloat16, device="cuda", park="cpu")
        else:
            from transformers import AutoModelForCausalLM, BitsAndBytesConfig

            q = BitsAndBytesConfig(
                load_in_4bit=True,
                bnb_4bit_quant_type="nf4",
                bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=torch.bfloat16,
            )
            model = AutoModelForCausalLM.from_pretrained(
                args.folder, dtype=torch.bfloat16, quantization_config=q, device_map={"": 0}
            )
            if args.child == "identical":
                ref = model.state_dict()
                del model
                torch.cuda.empty_cache()
                ours = load_blockwise(
                    args.folder, dtype=torch.bfloat16, quant="nf4", device="cuda"
                ).state_dict()
                same = [k for k in ref if k in ours and torch.equal(ref[k].cpu(), ours[k].cpu())]
                out.update(
                    tensors=len(ref),
                    identical=len(same),
                    keys_match=set(ref) == set(ours),
                    first_difference=next((k for k in ref if k not in same), None),
                )
                return out
        out["load_s"] = time.perf_counter() - t0
    else:  # ready / disk: from_pretrained + LoRA + stream + training steps
        from peft import LoraConfig, get_peft_model

        import narrows.stream as ns

        def load():
            return ns.from_pretrained(
                args.folder,
                quant="nf4",
                dtype=torch.bfloat16,
                cache=args.cache,
                host_budget=None if args.host_budget == "all" else args.host_budget,
            )

        if args.profile:  # where a load's time goes
            import cProfile
            import io
            import pstats

            prof = cProfile.Profile()
            model = prof.runcall(load)
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(40)
            Path(args.profile).write_text(text.getvalue())
        else:
            model = load()
        out["load_s"] = time.perf_counter() - t0
        torch.manual_seed(0)
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
        model = ns.stream(
            model, None if args.gpu_budget == "min" else args.gpu_budget, seq_len=args.seq, batch_size=1
        )
        plan = model.narrows_stream.plan
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        gen = torch.Generator().manual_seed(0)
        times, disk0 = [], None
        for i in range(args.steps + 1):
            ids = torch.randint(0, model.config.vocab_size, (1, args.seq), generator=gen).cuda()
            ts = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - ts)
            if i == 0:
                out["first_step_at_s"] = time.perf_counter() - t0
                disk0 = model.narrows_stream.stats.bytes_disk
        steady = sorted(times[1:])
        stats = model.narrows_stream.stats
        out.update(
            s_per_step=steady[len(steady) // 2],
            disk_bytes_per_step=(stats.bytes_disk - disk0) / args.steps,
            h2d_bytes_per_step=plan.h2d_bytes_per_step,
            disk_layers=len(plan.disk),
            layers=len(plan.layer_bytes),
            resident_layers=len(plan.resident),
            predicted_host_bytes=plan.predicted_host_bytes,
            predicted_peak=plan.predicted_peak,
        )
    out["wall_s"] = time.perf_counter() - t0
    out["peak_vram"] = torch.cuda.max_memory_allocated()
    return out


def measured(cmd: list[str], env: dict | None = None) -> dict:
    """Run `cmd` under /usr/bin/time -v: its RESULT line, peak RSS and wall time. The RSS
    is also sampled from /proc every 20 ms (the process tree's sum), since a process that
    resets its own high-water mark hides earlier peaks from /usr/bin/time."""
    import threading

    t = time.perf_counter()
    proc = subprocess.Popen(
        ["/usr/bin/time", "-v", *cmd],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env or os.environ.copy(),
    )
    sampled = [0]

    def tree_rss(pid: int) -> int:
        total, todo = 0, [pid]
        while todo:
            p = todo.pop()
            try:
                with open(f"/proc/{p}/status") as f:
                    total += next((int(x.split()[1]) * 1024 for x in f if x.startswith("VmRSS:")), 0)
                with open(f"/proc/{p}/task/{p}/children") as f:
                    todo += [int(c) for c in f.read().split()]
            except OSError:
                pass
        return total

    def poll() -> None:
        while proc.poll() is None:
            sampled[0] = max(sampled[0], tree_rss(proc.pid))
            time.sleep(0.02)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    stdout, stderr = proc.communicate()
    poller.join()
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", stderr)
    line = next((x for x in stdout.splitlines() if x.startswith("RESULT ")), None)
    row = json.loads(line[7:]) if line else {}
    if proc.returncode != 0:
        row["error"] = (stderr or stdout)[-1500:]
    row["peak_rss_time_v"] = int(m.group(1)) * 1024 if m else None
    row["peak_rss_sampled"] = sampled[0]
    row["process_wall_s"] = time.perf_counter() - t
    return row


def me(args: argparse.Namespace, case: str, folder: Path, **kw: str) -> list[str]:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        case,
        "--folder",
        str(folder),
        "--cache",
        str(args.work / "cache"),
        "--seq",
        str(args.seq),
        "--steps",
        str(args.steps),
        "--gpu-budget",
        args.gpu_budget,
    ]
    cmd[cmd.index("--seq") + 1] = str(kw.pop("seq", args.seq))
    if kw.pop("profile", None) and args.profile:
        cmd += ["--profile", str(Path(args.profile) / f"profile_{case}_{folder.name}.txt")]
    for k, v in kw.items():
        cmd += [f"--{k.replace('_', '-')}", v]
    return cmd


def disk_bandwidth(path: Path, nbytes: int = 4 * GIB) -> float:
    """Sequential O_DIRECT read bandwidth of the file system holding `path` (bytes/s)."""
    from narrows.stream.storage.tiers import aligned_pinned

    probe = path / "probe.bin"
    with open(probe, "wb") as f:
        block = os.urandom(64 << 20)
        for _ in range(nbytes // len(block)):
            f.write(block)
        os.fsync(f.fileno())
    buf = aligned_pinned(64 << 20, True)
    fd = os.open(probe, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    t, got = time.perf_counter(), 0
    while (k := os.preadv(fd, [memoryview(buf.numpy())], got)) > 0:
        got += k
    dt = time.perf_counter() - t
    os.close(fd)
    probe.unlink()
    return got / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="loader,ready,disk,finetune")
    ap.add_argument(
        "--config", default="qwen2.5-7b", help="bf16 sharded checkpoint of this shape ('none': skip)"
    )
    ap.add_argument("--bnb", help="also a pre-quantised NF4 checkpoint of this shape (ready/disk use it)")
    ap.add_argument(
        "--bnb-layers", type=int, help="decoder layers of the NF4 checkpoint (default: the config's)"
    )
    ap.add_argument(
        "--host-budgets", default="8GiB,all", help="disk part: host budgets to compare ('all': none)"
    )
    ap.add_argument("--loader-cases", default="narrows,transformers,old,identical")
    ap.add_argument("--gpu-budget", default="6GiB")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--disk-seqs", default="512", help="disk part: sequence lengths")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--work", type=Path, default=Path("/tmp/checkpoints"))
    ap.add_argument("--keep", action="store_true", help="keep the written folders")
    ap.add_argument("--out", default="benchmarks/results/checkpoints.json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    ap.add_argument("--host-budget", default="all", help=argparse.SUPPRESS)
    ap.add_argument(
        "--finetune-hosts", help="finetune part: host budgets (default: all and the first of --host-budgets)"
    )
    ap.add_argument("--finetune-gpu-budget", help="finetune part: its --gpu-budget (default: --gpu-budget)")
    ap.add_argument("--profile", help="write a cProfile of each warm load into this folder")
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return

    parts = args.parts.split(",")
    args.work.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    result = {
        "device": torch.cuda.get_device_name(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "rows": rows,
    }

    def record(part: str, label: str, row: dict) -> None:
        row.update(part=part, label=label)
        rows.append(row)
        print(json.dumps(row), flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))

    from stream_qlora import pinned_bandwidth

    result["disk_read_bw"] = disk_bandwidth(args.work)
    result["pinned_h2d_bw"] = pinned_bandwidth()
    folders = []
    if args.config != "none" and {"loader", "ready", "disk", "finetune"} & set(parts):
        t = time.perf_counter()
        bf16 = write_bf16(args.config, args.work / f"{args.config}-bf16")
        result["bf16_folder"] = {"bytes": folder_bytes(bf16), "write_s": time.perf_counter() - t}
        folders.append(("bf16", bf16))
    if args.bnb:
        t = time.perf_counter()
        bnb = write_bnb4(args.bnb, args.work / f"{args.bnb}-bnb4", args.bnb_layers)
        result["bnb_folder"] = {"bytes": folder_bytes(bnb), "write_s": time.perf_counter() - t}
        folders.append(("bnb4", bnb))
    if "loader" in parts:
        for kind, folder in folders:
            cases = args.loader_cases.split(",") if kind == "bf16" else ["narrows", "transformers"]
            for case in cases:
                record("loader", f"{kind} {case}", measured(me(args, case, folder)))

    def drop_caches() -> bool:
        """Empty the page cache so that cold runs read from the disk (needs root)."""
        try:
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            return True
        except OSError:
            return False

    for kind, folder in folders:
        if "ready" in parts:
            result.setdefault("page_cache_dropped", []).append(drop_caches())
            shutil.rmtree(args.work / "cache", ignore_errors=True)
            hb = args.host_budgets.split(",")[0]
            record("ready", f"{kind} cold host {hb}", measured(me(args, "ready", folder, host_budget=hb)))
            record(
                "ready",
                f"{kind} warm host {hb}",
                measured(me(args, "ready", folder, host_budget=hb, profile="1")),
            )
        if "disk" in parts:
            for hb in args.host_budgets.split(","):
                for seq in args.disk_seqs.split(","):
                    drop_caches()
                    row = measured(me(args, "ready", folder, host_budget=hb, seq=seq))
                    record("disk", f"{kind} host {hb} seq {seq}", row)
    if "finetune" in parts:
        train, held = args.work / "train.jsonl", args.work / "held.jsonl"
        for path, n in ((train, 64), (held, 8)):  # the weights are random: any text will do
            path.write_text(
                "".join(
                    json.dumps(
                        {
                            "prompt": f"Question {i}: what is {i} + {i}?",
                            "response": f"{i} + {i} = {2 * i}. " * 20,
                        }
                    )
                    + "\n"
                    for i in range(n)
                )
            )
        hosts = (args.finetune_hosts or f"all,{args.host_budgets.split(',')[0]}").split(",")
        for (kind, folder), hb in ((f, hb) for f in folders for hb in hosts):
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
                str(held),
                "--eval-rows",
                "4",
                "--quant",
                "nf4",
                "--gpu-budget",
                args.finetune_gpu_budget or args.gpu_budget,
                "--steps",
                "3",
                "--batch",
                "1",
                "--seq-len",
                str(args.seq),
                "--no-progress",
                "--exact-match",
                "0",
                "--cache",
                str(args.work / "cache"),
                "--out",
                str(args.work / f"run-{kind}-{hb}"),
            ]
            if hb != "all":
                cmd += ["--host-budget", hb]
            shutil.rmtree(args.work / f"run-{kind}-{hb}", ignore_errors=True)
            row = measured(cmd)
            summary = args.work / f"run-{kind}-{hb}" / "summary.json"
            if summary.is_file():
                row["summary"] = json.loads(summary.read_text())
            label = f"{kind} host {hb}"
            record(
                "finetune", label + (" (again: warm)" if any(r["label"] == label for r in rows) else ""), row
            )
    if not args.keep:
        for _, folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
    table(result)
    print(f"wrote {args.out}")


def table(result: dict) -> None:
    def g(v: float | None) -> str:
        return "–" if v is None else f"{v / GIB:.2f}"

    def s(v: float | None) -> str:
        return "–" if v is None else f"{v:.2f}"

    print(
        f"\n{result['device']}; disk read {result['disk_read_bw'] / 1e9:.2f} GB/s (O_DIRECT, sequential), "
        f"pinned host→device {result['pinned_h2d_bw'] / 1e9:.1f} GB/s"
    )
    print(
        f"{'part':<9}{'case':<28}{'RSS GiB':>9}{'time -v':>9}{'VRAM GiB':>10}{'load s':>8}{'1st step s':>11}"
        f"{'s/step':>8}{'floor s':>8}{'disk/step GiB':>14}{'disk layers':>12}"
    )
    for r in result["rows"]:
        if r.get("error"):
            print(f"{r['part']:<9}{r['label']:<28}failed: {r['error'].strip().splitlines()[-1][:80]}")
            continue
        disk = r.get("disk_bytes_per_step")
        if disk is not None:  # the transfer floor: the slower of the disk reads and the host→device copies
            r["floor_s"] = max(
                disk / result["disk_read_bw"], r["h2d_bytes_per_step"] / result["pinned_h2d_bw"]
            )
        layers = f"{r['disk_layers']}/{r['layers']}" if "layers" in r else "–"
        print(
            f"{r['part']:<9}{r['label']:<28}{g(r['peak_rss_sampled']):>9}{g(r['peak_rss_time_v']):>9}"
            f"{g(r.get('peak_vram')):>10}{s(r.get('load_s')):>8}{s(r.get('first_step_at_s')):>11}"
            f"{s(r.get('s_per_step')):>8}{s(r.get('floor_s')):>8}{g(disk):>14}{layers:>12}"
        )


if __name__ == "__main__":
    main()
