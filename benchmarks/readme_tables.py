"""The README tables generated from the results files (`results.py`): each names the cases
and rows it shows, and every number in it comes from a row. The READMEs mark each table
``<!-- results:NAME -->`` … ``<!-- /results:NAME -->``; `render` rewrites what lies between
from ``TABLES[NAME]`` (`python benchmarks/results.py tables`). No torch here:
tests/test_readme_numbers.py imports this module.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable

from results import HERE, ROOT, Results

READMES = (ROOT / "README.md", HERE / "README.md")


def gib(b: float) -> str:
    """'6.99 GiB'; three places under 1 GiB ('0.095 GiB')."""
    return f"{b / 2**30:.{2 if b >= 2**30 else 3}f} GiB"


def sec(s: float, digits: int = 3) -> str:
    return f"{s:.{digits}f} s"


def peak_s(m: dict, digits: int = 3) -> str:
    """'6.99 GiB, 0.355 s': peak allocated and the step (median where the row has one)."""
    return f"{gib(m['peak_allocated'])}, {sec(step_s(m), digits)}"


def step_s(m: dict) -> float:
    return m.get("median_s_per_step") or m["s_per_step"]


def table(header: list[str], lines: Iterable[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(cells) + " |" for cells in lines]
    return "\n".join(out)


# what each mode is, in words (stream_qlora.py's and peers.py's names)
BASELINES = {
    "unsloth": "Unsloth",
    "peft": "PEFT, no checkpointing",
    "peft-ckpt": "PEFT + checkpointing",
    "resident": "PEFT, no checkpointing",
    "resident-ckpt": "PEFT + checkpointing",
    "resident-ckpt-lmhead": "PEFT + checkpointing (narrows-lmhead's loss)",
    "resident-ckpt-lmhead-offload": "PEFT + checkpointing, inputs in host memory",
    "fsdp-offload": "FSDP+QLoRA, CPU offload",
    "deepspeed-z3": "DeepSpeed ZeRO-3 offload",
    "deepspeed-z3-ckpt": "DeepSpeed ZeRO-3 offload + checkpointing",
    "deepspeed-z3-lean": "DeepSpeed ZeRO-3 offload, small window",
    "deepspeed-z3-ckpt-lean": "DeepSpeed ZeRO-3 offload + checkpointing, small window",
}


def mode(name: str) -> str:
    return BASELINES.get(name, f"`{name}`")


def twin(m: dict) -> str:
    t = m.get("twin") or {}
    if "equal" not in t:
        return "–"
    steps = t.get("steps", "?")
    return ("equal" if t["equal"] else "**differ**") + f" ({steps} step{'' if steps == 1 else 's'})"


# ---------------------------------------------------------------------------------------
# The tables (filled in below)

TABLES: dict[str, Callable[[Results], str]] = {}


def generated(name: str):
    def register(fn: Callable[[Results], str]) -> Callable[[Results], str]:
        TABLES[name] = fn
        return fn

    return register


MARKED = re.compile(r"(<!-- results:([\w-]+) -->\n)(.*?)(<!-- /results:\2 -->)", re.S)


def render(text: str, results: Results) -> str:
    """`text` with every marked table regenerated from `results`."""
    return MARKED.sub(
        lambda m: m.group(1) + TABLES[m.group(2)](results).rstrip("\n") + "\n" + m.group(4), text
    )


def marked(text: str) -> list[str]:
    return [m.group(2) for m in MARKED.finditer(text)]


# ---------------------------------------------------------------------------------------
# The tables: each names the cases and rows it shows; every number comes from a row.


def model_name(name: str) -> str:
    """'qwen2.5-7b' -> '7B', 'llama-3.2-3b' -> 'Llama-3.2-3B'."""
    m = re.fullmatch(r"qwen2\.5-(\d+)b", str(name))
    return f"{m.group(1)}B" if m else str(name).replace("llama", "Llama").replace("b", "B")


def shape(args: dict) -> str:
    """'7B, 8 × 512, G = 8, dropout 0.05' from a run's arguments."""
    parts = [model_name(args.get("model") or args.get("config", "?"))]
    seq = args.get("seq") or args.get("seq_len")
    if seq:
        parts.append(f"{args.get('batch', 1)} × {seq}")
    if args.get("grad_accum", 1) > 1:
        parts.append(f"G = {args['grad_accum']}")
    if args.get("dropout"):
        parts.append(f"dropout {args['dropout']}")
    return ", ".join(parts)


def run_cell(rows: list[dict], label: str | None = None) -> str:
    """What ran and when, with its case (where its rows are)."""
    return f"{label or shape(rows[0]['arguments'])} ({rows[0]['date']}, `{rows[0]['case']}`)"


def has(r: Results, case: str, name: str | None, device: str = "h100") -> str | None:
    return name if name and any(x["name"] == name for x in r.case(case, device)) else None


def cell(
    r: Results, case: str, name: str | None, fmt: Callable[[dict], str] = peak_s, device: str = "h100"
) -> str:
    """One row's cell: '–' where the case has no such row, how it failed where it failed."""
    if not has(r, case, name, device):
        return "–"
    m = r.m(case, name, device)
    if "error" in m:
        error = str(m["error"])
        refused = "cannot hold" in error or "hold the minimum" in error  # (the tail of the message is kept)
        return "out of memory" if "OOM" in error else "refused" if refused else "failed"
    return fmt(m)


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}×"


def fastest(r: Results, case: str, names: Iterable[str]) -> dict:
    """The fastest row among `names` of a case that ran."""
    rows = [r.row(case, n) for n in names if has(r, case, n)]
    return min((x for x in rows if "error" not in x["metrics"]), key=lambda x: step_s(x["metrics"]))


def paragraphs(*parts: str) -> str:
    return "\n\n".join(parts)


