"""The planner's step-time model beside measured steps (CPU; reads the H100's rows in
benchmarks/results/h100.jsonl): for the default plan of each named peers case, the layer time
the model predicts with the fast layers' figures and with PEFT's, against the measured median
step (which also holds the head, the loss and the optimizer). The model ranks plans; this says
how far its figures are from a step.

    uv run --no-sync python benchmarks/steptime_fit.py --out /tmp/steptime_fit.json
    python benchmarks/results.py add cpu /tmp/steptime_fit.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from narrows.stream.planning import Shapes, step_seconds, steptime

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import results  # noqa: E402  (benchmarks/results.py: the measured rows)

BAND = (0.7, 1.1)  # the share of a measured step tests/test_steptime_fit.py holds the model's figure to
RUNS = [  # peers case in results/h100.jsonl, its default row, the shape it ran
    ("peers_7b_8x512", "stream-8GiB-lmhead-fast-auto", "qwen2.5-7b"),
    ("peers_32b_8x512", "stream-12GiB-lmhead-fast-auto", "qwen2.5-32b"),
    ("peers_72b_8x512", "stream-16GiB-lmhead-fast-auto", "qwen2.5-72b"),
]


def predicted(run: dict, row: dict, config: dict, fast: bool = True) -> float:
    """The model's layer time for the row's plan (its resident and whole layers, graphs or
    not, held weights), each streamed layer's bytes from the row's measured copies."""
    shapes = Shapes(
        layers=row["layers"],
        hidden=config["hidden_size"],
        intermediate=config["intermediate_size"],
        heads=config["num_attention_heads"],
        vocab=config["vocab_size"],
        act_bytes=2,
        batch=run["batch"],
        seq=run["seq"],
        eager_attention=False,
        fast=fast,
    )
    streamed = row["layers"] - row["resident_layers"]
    layer = int(row["h2d_bytes_per_step"] // max(1, 2 * streamed))  # each streamed layer copied twice a step
    return step_seconds(
        [layer] * row["layers"],
        shapes,
        row["resident_layers"],
        row["whole_layers"],
        graphs=row["graphs_planned"],
        held=True,
    )  # held: where the budget has room, the default


def fit(case: str, mode: str, config: str) -> dict:
    measured_row = results.Results(results.load("h100")).row(case, mode)
    run, row = measured_row["arguments"], measured_row["metrics"]  # the run's settings, the row's figures
    assert run["grad_accum"] == 1, "predicted() prices one micro-batch a step"
    cfg = json.loads((HERE / "configs" / f"{config}.json").read_text())
    fast, peft = predicted(run, row, cfg), predicted(run, row, cfg, fast=False)
    measured = row["median_s_per_step"]
    return {
        "case": case,
        "mode": mode,
        "model": config,
        "measured_s": measured,
        "fast_layers_s": fast,
        "peft_layers_s": peft,
        "fast_over_measured": fast / measured,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="JSON of every row")
    args = ap.parse_args()
    rows = [fit(*r) for r in RUNS]
    print("| run | measured step | model, fast layers | model, PEFT's layers |\n|---|---|---|---|")
    for r in rows:
        print(
            f"| `{r['case']}` | {r['measured_s']:.3f} s | {r['fast_layers_s']:.3f} s | {r['peft_layers_s']:.3f} s |"
        )
    constants = {
        "peft_matmul_tflops": steptime.MATMUL_RATE / 1e12,
        "fast_matmul_tflops": steptime.FAST_MATMUL_RATE / 1e12,
        "fast_backward_forwards": steptime.FAST_BACKWARD,
        "band": BAND,
    }
    if args.out:
        Path(args.out).write_text(json.dumps({"constants": constants, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
