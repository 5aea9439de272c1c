"""Every number README.md and benchmarks/README.md quote as a measurement is in the JSON
file it points at.

Checked: every "## " section of benchmarks/README.md after its "## Contents", except the
last, "## Measured, not recorded here" (tables and prose), and the table of README.md's
"## Results". The text is cut into blocks (paragraphs; table rows; markdown link targets
dropped). A block's JSON files are the
`*.json` names in its code spans (globs allowed, resolved under benchmarks/, and each must
exist); a paragraph naming none continues the block before it, and a table row naming none
takes the files of the paragraph above its table (the caption). Each quoted number must
equal, within the README's rounding (half a unit in its last digit), a numeric value of
one of its block's files, read through the quoted unit: GiB and MiB against bytes, GB and
GB/s against bytes or bytes/s, ms against seconds or milliseconds, % against fractions or
percentages. Not checked: code spans (flags, file names, commands), numbers glued to
letters (Qwen2.5-7B, r16, fp32, top-1000) and the settings in NOT_MEASURED. The few
derived numbers are in DERIVED, each recomputed here from the JSON it comes from.
README.md's links into benchmarks/README.md must name one of its sections.
No torch, no narrows import: the checks take well under a second.
"""

from __future__ import annotations

import bisect
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BENCHMARKS = ROOT / "benchmarks"
BENCH_README = BENCHMARKS / "README.md"
# the sections of benchmarks/README.md before its measurements, and the one after them
BENCH_UNCHECKED = ("Running them", "Contents", "Measured, not recorded here")
GIB, MIB = 2**30, 2**20


@cache
def _json(name: str):
    return json.loads(next(BENCHMARKS.rglob(name)).read_text())


def _row(name: str, label: str) -> dict:
    return next(r for r in _json(name)["rows"] if r.get("label") == label)


def _disk_floor(name: str, label: str) -> float:
    """A 72B transfer floor: the disk tier's bytes per step over the same run's O_DIRECT
    probe (`disk_read_bw`), in seconds."""
    return _row(name, label)["disk_bytes_per_step"] / _json(name)["disk_read_bw"]


def _qwen7b_embedding_gb() -> float:
    """bf16 embedding (and untied head) of Qwen2.5-7B: vocab x hidden x 2 bytes, in GB."""
    config = json.loads((BENCHMARKS / "configs" / "qwen2.5-7b.json").read_text())
    return config["vocab_size"] * config["hidden_size"] * 2 / 1e9


def _sustained_floor_72b() -> float:
    """The 72B layers' matmul FLOPs a step (layer_profile_72b.json) at the rate the card
    holds for as long as a step (overlap_72b_drag.json), in seconds."""
    flop = _json("layer_profile_72b.json")["rows"][0]["totals"]["layers_flop"]
    return flop / (_json("overlap_72b_drag.json")["gemm_tflops_sustained"] * 1e12)


# Quoted text (exactly as in README.md) -> its value in the quoted unit, from a JSON.
DERIVED: dict[str, Callable[[], float]] = {
    # step nine: "at the 693 TFLOP/s the card holds, 2.26 s, and this step is 1.29× that"
    "2.26 s": _sustained_floor_72b,
    "1.29×": lambda: _json("prof_72b_8x512_s10.json")["rows"][0]["s_per_step"] / _sustained_floor_72b(),
    # 72B table, transfer floor column: checkpoints_72b_registered.json, warm and cold rows
    "19.4 s": lambda: _disk_floor("checkpoints_72b_registered.json", "bnb4 warm host 24GiB"),
    "19.8 s": lambda: _disk_floor("checkpoints_72b_registered.json", "bnb4 cold host 24GiB"),
    # the earlier run's floors, checkpoints_72b_tiers.json: "23.2 s against a 22.9 s floor"
    # (warm 24 GiB row, disk) and "1.91 s/step against a 1.43 s host→device floor" (every
    # layer pinned: host→device bytes per step over the run's pinned_h2d_bw)
    "22.9 s": lambda: _disk_floor("checkpoints_72b_tiers.json", "bnb4 warm host 24GiB"),
    "1.43 s": lambda: (
        _row("checkpoints_72b_tiers.json", "bnb4 host all seq 512")["h2d_bytes_per_step"]
        / _json("checkpoints_72b_tiers.json")["pinned_h2d_bw"]
    ),
    # "(bf16, 1.09 GB each)": the embedding's size, from benchmarks/configs/qwen2.5-7b.json
    "1.09 GB": _qwen7b_embedding_gb,
    # "a 7B run peaks above 6 GB": the smaller default-host-budget peak of
    # checkpoints_7b_finetune3.json and _finetune6.json (6.75 GB), floored to whole GB
    "6 GB": lambda: math.floor(
        min(_json(f"checkpoints_7b_finetune{n}.json")["rows"][0]["peak_rss_time_v"] for n in (3, 6)) / 1e9
    ),
}

