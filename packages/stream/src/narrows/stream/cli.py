"""``narrows prepare``: contributed to the `narrows` command through the ``narrows.cli`` entry point."""

from __future__ import annotations

import argparse

__all__ = ["register"]


def _run(args: argparse.Namespace) -> int:
    import time

    import torch

    from narrows.core import format_bytes

    from .storage.pretrained import prepare

    t = time.perf_counter()
    dtype = getattr(torch, args.dtype)
    path = prepare(args.model, quant=args.quant, dtype=dtype, cache=args.cache, device=args.device)
    print(
        f"prepared cache {path} ({format_bytes(path.stat().st_size)}, {time.perf_counter() - t:.0f} s); "
        "narrows finetune --gpu-budget ... and narrows.stream.from_pretrained reuse it"
    )
    return 0


def register(sub) -> None:
    p = sub.add_parser(
        "prepare",
        help="quantise a checkpoint once into the prepared-slab cache that streamed runs reuse",
        description="Build (or check) the prepared-slab cache of a model folder: each decoder layer "
        "quantised and laid out as the slab narrows-stream moves, in one file with a checksum per "
        "slab. Later streamed runs start from it in seconds and read disk-tier layers from it.",
    )
    p.add_argument(
        "--model", required=True, help="HF model folder (bf16/fp32 safetensors or bnb-4bit) or .gguf"
    )
    p.add_argument(
        "--quant", choices=["nf4", "none"], default="none", help="nf4: quantise the decoder linears"
    )
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float16", "float32"],
        help="compute dtype of the base (default bfloat16; must match the run's --dtype)",
    )
    p.add_argument("--cache", help="cache folder (default: $NARROWS_CACHE/slabs)")
    p.add_argument("--device", help="where to quantise (default: cuda when present)")
    p.set_defaults(func=_run)
