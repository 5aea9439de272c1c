"""Benchmark results as data, and the README tables generated from them.

Each device has one file, ``benchmarks/results/<device>.jsonl`` (``h100``, ``h200x2``,
``cpu``): one JSON row per measurement, holding its case, its name within the case, the
date, the commit measured, the device, the script and its arguments, the metrics, and the
run's context (its bandwidth probes, versions, notes). A case is one configuration of one
script (a shape, a sequence length, modes compared side by side in one run); the file
keeps the latest measurement of each case, and git keeps the earlier ones.

    python benchmarks/peers.py --shape 7b-8x512 --twin 2 --out /tmp/peers_7b_8x512.json
    python benchmarks/results.py add h100 /tmp/peers_7b_8x512.json   # the script's JSON -> rows
    python benchmarks/results.py add h100 x.json --case long_qwen2.5-7b_4096 --merge
    python benchmarks/results.py tables           # rewrite the generated README tables
    python benchmarks/results.py tables --check   # exit 1 where a table is stale
    python benchmarks/results.py list [DEVICE]    # each case: date, commit, script, rows

``add`` names the case after the file (``--case`` to choose) and replaces that case's rows;
``--merge`` replaces only the rows of the same name (a re-measured row of a case). The
script is the JSON's ``command`` or is known from the case's name (``--script`` to say).
The commit is the JSON's ``commit_measured``, else its ``commit``, else the git commit
that added the file, else HEAD; the date is the JSON's ``date``, else the date the file
was added to git, else today.

The READMEs mark each generated table ``<!-- results:NAME -->`` … ``<!-- /results:NAME -->``;
``tables`` rewrites what lies between from ``readme_tables.TABLES[NAME]``, so no measured number in them
is typed by hand. No torch here: tests/test_readme_numbers.py imports this module.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
REQUIRED = ("device", "case", "name", "date", "commit", "script", "arguments", "metrics")

# ---------------------------------------------------------------------------------------
# A script's JSON -> rows

# case name prefix -> the script that writes it (first match wins)
SCRIPTS = (
    ("peers_qwen3", "peers.py"),  # a mixture of experts beside Unsloth
    ("peers_qwen", "stream_qlora.py"),  # the offloading peers are stream_qlora.py modes
    ("peers_", "peers.py"),
    ("main_job_", "peers.py"),
    ("expert_quant_loss", "expert_quant_loss.py"),
    ("finetune_", "finetune_shapes.py"),
    ("checkpoints_", "checkpoints.py"),
    ("shared_host_", "shared_host.py"),
    ("dp_", "shared_host.py"),
    ("fast_memory", "fast_memory.py"),
    ("fast_layer_time", "fast_memory.py"),
    ("fast_accuracy", "fast_accuracy.py"),
    ("host_launch", "host_launch.py"),
    ("overlap", "overlap.py"),
    ("layer_profile", "layer_profile.py"),
    ("fused_lora", "fused_lora.py"),
    ("lmhead_memory", "lmhead_memory.py"),
    ("lmhead_quality", "lmhead_quality.py"),
    ("packed_mask", "packed_masks.py"),
    ("data_tokens", "data_tokens.py"),
    ("fingerprint_cost", "fingerprint_cost.py"),
    ("steptime_fit", "steptime_fit.py"),
    ("architecture_probe", "architecture_probe.py"),
    ("dora_kernels", "dora_kernels.py"),
    ("dora_model", "dora_model.py"),
    ("eval_streamed", "eval_streamed.py"),
    ("loss_curve", "loss_curve.py"),
    ("", "stream_qlora.py"),  # stream_, sweep_, step_, graphs_, floor_, held_, long_, prof_, ...
)
# top-level keys that are the run's settings (its arguments) where the JSON keeps no `args`
SETTINGS = (
    "shape",
    "model",
    "config",
    "batch",
    "seq",
    "grad_accum",
    "steps",
    "warmup",
    "dropout",
    "traced",
    "graphs",
    "reps",
    "tokens",
    "layers",
    "budget",
    "head",
    "lmhead",
    "host_budget",
    "gpus",
    "blas",
    "CUBLAS_WORKSPACE_CONFIG",
)
# top-level keys that describe the run rather than measure it (a JSON without rows)
CONTEXT = (
    "device",
    "torch",
    "transformers",
    "peft",
    "triton",
    "versions",
    "cpu",
    "commit",
    "commit_measured",
    "date",
    "note",
    "title",
    "kernels_in_use",
    "derived",
)
# the keys a row is named by: per script, else the first of NAME_KEYS the row has
SCRIPT_NAME_KEYS = {
    "lmhead_memory.py": ("model", "dtype", "context", "trainable", "method"),
    "shared_host.py": ("ranks", "mode"),
    "finetune_shapes.py": ("mode", "packing"),
    "fingerprint_cost.py": ("model",),
    "fast_memory.py": ("model", "tokens"),
    "expert_quant_loss.py": ("scheme",),
}
NAME_KEYS = ("label", "mode", "variant", "arch", "call", "case", "method", "model", "name")


def script_for(case: str) -> str:
    return "benchmarks/" + next(script for prefix, script in SCRIPTS if case.startswith(prefix))


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return ""
    return out.stdout.strip()


def _commit_of(text: str) -> str:
    """The full hash of the commit a JSON's commit field starts with ('9cd4df7 (library
    code)'), or '' where it names none git knows."""
    m = re.match(r"\s*([0-9a-f]{7,40})\b", text or "")
    return _git("rev-parse", "--verify", "--quiet", m.group(1) + "^{commit}") if m else ""