# Counts of a JSON's rows, quoted as a phrase (a regex whose group is the count) -> the count.
COUNTED: dict[str, Callable[[], int]] = {
    # "trained 15 tiny architectures this way": the probe's rows, one per architecture
    r"trained (\d+) tiny architectures": lambda: len(_json("architecture_probe_cuda_graphs.json")["rows"]),
}

# Settings, not measurements, in the text checked here.
NOT_MEASURED = [
    r"planner 24 GiB",  # the planner's budget (benchmarks/stream_qlora.py mode stream-24GiB)
    r"24 GiB (?:run|budget)",  # the same budget, and the 72B host budget
    r"batch 1\b",  # benchmark setting
    r"\bseq \d+",  # sequence lengths are settings
    r"evaluation on 4 rows",  # narrows finetune --eval-rows 4 (benchmarks/checkpoints.py)
    r"(?:B|PEFT), \d+ GiB",  # a budget sweep's budget: "Qwen2.5-7B, 16 GiB |" (mode stream-16GiB)
    r"the \d+ GiB plan",  # the same budget in prose
]

UNITS = r"GiB|MiB|GB/s|GB|tokens/s|ms|s/step|s|%|×|x"
NUMBER = re.compile(
    r"(?<![\w.\-])(?<![A-Za-z]-)"  # not glued to a word (r16, Qwen2.5-7B, top-1000)
    r"([+−-]?)(\d{1,3}(?:,\d{3})+|\d+(?:\.\d+)?)"
    r"(?!\w)(?!\.\d)"  # not 7B, 16K
    rf"(?:\s*({UNITS})(?![\w/]))?"
)
RANGE = re.compile(rf"(\d[\d.,]*)–(\d[\d.,]*)\s*({UNITS})(?![\w/])")
JSON_NAME = re.compile(r"`([^`\s]*\.json)`")

# how a quoted unit reads a JSON value: the scales to try (JSON value = quoted value x scale)
SCALES = {
    "GiB": [GIB],
    "MiB": [MIB],
    "GB": [1e9],
    "GB/s": [1e9],
    "ms": [1e-3, 1.0],  # seconds, or milliseconds (dora_kernels.json)
    "%": [0.01, 1.0],  # fractions (trainable 0.05, vs_ce) or percentages
}


@dataclass(frozen=True)
class Quoted:
    text: str
    value: float
    half_unit: float
    unit: str
    files: frozenset[Path]
    block: str


