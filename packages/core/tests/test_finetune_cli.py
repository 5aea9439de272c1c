"""`narrows finetune` end to end on a tiny model folder: the real CLI in a subprocess (`finetune_cli`).

Determinism (the same command twice gives the same metrics), PEFT-loadable output, the flags
that choose what runs (--eval-every, --kernels, --lora-dtype), and bad input refused before
training with a message that names what is wrong. Exact resume after a kill or Ctrl-C is in
`test_finetune_cli_interrupted.py`.
"""

from __future__ import annotations

import json

import pytest
import torch
from finetune_cli import ROWS, adapter, assert_same_adapter, cli, losses, make_job

from narrows.core.app.cli import main
from narrows.core.optional import is_available
from narrows.core.testing import write_jsonl


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return make_job(tmp_path_factory)


def test_same_command_twice_gives_identical_metrics_and_a_peft_adapter(job):
    root, args = job
    runs = []
    for name in ("a", "b"):
        r = cli(*args, "--steps", "6", "--out", str(root / name))
        assert r.returncode == 0, r.stderr
        runs.append(root / name)
    assert "eval loss before → after" in r.stdout
    assert losses(runs[0]) == losses(runs[1])
    steps = [s for s, loss, _ in losses(runs[0]) if loss is not None]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert_same_adapter(*runs)
    assert not [p.name for p in runs[0].iterdir() if p.name.startswith(".")]  # no temporary left behind
    summary = json.loads((runs[0] / "summary.json").read_text())
    assert summary["eval_loss_after"] < summary["eval_loss_before"]
    # held out at step 0, every quarter of the steps (6 // 4: every step) and at the end; the summary's curve
    # and the table are those rows, and they say what they measure
    evaluated = [(s, e) for s, _, e in losses(runs[0]) if e is not None]
    assert [s for s, _ in evaluated] == [0, 1, 2, 3, 4, 5, 6]
    assert [tuple(p) for p in summary["eval_loss_by_step"]] == evaluated
    assert "eval_loss" in summary["measures"] and "eval loss by step" in r.stdout
    # every setup stage says what it does before it does it (--no-progress: plain lines)
    for stage in (
        "checking its files",
        "loading the tokenizer",
        "reading and tokenising the data",
        "loading the model on cpu",
        "building the lora adapter",
        "held-out loss before training",
        "the first step takes longer",
        "saving the adapter",
    ):
        assert f"narrows: {stage}" in r.stderr or stage in r.stderr, stage

    # --resume of a finished run says so at once, loads nothing, and prints the summary again
    again = cli("--resume", str(runs[0]), "--no-progress")
    assert again.returncode == 0, again.stderr
    assert f"{runs[0]} finished at step 6" in again.stderr and "--steps 12" in again.stderr
    assert "loading the model" not in again.stderr and "eval loss before → after" in again.stdout
    assert losses(runs[0]) == losses(runs[1])  # nothing trained or logged

    # plain PEFT loads the adapter and computes what the run's own eval computed
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(root / "model")
    tuned = PeftModel.from_pretrained(base, runs[0])
    assert all(
        torch.equal(p, adapter(runs[0])[k.replace(".default", "")])
        for k, p in tuned.named_parameters()
        if "lora_" in k
    )


def refused(capsys, *args):
    code = main(["finetune", *args])
    err = capsys.readouterr().err
    assert code == 2, err
    return err


def test_bad_input_is_refused_before_training(job, capsys, tmp_path):
    root, args = job
    base = dict(zip(args[::2], args[1::2]))
    out = ["--out", str(tmp_path / "run")]
    assert "does not exist" in refused(
        capsys, "--model", str(tmp_path / "nope"), "--data", base["--data"], *out
    )
    bad = write_jsonl(tmp_path / "bad.jsonl", [ROWS[0], '{"messages": [}'])
    assert "bad.jsonl:2: not valid JSON" in refused(
        capsys, "--model", base["--model"], "--data", str(bad), *out
    )
    err = refused(
        capsys, "--model", base["--model"], "--data", base["--data"], "--targets", "q_proj,wq", *out
    )
    assert "no linear module named ['wq']" in err and "'q_proj'" in err
    err = refused(capsys, "--model", base["--model"], "--data", base["--data"], "--seq-len", "8", *out)
    assert "no trainable token: truncation to --seq-len 8" in err
    assert "--model needs --data" in refused(capsys, "--model", base["--model"], *out)
    err = refused(capsys, "--model", base["--model"], "--data", "org/dataset", *out)
    assert "--data org/dataset: no such local file or folder. narrows reads local data only" in err
    err = refused(capsys, "--model", base["--model"], "--data", base["--data"], "--data-split", "train", *out)
    assert "--data-split chooses a split of a save_to_disk folder" in err
    err = refused(capsys, "--model", base["--model"], "--data", base["--data"], "--columns", "prompt", *out)
    assert "--columns 'prompt': 'prompt' is not FIELD=COLUMN" in err
    assert "unknown part 'fast'" in refused(
        capsys, "--model", base["--model"], "--data", base["--data"], "--lmhead", "mask,fast", *out
    ) or not is_available("narrows.lmhead")
    assert not (tmp_path / "run").exists()  # nothing was written for a refused run
    assert "no run there" in refused(capsys, "--resume", str(tmp_path / "nothing"))
    done = root / "a"
    if done.exists():
        assert "already holds a run" in refused(
            capsys, "--model", base["--model"], "--data", base["--data"], "--out", str(done)
        )