def provenance(data: dict, file: Path) -> tuple[str, str]:
    """(commit, date), as the module docstring says (the JSON's own words about its commit
    stay in the row's `run`)."""
    said = data.get("commit_measured") or data.get("commit") or ""
    meta = data.get("meta") if isinstance(data.get("meta"), dict) else {}
    said = said or meta.get("commit", "")
    commit = _commit_of(str(said))
    added = _git("log", "--diff-filter=A", "--format=%H %cs", "-1", "--", str(file.resolve()))
    added_commit, added_date = added.split() if added else ("", "")
    commit = commit or added_commit or _git("rev-parse", "HEAD")
    return commit, data.get("date") or added_date or datetime.date.today().isoformat()


def _name(row: dict, keys: tuple[str, ...]) -> str:
    """'off packing', 'ranks=1 share': words as they are, flags by name, numbers with theirs."""

    def part(k: str, v: object) -> str:
        if isinstance(v, bool):
            return k if v else f"no {k}"
        return f"{k}={v}" if isinstance(v, (int, float)) else str(v)

    present = [k for k in keys if k in row]
    return " ".join(part(k, row[k]) for k in present) if present else "run"


def to_rows(
    data: dict,
    device: str,
    case: str,
    script: str,
    commit: str,
    date: str,
    source: str = "",
    command: str = "",
) -> list[dict]:
    """One row per measurement of a script's JSON: its `rows`, or the whole JSON as one. The
    arguments are the JSON's `args`, `command` and settings; where it keeps none, `command`."""
    top = {k: v for k, v in data.items() if k != "rows"}
    top.update(top.pop("meta", None) or {})
    arguments: dict = {}
    if "args" in top:
        args = top.pop("args")
        arguments.update(args if isinstance(args, dict) else {"args": args})
    if "command" in top:
        arguments["command"] = top.pop("command")
    arguments.update({k: top.pop(k) for k in SETTINGS if k in top})
    arguments = arguments or {"command": command or f"python {script} (its flags not recorded)"}
    run = {("device_name" if k == "device" else k): v for k, v in top.items() if k != "date"}
    if isinstance(data.get("rows"), list):
        metrics = [dict(r) for r in data["rows"]]
    else:
        metrics = [{k: v for k, v in top.items() if k not in CONTEXT}]
        run = {k: v for k, v in run.items() if k in CONTEXT or k == "device_name"}
    keys = SCRIPT_NAME_KEYS.get(Path(script).name) or next(
        ((k,) for k in NAME_KEYS if any(k in m for m in metrics)), ()
    )
    names: list[str] = []
    for m in metrics:
        name = _name(m, keys)
        names.append(
            name if name not in names else f"{name} #{sum(n.split(' #')[0] == name for n in names) + 1}"
        )
    return [
        {
            "device": device,
            "case": case,
            "name": name,
            "date": date,
            "commit": commit,
            "script": script,
            "arguments": arguments,
            "metrics": m,
            "run": run,
            **({"source": source} if source else {}),
        }
        for name, m in zip(names, metrics)
    ]


# ---------------------------------------------------------------------------------------
# The results files


def load(device: str, results: Path = RESULTS) -> list[dict]:
    path = results / f"{device}.jsonl"
    return (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    )


def load_all(results: Path = RESULTS) -> list[dict]:
    return [row for path in sorted(results.glob("*.jsonl")) for row in load(path.stem, results)]


def save(device: str, rows: list[dict], results: Path = RESULTS) -> None:
    """Rows grouped by case, cases in name order, each case's rows in the order measured."""
    order = {case: i for i, case in enumerate(sorted({r["case"] for r in rows}))}
    rows = sorted(rows, key=lambda r: order[r["case"]])  # stable: a case keeps its rows' order
    results.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    (results / f"{device}.jsonl").write_text(text)


