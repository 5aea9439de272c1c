"""What is on the device at a run's peak: the CUDA caching allocator's history, replayed.

Put this folder first on PYTHONPATH and name an output; any `narrows finetune` process
started so records every allocation (with its Python stack) from interpreter start and,
at exit, replays the trace to the peak of allocated bytes, writing the live blocks there
grouped by where they were allocated — once for the training steps' peak (evaluation
excluded) and once for the evaluations':

    PYTHONPATH=benchmarks/allochistory:$PYTHONPATH ALLOC_HISTORY_OUT=out.json narrows finetune ...

Blocks allocated without Python frames come from the autograd engine's thread (the
backward). Recording slows the run; measure speed without it.
"""

import atexit
import json
import os
import sys


def _start() -> None:
    try:
        import torch

        torch.cuda.memory._record_memory_history(
            enabled="all",
            context="all",
            stacks="python",
            max_entries=int(os.environ.get("ALLOC_HISTORY_N", "4000000")),
        )
    except Exception as e:
        print(f"allochistory: not recording ({e})", file=sys.stderr)
        return
    atexit.register(_dump)


def _where(event: dict) -> str:
    frames = [f for f in event.get("frames", []) if "/torch/" not in f["filename"]]
    return " < ".join(f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}" for f in frames[:7])


def _is_eval(event: dict) -> bool:
    return any("evaluate.py" in f["filename"] for f in event.get("frames", []))


def _peak(trace: list[dict], counts) -> tuple[int, int, dict]:
    """Replays alloc/free_completed events; the peak among allocations `counts` accepts."""
    live, total, peak, at, at_peak = {}, 0, 0, -1, {}
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            live[e["addr"]] = e
            total += e["size"]
            if total > peak and counts(e):
                peak, at, at_peak = total, i, dict(live)
        elif e["action"] == "free_completed":
            gone = live.pop(e["addr"], None)
            if gone is not None:
                total -= gone["size"]
    return peak, at, at_peak


def _groups(live: dict) -> list[dict]:
    groups: dict[str, dict] = {}
    for e in live.values():
        g = groups.setdefault(_where(e), {"where": _where(e), "bytes": 0, "blocks": []})
        g["bytes"] += e["size"]
        g["blocks"].append(e["size"])
    for g in groups.values():
        g["blocks"].sort(reverse=True)
    return sorted(groups.values(), key=lambda g: -g["bytes"])


def _dump() -> None:
    if "finetune" not in sys.argv:
        return
    import torch

    trace = torch.cuda.memory._snapshot()["device_traces"][0]
    report = {
        "argv": sys.argv[1:],
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "events": len(trace),
    }
    for name, counts in (("training", lambda e: not _is_eval(e)), ("evaluation", _is_eval)):
        peak, at, live = _peak(trace, counts)
        report[name] = {"peak_bytes": peak, "event": at, "live": _groups(live)}
    out = os.environ["ALLOC_HISTORY_OUT"]
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"allochistory: wrote {out}", file=sys.stderr)


if os.environ.get("ALLOC_HISTORY_OUT"):
    _start()