@pytest.mark.skipif(is_available("narrows.dora"), reason="narrows-dora is installed here")
def test_a_missing_sibling_package_is_named(job, capsys, tmp_path):
    _, args = job
    base = dict(zip(args[::2], args[1::2]))
    err = refused(
        capsys,
        "--model",
        base["--model"],
        "--data",
        base["--data"],
        "--adapter",
        "dora",
        "--out",
        str(tmp_path / "run"),
    )
    assert "narrows-dora" in err and "pip install" in err


def test_eval_every_sets_the_held_out_points(job, tmp_path):
    _, args = job
    out = tmp_path / "run"
    r = cli(*args, "--steps", "5", "--eval-every", "2", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert [s for s, _, e in losses(out) if e is not None] == [0, 2, 4, 5]  # step 0, every 2, the last
    assert (
        "--eval-every must be at least 1"
        in cli(*args, "--eval-every", "0", "--out", str(tmp_path / "x")).stderr
    )


def test_answers_stop_once_the_answer_line_is_complete():
    """Generation ends at the GSM8K answer's "#### N" line, not after max_new_tokens: a stub
    model that continues past it token by token, as `generate` does, asking the stopping
    criteria after each token."""
    from narrows.core.app.finetune.evaluate import answer_scores, generate_answers
    from narrows.core.testing import tiny_tokenizer

    tok = tiny_tokenizer()
    said = "Half of 84 is 42.\n#### 42\nNow a second problem nobody asked for: what is 6 * 7?"
    continuation = tok(said, add_special_tokens=False, return_tensors="pt")["input_ids"]

    class Stub(torch.nn.Module):
        asked = 0

        def generate(self, input_ids, max_new_tokens, stopping_criteria, **kw):
            out = input_ids
            for t in continuation[0, :max_new_tokens]:
                out = torch.cat([out, t.view(1, 1)], dim=1)
                Stub.asked += 1
                if all(c(out, None).all() for c in stopping_criteria):
                    break
            return out

    rows = [{"messages": [{"role": "user", "content": "Half of 84?"}], "answer": "42"}]
    texts = generate_answers(Stub(), tok, rows, torch.device("cpu"), max_new_tokens=500)
    assert texts == ["Half of 84 is 42.\n#### 42\n"]
    assert Stub.asked == len(tok("Half of 84 is 42.\n#### 42\n", add_special_tokens=False)["input_ids"])
    # scored: a number after the last ####, commas dropped, and whether it is the answer
    answers = [{"answer": "1000"}, {"answer": "8"}, {"answer": "3"}, {"answer": "5"}]
    assert answer_scores(["so\n#### 1,000\n", "#### 7", "no answer line", "#### five"], answers) == (2, 1)


def test_cuda_graphs_flag_is_three_way():
    """Not given: None (the planner's choice, recorded as not asked for); --cuda-graphs on,
    --no-cuda-graphs off."""
    import argparse

    from narrows.core.app.finetune.command import add_parser
    from narrows.core.app.finetune.config import FinetuneConfig

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    got = [
        parser.parse_args(["finetune", *flag]).cuda_graphs
        for flag in ([], ["--cuda-graphs"], ["--no-cuda-graphs"])
    ]
    assert got == [None, True, False]
    assert FinetuneConfig().memory.cuda_graphs is None


def test_inputs_that_used_to_end_in_a_traceback_are_refused_naming_the_file(
    job, capsys, tmp_path, monkeypatch
):
    """Not UTF-8 data, an unknown model_type, a file with GGUF's magic that is not GGUF: each
    is exit 2 and one `narrows: error:` naming the file, before the model is loaded."""
    import shutil

    import narrows.core.app.finetune.job as job_module

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(job_module, "load_model", no_load)
    monkeypatch.setenv("NARROWS_CACHE", str(tmp_path / "cache"))
    _, args = job
    base = dict(zip(args[::2], args[1::2]))
    out = ["--out", str(tmp_path / "run")]

    def says(*argv) -> str:
        err = refused(capsys, *argv, *out)
        lines = err.strip().splitlines()  # the run's stage lines, then the one error line
        assert lines[-1].startswith("narrows: error: ") and err.count("narrows: error:") == 1, err
        assert all(line.startswith("narrows: ") for line in lines), err
        assert "Traceback" not in err
        return err

    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(json.dumps({"text": "caf\xe9"}, ensure_ascii=False).encode("latin-1") + b"\n")
    err = says("--model", base["--model"], "--data", str(latin))
    offset = latin.read_bytes().index(b"\xe9")
    assert (
        f"{latin}:1: not UTF-8 (byte 0xe9 at byte offset {offset} " in err
        and "iconv -f latin1 -t utf-8" in err
    )

    model = shutil.copytree(base["--model"], tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "no-such-type"}))
    err = says("--model", str(model), "--data", base["--data"])
    assert f"{model / 'config.json'}: model_type 'no-such-type' is not a model type transformers" in err
    assert "pip install -U transformers" in err and "correct model_type" in err

    if is_available("gguf"):
        import struct

        fake = tmp_path / "fake.gguf"  # GGUF's magic and version, then a key that is not UTF-8
        fake.write_bytes(b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 5) + b"ab\xffcd" + bytes(16))
        err = says("--model", str(fake), "--data", base["--data"])
        assert f"{fake} starts like a GGUF file but its header does not parse" in err and "re-export" in err
    assert not (tmp_path / "run").exists()


