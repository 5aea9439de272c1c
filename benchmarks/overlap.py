"""What runs at the same time on the H100, for one decoder layer's shapes: before moving
work off a step's critical path, this measures whether it would overlap at all.

- the base matmuls of a layer's forward, alone;
- its 4-bit weights dequantised (bitsandbytes, into preallocated rows), alone;
- both on one stream (what a fast layer does now: dequantise, then multiply) against
  the next layer's dequantisation on a side stream while this layer multiplies;
- pinned host→device and device→host copies, alone and both at once (is the link
  full-duplex?), and the matmuls while both copy;
- an adapter added onto the base output (`addmm_`) against one matmul over the input
  widened by the adapter's rank (``[x, s·x·Aᵀ] @ [W, B]ᵀ``), and against the adapter's
  product written first with the base accumulated onto it in the matmul's epilogue.

    python benchmarks/overlap.py --shape 72b --out /tmp/overlap_72b.json
    python benchmarks/results.py add h100 /tmp/overlap_72b.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
from pathlib import Path

import torch

SHAPES = {  # hidden, q out, kv out, intermediate (Qwen2.5)
    "7b": (3584, 3584, 512, 18944),
    "32b": (5120, 5120, 1024, 27648),
    "72b": (8192, 8192, 1024, 29568),
}


def timed(fn, reps: int) -> float:
    """Seconds a call, CUDA events around `reps` calls after two warm-ups."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


