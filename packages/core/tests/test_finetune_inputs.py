"""What a run trains on, by content: ``--resume`` finds the files the run started with
wherever it is started from, refuses changed ones (naming what changed), takes a moved one
named anew when its content matches, and ``--override`` records a change. The tokenised
data cache is keyed by content: times set back over changed bytes do not fool it.

The real CLI in subprocesses, as in test_finetune_run_folder.py (refusals come before the
model loads, so they are fast).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from narrows.core.app.data import open_source, tokenize
from narrows.core.io.fingerprint import data_fingerprint, differences, model_fingerprint
from narrows.core.testing import child_env, tiny_model_folder, tiny_tokenizer, write_jsonl

ROWS = [
    {"messages": [{"role": "user", "content": f"{a}+{b}?"}, {"role": "assistant", "content": f"{a + b}"}]}
    for a in range(6)
    for b in range(4)
]
OTHER = [{"text": f"something else entirely, number {i}"} for i in range(20)]


def cli(*args, cwd: Path):
    cmd = [sys.executable, "-m", "narrows.core.app.cli", "finetune", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, env=child_env(), timeout=600, cwd=cwd)


def ok(r) -> str:
    assert r.returncode == 0, (r.stdout, r.stderr)
    return r.stderr


def refused(r) -> str:
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and "narrows: error: " in r.stderr, r.stderr
    return r.stderr


def config(run: Path) -> dict:
    return json.loads((run / "config.json").read_text())


def adapter(run: Path) -> dict:
    return load_file(run / "adapter_model.safetensors")


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    """A 2-step run started with relative --model and --data from its own directory."""
    root = tmp_path_factory.mktemp("inputs")
    tiny_model_folder(root / "model")
    write_jsonl(root / "train.jsonl", ROWS[:20])
    args = [
        "--rank",
        "4",
        "--batch",
        "2",
        "--seq-len",
        "64",
        "--no-progress",
        "--lmhead",
        "off",
        "--save-every",
        "2",
    ]
    ok(cli("--model", "model", "--data", "train.jsonl", *args, "--steps", "2", "--out", "run", cwd=root))
    return SimpleNamespace(root=root, run=root / "run")


def copy_run(src: Path, dst: Path, **inputs: Path) -> Path:
    """A copy of a run whose recorded inputs point at `inputs` (copies made by the test)."""
    shutil.copytree(src, dst)
    saved = config(dst)
    for name, path in inputs.items():
        saved["config"][name] = str(path)
        saved["inputs"][name]["path"] = str(path)
    (dst / "config.json").write_text(json.dumps(saved))
    return dst


def test_the_run_records_absolute_paths_and_content(started):
    saved = config(started.run)
    assert saved["config"]["model"] == str(started.root / "model")
    assert saved["config"]["data"] == str(started.root / "train.jsonl")
    assert saved["inputs"]["data"]["fingerprint"] == data_fingerprint(started.root / "train.jsonl")
    assert saved["inputs"]["model"]["fingerprint"] == model_fingerprint(started.root / "model")
    assert "model.safetensors" in saved["inputs"]["model"]["fingerprint"]["files"]
    assert "config.json" in saved["inputs"]["model"]["fingerprint"]["files"]


def test_resume_from_another_directory_trains_on_the_recorded_files(started, tmp_path):
    """Another directory with its own train.jsonl and model/ of the same shape: the resumed
    steps still train on the run's own files (the same adapter as resuming from home)."""
    elsewhere = tmp_path / "elsewhere"
    tiny_model_folder(elsewhere / "model", initializer_range=0.5)  # the same shapes, other weights
    write_jsonl(elsewhere / "train.jsonl", OTHER)
    home = shutil.copytree(started.run, tmp_path / "home")
    away = shutil.copytree(started.run, tmp_path / "away")
    ok(cli("--resume", home, "--steps", "4", cwd=started.root))
    err = ok(cli("--resume", away, "--steps", "4", cwd=elsewhere))
    assert "format text" not in err
    a, b = adapter(home), adapter(away)
    assert a.keys() == b.keys() and a
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_changed_data_is_refused_naming_the_change_and_override_records_it(started, tmp_path):
    data = shutil.copy(started.root / "train.jsonl", tmp_path / "train.jsonl")
    run = copy_run(started.run, tmp_path / "run", data=Path(data))
    before = os.stat(data)
    text = Path(data).read_text()
    Path(data).write_text(text.replace("0+1?", "0+9?", 1))  # same size, other content
    os.utime(data, ns=(before.st_atime_ns, before.st_mtime_ns))  # and the old time, as cp -p would leave
    kept = (run / "config.json").read_bytes()
    err = refused(cli("--resume", run, "--steps", "4", cwd=tmp_path))
    assert "training data changed since the run started" in err and str(data) in err
    assert "other content (same size" in err and "--override" in err
    assert (run / "config.json").read_bytes() == kept

    err = ok(cli("--resume", run, "--steps", "4", "--override", cwd=tmp_path))
    assert "continuing on it (--override" in err
    last = config(run)["history"][-1]
    assert last["override"] is True and "data" in last["inputs_changed"]
    assert config(run)["inputs"]["data"]["fingerprint"] == data_fingerprint(data)