def test_kernels_flag_picks_the_layers_and_the_summary_says_which(job, tmp_path):
    """Fast layers by default (the tiny Llama loads with SDPA: all three covered); --kernels
    peft trains PEFT's modules, other bits; each run's summary says which ran."""
    _, args = job
    fast = cli(*args, "--steps", "2", "--out", str(tmp_path / "fast"))
    peft = cli(*args, "--steps", "2", "--kernels", "peft", "--out", str(tmp_path / "peft"))
    assert fast.returncode == 0 and peft.returncode == 0, fast.stderr + peft.stderr
    assert "fast layers: all 3 decoder layers" in fast.stdout
    assert "PEFT's modules (--kernels peft)" in peft.stdout
    a, b = adapter(tmp_path / "fast"), adapter(tmp_path / "peft")
    assert a.keys() == b.keys() and not all(torch.equal(a[k], b[k]) for k in a)


def test_kernels_setting_is_checked_and_older_runs_keep_pefts():
    from narrows.core.app.finetune.config import FinetuneConfig
    from narrows.core.errors import NarrowsError

    with pytest.raises(NarrowsError, match=r"--kernels must be fast .* or peft"):
        FinetuneConfig.of(kernels="triton").checked()
    assert FinetuneConfig().base.kernels == "fast"
    assert (
        FinetuneConfig.from_dict({"steps": 3}, "config.json").base.kernels == "peft"
    )  # written before fast layers
    with pytest.raises(NarrowsError, match=r"--lora-dtype must be auto .* or float32"):
        FinetuneConfig.of(lora_dtype="bf16").checked()
    with pytest.raises(NarrowsError, match=r"--lora-dtype float32 is the fast layers' option"):
        FinetuneConfig.of(kernels="peft", lora_dtype="float32").checked()
    assert FinetuneConfig.from_dict({"steps": 3}, "config.json").base.lora_dtype == "auto"


def test_lora_dtype_float32_reaches_the_fast_layers_and_the_summary(job, tmp_path):
    """--lora-dtype float32: the fast layers compute the adapters in float32 (the summary
    says so); given with --kernels peft it is refused before anything is written."""
    _, args = job
    done = cli(*args, "--steps", "1", "--lora-dtype", "float32", "--out", str(tmp_path / "wide"))
    assert done.returncode == 0, done.stderr
    assert "fast layers: all 3 decoder layers (LoRA in float32)" in done.stdout
    refused = cli(*args, "--kernels", "peft", "--lora-dtype", "float32", "--out", str(tmp_path / "no"))
    assert refused.returncode == 2 and "narrows: error: --lora-dtype float32" in refused.stderr
    assert not (tmp_path / "no").exists()


def test_the_steps_run_with_what_loading_made_out_of_the_collectors_walks(job, tmp_path, monkeypatch):
    """The training loop runs with the loaded objects frozen (`settled_heap`: the cyclic
    collector's full walks skip them) and the heap is handed back after, in-process."""
    import gc

    from narrows.core.app.finetune import job as job_module

    real, seen = job_module.train, []

    def train(*args, **kwargs):
        seen.append(gc.get_freeze_count())
        return real(*args, **kwargs)

    monkeypatch.setattr(job_module, "train", train)
    _, args = job
    assert main(["finetune", *args, "--steps", "1", "--out", str(tmp_path / "run")]) == 0
    assert len(seen) == 1 and seen[0] > 10_000  # the model, the data: frozen while the steps ran
    assert gc.get_freeze_count() == 0