def add(
    device: str,
    file: Path,
    case: str | None = None,
    script: str | None = None,
    merge: bool = False,
    command: str = "",
    results: Path = RESULTS,
) -> list[dict]:
    """Turn one JSON into rows of `device`'s file: the case's rows replaced (`merge`: the
    rows of the same names only). Returns the new rows."""
    data = json.loads(Path(file).read_text())
    if not isinstance(data, dict):
        raise SystemExit(f"{file}: a benchmark's JSON is an object")
    case = case or Path(file).stem
    named = re.search(r"benchmarks/(\w+\.py)", str(data.get("command", "")))
    script = script or (f"benchmarks/{named.group(1)}" if named else script_for(case))
    script = script if script.startswith("benchmarks/") else f"benchmarks/{script}"
    commit, date = provenance(data, Path(file))
    try:
        source = str(Path(file).resolve().relative_to(ROOT))
    except ValueError:
        source = Path(file).name
    new = to_rows(data, device, case, script, commit, date, source, command)
    names = {r["name"] for r in new}
    kept = [r for r in load(device, results) if r["case"] != case or (merge and r["name"] not in names)]
    save(device, kept + new, results)
    return new


# ---------------------------------------------------------------------------------------
# Reading rows for the tables


class Results:
    """Every device's rows, looked up by device, case and name."""

    def __init__(self, rows: Iterable[dict]):
        self.rows = list(rows)
        self.cases: dict[tuple[str, str], list[dict]] = {}
        for r in self.rows:
            self.cases.setdefault((r["device"], r["case"]), []).append(r)

    def case(self, case: str, device: str = "h100") -> list[dict]:
        try:
            return self.cases[(device, case)]
        except KeyError:
            raise KeyError(f"no case {case!r} in results/{device}.jsonl") from None

    def row(self, case: str, name: str, device: str = "h100") -> dict:
        for r in self.case(case, device):
            if r["name"] == name:
                return r
        raise KeyError(f"no row {name!r} in case {case!r} of results/{device}.jsonl")

    def m(self, case: str, name: str, device: str = "h100") -> dict:
        """The metrics of one row."""
        return self.row(case, name, device)["metrics"]


def when(rows: Iterable[dict]) -> str:
    """'2026-11-26 bf7a2b7': the dates and commits of the rows."""
    seen = sorted({(r["date"], r["commit"][:7]) for r in rows})
    return "; ".join(f"{d} {c}" for d, c in seen)


# ---------------------------------------------------------------------------------------
# The command line


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="verb", required=True)
    a = sub.add_parser("add", help="turn benchmark JSON files into rows of a device's results file")
    a.add_argument("device", help="h100, h200x2, cpu, ...: the results file's name")
    a.add_argument("files", nargs="+", type=Path)
    a.add_argument("--case", help="the case (default: each file's name without .json)")
    a.add_argument("--script", help="the script that wrote it (default: from the JSON or the case's name)")
    a.add_argument("--merge", action="store_true", help="replace only the case's rows of the same names")
    a.add_argument("--command", default="", help="the command that ran, where the JSON records no arguments")
    t = sub.add_parser("tables", help="rewrite the generated tables of README.md and benchmarks/README.md")
    t.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table is stale")
    li = sub.add_parser("list", help="each case: date, commit, script, rows")
    li.add_argument("device", nargs="?")
    args = ap.parse_args(argv)

    if args.verb == "add":
        if args.case and len(args.files) > 1 and not args.merge:
            raise SystemExit("--case with several files: give --merge, or one file")
        for file in args.files:
            rows = add(args.device, file, args.case, args.script, args.merge, args.command)
            print(
                f"{args.device}: {rows[0]['case']}: {len(rows)} rows ({rows[0]['date']}, {rows[0]['commit'][:7]})"
            )
        return 0
    if args.verb == "tables":
        from readme_tables import READMES, render

        results, stale = Results(load_all()), []
        for readme in READMES:
            text = readme.read_text()
            new = render(text, results)
            if new != text:
                stale.append(readme.relative_to(ROOT))
                if not args.check:
                    readme.write_text(new)
        verb = "stale" if args.check else "rewritten"
        print(f"{verb}: {', '.join(map(str, stale))}" if stale else "tables up to date")
        return 1 if args.check and stale else 0
    rows = Results(load_all()).rows
    for (device, case), group in sorted(Results(rows).cases.items()):
        if args.device in (None, device):
            print(f"{device:7} {case:40} {when(group):28} {group[0]['script']:32} {len(group)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
