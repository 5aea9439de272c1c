"""What dequantising one decoder layer's routed experts costs on the GPU, per scheme: the time
a pass spends turning the stored stacks back into the bf16 stacks the grouped matmuls read
(narrows dequantises them once per pass: the forward's, and once for recompute and backward).

Schemes, each on the same random stacks of a config's shape (gate_up [E, H, 2I], down
[E, I, H]): ``nf4`` (bitsandbytes' `dequantize_4bit`, double-quantised, as `quantize_nf4`
stores the stacks), ``nf4-narrows`` (the same stacks through narrows' one-launch Triton kernel,
`narrows.core.dequantize_nf4`, what the fast layer calls), ``nf3`` and ``nf2`` (narrows' codes, its Triton kernel), ``mxfp4``
(gpt-oss's release format kept as stored, the same kernel's MXFP4 path, which writes the
stack transposed) and ``mxfp4-torch`` (its PyTorch reference). Beside them the floor: the
bytes a scheme reads and writes at the bandwidth of a plain device-to-device copy of 1 GiB
measured on the same GPU. Each row: ms per layer (median of `--repeat` after a warm-up), bytes read
and written, GB/s, the ratio to the floor, and the host's CPU time to launch one stack's
dequantisation (µs, the mean over 200 launches without waiting for the GPU).

    source .gpu/env && python3 benchmarks/expert_dequant.py --config gpt-oss-120b --out $OUT/expert_dequant.json
    python3 benchmarks/results.py add h200 expert_dequant.json --case expert_dequant_gpt-oss-120b
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import torch
from dora_kernels import copy_bandwidth, median_ms  # CUDA-event timing, the copy floor

from narrows.core.quant import lowbit

CONFIGS = Path(__file__).parent / "configs"
SCHEMES = ("nf4", "nf4-narrows", "nf3", "nf2", "mxfp4", "mxfp4-torch")


def stacks_of(config: dict, experts: int | None) -> dict[str, tuple[int, ...]]:
    e = experts or config.get("num_local_experts") or config["num_experts"]
    h = config["hidden_size"]
    i = config.get("moe_intermediate_size") or config["intermediate_size"]
    return {"gate_up_proj": (e, h, 2 * i), "down_proj": (e, i, h)}


def prepared(scheme: str, shape: tuple[int, ...], gen: torch.Generator):
    """(a call that dequantises the stack, bytes it reads as stored)."""
    experts, per = shape[0], shape[1] * shape[2]
    if scheme.startswith("mxfp4"):
        codes = torch.randint(0, 256, (experts, per // 2), generator=gen, dtype=torch.uint8, device="cuda")
        scales = torch.randint(
            118, 128, (experts, per // 32), generator=gen, dtype=torch.uint8, device="cuda"
        )
        spec = lowbit.LowbitStack.of_mxfp4(shape, torch.bfloat16)
        impl = "torch" if scheme == "mxfp4-torch" else "triton"
        return (lambda: lowbit.dequantize(codes, scales, spec, impl=impl)), codes.nbytes + scales.nbytes
    weights = torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02
    if scheme.startswith("nf4"):
        from bitsandbytes.functional import quantize_4bit

        from narrows.core import dequantize_nf4

        packed, state = quantize_4bit(weights, blocksize=64, compress_statistics=True, quant_type="nf4")
        stored = packed.nbytes + state.absmax.nbytes + state.state2.absmax.nbytes
        impl = "triton" if scheme == "nf4-narrows" else "bnb"
        return (lambda: dequantize_nf4(packed, state, impl=impl)), stored
    spec = lowbit.LowbitStack(lowbit.SCHEMES[scheme], shape, torch.bfloat16)
    codes, absmax = lowbit.quantize(weights, spec.bits)
    del weights
    return (lambda: lowbit.dequantize(codes, absmax, spec, impl="triton")), codes.nbytes + absmax.nbytes


def launch_us(call, n: int = 200) -> float:
    """The host's CPU time to launch `call` once, in µs (its results dropped as they come,
    the GPU's queue drained every 20 so memory stays bounded)."""
    total = 0.0
    for i in range(n):
        if i % 20 == 0:
            torch.cuda.synchronize()
        t = time.thread_time()
        call()
        total += time.thread_time() - t
    torch.cuda.synchronize()
    return total / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="gpt-oss-120b", help="a config of benchmarks/configs")
    parser.add_argument("--experts", type=int, help="experts a stack (default: the config's)")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    config = json.loads((CONFIGS / f"{args.config}.json").read_text())
    shapes = stacks_of(config, args.experts)
    written = sum(2 * torch.Size(s).numel() for s in shapes.values())  # bf16 out
    gen = torch.Generator("cuda").manual_seed(0)

    copy_bw = copy_bandwidth()

    rows = []
    for scheme in SCHEMES:
        ms, stored, host_us = 0.0, 0, []
        for shape in shapes.values():
            call, nbytes = prepared(scheme, shape, gen)
            ms += median_ms(call, args.repeat)
            host_us.append(launch_us(call))
            stored += nbytes
            del call
            torch.cuda.empty_cache()
        floor_ms = (stored + written) / copy_bw * 1e3
        rows.append(
            {
                "label": scheme,
                "scheme": scheme,
                "ms": ms,
                "stored_bytes": stored,
                "written_bytes": written,
                "gb_per_s": (stored + written) / (ms / 1e3) / 1e9,
                "floor_ms": floor_ms,
                "over_floor": ms / floor_ms,
                "host_us_per_launch": sum(host_us) / len(host_us),
            }
        )
        print(
            f"{scheme:12s} {ms:8.3f} ms  floor {floor_ms:.3f} ms  ({ms / floor_ms:.2f}x)  "
            f"host {rows[-1]['host_us_per_launch']:.0f} us a launch",
            flush=True,
        )
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "title": f"dequantising one {args.config} layer's routed experts, per scheme",
        "commit": commit,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "args": {"config": args.config, "experts": args.experts, "repeat": args.repeat},
        "shapes": {k: list(v) for k, v in shapes.items()},
        "copy_gb_per_s": copy_bw / 1e9,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
