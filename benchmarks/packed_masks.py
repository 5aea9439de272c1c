"""What the attention masks of packed sequences cost: one forward and backward of a
Qwen2.5-7B-shaped NF4 model with LoRA, resident, on 512 tokens as one causal sequence
(no mask), as three packed examples (positions restarted, so transformers builds a
block-diagonal mask), and with a 2-D mask of ones; for sdpa and flex_attention. Median of
the last six of eight steps. Needs CUDA.

    python benchmarks/packed_masks.py --out benchmarks/results/packed_mask_cost_7b.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from _models import add_lora, load_config, random_nf4_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-7b")
    ap.add_argument("--out", default="benchmarks/results/packed_mask_cost_7b.json")
    args = ap.parse_args()
    model = add_lora(random_nf4_model(load_config(args.model), work_device="cuda", attn="sdpa")).train()
    model.to("cuda")
    ids = torch.randint(0, 1000, (1, 512), device="cuda")
    packed = torch.cat([torch.arange(n) for n in (170, 160, 182)]).unsqueeze(0).cuda()
    cases = {
        "causal": {},
        "packed3": {"position_ids": packed},
        "mask_ones": {"attention_mask": torch.ones_like(ids)},
    }
    out = {}
    for impl in ("sdpa", "flex_attention"):
        model.set_attn_implementation(impl)
        for name, kw in cases.items():
            times = []
            for _ in range(8):
                torch.cuda.synchronize()
                t = time.perf_counter()
                model(input_ids=ids, labels=ids, use_cache=False, **kw).loss.backward()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
            out[f"{impl}/{name}"] = sorted(times[2:])[len(times[2:]) // 2]
            print(f"{impl:<15} {name:<10} {out[f'{impl}/{name}']:.4f} s", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
