"""The READMEs quote no measured number by hand: every table of measurements in README.md and
benchmarks/README.md lies between `<!-- results:NAME -->` markers and is exactly what
`python benchmarks/results.py tables` generates from the results files
(`benchmarks/results/<device>.jsonl`), and every row of those files says where it came from
(date, commit, device, script, arguments). No torch, no narrows import: it takes well under
a second.
"""

from __future__ import annotations

import copy
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import readme_tables  # noqa: E402  (benchmarks/readme_tables.py)
import results  # noqa: E402  (benchmarks/results.py)

READMES = {"README.md": ROOT / "README.md", "benchmarks/README.md": BENCHMARKS / "README.md"}
# a measurement written in prose: a number with the unit of a time, a size, a rate or a ratio
MEASURED = re.compile(r"\d[\d.,]*\s?(?:GiB|MiB|GB/s|ms|µs|s/step|tokens/s|TFLOP/s|×)(?![\w/])|\d\.\d+ s\b")


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return results.load_all()


@pytest.fixture(scope="module")
def measured(rows) -> results.Results:
    return results.Results(rows)


def outside_tables(text: str) -> str:
    """The README's own words: without generated blocks, code blocks and code spans."""
    text = readme_tables.MARKED.sub("", text)
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`]*`", "", text)


@pytest.mark.parametrize("name", READMES)
def test_the_tables_are_what_the_results_files_give(name, measured):
    text = READMES[name].read_text()
    assert readme_tables.marked(text), f"{name} has no generated table"
    for table in readme_tables.marked(text):
        assert table in readme_tables.TABLES, f"{name}: no generator for <!-- results:{table} -->"
    stale = [
        m.group(2)
        for m in readme_tables.MARKED.finditer(text)
        if m.group(3) != readme_tables.TABLES[m.group(2)](measured).rstrip("\n") + "\n"
    ]
    assert not stale, f"{name}: stale tables {stale}; run python benchmarks/results.py tables"


@pytest.mark.parametrize("name", READMES)
def test_no_measured_number_is_typed_by_hand(name):
    prose = outside_tables(READMES[name].read_text())
    assert not MEASURED.findall(prose), f"{name} quotes measurements outside its generated tables"


def test_every_row_says_where_it_came_from(rows):
    files = sorted(p.stem for p in results.RESULTS.glob("*.jsonl"))
    assert {"h100", "h200x2", "cpu"} <= set(files)
    names = set()
    for row in rows:
        where = f"{row.get('device')}:{row.get('case')}:{row.get('name')}"
        missing = [k for k in results.REQUIRED if row.get(k) in (None, "", {})]
        assert not missing, f"{where} lacks {missing}"
        assert re.fullmatch(r"[0-9a-f]{40}", row["commit"]), where
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", row["date"]), where
        assert (ROOT / row["script"]).is_file(), f"{where}: no {row['script']}"
        assert (row["device"], row["case"], row["name"]) not in names, f"{where} twice"
        names.add((row["device"], row["case"], row["name"]))
    for device in files:  # a row lives in its device's file
        assert {r["device"] for r in results.load(device)} == {device}


def test_the_results_are_the_only_measurements_kept():
    """Benchmark JSON is turned into rows (`results.py add`), not kept beside them."""
    beside = [p for p in BENCHMARKS.rglob("*.json") if p.parent.name not in ("configs", "results")]
    assert not beside, beside


def test_a_changed_measurement_changes_its_table(rows):
    """The check is live: alter the metric a table quotes and its block no longer matches."""
    changed = copy.deepcopy(rows)
    row = next(r for r in changed if r["case"] == "peers_7b_8x512" and r["name"] == "unsloth")
    row["metrics"]["median_s_per_step"] *= 1.5
    text = READMES["README.md"].read_text()
    assert readme_tables.render(text, results.Results(changed)) != text


def test_links_into_benchmarks_readme_name_its_sections():
    bench = READMES["benchmarks/README.md"].read_text()
    headings = re.findall(r"^#+ (.+)$", bench, re.M)
    anchors = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}
    links = re.findall(r"\(benchmarks/README\.md#([^)]+)\)", READMES["README.md"].read_text())
    assert links and set(links) <= anchors, set(links) - anchors


def test_add_turns_a_scripts_json_into_rows(tmp_path):
    """`add` keeps the JSON's commit and arguments, names rows by mode, and replaces the case."""
    run = {
        "model": "qwen2.5-7b",
        "seq": 512,
        "commit_measured": "0" * 40,
        "rows": [{"mode": "resident", "s_per_step": 1.0}, {"mode": "stream-8GiB", "s_per_step": 2.0}],
    }
    (tmp_path / "sweep_x.json").write_text(json.dumps(run))
    results.add("h100", tmp_path / "sweep_x.json", results=tmp_path / "out")
    run["rows"] = run["rows"][:1]
    (tmp_path / "sweep_x.json").write_text(json.dumps(run))
    new = results.add("h100", tmp_path / "sweep_x.json", results=tmp_path / "out")
    kept = results.load("h100", tmp_path / "out")
    assert [r["name"] for r in kept] == ["resident"] and kept == new
    assert kept[0]["script"] == "benchmarks/stream_qlora.py"
    assert kept[0]["arguments"] == {"model": "qwen2.5-7b", "seq": 512}