HEADLINE = (  # README.md's results: (case, what ran, narrows' rows, the baselines of its run)
    (
        "peers_7b_8x512",
        "7B, 8 × 512 tokens a step, `8GiB`; smallest footprint",
        ["stream-8GiB-lmhead-fast-auto", "stream-min-lmhead-fast"],
        ["unsloth", "peft", "peft-ckpt"],
    ),
    (
        "peers_7b_8x512_drop",
        "the same with LoRA dropout 0.05",
        ["stream-8GiB-lmhead-fast-auto", "stream-min-lmhead-fast"],
        ["unsloth"],
    ),
    (
        "peers_7b_1x32768",
        "7B, one sequence of 32768 tokens, `8GiB`",
        ["stream-8GiB-lmhead-fast-tile"],
        ["unsloth"],
    ),
    (
        "peers_7b_1x512_g8",
        "7B, 1 × 512, G = 8, `8GiB`; smallest footprint",
        ["stream-8GiB-lmhead-fast-auto", "stream-min-lmhead-fast-auto"],
        ["unsloth"],
    ),
    (
        "peers_32b_8x512",
        "32B, 8 × 512, `12GiB`; smallest footprint",
        ["stream-12GiB-lmhead-fast-auto", "stream-min-lmhead-fast-auto"],
        ["unsloth"],
    ),
    (
        "peers_qwen3-30b-a3b-6l_8x512",
        "Qwen3-30B-A3B's shape (6 of 48 layers, NF4 experts, LoRA on attention), 8 × 512, the main job "
        "at `8GiB`; smallest footprint",
        ["finetune-8GiB", "finetune-min"],
        ["unsloth", "peft-ckpt"],
    ),
    (
        "peers_qwen2.5-7b_512_g1",
        "7B, 1 × 512, `12GiB`",
        ["stream-12GiB-auto"],
        ["resident", "resident-ckpt", "fsdp-offload", "deepspeed-z3", "deepspeed-z3-ckpt"],
    ),
    (
        "floor_shared_qwen2.5-7b_g8",
        "7B, 1 × 512, G = 8, the memory floor (head, optimizer state and adapters in host memory)",
        ["step-min-head-lmhead-hostadapters-graphs"],
        ["resident"],
    ),
    (
        "floor_shared_qwen2.5-72b_g16",
        "72B, 1 × 512, G = 16, the memory floor",
        ["step-min-head-lmhead-hostadapters-graphs"],
        ["resident"],
    ),
    (
        "seq4096_qwen2.5-72b_4096_g4",
        "72B, 1 × 4096, G = 4, `24GiB`",
        ["step-24GiB-head-lmhead-auto-fuse"],
        ["resident-ckpt"],
    ),
)
LM = "llama-3.2-3b bf16 context=16384 trainable=1.0 "  # the LM head's rows the results quote
LOSSES = {"hf": "HF", "liger": "Liger-Kernel", "cce": "Cut Cross-Entropy"}


def loss_cell(m: dict) -> str:
    return f"{gib(m['peak_bytes'])}, {m['seconds'] * 1e3:.0f} ms"


@generated("headline")
def _headline(r: Results) -> str:
    lines = []
    for case, what, ours, theirs in HEADLINE:
        narrows = "; ".join(peak_s(r.m(case, n)) for n in ours)
        if theirs:
            best = fastest(r, case, theirs)
            baseline = f"{mode(best['name'])}: {peak_s(best['metrics'])}"
            versus = "; ".join(ratio(step_s(r.m(case, n)), step_s(best["metrics"])) for n in ours)
            rest = "; ".join(f"{mode(n)}: {cell(r, case, n)}" for n in theirs if n != best["name"]) or "–"
        else:
            baseline, versus, rest = "none fits one card", "–", "–"
        lines.append([what, narrows, baseline, versus, rest, f"{r.case(case)[0]['date']}, `{case}`"])
    ours = r.m("lmhead_memory", LM + "masked+chunked+cce")
    best = min(LOSSES, key=lambda k: r.m("lmhead_memory", LM + k)["seconds"])
    lines.append(
        [
            "the LM head's loss alone, Llama-3.2-3B, 16384 tokens, bf16",
            loss_cell(ours),
            f"{LOSSES[best]}: {loss_cell(r.m('lmhead_memory', LM + best))}",
            ratio(ours["seconds"], r.m("lmhead_memory", LM + best)["seconds"]),
            "; ".join(f"{LOSSES[k]}: {loss_cell(r.m('lmhead_memory', LM + k))}" for k in LOSSES if k != best),
            f"{r.row('lmhead_memory', LM + 'hf')['date']}, `lmhead_memory`",
        ]
    )
    return table(
        [
            "workload",
            "narrows",
            "fastest baseline, same run",
            "narrows' time ÷ its",
            "other baselines",
            "measured, case",
        ],
        lines,
    )


PEERS = (  # (case, narrows' default, its smallest footprint)
    ("peers_7b_8x512", "stream-8GiB-lmhead-fast-auto", "stream-min-lmhead-fast"),
    ("peers_7b_8x512_drop", "stream-8GiB-lmhead-fast-auto", "stream-min-lmhead-fast"),
    ("peers_7b_1x32768", "stream-8GiB-lmhead-fast-tile", None),
    ("peers_7b_1x512_g8", "stream-8GiB-lmhead-fast-auto", "stream-min-lmhead-fast-auto"),
    ("peers_32b_8x512", "stream-12GiB-lmhead-fast-auto", "stream-min-lmhead-fast-auto"),
    ("peers_72b_8x512", "stream-16GiB-lmhead-fast-auto", "stream-min-lmhead-fast-auto"),
)
PEER_VARIANTS = (  # (case, mode, what it is)
    ("peers_7b_8x512", "stream-8GiB-lmhead", "7B, `8GiB`, PEFT's kernels streamed"),
    ("peers_72b_8x512", "stream-16GiB-lmhead", "72B, `16GiB`, PEFT's kernels streamed"),
    ("peers_7b_8x512_f32lora", "stream-8GiB-lmhead-fast", "7B, `8GiB`, graphs off, bf16 LoRA"),
    (
        "peers_7b_8x512_f32lora",
        "stream-8GiB-lmhead-fast-f32lora",
        "the same, float32 LoRA (`--lora-dtype float32`)",
    ),
    ("peers_7b_1x32768_attn", "stream-8GiB-lmhead-fast-tile", "7B, 1 × 32768, attention kept in host memory"),
    ("peers_7b_1x32768_attn", "stream-8GiB-lmhead-fast-tile-noattn", "the same, attention recomputed"),
)


def twins(r: Results, case: str) -> str:
    return ", ".join(sorted({twin(x["metrics"]) for x in r.case(case)} - {"–"})) or "–"


@generated("peers")
def _peers(r: Results) -> str:
    lines = [
        [
            run_cell(r.case(case)),
            f"`{default}`: {cell(r, case, default)}",
            cell(r, case, smallest),
            *(cell(r, case, n) for n in ("unsloth", "peft", "peft-ckpt")),
            twins(r, case),
        ]
        for case, default, smallest in PEERS
    ]
    variants = [
        [
            what,
            f"`{name}`",
            cell(r, case, name),
            cell(r, case, "unsloth"),
            f"{r.row(case, name)['date']}, `{case}`",
        ]
        for case, name, what in PEER_VARIANTS
    ]
    return paragraphs(
        table(
            [
                "run",
                "narrows, its default",
                "narrows, smallest footprint",
                "Unsloth",
                "PEFT, no checkpointing",
                "PEFT + checkpointing",
                "twins",
            ],
            lines,
        ),
        table(["other modes of these runs", "mode", "narrows", "Unsloth", "measured, case"], variants),
    )


