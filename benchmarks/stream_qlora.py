"""A training step of narrows.stream: QLoRA r16 on all seven projections of a real
architecture's shape (random NF4 weights), batch 1 unless --batch, one seq length; for each mode the peak
allocated VRAM, s/step, tokens/s, and the transfer floor (host→device bytes per step over
the pinned bandwidth measured in the same run). Modes run in fresh subprocesses.

    python benchmarks/stream_qlora.py --model qwen2.5-7b --seq 512 --steps 20 \
        --modes stream-min,stream-24GiB,stream-40GiB,resident-ckpt,resident --out results/stream_7b.json

Modes: stream-min (every layer streamed, smallest footprint), stream-<size> (planner with
that budget), either with "-head" (LM head streamed in vocabulary chunks too) and/or
"-lmhead" (narrows.lmhead's masked, chunked exact loss: no full logits), "-tile" (the
planner may tile the MLP over the sequence: seq_tile="auto") or "-keep" (saved layer
inputs never offloaded: offload="off") or "-recompute" (every layer recomputed, none kept
whole: recompute="all") or "-graphs" (layers replayed as CUDA graphs: graphs=True) or "-auto" (the planner's choice,
graphs="auto"; without either suffix graphs=False; the library defaults to "auto"), "-attn"/"-noattn" (the fast
layers' attention kept in host memory for the backward: keep_attention=True/False; without either, "auto",
the library's default), e.g. stream-min-head-lmhead-tile; step-<size>/step-min (the same
plan trained by `StepTrainer`: block-major accumulation over --grad-accum micro-batches;
"-hostopt": AdamW state in host memory, each layer updated when its gradients are complete;
"-hostadapters": that and the adapter parameters in host memory too (host_state="adapters");
"-held": each layer's NF4 weights dequantised once per pass, hold_weights=True, "-noheld"
False, neither: the library's "auto"; step modes plan with grad_accum and step_mode=True);
"-fast" on a stream mode: kernels="fast" (the same fast layers, streamed); on a resident mode: narrows.core.fuse_layers (each decoder layer one autograd node with a
written-out backward, LoRA in bf16 on tensor cores; with -ckpt it recomputes itself, selectively);
"-f32lora" with "-fast": the fast layers' adapters in PEFT's float32 arithmetic (lora_dtype);
"-drop" on any mode: LoRA dropout 0.05 (DROPOUT; without it none, as the peers run);
"-fuse" on any mode: narrows.core.fuse_lora (each LoRA branch one autograd node, the float32
cast of an input shared by Q/K/V or gate/up made and saved once);
resident-ckpt (everything on the GPU, PEFT + HF gradient checkpointing), resident (no
checkpointing), either with "-tile<N>" (the MLP over sequence tiles of N tokens); "-offload" on resident-ckpt holds the checkpointed inputs in pinned host
memory (transformers' own `offload=True`, or torch's `save_on_cpu` around its
checkpoint where that transformers has no such option); the peers (benchmarks/_peers.py):
fsdp-offload (answer.ai's FSDP+QLoRA recipe: FSDP1, parameters offloaded to CPU, every
layer checkpointed) and deepspeed-z3 (ZeRO-3, parameters offloaded to pinned CPU memory;
"-ckpt" adds HF checkpointing, "-lean" a smaller gathering window). With --grad-accum G every mode
makes one optimizer step of G micro-batches (the others accumulate sequentially).
Ratios: `vs_resident` against the fastest resident mode of the run; for a mode with a
budget, `vs_best_peft_fitting` against the fastest resident mode whose peak fits it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))


def pinned_bandwidth(nbytes: int = 1 << 30, reps: int = 5) -> float:
    """Measured host(pinned)→device bandwidth in bytes/s."""
    if not torch.cuda.is_available():
        return float("nan")
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        dst.copy_(src, non_blocking=True)
    end.record()
    torch.cuda.synchronize()
    return nbytes * reps / (start.elapsed_time(end) / 1e3)


def checkpointing(model, *, offload: bool) -> None:
    """HF gradient checkpointing, its inputs in pinned host memory when `offload`."""
    kwargs = {"use_reentrant": False}
    if not offload:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        return
    try:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs, offload=True)
        print("offload: transformers' gradient_checkpointing offload=True", file=sys.stderr)
    except TypeError:  # a transformers without the option: what it does, by hand
        import functools

        from torch.autograd.graph import save_on_cpu
        from torch.utils.checkpoint import checkpoint

        def offloaded(function, *args, **kw):
            with save_on_cpu(pin_memory=True):
                return checkpoint(function, *args, **kw)

        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        base._set_gradient_checkpointing(
            enable=True, gradient_checkpointing_func=functools.partial(offloaded, **kwargs)
        )
        print("offload: save_on_cpu(pin_memory=True) around HF's checkpoint", file=sys.stderr)


def peak_breakdown(snapshot: dict, top: int = 25) -> str:
    """What was allocated at the moment of the peak, grouped by the innermost frame of
    the allocating call that is not in torch itself (from a memory-history snapshot)."""
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for trace in snapshot["device_traces"]:
        for ev in trace:
            if ev["action"] == "alloc":
                frames = [f for f in ev.get("frames", []) if "/torch/" not in f["filename"]]
                where = " < ".join(f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in frames[:3])
                live[ev["addr"]] = (ev["size"], where)
                total += ev["size"]
                if total > peak:
                    peak, at_peak = total, dict(live)
            elif ev["action"] in ("free_requested",) and ev["addr"] in live:
                total -= live.pop(ev["addr"])[0]
    groups: dict[str, list[int]] = {}
    for size, where in at_peak.values():
        groups.setdefault(where, []).append(size)
    rows = sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:top]
    lines = [
        f"peak {peak / 2**30:.2f} GiB over the traced steps (allocations live before tracing not counted)"
    ]
    lines += [f"{sum(v) / 2**20:>9.1f} MiB  x{len(v):<4} {k}" for k, v in rows]
    return "\n".join(lines)


DROPOUT = 0.05  # "-drop": a LoRA dropout users set (PEFT's examples use 0.05 or 0.1)


def run_one(args: argparse.Namespace) -> dict:
    from _models import add_lora, load_config, random_nf4_model

    import narrows.stream as ns
    from narrows.core import read_peaks, reset_peaks

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    mode = args.run_one
    twin = getattr(args, "deterministic", False)  # peers.py's twins: deterministic kernels, adapters saved
    if twin:
        from narrows.core.protocol.determinism import deterministic

        deterministic(True)
    torch.manual_seed(0)  # adapter init draws from the global RNG: same start in every mode
    t0 = time.perf_counter()
    experts = getattr(args, "expert_quant", "nf4")  # peers.py's namespaces have none: NF4
    model = random_nf4_model(
        load_config(args.model), work_device=str(device), attn=args.attn, experts=experts
    )
    parts = mode.split("-")
    dropout = DROPOUT if "drop" in parts else 0.0
    model = add_lora(model, dropout=dropout).train()
    model.config.use_cache = False
    vocab = model.config.vocab_size
    build_s = time.perf_counter() - t0
    plan = engine = None
    if "fuse" in parts:  # each LoRA branch one autograd node, a shared input cast once
        from narrows.core import fuse_lora

        fuse_lora(model)
    if "lmhead" in parts:  # masked + chunked exact CE through core's head hook
        import narrows.lmhead as lmh

        lmh.apply(model)
    if mode.startswith(("stream", "step")):
        budget = None if parts[1] == "min" else parts[1]
        head = "stream" if "head" in parts else "resident"
        # a step mode plans for its G micro-batches: room for its held weights and layer boundaries, and
        # (block-major recomputes every layer) no layer whole, as narrows finetune does
        step = parts[0] == "step"
        ns.stream(
            model,
            budget,
            device=device,
            seq_len=args.seq,
            batch_size=args.batch,
            head=head,
            grad_accum=args.grad_accum if step else 1,
            step_mode=True if step else "auto",
            hold_weights=True if "held" in parts else False if "noheld" in parts else "auto",
            seq_tile="auto" if "tile" in parts else None,
            offload="off" if "keep" in parts else "auto",
            recompute="all" if "recompute" in parts or step else "auto",
            graphs=True if "graphs" in parts else "auto" if "auto" in parts else False,
            host_state="adapters"
            if "hostadapters" in parts
            else "optimizer"
            if "hostopt" in parts
            else "none",
            kernels="fast" if "fast" in parts else "peft",
            deterministic=twin,
            lora_dtype="float32" if "f32lora" in parts else None,
            keep_attention=True if "attn" in parts else False if "noattn" in parts else "auto",
        )
        plan = model.narrows_stream.plan
        print(plan, file=sys.stderr)
    elif mode.startswith(("fsdp", "deepspeed")):
        import _peers

        from narrows.core import anatomy_of

        layer_cls = type(anatomy_of(model).layers[0])
        if "ckpt" in parts:
            checkpointing(model, offload=False)
            model.enable_input_require_grads()
        if mode.startswith("fsdp"):
            model = _peers.fsdp_offload(model, layer_cls, cuda)
        else:
            engine = _peers.deepspeed_zero3(model, args.grad_accum, cuda, lean="lean" in parts)
    else:
        if mode.startswith("resident-ckpt"):
            checkpointing(model, offload="offload" in parts)
            model.enable_input_require_grads()
        model.to(device)
        tile = next((int(x[4:]) for x in parts if x.startswith("tile") and x[4:].isdigit()), None)
        if tile is not None:  # "-tile<N>": the MLP over sequence tiles of N tokens (peers.py's tiled twins)
            ns.tile_sequence(model, tile)
        if "fast" in parts:  # after checkpointing: a fused layer recomputes itself where it was on
            from narrows.core import fuse_layers

            print(
                fuse_layers(model, lora_dtype=torch.float32 if "f32lora" in parts else None), file=sys.stderr
            )
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    gen = torch.Generator().manual_seed(0)

    g = args.grad_accum
    trainer = (
        ns.StepTrainer(model, opt, grad_accum=g)  # host state and held weights: the plan's
        if mode.startswith("step")
        else None
    )

    def step() -> float:
        return float(enqueue())

    def enqueue() -> torch.Tensor | float:
        """One step's work handed to the device; its loss, not yet read back (no sync)."""
        batches = []
        for _ in range(g):
            ids = torch.randint(0, vocab, (args.batch, args.seq), generator=gen).to(device)
            batches.append({"input_ids": ids, "labels": ids})
        if trainer is not None:
            return trainer.step(batches).loss
        total = 0.0
        if engine is not None:  # DeepSpeed scales by 1/G and steps at the G-th call itself
            for batch in batches:
                loss = engine(**batch).loss
                engine.backward(loss)
                engine.step()
                total = total + loss.detach() / g
            return total
        for batch in batches:
            loss = model(**batch).loss
            (loss / g).backward()
            total = total + loss.detach() / g  # no device sync per micro-batch
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    collector = getattr(args, "gc", "on")  # (peers.py builds its own args, without it)
    if collector != "on":  # does the collector's walk over the model's objects cost the host?
        import gc

        gc.collect()
        gc.freeze() if collector == "freeze" else gc.disable()
    for _ in range(args.warmup):
        step()

    def moved_h2d() -> int:  # weights, the streamed head, the saved inputs brought back, adapters
        stats = model.narrows_stream.stats
        adapters = trainer.adapters.bytes_h2d if trainer is not None and trainer.adapters is not None else 0
        return stats.bytes_h2d + stats.act_h2d + adapters

    loads0 = moved_h2d() if plan else 0
    if args.trace and cuda:
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    reset_peaks(device)
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    losses = [step() for _ in range(args.steps)]
    if cuda:
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t) / args.steps
    peaks = read_peaks(device)
    if args.trace and cuda:
        print(peak_breakdown(torch.cuda.memory._snapshot()), file=sys.stderr)
        torch.cuda.memory._record_memory_history(enabled=None)
    out = {
        "mode": mode,
        "lora_dropout": dropout,
        "grad_accum": g,
        "build_s": round(build_s, 1),
        "s_per_step": dt,
        "batch": args.batch,
        "tokens_per_s": args.seq * args.batch * g / dt,
        "peak_allocated": peaks.cuda_allocated,
        "peak_reserved": peaks.cuda_reserved,
        "host_rss_peak": peaks.host_rss,
        "final_loss": losses[-1],
    }
    if plan is not None:
        moved = (moved_h2d() - loads0) / args.steps
        out.update(
            predicted_peak=plan.predicted_peak if trainer is None else trainer.predicted_peak,
            resident_layers=len(plan.resident),
            layers=len(plan.layer_bytes),
            prefetch=plan.prefetch,
            h2d_bytes_per_step_planned=plan.h2d_bytes_per_step,
            h2d_bytes_per_step=moved,
            offloaded_layers=len(plan.offloaded),
            host_activation_bytes=plan.host_activation_bytes,
            d2h_bytes_per_step=plan.d2h_bytes_per_step,
            tile_tokens=plan.tile_tokens,
            act_waits=model.narrows_stream.stats.act_waits,
            whole_layers=len(plan.whole),
            graph_bytes_planned=plan.graph_bytes,
            graphs_planned=plan.graphs,
            graphs_choice=plan.graphs_choice,
            kept_attention_layers=len(plan.kept_attention),
            attention_choice=plan.attention_choice,
        )
        if trainer is not None:
            out["hold_weights"] = trainer.held_choice
            out["head_group"] = trainer.head_group  # micro-batches per pass over a streamed head
        graphs = model.narrows_stream.graphs
        if graphs is not None:  # replays use the graphs' pool, which the allocator's peak does not see
            pool = graphs.pool_bytes()
            out.update(
                graphs=graphs.stats.as_dict(),
                graph_pool_bytes=pool,
                peak_allocated=peaks.cuda_allocated + pool,
                peak_allocated_outside_graphs=peaks.cuda_allocated,
            )
        if args.profile:  # one more step, after the timed ones: the overlap audit
            with model.narrows_stream.profiling() as prof:
                step()
            print(f"{mode}: one step profiled\n{prof}", file=sys.stderr)
            out["profile"] = prof.as_dict()
    # After the step's counters are read: how long the host takes to hand one step over (the
    # device synchronised before it). It counts any wait for the device inside the step too, so
    # it bounds the host's share from above. Not in a twin (it saves the adapters after --steps)
    # nor where peers.py's optimizer clock synchronises every step (host_steps=0).
    host_s = []
    for _ in range(getattr(args, "host_steps", 3) if cuda and not twin else 0):
        torch.cuda.synchronize()
        t = time.perf_counter()
        loss = enqueue()
        host_s.append(time.perf_counter() - t)
        float(loss)
    out["host_s_per_step"] = sorted(host_s)[len(host_s) // 2] if host_s else None
    save = getattr(args, "save_adapters", None)
    if save:  # the trained adapters, for peers.py's torch.equal against a twin run
        torch.save({n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad}, save)
    if getattr(args, "host_profile", False):  # one more step: the host's time by Python function
        out["host_profile"] = host_profile(step)
        print(f"{mode}: host profile\n" + "\n".join(map(str, out["host_profile"])), file=sys.stderr)
    if args.torch_profile and cuda:  # one more step: where its time goes, host and device
        out["torch_profile"] = torch_profile(step)
        print(f"{mode}: torch profile {json.dumps(out['torch_profile'])}", file=sys.stderr)
    return out


def host_profile(step, top: int = 40) -> list[list]:
    """One step under cProfile: [function, calls, own s, cumulative s], by own time."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    step()
    prof.disable()
    stats = pstats.Stats(prof).stats
    ranked = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [
        [f"{Path(f).name}:{line}({fn})", calls, round(own, 4), round(cum, 4)]
        for (f, line, fn), (_, calls, own, cum, _) in ranked
    ]


def torch_profile(step, top: int = 25) -> dict:
    """One step under torch.profiler: its wall time, the device's busy time (kernels and
    copies, summed), and the ops that took the most host and device time themselves. A
    device busy for a small share of the wall is waiting for the host (launches, Python)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    events = prof.key_averages()
    with tempfile.TemporaryDirectory() as tmp:  # a 72B step's trace is hundreds of MB: not left behind
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        kinds = device_categories(json.loads(trace.read_text()))

    def device_us(e) -> float:
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)

    def rows(key) -> list[list]:
        ranked = sorted(events, key=key, reverse=True)[:top]
        return [
            [e.key[:90], e.count, round(e.self_cpu_time_total / 1e6, 4), round(device_us(e) / 1e6, 4)]
            for e in ranked
        ]

    return {
        "wall_s": wall,
        "device_busy_s": sum(device_us(e) for e in events) / 1e6,
        "host_ops": sum(e.count for e in events),
        "top_host": rows(lambda e: e.self_cpu_time_total),  # [op, calls, self host s, self device s]
        "top_device": rows(device_us),
        **kinds,
    }


