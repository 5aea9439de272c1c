"""What one fast decoder layer holds on the device, measured beside the planner's figures.

For one layer of a real shape (random NF4 weights, LoRA r16 on all seven projections) and
a batch of T tokens, on CUDA (the CPU has no allocator statistics):

- ``kept``: what `compute.forward_keeping` leaves allocated besides its input and output
  (a layer run whole, no recompute), beside `planning.whole_bytes` less the saved input;
- ``work``: the peak above the input and the output's gradient while `compute.recompute`
  and `compute.backward` run (a streamed or checkpointed layer's backward), without and
  with the shared dequantisation cache, beside `planning.layer_work_bytes`;
- the same two for PEFT's modules under autograd (the fits' reference);
- with timing (the default), the median seconds of the forward and of the recompute +
  backward, eager and replayed as a CUDA graph, beside the forward's base matmuls alone:
  eager minus graph is what the host costs.

Run on the device: ``source .gpu/env && python3 benchmarks/fast_memory.py --out $OUT/fast_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))


def one_layer(name: str, device: torch.device, dropout: float = 0.0, experts: bool = False):
    """One NF4 decoder layer of `name`'s shape with LoRA on its default targets (and on a
    mixture of experts' routed experts with `experts`), on `device`."""
    from _models import add_lora, load_config, random_nf4_model

    from narrows.core import lora_targets

    cfg = load_config(name)
    cfg.num_hidden_layers = 1
    model = random_nf4_model(cfg, work_device=str(device))
    stacks = lora_targets(model, experts=True).parameters if experts else ()
    model = add_lora(model, dropout=dropout, parameters=stacks).train()
    model.to(device)
    for p in model.parameters():  # non-zero B: the adapters' backward does its full work
        if p.requires_grad and p.dim() == 2 and not p.any():
            torch.nn.init.normal_(p, std=0.02)
    return model, cfg


def measure(
    name: str, tokens: int, seq: int, device: torch.device, timing: bool = False, tile: int | None = None
) -> dict:
    from narrows.core import anatomy_of
    from narrows.core.kernels.fastlayer import compute, parts_of
    from narrows.stream.planning import Shapes, layer_work_bytes, whole_bytes

    model, cfg = one_layer(name, device)
    anat = anatomy_of(model)
    layer = anat.layers[0]
    parts = parts_of(layer)
    parts.mlp_tile = tile  # the MLP over sequence tiles of this many tokens (None: one pass)
    batch = tokens // seq
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(batch, seq, cfg.hidden_size, device=device, dtype=torch.bfloat16, generator=gen)
    pos = torch.arange(seq, device=device).expand(batch, -1)
    cos, sin = anat.decoder.rotary_emb(x, pos)
    g = torch.randn_like(x)
    shapes = Shapes.of(anat, batch, seq, fast=True)
    alloc = torch.cuda.memory_allocated

    def peak_above(fn) -> tuple[int, object]:
        torch.cuda.synchronize()
        base = alloc()
        torch.cuda.reset_peak_memory_stats()
        result = fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, result

    row = {
        "model": name,
        "tokens": tokens,
        "seq": seq,
        "tile": tile,
        "hidden": cfg.hidden_size,
        "intermediate": cfg.intermediate_size,
        "kv": cfg.num_key_value_heads * parts.head_dim,
        "planned_whole_less_input": whole_bytes(shapes) - x.numel() * 2,
        "planned_work": layer_work_bytes(shapes, tile),
        "dequant_largest": shapes.dequant_bytes,
    }
    for _ in range(2):  # the second pass is the one recorded: kernels and workspaces warmed up
        base = alloc()
        out, saved = compute.forward_keeping(parts, x, cos, sin, None)
        row["fast_kept"] = alloc() - base - out.numel() * out.element_size()
        del out, saved
        for cache in (None, {}):
            key = "fast_work" if cache is None else "fast_work_cached"

            def step(cache=cache):
                saved = compute.recompute(parts, x, cos, sin, None, cache)
                return compute.backward(parts, saved, g, cache)

            row[key], res = peak_above(step)
            del res
    params = [p for p in layer.parameters() if p.requires_grad]
    xg = x.detach().requires_grad_()
    for _ in range(2):
        base = alloc()
        out = layer(xg, position_embeddings=(cos, sin))
        out = out[0] if isinstance(out, tuple) else out
        row["peft_kept"] = alloc() - base - out.numel() * out.element_size()

        def back(out=out):
            return torch.autograd.grad(out, [xg, *params], g)

        row["peft_work"], res = peak_above(back)
        del out, res
    if timing:
        row["seconds"] = times(parts, x, cos, sin, g)
    del model
    torch.cuda.empty_cache()
    return row


def times(parts, x, cos, sin, g, reps: int = 10) -> dict:
    """Median seconds of the layer's forward and of its recompute + backward, eager and
    replayed as a CUDA graph (the graph pays no host cost: the gap is the host's), beside
    the base matmuls alone (the tensor-core floor of the forward)."""
    from narrows.core.kernels.fastlayer import compute

    ws = [p.w(x, None) for grp in parts.groups for p in grp.linears]
    flat = x.reshape(-1, x.shape[-1])
    # inputs of the right widths, made before the clock starts
    inputs = [
        flat
        if w.shape[1] == flat.shape[1]
        else torch.randn(flat.shape[0], w.shape[1], device=x.device, dtype=x.dtype)
        for w in ws
    ]

    def matmuls():  # the forward's base GEMMs alone
        for inp, w in zip(inputs, ws):
            inp.mm(w.t())

    def fwd():
        compute.forward(parts, x, cos, sin, None)

    def bwd():
        compute.backward(parts, compute.recompute(parts, x, cos, sin, None), g)

    def median(fn) -> float:
        out = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            out.append(time.perf_counter() - t)
        return sorted(out)[reps // 2]

    res = {}
    for name, fn in (("matmuls", matmuls), ("forward", fwd), ("recompute_backward", bwd)):
        fn()
        res[name] = median(fn)
        if name == "matmuls":
            continue
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fn()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            res[name + "_graph"] = median(graph.replay)
            del graph
        except Exception as e:  # a capture that fails is reported, not fatal
            res[name + "_graph"] = f"capture failed: {str(e)[:120]}"
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--cases",
        default="qwen2.5-7b:4096:512,qwen2.5-7b:32768:32768,qwen2.5-32b:4096:512,qwen2.5-72b:4096:512",
        help="model:tokens:seq[:tile] (tile: the MLP's sequence tile in tokens), comma-separated",
    )
    ap.add_argument("--out", default="benchmarks/results/fast_memory.json")
    ap.add_argument("--no-timing", action="store_true", help="memory only")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("fast_memory.py measures the CUDA allocator: run it on a GPU")
    device = torch.device("cuda")
    rows = []
    for case in args.cases.split(","):
        name, tokens, seq, *tile = case.split(":")
        row = measure(
            name,
            int(tokens),
            int(seq),
            device,
            timing=not args.no_timing,
            tile=int(tile[0]) if tile else None,
        )
        per = {
            k: round(v / row["tokens"])
            for k, v in row.items()
            if k.startswith(("fast_", "peft_", "planned_"))
        }
        row["bytes_per_token"] = per
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