OFFLOAD = (  # (case, narrows' row)
    ("peers_qwen2.5-7b_512_g1", "stream-12GiB-auto"),
    ("peers_qwen2.5-32b_512_g2", "step-min-head-lmhead-graphs"),
    ("peers_qwen2.5-7b_512_g8", "step-min-head-lmhead-hostadapters-graphs"),
    ("peers_qwen2.5-32b_512_g8", "step-min-head-lmhead-hostadapters-graphs"),
    ("peers_qwen2.5-72b_512_g16", "step-min-head-lmhead-hostadapters-graphs-fuse"),
)


@generated("offload-peers")
def _offload_peers(r: Results) -> str:
    lines = []
    for case, ours in OFFLOAD:
        lean = "-lean" if case.endswith("_lean") else ""
        names = [
            "resident",
            "resident-ckpt",
            "fsdp-offload",
            f"deepspeed-z3{lean}",
            f"deepspeed-z3-ckpt{lean}",
        ]
        label = shape(r.case(case)[0]["arguments"]) + (", DeepSpeed's small window" if lean else "")
        lines.append([run_cell(r.case(case), label), cell(r, case, ours), *(cell(r, case, n) for n in names)])
    return table(
        [
            "run",
            "narrows",
            "PEFT, no checkpointing",
            "PEFT + checkpointing",
            "FSDP+QLoRA, CPU offload",
            "DeepSpeed ZeRO-3 offload",
            "DeepSpeed ZeRO-3 + checkpointing",
        ],
        lines,
    )


BUDGETS = (  # (case, its rows at 6, 8, 12 and 24 GiB)
    ("sweep_graphs_qwen2.5-7b_512", ("stream-6GiB-graphs", "stream-8GiB-auto", "stream-12GiB-auto", None)),
    (
        "sweep_auto_qwen2.5-32b_512",
        ("stream-6GiB-auto", "stream-8GiB-auto", "stream-12GiB-auto", "stream-24GiB-auto"),
    ),
)
STEP_MODE = (  # (case, step mode, step mode with weights held, sequential)
    ("step_qwen2.5-72b_512_g16", "step-min-head-lmhead-graphs", None, "stream-min-head-lmhead-graphs"),
    ("graphs_step_qwen2.5-32b_512_g8", "step-min-head-lmhead-graphs", None, "stream-min-head-lmhead-graphs"),
    ("held_qwen2.5-7b_512_g8", "step-min-head-lmhead-graphs", "step-min-head-lmhead-graphs-held", None),
    ("held_qwen2.5-32b_512_g8", "step-min-head-lmhead-graphs", "step-min-head-lmhead-graphs-held", None),
    ("held_qwen2.5-72b_512_g16", "step-min-head-lmhead-graphs", "step-min-head-lmhead-graphs-held", None),
)
PEFT_BOTH = ("resident", "resident-ckpt")


@generated("streaming")
def _streaming(r: Results) -> str:
    def with_layers(m: dict) -> str:
        return f"{peak_s(m)}, {m['resident_layers']} ({m.get('whole_layers', 0)})"

    budgets = [
        [
            run_cell(r.case(case)),
            *(cell(r, case, n, with_layers) for n in names),
            *(cell(r, case, n) for n in PEFT_BOTH),
        ]
        for case, names in BUDGETS
    ]
    steps = [
        [
            run_cell(r.case(case)),
            cell(r, case, step),
            cell(r, case, held),
            cell(r, case, seq),
            cell(r, case, "resident"),
            cell(r, case, "resident-ckpt-lmhead"),
        ]
        for case, step, held, seq in STEP_MODE
    ]
    sizes = ("6GiB", "8GiB", "12GiB", "16GiB", "24GiB")
    at = [
        [
            run_cell(r.case(c)),
            *(cell(r, c, f"step-{b}-head-lmhead-auto", with_layers) for b in sizes),
            *(cell(r, c, n) for n in PEFT_BOTH),
        ]
        for c in ("sweep_qwen2.5-7b_512_g8", "sweep_qwen2.5-32b_512_g8")
    ]
    floor = []
    for s in ("qwen2.5-7b_g8", "qwen2.5-32b_g8", "qwen2.5-72b_g16"):
        shared, eager = f"floor_shared_{s}", f"floor_adapters_{s}"
        floor.append(
            [
                run_cell(r.case(shared)),
                cell(r, shared, "step-min-head-lmhead-hostadapters-graphs"),
                cell(r, shared, "resident"),
                cell(r, eager, "step-min-head-lmhead-hostadapters"),
                cell(r, eager, "step-min-head-lmhead-hostopt"),
                cell(r, eager, "resident"),
            ]
        )
    held = "floor_graphs_held_qwen2.5-72b_g16"
    floor.append(
        [
            run_cell(r.case(held), "72B, G = 16, NF4 weights held"),
            cell(r, held, "step-min-head-lmhead-hostadapters-graphs-held"),
            cell(r, held, "resident"),
            "–",
            "–",
            "–",
        ]
    )
    peft = ["PEFT, no checkpointing", "PEFT + checkpointing"]
    return paragraphs(
        table(["one micro-batch, at", "`6GiB`", "`8GiB`", "`12GiB`", "`24GiB`", *peft], budgets),
        table(["step mode, smallest footprint", "step mode", "NF4 weights held", "sequential", *peft], steps),
        table(["step mode at", *(f"`{b}`" for b in sizes), *peft], at),
        table(
            [
                "the floor",
                "graphs",
                "PEFT, no checkpointing",
                "eager (`floor_adapters_*`)",
                "eager, adapters on the GPU",
                "PEFT, that run",
            ],
            floor,
        ),
    )


LONG = (
    "long_qwen2.5-7b_4096",
    "long_qwen2.5-7b_16384",
    "long_qwen2.5-7b_32768",
    "long_qwen2.5-7b_65536",
    "long_qwen2.5-7b_131072",
    "long_qwen2.5-32b_16384",
    "long_qwen2.5-32b_32768",
    "long_qwen2.5-32b_65536",
)
LONG_STEP = (  # (case, narrows' two rows)
    ("seq4096_qwen2.5-32b_4096_g4", "step-12GiB-head-lmhead-auto", "step-24GiB-head-lmhead-auto"),
    ("seq4096_qwen2.5-72b_4096_g1", "stream-min-head-lmhead-fuse", "stream-24GiB-head-lmhead-auto-fuse"),
    ("seq4096_qwen2.5-72b_4096_g4", "step-min-head-lmhead-fuse", "step-24GiB-head-lmhead-auto-fuse"),
)