def _section(text: str, title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"no section '## {title}'"
    return match.group(1)


def _sections(text: str) -> dict[str, str]:
    """Each "## " section's title -> its text (subsections included)."""
    parts = re.split(r"^## (.*)\n", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def checked_text(readme: str, bench: str) -> str:
    """README.md's results table, then benchmarks/README.md's measurement sections."""
    results = _section(readme, "Results")
    measured = {t: body for t, body in _sections(bench).items() if t not in BENCH_UNCHECKED}
    assert set(BENCH_UNCHECKED) <= set(_sections(bench)), "benchmarks/README.md's sections moved"
    assert len(measured) >= 15, "too few measurement sections in benchmarks/README.md"
    return "\n\n".join(
        ["\n".join(line for line in results.splitlines() if line.startswith("|")), *measured.values()]
    )


def resolve(name: str) -> frozenset[Path]:
    pattern = Path(name).name
    found = frozenset(p for p in BENCHMARKS.rglob(pattern) if "configs" not in p.parts)
    assert found, f"README.md names {name}, which is not under benchmarks/"
    return found


def blocks(text: str) -> list[tuple[str, frozenset[Path]]]:
    """(text, JSON files it points at) for every paragraph and every table row."""
    out: list[tuple[str, frozenset[Path]]] = []
    scope: frozenset[Path] = frozenset()  # of the block before
    caption: frozenset[Path] = frozenset()  # of the last paragraph, for a table under it
    for chunk in re.split(r"\n\s*\n", text):
        lines = [line for line in chunk.splitlines() if line.strip()]
        if not lines:
            continue
        if lines[0].startswith("|"):
            rows = [line for line in lines if not re.fullmatch(r"\|[-|\s]+\|", line)]
            table_scope: frozenset[Path] = frozenset()
            for row in rows:
                own = frozenset().union(*(resolve(n) for n in JSON_NAME.findall(row)))
                out.append((row, own or caption))
                table_scope |= own or caption
            scope = table_scope
        else:
            para = "\n".join(lines)
            own = frozenset().union(*(resolve(n) for n in JSON_NAME.findall(para)))
            scope = caption = own or scope
            out.append((para, scope))
    return out


def quoted_numbers(readme: str, bench: str) -> list[Quoted]:
    out = []
    for block, files in blocks(checked_text(readme, bench)):
        text = re.sub(r"\]\([^)]*\)", "]", block)  # link targets: paths and anchors
        text = re.sub(r"`[^`]*`", " ", text)  # code spans: flags, file names, commands
        text = RANGE.sub(r"\1 \3 – \2 \3", text)  # 2.14–2.24 GiB: both ends in GiB
        for pattern in [*NOT_MEASURED, *COUNTED]:
            text = re.sub(pattern, " ", text)
        for m in NUMBER.finditer(text):
            sign, digits, unit = m.group(1), m.group(2), m.group(3) or ""
            plain = digits.replace(",", "")
            decimals = len(plain.split(".")[1]) if "." in plain else 0
            value = -float(plain) if sign in ("-", "−") else float(plain)
            out.append(Quoted(" ".join(m.group(0).split()), value, 0.5 * 10**-decimals, unit, files, block))
    return out


def _numbers(obj) -> list[float]:
    if isinstance(obj, bool):
        return []
    if isinstance(obj, (int, float)):
        return [float(obj)] if math.isfinite(obj) else []
    if isinstance(obj, str):  # benchmarks/checkpoints.py records its arguments as strings
        try:
            return _numbers(float(obj))
        except ValueError:
            return []
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in _numbers(v)]
    if isinstance(obj, list):
        return [x for v in obj for x in _numbers(v)]
    return []


@cache
def values_of(files: frozenset[Path]) -> list[float]:
    return sorted(x for p in files for x in _numbers(json.loads(p.read_text())))


def found(values: list[float], q: Quoted) -> bool:
    for scale in SCALES.get(q.unit, [1.0]):
        lo, hi = sorted(((q.value - q.half_unit) * scale, (q.value + q.half_unit) * scale))
        slack = 1e-9 * max(abs(lo), abs(hi), 1.0)  # a tie (62.25 quoted as 62.2) counts
        i = bisect.bisect_left(values, lo - slack)
        if i < len(values) and values[i] <= hi + slack:
            return True
    return False


def problems(readme: str, bench: str) -> list[str]:
    out = []
    text = " ".join(checked_text(readme, bench).split())
    for pattern, count in COUNTED.items():
        quoted = [int(n) for n in re.findall(pattern, text)]
        if not quoted or any(n != count() for n in quoted):
            out.append(f"{pattern!r} quotes {quoted}, the JSON counts {count()}")
    for q in quoted_numbers(readme, bench):
        if q.text in DERIVED:
            now = DERIVED[q.text]()
            if abs(now - q.value) > q.half_unit * (1 + 1e-9):
                out.append(f"{q.text!r} is derived as {now!r} now")
        elif not q.files:
            out.append(f"{q.text!r} points at no JSON: {q.block[:80]!r}")
        elif not found(values_of(q.files), q):
            names = sorted(p.name for p in q.files)
            out.append(f"{q.text!r} is in none of {names}: {q.block[:80]!r}")
    return out


def _texts() -> tuple[str, str]:
    return README.read_text(), BENCH_README.read_text()


def test_every_measured_number_in_the_readmes_is_in_the_json_it_points_at():
    readme, bench = _texts()
    assert len(quoted_numbers(readme, bench)) > 150, "too few numbers found: did a section move?"
    found_problems = problems(readme, bench)
    assert not found_problems, "numbers without their JSON:\n" + "\n".join(found_problems)


def test_the_results_table_quotes_numbers_with_their_json():
    """README.md's results table is checked: it has rows, and each row names its JSON."""
    rows = [line for line in _section(README.read_text(), "Results").splitlines()
            if line.startswith("|") and not re.fullmatch(r"\|[-|\s]+\|", line)][1:]  # fmt: skip
    assert 5 <= len(rows) <= 12, f"{len(rows)} rows in README.md's results table"
    assert all(JSON_NAME.search(row) for row in rows), "a results row names no JSON"


def _anchor(title: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def test_links_into_benchmarks_readme_name_its_sections():
    readme, bench = _texts()
    anchors = {_anchor(t) for t in re.findall(r"^#{1,6} (.*)$", bench, flags=re.M)}
    links = re.findall(r"\]\(benchmarks/README\.md#([^)]+)\)", readme)
    assert links, "README.md links to no section of benchmarks/README.md"
    assert not set(links) - anchors, f"README.md links to missing sections: {set(links) - anchors}"
    toc = re.findall(r"\]\(#([^)]+)\)", bench)
    assert not set(toc) - anchors, (
        f"benchmarks/README.md's contents name missing sections: {set(toc) - anchors}"
    )


def test_every_derived_number_is_still_quoted():
    quoted = {q.text for q in quoted_numbers(*_texts())}
    assert not set(DERIVED) - quoted, (
        f"DERIVED lists numbers the READMEs no longer quote: {set(DERIVED) - quoted}"
    )


@pytest.mark.parametrize(
    ("readme", "old", "new"),
    [
        ("bench", "10.90 GiB, 0.33 s", "10.97 GiB, 0.33 s"),  # a table cell
        ("bench", "0.7688 with exact CE", "0.7699 with exact CE"),  # prose, no unit
        ("bench", "| 23.48 GiB | 67 ms |", "| 23.48 GiB | 61 ms |"),  # milliseconds
        ("bench", "6.29 GiB | 6.11 GiB", "6.29 GiB | 6.19 GiB"),  # the loading section's table
        ("bench", "9.8 tokens/s", "9.3 tokens/s"),  # the loading section's prose
        ("bench", "19.4 s (disk)", "19.6 s (disk)"),  # a derived number
        ("bench", "`stream_qwen2.5-32b_512.json`", "`stream_qwen2.5-7b_512.json`"),  # the wrong JSON
        ("bench", "1.92 GB/s", "1.82 GB/s"),  # GB/s
        ("bench", "trained 15 tiny", "trained 16 tiny"),  # a count of a JSON's rows
        ("readme", "1.02 GiB, 1.525 s", "1.02 GiB, 1.425 s"),  # the results table
        ("readme", "`floor_shared_qwen2.5-72b_g16.json`", "`floor_shared_qwen2.5-7b_g8.json`"),  # its JSON
    ],
)
def test_a_changed_number_or_source_is_caught(readme, old, new):
    texts = dict(zip(("readme", "bench"), _texts()))
    assert old in texts[readme], f"{readme} no longer contains {old!r}: update this test"
    texts[readme] = texts[readme].replace(old, new, 1)
    assert problems(texts["readme"], texts["bench"])