def test_a_moved_input_is_named_anew_and_taken_when_its_content_matches(started, tmp_path):
    model = shutil.copytree(started.root / "model", tmp_path / "model")
    data = Path(shutil.copy(started.root / "train.jsonl", tmp_path / "train.jsonl"))
    run = copy_run(started.run, tmp_path / "run", model=model, data=data)
    moved_model = model.rename(tmp_path / "model-moved")
    moved_data = data.rename(tmp_path / "moved.jsonl")
    err = refused(cli("--resume", run, "--steps", "4", cwd=tmp_path))
    assert f"{model}, is not there any more" in err and "--model NEW_PATH" in err

    other = write_jsonl(tmp_path / "other.jsonl", OTHER)
    err = refused(cli("--resume", run, "--steps", "4", "--model", moved_model, "--data", other, cwd=tmp_path))
    assert "training data changed since the run started" in err and "changed size" in err

    (moved_model / "config.json").write_text(
        (moved_model / "config.json").read_text().replace("}", ' , "x": 1}', 1)
    )
    err = refused(
        cli("--resume", run, "--steps", "4", "--model", moved_model, "--data", moved_data, cwd=tmp_path)
    )
    assert "model changed since the run started" in err and "config.json" in err
    shutil.rmtree(moved_model)
    shutil.copytree(started.root / "model", moved_model)

    err = ok(
        cli("--resume", run, "--steps", "4", "--model", "model-moved", "--data", "moved.jsonl", cwd=tmp_path)
    )
    assert f"--data now {moved_data}: the same content as {data}" in err
    saved = config(run)
    assert saved["config"]["data"] == str(moved_data) and saved["config"]["model"] == str(moved_model)
    assert saved["history"][-1]["moved"] == {
        "model": [str(model), str(moved_model)],
        "data": [str(data), str(moved_data)],
    }
    assert "override" not in saved["history"][-1]


def test_differences_name_each_kind_of_change(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", ROWS[:3])
    fp = data_fingerprint(a)
    assert differences(fp, data_fingerprint(a)) == []
    b = shutil.copy(a, tmp_path / "b.jsonl")
    assert differences(fp, data_fingerprint(b)) == []  # a renamed copy is the same content
    Path(b).write_text(Path(b).read_text() + "\n")
    assert differences(fp, data_fingerprint(b)) == [
        f"the file changed size ({a.stat().st_size} → {a.stat().st_size + 1} bytes)"
    ]
    folder = tiny_model_folder(tmp_path / "m")
    before = model_fingerprint(folder)
    (folder / "extra.txt").write_text("x")
    assert differences(before, model_fingerprint(folder)) == ["extra.txt is new"]


def test_the_token_cache_misses_when_content_changes_under_the_old_times(tmp_path):
    """Content changed with the size kept and the old times restored (cp -p, rsync -t,
    touch -r): the cache must tokenise again, not serve the old tokens."""
    tok = tiny_tokenizer()
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "aaaa bbbb"}, {"text": "cccc dddd"}])
    first, how = tokenize(open_source(str(path)), tok, 64)
    assert how.startswith("tokenised")
    again, how = tokenize(open_source(str(path)), tok, 64)
    assert how.startswith("cached") and torch.equal(again.ids, first.ids)
    st = os.stat(path)
    path.write_text(path.read_text().replace("aaaa", "zzzz"))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size and os.stat(path).st_mtime_ns == st.st_mtime_ns
    changed, how = tokenize(open_source(str(path)), tok, 64)
    assert how.startswith("tokenised"), how
    assert not torch.equal(changed.ids, first.ids)
    assert changed.ids.tolist() == tokenize(open_source(str(path)), tok, 64, cache=False)[0].ids.tolist()