def with_rss(m: dict) -> str:
    return f"{peak_s(m, 2)}, RSS {gib(m['host_rss_peak'])}"


@generated("long")
def _long(r: Results) -> str:
    names = [
        "stream-min-head-lmhead-tile",
        "stream-24GiB-lmhead-tile",
        "resident-ckpt-lmhead",
        "resident-ckpt-lmhead-offload",
    ]
    lines = [[run_cell(r.case(c)), *(cell(r, c, n, with_rss) for n in names)] for c in LONG]
    steps = [
        [
            run_cell(r.case(c)),
            f"`{a}`: {cell(r, c, a, with_rss)}",
            f"`{b}`: {cell(r, c, b, with_rss)}",
            cell(r, c, "resident-ckpt", with_rss),
        ]
        for c, a, b in LONG_STEP
    ]
    return paragraphs(
        table(
            [
                "run",
                "smallest footprint",
                "`24GiB`",
                "PEFT + checkpointing",
                "PEFT + checkpointing, offloaded",
            ],
            lines,
        ),
        table(["4096 tokens, G micro-batches", "narrows", "narrows, `24GiB`", "PEFT + checkpointing"], steps),
    )


@generated("fast-layers")
def _fast_layers(r: Results) -> str:
    case = "fast_all_7b_8x512"
    pairs = [
        ("resident", "resident-fast", "resident"),
        ("resident + checkpointing", "resident-ckpt-fast", "resident-ckpt"),
        ("streamed, `8GiB`", "stream-8GiB-lmhead-fast", "stream-8GiB-lmhead"),
        ("streamed, smallest footprint", "stream-min-lmhead-fast", "stream-min-lmhead"),
    ]
    lines = [[what, cell(r, case, fast), cell(r, case, peft)] for what, fast, peft in pairs]
    rows = r.case("loss_curve_smollm2_gsm8k")
    s = rows[0]["metrics"]["summary"]
    held, windows = s["held_out"], s["windows"]
    within = sum(w["fast"]["within_noise"] for w in windows)
    curve = [
        [
            run_cell(rows, f"SmolLM2-135M on GSM8K, {len(s['seeds'])} seeds"),
            f"{held['peft']['mean']:.4f} ± {held['peft']['std']:.4f}",
            f"{held['fast']['mean']:.4f} ± {held['fast']['std']:.4f}",
            f"{within} of {len(windows)}",
        ]
    ]
    return paragraphs(
        table([run_cell(r.case(case)), "fast layers", "PEFT's modules"], lines),
        table(
            [
                "`loss_curve.py`, 300 steps of 8 rows",
                "held-out loss, PEFT's modules",
                "fast layers",
                "25-step windows within the seeds' noise",
            ],
            curve,
        ),
    )


OVERLAP = (
    "gate/up: base mm alone",
    "gate/up: base, then adapter addmm_ (h given)",
    "gate/up: adapter, then base addmm_ onto it (h given)",
    "gemms while both copy, per layer",
)
FUSED = ("fused_lora_qwen2.5-7b_512", "fused_lora_qwen2.5-7b_4096", "fused_lora_qwen2.5-32b_512")


@generated("one-layer")
def _one_layer(r: Results) -> str:
    prof = [
        [
            run_cell(r.case(c), model_name(c.split("_")[-1])),
            f"{t['layer_device_s'] * 1e3:.2f} ms",
            f"{t['layer_floor_s_at_800'] * 1e3:.2f} ms",
            ratio(t["layer_device_s"], t["layer_floor_s_at_800"]),
            ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in t["layer_s_by_kind"].items()),
        ]
        for c in ("layer_profile_7b", "layer_profile_72b")
        for t in [r.m(c, r.case(c)[0]["name"])["totals"]]
    ]
    cases = ["overlap_7b", "overlap_32b", "overlap_72b"]
    overlap = [[k, *(f"{r.m(c, 'run')['seconds'][k] * 1e3:.3f} ms" for c in cases)] for k in OVERLAP]
    drag = r.m("overlap_72b_drag", "run")
    clocks = next(iter(drag["clocks"].values()))
    host = {
        c: r.m(c, "base n @ W_qkvᵀ")["host_us"]
        for c in ("host_launch_plain", "host_launch_ws", "host_launch_lt")
    }
    mem = r.m("fast_memory", "qwen2.5-7b tokens=4096")["bytes_per_token"]
    acc = {c: r.m(c, "run") for c in ("fast_accuracy_7b", "fast_accuracy_7b_x16")}
    fit = [
        [
            f"`{x['metrics']['case']}`",
            sec(x["metrics"]["measured_s"]),
            sec(x["metrics"]["fast_layers_s"]),
            sec(x["metrics"]["peft_layers_s"]),
        ]
        for x in r.case("steptime_fit", "cpu")
    ]

    def fused(m: dict) -> str:
        same = "" if m["identical_to_peft"] else ", not bit-identical"
        return f"{m['saved_bytes_per_layer'] / 2**20:.1f} MiB, {m['ms_per_layer']:.2f} ms{same}"

    fuse = [
        [
            run_cell(
                r.case(c), f"{model_name(r.case(c)[0]['arguments']['model'])}, {r.m(c, 'peft')['seq']} tokens"
            ),
            *(cell(r, c, n, fused) for n in ("peft", "fused", "grouped")),
        ]
        for c in FUSED
    ]
    return paragraphs(
        table(
            [
                "`layer_profile.py`, 4096 tokens",
                "a layer, device time",
                "its matmuls at 800 TFLOP/s",
                "÷",
                "by kind",
            ],
            prof,
        ),
        table(
            ["`overlap.py`, 4096 tokens", *(run_cell(r.case(c), model_name(c.split("_")[1])) for c in cases)],
            overlap,
        ),
        f"Held as long as a step (`overlap.py --drag`, {r.case('overlap_72b_drag')[0]['date']}), 72B's base matmuls "
        f"ran at {drag['gemm_tflops_sustained']:.0f} TFLOP/s against {drag['gemm_tflops']:.0f} in a burst, the SM "
        f"clock at {clocks['sm_mhz_mean']:.0f} MHz, the card at {clocks['watts_mean']:.0f} W. A Q/K/V matmul call "
        f"costs the host {host['host_launch_plain']:.1f} µs, {host['host_launch_ws']:.1f} µs with "
        f"`CUBLAS_WORKSPACE_CONFIG=:4096:8` (set by `--deterministic`), {host['host_launch_lt']:.1f} µs with "
        f"cuBLASLt (`host_launch.py`, {r.case('host_launch_plain')[0]['date']}). At 7B a fast layer kept whole holds "
        f"{mem['fast_kept']} bytes a token (PEFT's: {mem['peft_kept']}), its recompute and backward peak at "
        f"{mem['fast_work']} (`fast_memory.py`, {r.case('fast_memory')[0]['date']}). Against float64 its worst error "
        f"is {acc['fast_accuracy_7b']['worst_layer_ratio']:.3f}× PEFT's bf16 path's, "
        f"{acc['fast_accuracy_7b_x16']['worst_layer_ratio']:.3f}× with an input 16 times a sublayer's size "
        f"(`fast_accuracy.py`, {r.case('fast_accuracy_7b')[0]['date']}).",
        table(
            [
                run_cell(r.case("steptime_fit", "cpu"), "`steptime_fit.py`"),
                "measured step",
                "model, fast layers",
                "model, PEFT's layers",
            ],
            fit,
        ),
        table(["`fused_lora.py`, a layer", "PEFT", "`fuse_lora`", "one matmul for the A matrices"], fuse),
    )


