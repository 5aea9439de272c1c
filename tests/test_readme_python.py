"""Every ```python block of README.md runs as written on a CPU, against tiny stand-ins.

The blocks name a few placeholders (PLACEHOLDERS: a model folder, a JSONL file); the test
maps each to a tiny one made here. Any other string that looks like a path must be an
output folder the block writes under its working folder (OUTPUTS), and `...` is refused:
a block that cannot run as written fails. BLOCKS lists every block in README order by its
first line, with the block it continues (run first, in the same namespace, and so on up
the chain); a block that appears, goes or moves fails until BLOCKS says how to run it.

All blocks run in one child process, so the imports are paid once; each in a fresh
namespace, seeded, in its own working folder, with ``$NARROWS_CACHE`` and the datasets
cache in the test's folder. The data-parallel and pipeline blocks run as one torchrun rank
would (gloo, world size 1: one stage holding every layer). TRL's `SFTTrainer` on the streamed model is also run on the
resident one (the same block without its `ns.stream` line): `torch.equal` adapters.
"""

from __future__ import annotations

import ast
import json
import re
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

from narrows.core.testing import child_env, tiny_model_folder, write_jsonl

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

# placeholder as the README writes it -> what the test puts there (filled in by `_workspace`)
PLACEHOLDERS = ("path/to/model", "train.jsonl", "/models/Qwen2.5-72B-Instruct")
OUTPUTS = ("runs/trainer", "runs/sft", "runs/pipeline")  # written under each block's working folder


@dataclass(frozen=True)
class Block:
    name: str
    starts: str  # how the block starts in README.md, as written
    continues: str | None = None  # the block run before it, in the same namespace
    dist: bool = False  # run as torchrun's single rank


BLOCKS = (
    Block("core", "import torch\nfrom transformers import"),
    Block("setup", "import torch\nfrom peft import"),
    Block("stream", 'print(ns.plan(model, "12GiB", seq_len=512))', "setup"),
    Block("step-trainer", "trainer = ns.StepTrainer(", "stream"),
    Block("step-mode-trainer", "from datasets import load_dataset\nfrom transformers import", "setup"),
    Block("trl", "from datasets import load_dataset\nfrom trl import", "setup"),
    Block("profiling", "with model.narrows_stream.profiling() as prof:", "stream"),
    Block("graphs", 'model = ns.stream(model, "12GiB")', "setup"),
    Block("long-sequences", 'model = ns.stream(model, gpu_budget="12GiB", seq_len=32768', "setup"),
    Block("data-parallel", "# torchrun --nproc-per-node 2 train.py (train.py", "setup", dist=True),
    Block("pipeline", "# torchrun --nproc-per-node 2 train.py: rank r", "setup", dist=True),
    Block("from-pretrained", "from peft import LoraConfig, get_peft_model"),
    Block("lmhead", "import narrows.lmhead as lmh", "setup"),
    Block(
        "dora",
        "from peft import LoraConfig, get_peft_model\nfrom transformers import AutoModelForCausalLM\nimport narrows.dora",
    ),
)
# The TRL block's stream line, and what its twins put there: the resident model with the
# stream's default kernels (the fast layers, as README says), and every layer streamed and
# recomputed (at the block's budget the tiny model's layers all stay whole).
STREAM_LINE = 'ns.stream(model, gpu_budget="4GiB")\n'
TRL_TWINS = {
    "trl-resident": "import narrows.core\nnarrows.core.fuse_layers(model)\n",
    "trl-streamed": "ns.stream(model, gpu_budget=None)\n",
}


def readme_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def _paths_in(code: str) -> set[str]:
    """String constants that look like a path or a file name, and any `...`."""
    found = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Constant) and node.value is Ellipsis:
            found.add("...")
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and ("/" in node.value or re.search(r"\.(jsonl?|parquet|gguf|safetensors|pt)$", node.value))
        ):
            found.add(node.value)
    return found


def _substitute(code: str, mapping: dict[str, str]) -> str:
    for placeholder, real in mapping.items():
        code = code.replace(repr(placeholder).replace("'", '"'), repr(real))
    return code