@contextlib.contextmanager
def sampled_clocks():
    """nvidia-smi's SM clock (MHz) and power (W), sampled every 20 ms while the block runs:
    yields a dict filled with their means and minimums when it ends (empty without nvidia-smi)."""
    got: dict = {}
    try:
        proc = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "20"],
            stdout=subprocess.PIPE,
            text=True,
        )
    except OSError:
        yield got
        return
    try:
        yield got
    finally:
        proc.terminate()
        out = proc.communicate()[0]
        pairs = [
            tuple(float(v) for v in line.split(",")) for line in out.splitlines() if line.count(",") == 1
        ]
        if pairs:
            mhz, watts = zip(*pairs)
            got.update(
                samples=len(pairs),
                sm_mhz_mean=sum(mhz) / len(mhz),
                sm_mhz_min=min(mhz),
                watts_mean=sum(watts) / len(watts),
                watts_max=max(watts),
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="72b")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=6, help="layers a timed call runs")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/overlap.json")
    ap.add_argument(
        "--drag",
        action="store_true",
        help="also: the matmuls while host→device copies run as long as they do (whole or in "
        "pieces) against alone, with the SM clock and power sampled",
    )
    args = ap.parse_args()
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    dev, bf = torch.device("cuda"), torch.bfloat16
    hid, qo, kvo, inter = SHAPES[args.shape]
    T, L, rank = args.tokens, args.layers, 16
    shapes = {
        "q": (qo, hid),
        "k": (kvo, hid),
        "v": (kvo, hid),
        "o": (hid, qo),
        "gate": (inter, hid),
        "up": (inter, hid),
        "down": (hid, inter),
    }
    packed = {
        n: quantize_4bit(
            torch.randn(s, device=dev, dtype=bf) * 0.02, quant_type="nf4", compress_statistics=True
        )
        for n, s in shapes.items()
    }

    def buffers() -> dict[str, torch.Tensor]:
        qkv = torch.empty(qo + 2 * kvo, hid, device=dev, dtype=bf)
        gu = torch.empty(2 * inter, hid, device=dev, dtype=bf)
        return {
            "qkv": qkv,
            "q": qkv[:qo],
            "k": qkv[qo : qo + kvo],
            "v": qkv[qo + kvo :],
            "o": torch.empty(hid, qo, device=dev, dtype=bf),
            "gu": gu,
            "gate": gu[:inter],
            "up": gu[inter:],
            "down": torch.empty(hid, inter, device=dev, dtype=bf),
        }

    bufs = [buffers(), buffers()]

    def dequant(b: dict[str, torch.Tensor]) -> None:
        for n, (p, qs) in packed.items():
            dequantize_4bit(p.view(-1, 1), qs, out=b[n])

    x = torch.randn(T, hid, device=dev, dtype=bf)
    a_in = torch.randn(T, qo, device=dev, dtype=bf)
    m_in = torch.randn(T, inter, device=dev, dtype=bf)

    def gemms(b: dict[str, torch.Tensor]) -> None:
        x.mm(b["qkv"].t())
        a_in.mm(b["o"].t())
        x.mm(b["gu"].t())
        m_in.mm(b["down"].t())

    side = torch.cuda.Stream()

    def serial() -> None:
        for i in range(L):
            dequant(bufs[i % 2])
            gemms(bufs[i % 2])

    def overlapped() -> None:
        main = torch.cuda.current_stream()
        ready = [torch.cuda.Event(), torch.cuda.Event()]
        free = [torch.cuda.Event(), torch.cuda.Event()]
        with torch.cuda.stream(side):
            side.wait_stream(main)
            dequant(bufs[0])
            ready[0].record()
        for i in range(L):
            if i + 1 < L:
                with torch.cuda.stream(side):
                    if i >= 1:
                        side.wait_event(free[(i + 1) % 2])
                    dequant(bufs[(i + 1) % 2])
                    ready[(i + 1) % 2].record()
            main.wait_event(ready[i % 2])
            gemms(bufs[i % 2])
            free[i % 2].record()
        main.wait_stream(side)

    rows: dict[str, float] = {}
    rows["gemms, per layer"] = timed(lambda: [gemms(bufs[0]) for _ in range(L)], args.reps) / L
    rows["dequant, per layer"] = timed(lambda: [dequant(bufs[0]) for _ in range(L)], args.reps) / L
    rows["dequant then gemms, one stream, per layer"] = timed(serial, args.reps) / L
    rows["next dequant on a side stream, per layer"] = timed(overlapped, args.reps) / L

    nbytes = 1 << 30
    host_a = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_b = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev_a = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dev_b = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    up_s, down_s = torch.cuda.Stream(), torch.cuda.Stream()

    def h2d() -> None:
        dev_a.copy_(host_a, non_blocking=True)

    def d2h() -> None:
        host_b.copy_(dev_b, non_blocking=True)

    def copying(layers: int) -> None:
        """Both copies on their own streams, `layers` layers' matmuls beside them."""
        main = torch.cuda.current_stream()
        for s, fn in ((up_s, h2d), (down_s, d2h)):
            s.wait_stream(main)
            with torch.cuda.stream(s):
                fn()
        for _ in range(layers):
            gemms(bufs[0])
        main.wait_stream(up_s)
        main.wait_stream(down_s)

    rows["h2d 1 GiB"] = timed(h2d, args.reps)
    rows["d2h 1 GiB"] = timed(d2h, args.reps)
    rows["h2d and d2h 1 GiB each, at once"] = timed(lambda: copying(0), args.reps)

    rows["gemms while both copy, per layer"] = timed(lambda: copying(L), args.reps) / L

    if args.drag:  # a step's pattern: host→device copies alone (no d2h), for as long as the matmuls run
        long = 5 * L
        clocks: dict[str, dict] = {}
        for chunk in (nbytes, nbytes // 16):
            pieces = [(host_a[i : i + chunk], dev_a[i : i + chunk]) for i in range(0, nbytes, chunk)]

            def h2d_while(layers: int = long, pieces=pieces) -> None:
                main = torch.cuda.current_stream()
                up_s.wait_stream(main)
                with torch.cuda.stream(up_s):
                    for _ in range(14 * L // 6):  # ≈ the matmuls' time at 55 GB/s
                        for src, dst in pieces:
                            dst.copy_(src, non_blocking=True)
                for _ in range(layers):
                    gemms(bufs[0])
                main.wait_stream(up_s)

            name = f"gemms while h2d copies ({chunk >> 20} MiB pieces), per layer"
            with sampled_clocks() as got:
                rows[name] = timed(h2d_while, args.reps) / long
            clocks[name] = got
        name = "gemms alone, as long, per layer"
        with sampled_clocks() as got:
            rows[name] = timed(lambda: [gemms(bufs[0]) for _ in range(long)], args.reps) / long
        clocks[name] = got

    w, bmat = bufs[0]["gu"], torch.randn(2 * inter, rank, device=dev, dtype=bf)
    amat = torch.randn(rank, hid, device=dev, dtype=bf)
    wide_w = torch.randn(2 * inter, hid + rank, device=dev, dtype=bf)
    wide_x = torch.empty(T, hid + rank, device=dev, dtype=bf)

    def lora_addmm() -> None:
        out = x.mm(w.t())
        out.addmm_(x.mm(amat.t()), bmat.t())

    def lora_wide() -> None:
        wide_x[:, :hid].copy_(x)
        torch.mm(x, amat.t(), out=wide_x[:, hid:])
        wide_x.mm(wide_w.t())

    h = x.mm(amat.t())
    out = torch.empty(T, 2 * inter, device=dev, dtype=bf)

    def adapter_first() -> None:  # the adapter's product written first, the base accumulated onto it
        torch.addmm(out, h, bmat.t(), beta=0, alpha=2.0, out=out)
        out.addmm_(x, w.t())

    def base_first() -> None:  # the base written first, the adapter's product added by a second pass
        torch.mm(x, w.t(), out=out)
        out.addmm_(h, bmat.t(), alpha=2.0)

    rows["gate/up: base mm + adapter addmm_"] = timed(lora_addmm, args.reps * 4)
    rows["gate/up: one mm over [x, xAᵀ]"] = timed(lora_wide, args.reps * 4)
    rows["gate/up: base mm alone"] = timed(lambda: torch.mm(x, w.t(), out=out), args.reps * 4)
    rows["gate/up: base, then adapter addmm_ (h given)"] = timed(base_first, args.reps * 4)
    rows["gate/up: adapter, then base addmm_ onto it (h given)"] = timed(adapter_first, args.reps * 4)

    run = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": args.shape,
        "tokens": T,
        "layers": L,
        "reps": args.reps,
        "copy_bytes": nbytes,
        "seconds": rows,
    }
    if args.drag:
        run["clocks"] = clocks  # SM MHz and watts sampled by nvidia-smi while each timed call ran
    flops = 2 * T * hid * (qo + 2 * kvo + 2 * inter) + 2 * T * qo * hid + 2 * T * inter * hid
    run["gemm_tflops"] = flops / rows["gemms, per layer"] / 1e12
    if args.drag:  # the rate a step's matmuls hold for longer than a burst (the card's power limit)
        run["gemm_tflops_sustained"] = flops / rows["gemms alone, as long, per layer"] / 1e12
    print(f"{run['device']}, {args.shape}, {T} tokens; layer GEMMs at {run['gemm_tflops']:.0f} TFLOP/s")
    for name, s in rows.items():
        print(f"  {name:48s} {s * 1e3:8.3f} ms")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(run, indent=1))


if __name__ == "__main__":
    main()