@generated("finetune")
def _finetune(r: Results) -> str:
    lines = []
    for case in ("finetune_7b", "finetune_7b_g8"):
        for i, row in enumerate(r.case(case)):
            m = row["metrics"]
            lines.append(
                [
                    run_cell(r.case(case)) if i == 0 else "",
                    f"`{m['mode']}`",
                    "on" if m.get("packing") else "off",
                    gib(m["peak_bytes"]),
                    f"{m['median_step_s']:.3f}",
                    f"{m['steady_tokens_per_s']:.0f}",
                    f"{m['eval_loss_after']:.2f}",
                ]
            )
    rows = r.case("packed_mask_cost_7b")
    m = rows[0]["metrics"]
    return paragraphs(
        table(
            ["run", "`--gpu-budget`", "`--packing`", "peak", "s/step", "tokens/s", "held-out loss after"],
            lines,
        ),
        f"Packed attention masks (`packed_masks.py`, {rows[0]['date']}): a 7B forward and backward of 512 tokens took "
        f"{sec(m['sdpa/causal'])} as one causal sequence, {sec(m['sdpa/packed3'])} as three packed ones and "
        f"{sec(m['sdpa/mask_ones'])} with a mask of ones under SDPA.",
    )


@generated("checkpoints")
def _checkpoints(r: Results) -> str:
    load = [
        [run_cell(r.case(case), what), gib(m["peak_rss_time_v"]), gib(m["peak_vram"]), sec(m["load_s"], 1)]
        for case, name, what in (
            ("checkpoints_7b_loader", "narrows", "7B bf16 → NF4, narrows"),
            ("checkpoints_7b_loader", "transformers", "the same, transformers `BitsAndBytesConfig`"),
            ("checkpoints_72b_loader", "bnb4 narrows", "72B NF4 folder, narrows"),
            ("checkpoints_72b_loader", "bnb4 transformers", "the same, transformers"),
        )
        for m in [r.m(case, name)]
    ]
    same = r.m("checkpoints_7b_identical", "identical")

    def floor(row: dict) -> str:
        m = row["metrics"]
        return (
            sec(m["disk_bytes_per_step"] / row["run"]["disk_read_bw"], 1)
            if m.get("disk_bytes_per_step")
            else "–"
        )

    train = []
    for case, name in (
        ("checkpoints_72b_tiers", "bnb4 warm host 24GiB"),
        ("checkpoints_72b_tiers", "bnb4 cold host 24GiB"),
        ("checkpoints_72b_tiers", "bnb4 host all seq 512"),
    ):
        row = r.row(case, name)
        m = row["metrics"]
        train.append(
            [
                f"`{name}` ({row['date']}, `{case}`)",
                f"{m.get('disk_layers', 0)} / {m['layers']}",
                gib(m["peak_rss_time_v"]),
                gib(m["peak_vram"]),
                sec(m["s_per_step"], 2),
                floor(row),
                sec(m["first_step_at_s"], 1),
            ]
        )
    job = r.row("checkpoints_72b_finetune", "bnb4 host 24GiB")
    s = job["metrics"]["summary"]
    return paragraphs(
        table(["loading", "peak RSS", "peak VRAM", "load"], load),
        table(
            [
                "72B, smallest GPU footprint",
                "layers on disk",
                "peak RSS",
                "peak VRAM",
                "s/step",
                "disk floor",
                "first step after",
            ],
            train,
        ),
        f"The NF4 bytes equal transformers' in {same['identical']} of {same['tensors']} tensors "
        f"(`checkpoints_7b_identical`). `narrows finetune --gpu-budget 12GiB --host-budget 24GiB` on the 72B folder "
        f"(`checkpoints_72b_finetune`, {job['date']}): peak RSS {gib(job['metrics']['peak_rss_time_v'])} against "
        f"{gib(s['stream']['predicted_host_bytes'])} predicted, {s['stream']['disk_layers']} layers on disk, "
        f"{s['tokens_per_s']:.1f} tokens/s.",
    )


@generated("shared-host")
def _shared_host(r: Results) -> str:
    def last(case: str, device: str, prefix: str) -> str | None:
        names = [x["name"] for x in r.case(case, device) if x["name"].startswith(prefix)]
        return names[-1] if names else None

    def one(m: dict) -> str:
        rate = f", {m['tokens_per_s']:.0f} tokens/s" if "tokens_per_s" in m else ""
        return f"Pss {gib(m['pss_sum'])}, RSS {gib(m['rss_sum'])}, {sec(m['s_per_step'])}{rate}"

    lines = [
        [
            run_cell(
                r.case(case, device),
                f"{model_name(r.case(case, device)[0]['arguments']['config'])}, {device}",
            ),
            *(
                cell(r, case, last(case, device, p), one, device)
                for p in ("ranks=1 share", "ranks=2 share", "ranks=2 private")
            ),
        ]
        for case, device in (
            ("shared_host_qwen2.5-7b", "h100"),
            ("shared_host_qwen2.5-32b", "h100"),
            ("dp_qwen2.5-32b_512", "h200x2"),
        )
    ]
    return table(["run", "one rank", "two ranks, one shared copy", "two ranks, each its own"], lines)


DATA_PARALLEL = (  # (case, device): the main job under torchrun and the peers at 1, 2, 4 ranks
    ("dp_qwen2.5-7b_8x512", "h200x4"),
    ("dp_qwen2.5-7b_8x2048", "h200x4"),
    ("dp_qwen2.5-72b_8x512", "h200x4"),
    ("dp_qwen2.5-7b_2x512", "h200x4"),
)
DP_MODES = (
    ("job", "narrows finetune"),
    ("stages", "narrows finetune --pipeline-stages (1F1B, micro-batches: the GPUs)"),
    ("fsdp", "FSDP+QLoRA, CPU offload"),
    ("deepspeed", "DeepSpeed ZeRO-3 offload"),
)