RUNNER = r"""
import json, os, sys, traceback
import torch
import torch.distributed as dist

spec = json.loads(open(sys.argv[1]).read())
results = {}
for job in spec["jobs"]:
    os.makedirs(job["cwd"], exist_ok=True)
    os.chdir(job["cwd"])
    os.environ.update(job["env"])
    torch.manual_seed(0)
    ns = {"__name__": "__main__"}
    try:
        for code in job["chain"]:
            exec(compile(code, job["name"], "exec"), ns)
        if job["save"]:
            model = ns["model"]
            handle = getattr(model, "narrows_stream", None)
            saved = {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad}
            torch.save({"params": saved, "streamed": handle and list(handle.plan.streamed)}, job["save"])
        results[job["name"]] = "ok"
    except BaseException:
        results[job["name"]] = traceback.format_exc()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for key in job["env"]:
            os.environ.pop(key, None)
json.dump(results, open(spec["results"], "w"))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """Every block run once in one child; what each left: "ok" or its traceback."""
    tmp = tmp_path_factory.mktemp("readme")
    model = tiny_model_folder(tmp / "model")
    rows = [{"text": f"Row {i}: the tiny model reads {i} words of plain text."} for i in range(16)]
    mapping = {
        "path/to/model": str(model),
        "train.jsonl": str(write_jsonl(tmp / "train.jsonl", rows)),
        "/models/Qwen2.5-72B-Instruct": str(model),
    }
    assert set(mapping) == set(PLACEHOLDERS)
    codes = dict(zip([b.name for b in BLOCKS], readme_blocks()))

    def chain(name: str) -> list[str]:
        block = next(b for b in BLOCKS if b.name == name)
        return (chain(block.continues) if block.continues else []) + [_substitute(codes[name], mapping)]

    jobs = []
    for b in BLOCKS:
        env = {}
        if b.dist:
            env = dict(
                RANK="0",
                LOCAL_RANK="0",
                WORLD_SIZE="1",
                LOCAL_WORLD_SIZE="1",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(_free_port()),
            )
        save = str(tmp / f"{b.name}.pt") if b.name == "trl" else None
        jobs.append(dict(name=b.name, chain=chain(b.name), cwd=str(tmp / "cwd" / b.name), env=env, save=save))
    for name, line in TRL_TWINS.items():
        twin = chain("trl")
        assert twin[-1].count(STREAM_LINE) == 1
        twin[-1] = twin[-1].replace(STREAM_LINE, line)
        jobs.append(
            dict(name=name, chain=twin, cwd=str(tmp / "cwd" / name), env={}, save=str(tmp / f"{name}.pt"))
        )
    spec = tmp / "spec.json"
    spec.write_text(json.dumps({"jobs": jobs, "results": str(tmp / "results.json")}))
    runner = tmp / "runner.py"
    runner.write_text(RUNNER)
    env = child_env(
        NARROWS_CACHE=str(tmp / "cache"),
        HF_DATASETS_CACHE=str(tmp / "datasets"),
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
    )
    proc = subprocess.run(
        [sys.executable, str(runner), str(spec)], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return tmp, json.loads((tmp / "results.json").read_text())


def test_every_block_is_declared_in_order():
    """A new, removed or reordered block fails here: BLOCKS must say how it runs."""
    blocks = readme_blocks()
    assert len(blocks) == len(BLOCKS), (
        f"README.md has {len(blocks)} python blocks, BLOCKS declares {len(BLOCKS)}"
    )
    for b, code in zip(BLOCKS, blocks):
        assert code.startswith(b.starts), f"block {b.name!r} should start {b.starts!r}, found {code[:80]!r}"


def test_blocks_name_only_mapped_placeholders():
    """A path the test does not map (or a `...`) would not run as written."""
    for b, code in zip(BLOCKS, readme_blocks(), strict=True):
        unmapped = _paths_in(code) - set(PLACEHOLDERS) - set(OUTPUTS)
        assert not unmapped, (
            f"block {b.name!r} names {sorted(unmapped)}: map them in PLACEHOLDERS or fix the block"
        )
    assert _paths_in('f("path/to/model", LoraConfig(...), "x.jsonl")') == {"path/to/model", "...", "x.jsonl"}


@pytest.mark.parametrize("name", [b.name for b in BLOCKS])
def test_block_runs(workspace, name):
    _, results = workspace
    assert results[name] == "ok", results[name]


@pytest.mark.parametrize("name", ["trl", "trl-streamed"])
def test_sft_trainer_streamed_equals_resident(workspace, name):
    """The README's SFTTrainer example (LoRA dropout on) trains the streamed model as it
    trains the resident one: every adapter tensor `torch.equal`, and the adapters moved.
    "trl" is the block as written; "trl-streamed" streams and recomputes every layer."""
    import torch

    tmp, results = workspace
    for run in (name, "trl-resident"):
        assert results[run] == "ok", results[run]
    streamed, resident = torch.load(tmp / f"{name}.pt"), torch.load(tmp / "trl-resident.pt")
    assert resident["streamed"] is None and streamed["streamed"] is not None
    if name == "trl-streamed":
        assert streamed["streamed"] == [0, 1, 2]  # the tiny model's three layers
    a, b = streamed["params"], resident["params"]
    assert a.keys() == b.keys() and a
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(k.endswith("lora_B.default.weight") and a[k].abs().sum() > 0 for k in a)