def test_tokenising_a_large_corpus_says_how_far_it_got(capsys):
    from narrows.core.app.data.store import _ticking

    rows = [(f"r{i}", {"text": "x"}) for i in range(3)]
    assert list(_ticking(iter(rows), "d.jsonl", every=0.0)) == rows
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" rows")[0] for line in lines] == [
        f"narrows: tokenising d.jsonl: {n}" for n in (1, 2, 3)
    ]
    assert list(_ticking(iter(rows), "d.jsonl")) == rows and capsys.readouterr().err == ""


def rewrite_weights(folder: Path, change) -> None:
    """The folder's model.safetensors written again in place with `change(name, tensor)` applied
    to every tensor: the same names, dtypes, shapes and metadata, so the same header bytes."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    file = folder / "model.safetensors"
    with safe_open(str(file), "pt") as f:
        meta = f.metadata()
    weights = load_file(file)
    save_file({k: change(k, v.clone()) for k, v in weights.items()}, str(file), metadata=meta)


def test_weights_rewritten_under_the_same_header_are_caught_by_their_sampled_content(tmp_path):
    """A fine-tuned copy saved over the original (every weight other, the header the same),
    one byte in a sampled block of a large tensor, and one in a small tensor kept whole are
    each caught; a byte between the samples of a large tensor is not (the sampling's limit,
    as the fingerprint's docstring and the README say)."""
    from narrows.core.io.fingerprint import SAMPLE_BYTES, SAMPLES

    folder = tiny_model_folder(tmp_path / "m", vocab_size=2048)  # a 512 KiB embedding among small tensors
    before = model_fingerprint(folder)
    sizes = {k: v.numel() * v.element_size() for k, v in load_file(folder / "model.safetensors").items()}
    large = max(sizes, key=sizes.get)
    small = min(sizes, key=sizes.get)
    assert sizes[large] > 4 * SAMPLES * SAMPLE_BYTES and sizes[small] <= SAMPLES * SAMPLE_BYTES

    def nudged(target: str, byte: int):
        def change(name, tensor):
            if name == target:
                raw = tensor.view(-1).view(torch.uint8)
                raw[byte] ^= 1
            return tensor

        return change

    gap = SAMPLE_BYTES + (sizes[large] - SAMPLE_BYTES) // (SAMPLES - 1) // 2  # between the 1st and 2nd block
    cases = {
        "fine-tuned": (lambda name, t: t + 0.01 if t.is_floating_point() else t, True),
        "last byte of the largest tensor": (nudged(large, sizes[large] - 1), True),
        "a byte of the smallest tensor": (nudged(small, sizes[small] // 2), True),
        "a byte between samples": (nudged(large, gap), False),
    }
    for name, (change, caught) in cases.items():
        copy = shutil.copytree(folder, tmp_path / name.replace(" ", "-"))
        rewrite_weights(copy, change)
        after = model_fingerprint(copy)
        file_before, file_after = before["files"]["model.safetensors"], after["files"]["model.safetensors"]
        assert file_before["header_sha256"] == file_after["header_sha256"], name  # the same header
        said = differences(before, after)
        if caught:
            assert said == [
                "model.safetensors has other weights under the same header (sampled: "
                f"{after['weights_sampled']})"
            ], name
        else:
            assert said == [], name
    # a record made before narrows sampled weights compares by size and header only
    old = json.loads(json.dumps(before))
    del old["files"]["model.safetensors"]["weights_sample_sha256"]
    assert differences(old, model_fingerprint(folder)) == []


def test_resume_refuses_a_base_whose_weights_were_rewritten_under_the_same_header(started, tmp_path):
    model = shutil.copytree(started.root / "model", tmp_path / "model")
    run = copy_run(started.run, tmp_path / "run", model=model)
    rewrite_weights(model, lambda name, t: t * 1.5 if t.is_floating_point() else t)
    err = refused(cli("--resume", run, "--steps", "4", cwd=tmp_path))
    assert "the model changed since the run started" in err
    assert "model.safetensors has other weights under the same header" in err