def _dp_row(rows: list[dict], mode: str, ranks: int) -> dict | None:
    return next((x for x in rows if x["name"] == f"ranks={ranks} {mode}"), None)


def _dp_cell(rows: list[dict], mode: str, ranks: int, host: bool = True) -> str:
    """Tokens/s of all ranks (per-GPU efficiency against one rank of the same mode) and the
    largest rank's peak; with `host`, the ranks' Pss together and the commit measured."""
    row = _dp_row(rows, mode, ranks)
    if row is None:
        return "–"
    m = row["metrics"]
    if "error" in m:
        return "failed"
    one = _dp_row(rows, mode, 1) or _dp_row(rows, "job", 1)  # stages: against the job on one GPU
    eff = ""
    if one is not None and "error" not in one["metrics"]:
        eff = f" ({m['tokens_per_s'] / (ranks * one['metrics']['tokens_per_s']):.0%})"
    cell = f"{m['tokens_per_s']:.0f} tokens/s{eff}, {gib(m['peak_allocated'])}"
    return cell + (f", Pss {gib(m['pss_sum'])} (`{row['commit'][:7]}`)" if host else "")


@generated("data-parallel")
def _data_parallel(r: Results) -> str:
    """Each mode's rows at 1, 2 and 4 ranks (`_dp_cell`), then the pinned bandwidth."""
    lines = []
    for case, device in DATA_PARALLEL:
        rows = r.case(case, device)
        if not rows:
            continue
        budget = rows[0]["arguments"]["budget"]
        for mode, label in DP_MODES:
            cells = [_dp_cell(rows, mode, n) for n in (1, 2, 4)]
            if any(c != "–" for c in cells):
                lines.append(
                    [run_cell(rows, f"{shape(rows[0]['arguments'])}, {budget} a GPU"), label, *cells]
                )
        bw = rows[0]["run"].get("pinned_bw") or {}
        lines.append(
            [
                run_cell(rows, f"{shape(rows[0]['arguments'])}, {device}"),
                "pinned host→device, per GPU, when all pull at once",
                *(f"{bw[str(n)] / n / 1e9:.1f} GB/s" if str(n) in bw else "–" for n in (1, 2, 4)),
            ]
        )
    return table(["run", "who", "1 GPU", "2 GPUs", "4 GPUs"], lines)


@generated("data-parallel-headline")
def _data_parallel_headline(r: Results) -> str:
    """README's rows: the main job at 1, 2 and 4 GPUs, and the fastest peer the same run
    measured (at any number of GPUs; its own memory, which no budget bounds)."""
    lines = []
    for case, device in DATA_PARALLEL:
        rows = r.case(case, device)
        if _dp_row(rows, "job", 1) is None:
            continue
        ours = (" job", " stages")
        peers = [x for x in rows if not x["name"].endswith(ours) and "error" not in x["metrics"]]
        best = max(peers, key=lambda x: x["metrics"]["tokens_per_s"], default=None)
        fastest = "not run"
        if best is not None:
            m, label = best["metrics"], dict(DP_MODES)[best["name"].split()[-1]]
            fastest = (
                f"{label}, {m['ranks']} GPUs: {m['tokens_per_s']:.0f} tokens/s, {gib(m['peak_allocated'])}"
            )
        args = rows[0]["arguments"]
        lines.append(
            [
                run_cell(rows, f"{shape(args)} a GPU, `{args['budget']}`"),
                *(_dp_cell(rows, "job", n, host=False) for n in (1, 2, 4)),
                fastest,
            ]
        )
    return table(["run", "1 GPU", "2 GPUs (per-GPU efficiency)", "4 GPUs", "fastest peer measured"], lines)


EXPERT_QUANT = ("nf2", "nf3", "nf4", "nf4-bitsandbytes", "mxfp4")


@generated("expert-quant")
def _expert_quant(r: Results) -> str:
    """Per weight set, each scheme's relative Frobenius error and the bits a weight takes."""
    rows = r.case("expert_quant_error", "cpu")
    sets = list(dict.fromkeys(x["metrics"]["set"] for x in rows))

    def at(name: str, scheme: str) -> str:
        m = next(
            (x["metrics"] for x in rows if x["metrics"]["set"] == name and x["metrics"]["scheme"] == scheme),
            None,
        )
        return "–" if m is None else f"{m['rel_frobenius']:.4f} ({m['bits_per_weight']:.2f} bits)"

    what = {x["metrics"]["set"]: x["metrics"]["what"] for x in rows}
    lines = [
        [run_cell(rows, f"{name}: {what[name]}"), *(at(name, sc) for sc in EXPERT_QUANT)] for name in sets
    ]
    return table(["weights", *(f"`{sc}`" for sc in EXPERT_QUANT)], lines)


@generated("expert-quant-loss")
def _expert_quant_loss(r: Results) -> str:
    """Per scheme of the routed experts: the held-out loss of the upcycled SmolLM2 before
    and after the same fine-tune, each against the bf16 run's."""
    rows = r.case("expert_quant_loss", "cpu")
    if not rows:
        return ""
    lines = []
    for x in rows:
        m = x["metrics"]
        if "error" in m:
            lines.append([run_cell([x], f"`{m['scheme']}`"), f"failed: {m['error'][:80]}", "–"])
            continue
        vs = m["scheme"] != "bf16" and "before_vs_bf16" in m
        lines.append(
            [
                run_cell([x], f"`{m['scheme']}`"),
                f"{m['eval_loss_before']:.3f}" + (f" ({m['before_vs_bf16']:+.3f})" if vs else ""),
                f"{m['eval_loss_after']:.3f}" + (f" ({m['after_vs_bf16']:+.3f})" if vs else ""),
            ]
        )
    steps = rows[0]["arguments"].get("steps")
    return table(
        ["routed experts", "held-out loss before (vs bf16)", f"after {steps} steps (vs bf16)"], lines
    )


@generated("expert-dequant")
def _expert_dequant(r: Results) -> str:
    """Per scheme: one layer's routed experts dequantised, its time against the copy floor."""
    rows = r.case("expert_dequant_gpt-oss-120b", "h200")
    lines = [
        [
            run_cell([x], f"`{x['metrics']['scheme']}`"),
            f"{x['metrics']['stored_bytes'] / 1e9:.2f} GB → {x['metrics']['written_bytes'] / 1e9:.2f} GB",
            f"{x['metrics']['ms']:.2f} ms",
            f"{x['metrics']['floor_ms']:.2f} ms",
            f"{x['metrics']['over_floor']:.2f}×",
        ]
        for x in rows
    ]
    return table(["scheme", "stored → bf16", "a layer's stacks", "copy floor", "÷ floor"], lines)