CATEGORIES = (  # (category, substrings of a kernel's name), first match wins
    ("dequantise", ("Dequantize",)),
    ("attention", ("flash", "fmha", "sdpa", "attention")),
    ("matmul", ("nvjet", "gemm", "cutlass", "xmma", "splitKreduce")),
)


def device_categories(trace: dict) -> dict:
    """Device time by kind of kernel, and how busy the busiest stream (the compute
    stream) was: its kernels' union against the span from its first to its last, so a
    stream idle while it waits for the host or a copy shows as idle."""
    by_cat: dict[str, float] = {}
    others: dict[str, float] = {}
    streams: dict[object, list[tuple[float, float]]] = {}
    for e in trace.get("traceEvents", []):
        cat = e.get("cat", "")
        if e.get("ph") != "X" or cat not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        name, dur = e.get("name", ""), float(e.get("dur", 0)) / 1e6
        if cat != "kernel":
            kind = "copy " + (
                "host→device" if "HtoD" in name else "device→host" if "DtoH" in name else "other"
            )
        else:
            kind = next((c for c, keys in CATEGORIES if any(k in name for k in keys)), "other kernels")
            streams.setdefault(e.get("tid"), []).append(
                (float(e["ts"]), float(e["ts"]) + float(e["dur"]), name[:70])
            )
            if kind == "other kernels":
                others[name[:70]] = others.get(name[:70], 0.0) + dur
        by_cat[kind] = by_cat.get(kind, 0.0) + dur
    busiest = max(streams.values(), key=lambda iv: sum(b - a for a, b, _ in iv), default=[])
    busy, end, last = 0.0, None, ""
    gaps: list[tuple[float, str, str]] = []  # idle µs between kernels, the kernel before, the one after
    for a, b, name in sorted(busiest):
        if end is None or a > end:
            if end is not None:
                gaps.append((a - end, last, name))
            busy, end = busy + (b - a), b
        elif b > end:
            busy, end = busy + (b - end), b
        if b >= end:
            last = name
    span = (max(b for _, b, _ in busiest) - min(a for a, _, _ in busiest)) / 1e6 if busiest else 0.0
    top_others = sorted(others.items(), key=lambda kv: -kv[1])[:12]
    return {
        "device_s_by_kind": {k: round(v, 4) for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
        "compute_stream": {
            "span_s": round(span, 4),
            "busy_s": round(busy / 1e6, 4),
            # where it waits: idle time by gap size, and the longest gaps with their neighbours
            "idle_s_by_gap": {
                f"{lo}-{hi} µs": round(sum(g for g, _, _ in gaps if lo <= g < hi) / 1e6, 4)
                for lo, hi in ((0, 20), (20, 100), (100, 1000), (1000, 10**9))
            },
            "longest_gaps": [
                [round(g), before, after] for g, before, after in sorted(gaps, reverse=True)[:15]
            ],
        },
        "other_kernels_top": [[k, round(v, 4)] for k, v in top_others],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-7b")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step (G)")
    ap.add_argument("--batch", type=int, default=1, help="sequences per micro-batch")
    ap.add_argument(
        "--expert-quant",
        default="nf4",
        choices=("nf4", "nf3", "nf2"),
        help="a mixture of experts' routed expert stacks: NF4, or narrows' NF3 / NF2 codes",
    )
    ap.add_argument("--modes", default="stream-min,stream-24GiB,stream-40GiB,resident-ckpt,resident")
    ap.add_argument("--out", default="benchmarks/results/stream_qlora.json")
    ap.add_argument("--attn", default="sdpa", help="attention implementation (eager: deterministic backward)")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="after the timed steps, profile one more: per-layer compute, copy and exposed copy time",
    )
    ap.add_argument(
        "--torch-profile",
        action="store_true",
        help="after the timed steps, run one more under torch.profiler: wall vs device-busy time, top ops",
    )
    ap.add_argument(
        "--host-profile",
        action="store_true",
        help="after the timed steps, run one more under cProfile: the host's time by Python function",
    )
    ap.add_argument(
        "--gc",
        choices=("on", "freeze", "off"),
        default="on",
        help="Python's garbage collector in each mode: on, the model's objects frozen "
        "(gc.freeze after the build), or off",
    )
    ap.add_argument("--run-one", help=argparse.SUPPRESS)
    ap.add_argument(
        "--trace",
        action="store_true",
        help="print what is allocated at each mode's peak (the steps then run with "
        "CUDA's memory history on: their timings are not comparable)",
    )
    args = ap.parse_args()
    if args.run_one:
        try:
            print("RESULT " + json.dumps(run_one(args)), flush=True)
        except torch.OutOfMemoryError as e:
            print("RESULT " + json.dumps({"mode": args.run_one, "error": f"OOM: {str(e)[:120]}"}), flush=True)
        return

    bw = pinned_bandwidth()
    rows = []
    for mode in args.modes.split(","):
        cmd = [
            sys.executable,
            __file__,
            "--run-one",
            mode,
            "--model",
            args.model,
            "--seq",
            str(args.seq),
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--attn",
            args.attn,
            "--grad-accum",
            str(args.grad_accum),
            "--batch",
            str(args.batch),
            *(["--profile"] if args.profile else []),
            *(["--trace"] if args.trace else []),
            *(["--torch-profile"] if args.torch_profile else []),
            *(["--host-profile"] if args.host_profile else []),
            "--gc",
            args.gc,
            "--expert-quant",
            args.expert_quant,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
        if args.trace:  # the child's breakdown of its peak
            said = proc.stderr.splitlines()
            start = next((i for i, x in enumerate(said) if x.startswith("peak ")), len(said))
            print(f"{mode}:", *said[start : start + 26], sep="\n", flush=True)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-4:] or ["no output"]
        row = (
            json.loads(line[7:])
            if line
            else {"mode": mode, "error": " | ".join(tail)[-600:], "returncode": proc.returncode}
        )
        if "h2d_bytes_per_step" in row and bw == bw:
            row["transfer_floor_s"] = row["h2d_bytes_per_step"] / bw
        rows.append(row)
        print(json.dumps(row), flush=True)
        write(args, bw, rows)  # after every mode: a run cut short keeps what it measured

    ok = [r for r in rows if "error" not in r]
    peft = [r for r in ok if r["mode"].startswith("resident")]
    ref = min(peft, key=lambda r: r["s_per_step"], default=None)  # the fastest resident PEFT run
    for r in ok:
        if ref:
            r["vs_resident"] = r["s_per_step"] / ref["s_per_step"]
            r["reference"] = ref["mode"]
        budget = _budget_of(r["mode"])
        if budget is not None:  # the best plain PEFT configuration that fits the same budget
            fits = [p for p in peft if p["peak_allocated"] <= budget]
            best = min(fits, key=lambda p: p["s_per_step"], default=None)
            r["best_peft_fitting"] = best["mode"] if best else None
            r["vs_best_peft_fitting"] = r["s_per_step"] / best["s_per_step"] if best else None
    gib = 2**30
    print(
        f"\n{args.model}, seq {args.seq}, batch {args.batch}, G {args.grad_accum}, LoRA r16 x7, NF4; pinned H2D {bw / 1e9:.1f} GB/s"
    )
    print(
        f"{'mode':<30}{'peak GiB':>10}{'RSS GiB':>9}{'s/step':>9}{'tok/s':>9}{'floor s':>9}{'vs ref time':>12}{'vs ref mem':>11}{'vs fitting PEFT':>16}  resident"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['mode']:<30}  {r['error'][:90]}")
            continue
        floor = r.get("transfer_floor_s")
        t_ratio = r["s_per_step"] / ref["s_per_step"] if ref else float("nan")
        m_ratio = (
            r["peak_allocated"] / ref["peak_allocated"] if ref and ref["peak_allocated"] else float("nan")
        )
        res = f"{r['resident_layers']}/{r['layers']} ({r['whole_layers']} whole)" if "layers" in r else "all"
        fitting = r.get("vs_best_peft_fitting")
        fitting = "" if "best_peft_fitting" not in r else "none fits" if fitting is None else f"{fitting:.2f}"
        print(
            f"{r['mode']:<30}{r['peak_allocated'] / gib:>10.2f}{(r['host_rss_peak'] or 0) / gib:>9.2f}{r['s_per_step']:>9.3f}{r['tokens_per_s']:>9.0f}"
            f"{(floor if floor is not None else float('nan')):>9.3f}{t_ratio:>12.2f}{m_ratio:>11.2f}{fitting:>16}  {res}"
        )
    write(args, bw, rows)


def _budget_of(mode: str) -> int | None:
    """The GPU budget a stream/step mode ran under (None: the smallest footprint)."""
    parts = mode.split("-")
    if parts[0] in ("stream", "step") and parts[1].endswith("GiB"):
        return int(float(parts[1][:-3]) * 2**30)
    return None


def write(args: argparse.Namespace, bw: float, rows: list[dict]) -> None:
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    Path(args.out).write_text(
        json.dumps(
            {
                "model": args.model,
                "seq": args.seq,
                "steps": args.steps,
                "grad_accum": args.grad_accum,
                "batch": args.batch,
                "warmup": args.warmup,
                "pinned_bw": bw,
                "device": device,
                "traced": args.trace,  # memory history on: the timings are not
                "rows": rows,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