LMHEAD = (
    ("hf", "HF (full logits)"),
    ("liger", "Liger-Kernel"),
    ("cce", "Cut Cross-Entropy"),
    ("masked", "narrows, masked only (full logits at the trained positions)"),
    ("chunked", "narrows, chunked"),
    ("masked+chunked", "narrows, masked + chunked (`lmh.apply`)"),
    ("masked+chunked+cce", "narrows, masked + chunked, tiles by Cut Cross-Entropy"),
    ("topk-1000", "narrows, top-1000 (an approximation)"),
)


@generated("lmhead")
def _lmhead(r: Results) -> str:
    columns = [("bf16", 1.0), ("bf16", 0.05), ("fp32", 1.0), ("fp32", 0.05)]

    def at(method: str, dtype: str, trainable: float) -> str:
        name = f"llama-3.2-3b {dtype} context=16384 trainable={trainable} {method}"
        if not has(r, "lmhead_memory", name):
            return "–"
        m = r.m("lmhead_memory", name)
        if "error" in m:
            return "refuses fp32" if "bf16 or fp16" in str(m["error"]) else "failed"
        return loss_cell(m)

    dates = [
        r.row("lmhead_memory", f"llama-3.2-3b {d} context=16384 trainable={t} hf")["date"] for d, t in columns
    ]
    header = [
        f"{d}, {'all positions' if t == 1.0 else f'{t:.0%} of positions'} train ({day})"
        for (d, t), day in zip(columns, dates)
    ]
    quality = r.case("lmhead_quality")
    return paragraphs(
        table(
            ["loss", *header], [[what, *(at(method, d, t) for d, t in columns)] for method, what in LMHEAD]
        ),
        table(
            [run_cell(quality, "`lmhead_quality.py`, 150 steps × 8"), *(x["name"] for x in quality)],
            [
                [
                    "held-out loss (full softmax)",
                    *(f"{x['metrics']['eval_loss_after']:.4f}" for x in quality),
                ],
                ["against exact", *(f"{x['metrics']['vs_ce']:+.1%}" for x in quality)],
            ],
        ),
    )


DORA = (
    ("dora_model_qwen2.5-7b_none", "7B ×4, bf16 base, fp32 adapters"),
    ("dora_model_qwen2.5-7b_none_autocast", "the same under bf16 autocast"),
    ("dora_model_qwen2.5-7b_none_bf16", "7B ×4, bf16 adapters"),
    ("dora_model_qwen2.5-7b_nf4", "7B ×4, NF4 base (QDoRA)"),
    ("dora_model_qwen2.5-32b_none", "32B ×2, bf16 base, fp32 adapters"),
)


def _dora_eval(r: Results) -> str:
    dora = [
        [run_cell(r.case(c), what), *(cell(r, c, n) for n in ("peft-lora", "peft", "narrows-fused"))]
        for c, what in DORA
    ]
    rows = r.case("eval_streamed_qwen2.5-32b")
    same = rows[0]["run"].get("comparison", {})
    streamed, resident = (r.m(rows[0]["case"], n) for n in ("streamed", "resident"))
    return paragraphs(
        table(["DoRA r384, 4096 tokens", "PEFT LoRA", "PEFT DoRA", "narrows-dora"], dora),
        f"narrows-eval at 32B, {same.get('requests')} requests (`eval_streamed_qwen2.5-32b`, {rows[0]['date']}): "
        f"streamed at `8GiB` {gib(streamed['peak_allocated'])}, {streamed['tokens_per_s']:.0f} tokens/s; resident "
        f"{gib(resident['peak_allocated'])}, {resident['tokens_per_s']:.0f} tokens/s; "
        f"{same.get('requests_equal')} of {same.get('requests')} log-likelihoods equal.",
    )


def scaled(m: dict, text: str) -> str:
    """A figure scaled from another row's measurement (a checkpoint too large for the disk), marked so."""
    return f"≈{text} (scaled from 7B)" if "scaled" in m.get("how", "") else text


@generated("fingerprint")
def _fingerprint(r: Results) -> str:
    lines = [
        [
            f"{model_name(m['model'])} ({row['date']}, `fingerprint_cost`)",
            f"{m['sampled_bytes'] / 1e6:.0f} MB",
            scaled(m, sec(m["sampled_cold_s"], 2)),
            sec(m["sampled_warm_s"], 3),
            scaled(m, sec(m["full_sha256_s"], 0)),
        ]
        for row in r.case("fingerprint_cost", "cpu")
        for m in [row["metrics"]]
    ]
    return table(
        ["base (CPU machine)", "sampled", "sampling, cold page cache", "warm", "sha256 of every byte"], lines
    )


@generated("others")
def _others(r: Results) -> str:
    data = [
        [
            f"`{row['name']}`",
            sec(row["metrics"]["seconds"], 2),
            f"{row['metrics']['peak_rss_bytes'] / 2**20:.0f} MiB",
        ]
        for row in r.case("data_tokens", "cpu")
    ]
    probe = []
    for case, device in (("architecture_probe", "cpu"), ("architecture_probe_cuda_graphs", "h100")):
        rows = r.case(case, device)
        equal = sum(x["metrics"]["lora"]["differing"] == 0 for x in rows)
        probe.append(
            f"{equal} of {len(rows)} on the {device}{' with CUDA graphs' if 'graphs' in case else ''} "
            f"({rows[0]['date']}, `{case}`)"
        )
    return paragraphs(
        _dora_eval(r),
        table([run_cell(r.case("data_tokens", "cpu"), "`data_tokens.py`"), "time", "peak RSS"], data),
        f"Architectures trained streamed `torch.equal` to resident: {'; '.join(probe)}.",
        _fingerprint(r),
    )


MOE_PLAN = (  # (case, the modes' suffix, what the suffix says)
    ("moe_plan_qwen3-30b-a3b-6l_8x512", "", ""),
    ("moe_plan_qwen3-30b-a3b-6l_4x2048", "", ""),
    ("moe_graphs_qwen3-30b-a3b-6l_8x512", "-graphs", ", CUDA graphs"),
    ("moe_fast_qwen3-30b-a3b-6l_8x512", "-fast", ", fast MoE layers"),
    ("moe_fast_qwen3-30b-a3b-6l_8x512", "-fast-graphs", ", fast MoE layers, CUDA graphs"),
)


MOE_LORA = (  # (case, device, what the adapters sit on and how many layers, the main job's budgets)
    (
        "peers_qwen3-30b-a3b-6l_8x512",
        "h200",
        "attention; 6 of 48 layers",
        ("8GiB", "8GiB-eager", "5GiB", "4.6GiB", "4.25GiB", "4GiB"),
    ),
    (
        "peers_qwen3-30b-a3b-6l_8x512_experts",
        "h200",
        "attention and the routed experts; 6 of 48 layers",
        ("8GiB", "5.5GiB", "4.6GiB"),
    ),
    (
        "peers_qwen3-30b-a3b_8x512_experts",
        "h200x2",
        "attention and the routed experts; all 48 layers",
        ("8GiB", "27GiB"),
    ),
)


@generated("moe-lora")
def _moe_lora(r: Results) -> str:
    """The main job at a budget and at its floor beside Unsloth, on one H200 (of an x2 machine
    for the whole model: its host memory), LoRA on attention and on the routed experts too."""
    lines = []
    for c, device, said, budgets in MOE_LORA:
        rows = r.case(c, device)
        unsloth = step_s(r.m(c, "unsloth", device))
        present = {row["name"] for row in rows}  # the budgets this case's run measured
        names = [n for n in [f"finetune-{b}" for b in budgets] + ["finetune-min"] if n in present]
        ours = "; ".join(f"`{n[9:]}`: {cell(r, c, n, device=device)}" for n in names)
        times = "; ".join(
            ratio(step_s(r.m(c, n, device)), unsloth) for n in names if "error" not in r.m(c, n, device)
        )
        lines.append([run_cell(rows, said), ours, cell(r, c, "unsloth", device=device), times])
    return table(["LoRA on", "the main job at `--gpu-budget`", "Unsloth", "narrows' time ÷ Unsloth's"], lines)


@generated("moe-host")
def _moe_host(r: Results) -> str:
    """Where the main job's MoE step goes, host against device (peers.py --host-profile):
    the step, the main thread's CPU time a step (its waits on the device blocking, so they
    cost none), and in one step under torch.profiler the compute stream's busy time against
    its span."""
    c, device = "main_job_qwen3-30b-a3b-6l_8x512", "h200"
    lines = []
    for row in r.case(c, device):
        host = row["metrics"].get("host_profile")
        if not host or "plain" not in host:
            continue
        dev, stream = host["device_profile"], host["device_profile"]["compute_stream"]
        lines.append(
            [
                f"`{row['name']}` ({row['date']}, `{c}`)",
                f"{host['plain']['median_step_s']:.3f} s",
                f"{host['plain']['median_thread_cpu_s']:.3f} s",
                f"{stream['busy_s']:.3f} s of {stream['span_s']:.3f} s (step {dev['step_s']:.3f} s)",
            ]
        )
    return table(
        [
            "the main job, Qwen3-30B-A3B's shape, 6 layers, 8 × 512",
            "step (no profiler)",
            "host CPU a step",
            "compute stream busy, one profiled step",
        ],
        lines,
    )


def matmul_floor_s(model: str, tokens: int, rate: float = 800e12) -> float:
    """A training step's linears at `rate` (bf16, 800 TFLOP/s): each layer's attention
    projections and each token's k routed experts (Qwen3-MoE's config keys) forward, again
    in the recompute but for down, and once more for the input's gradient; the LM head
    three times (its loss recomputes the logits). Attention's own products, the adapters and
    every other kernel are left out: a floor, not an estimate."""
    c = json.loads((HERE / "configs" / f"{model}.json").read_text())
    h, d = c["hidden_size"], c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    attention = 2 * h * d * (c["num_attention_heads"] + c["num_key_value_heads"])
    gate_up = c["num_experts_per_tok"] * 2 * h * c["moe_intermediate_size"]
    down = c["num_experts_per_tok"] * c["moe_intermediate_size"] * h
    forward = 2 * tokens * (attention + gate_up + down)
    layer = forward + (2 * forward - 2 * tokens * down)
    head = 3 * 2 * tokens * h * c["vocab_size"]
    return (c["num_hidden_layers"] * layer + head) / rate


@generated("moe-frontier")
def _moe_frontier(r: Results) -> str:
    """Qwen3-235B-A22B streamed through one H200 at 24 GiB: the step against its floors."""
    lines = []
    for c in ("frontier_qwen3-235b-a22b_8x1024_nf2",):
        for row in r.case(c, "h200x2"):
            m, profile = row["metrics"], row["metrics"]["profile"]
            per = profile["per_streamed_layer"]
            matmuls = matmul_floor_s(row["arguments"]["model"], m["batch"] * row["arguments"]["seq"])
            lines.append(
                [
                    run_cell([row], f"{m['batch']} × {row['arguments']['seq']}, NF2 experts"),
                    f"{gib(m['peak_allocated'])} ({gib(m['predicted_peak'])} planned); host {gib(m['host_rss_peak'])}",
                    f"{sec(step_s(m))}, {m['tokens_per_s']:.0f} tokens/s",
                    f"{m['h2d_bytes_per_step'] / 1e9:.1f} GB: {sec(m['transfer_floor_s'])}",
                    sec(matmuls),
                    f"{sec(profile['forward_s'] + profile['backward_s'])}",
                    f"{per['forward'] * 1e3:.1f} + {per['backward'] * 1e3:.1f} ms / {per['copy'] * 1e3:.1f} ms",
                    ratio(step_s(m), max(m["transfer_floor_s"], matmuls)),
                ]
            )
    return table(
        [
            "tokens",
            "peak (GPU; host RSS)",
            "step",
            "host→device a step: floor",
            "matmul floor",
            "layers' compute",
            "a streamed layer: forward + backward / copies",
            "step ÷ the larger floor",
        ],
        lines,
    )


@generated("moe")
def _moe(r: Results) -> str:
    """Per token count, each budget's peak, the plan's price and the step."""
    budgets = ["min", "4GiB", "6GiB", "8GiB", "10GiB", "12GiB", "14GiB"]

    def at(m: dict) -> str:
        planned = m.get("predicted_peak")
        price = f" ({planned / m['peak_allocated'] - 1:+.1%} planned)" if planned else ""
        return f"{gib(m['peak_allocated'])}{price}, {sec(m['s_per_step'])}"

    lines = []
    for c, suffix, said in MOE_PLAN:
        rows = r.case(c)
        label = f"{rows[0]['metrics']['batch']} × {rows[0]['arguments']['seq']}{said}"
        names = [f"stream-{b}-lmhead{suffix}" for b in budgets] + [f"stream-min{suffix}", "resident-ckpt"]
        lines.append([run_cell(rows, label), *(cell(r, c, n, at) for n in names)])
    return table(
        ["tokens", *(f"`{b}`" for b in budgets), "`min`, full logits", "PEFT + checkpointing"], lines
    )
