"""narrows beside its peers on one GPU: narrows with its fast kernels and with PEFT's,
Unsloth, and PEFT with and without HF gradient checkpointing, on the same random checkpoint and
the same token stream, each mode in its own process.

What every row shares: one pre-quantised bitsandbytes NF4 checkpoint *folder* per model
(transformers' 4-bit serialisation, `quantization_config` in config.json, a byte-level tokenizer),
built once from `_models.random_nf4_model` (seeded, quantised layer by layer) and loaded by every
mode; LoRA r16, alpha 32, on q, k, v, o, gate, up and down, no dropout unless ``--dropout P`` gives
every row's adapters (the twins' too) that dropout; AdamW at lr 1e-4; bf16
compute; seeded random token ids over the model's vocabulary, the same batches in the same order
(stream_qlora.py's stream); G micro-batches per optimizer step, each loss scaled by 1/G.

Per row: peak allocated GPU memory over the timed steps (`max_memory_allocated` after a reset),
the median seconds a step over the timed steps after the warm-up (the device synchronised around
each step), the final loss, the package versions the row's process ran with, and a fingerprint of
its adapters' initial weights (equal fingerprints: the same start). The run records the pinned
host->device bandwidth and the GPU. Each streamed narrows row also gets a twin check (``--twin``
steps, 3 by default): the row's mode and the resident mode with the same kernels and loss
(`twin_of`), each with deterministic kernels in its own process, and whether the adapters they
train are ``torch.equal`` (the row's ``twin``, the table's last column).

Modes: ``unsloth`` (FastLanguageModel over the folder, its own gradient checkpointing
``use_gradient_checkpointing="unsloth"``, run from its own site directory: see
benchmarks/stage_unsloth.sh); ``peft`` and ``peft-ckpt`` (transformers' own load of the folder,
PEFT's LoRA, with HF gradient checkpointing for ``-ckpt``: no narrows code in the process); any
other is a mode of stream_qlora.py run over the folder (``stream-8GiB-lmhead-fast``,
``stream-min-lmhead``, ``resident-ckpt-fast``, ``resident``, ...: see its docstring).

Stage here first (PyPI reachable): ../shared/gpu/stage && bash benchmarks/stage_unsloth.sh. Then on
the GPU machine, from the checkout root, carrying .gpu and .gpu-unsloth:

    source .gpu/env && python3 benchmarks/peers.py --shape 7b-8x512 --timeout 240 --out $OUT/peers_7b-8x512.json

(`bash -c 'source .gpu-unsloth/env && python3 benchmarks/peers.py --check-unsloth'` lists what
Unsloth's staged packages declare and that machine lacks.) The folder is kept under --work and
reused by the next run of the same model while the machine stays warm.

The smoke form on a CPU (Unsloth's rows are skipped there: its kernels are Triton):

    uv run --no-sync python benchmarks/peers.py --shape tiny --steps 2 --warmup 1 --out /tmp/peers_tiny.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

sys.path.insert(0, str(Path(__file__).parent))
import _models
import stream_qlora
from checkpoints import folder_bytes

ROOT = Path(__file__).resolve().parent.parent
UNSLOTH_ENV = ROOT / ".gpu-unsloth" / "env"
VERSIONS = (
    "torch",
    "triton",
    "transformers",
    "peft",
    "accelerate",
    "bitsandbytes",
    "liger-kernel",
    "unsloth",
    "unsloth-zoo",
    "trl",
    "datasets",
)


@dataclass(frozen=True)
class Shape:
    model: str  # a config of benchmarks/configs
    batch: int  # sequences per micro-batch
    seq: int  # tokens per sequence
    grad_accum: int  # micro-batches per optimizer step
    modes: str  # the rows run unless --modes says otherwise


NARROWS_7B = "stream-8GiB-lmhead-fast,stream-min-lmhead-fast,resident-ckpt-fast,stream-8GiB-lmhead"
SHAPES = {
    "7b-8x512": Shape("qwen2.5-7b", 8, 512, 1, f"{NARROWS_7B},unsloth,peft,peft-ckpt"),
    "7b-1x512-g8": Shape("qwen2.5-7b", 1, 512, 8, f"{NARROWS_7B},unsloth,peft,peft-ckpt"),
    "32b-8x512": Shape(
        "qwen2.5-32b",
        8,
        512,
        1,
        "stream-12GiB-lmhead-fast,stream-min-lmhead-fast,stream-12GiB-lmhead,unsloth,peft-ckpt",
    ),
    "7b-1x32768": Shape(
        "qwen2.5-7b", 1, 32768, 1, "stream-min-lmhead-fast,stream-min-lmhead,unsloth,peft-ckpt"
    ),
    # narrows only: no peer trains 72B on one card at these budgets
    "72b-8x512": Shape(
        "qwen2.5-72b",
        8,
        512,
        1,
        "stream-16GiB-lmhead-fast,stream-24GiB-lmhead-fast,stream-min-lmhead-fast,stream-16GiB-lmhead",
    ),
    "tiny": Shape(
        "qwen2-tiny", 2, 64, 1, "stream-min-lmhead-fast,resident-ckpt-fast,resident,unsloth,peft,peft-ckpt"
    ),
}


# --- the checkpoint folder ---------------------------------------------------------------------
def build_folder(config_name: str, folder: Path, *, seed: int = 0, shard_bytes: int = 4 << 30) -> Path:
    """A pre-quantised NF4 checkpoint folder of `config_name`'s shape with seeded random weights,
    as transformers saves a bitsandbytes 4-bit model: each packed weight beside its quant state
    (absmax, quant_map, nested_absmax, nested_quant_map, quant_state.bitsandbytes__nf4), the
    embedding and head in bf16, `quantization_config` in config.json, and a byte-level tokenizer.
    Kept and reused while its `complete` marker is there."""
    if (folder / "complete").is_file():
        kept = json.loads((folder / "config.json").read_text())
        want = _models.load_config(config_name)
        shape = ("hidden_size", "num_hidden_layers", "intermediate_size")
        if any(kept.get(k) != getattr(want, k) for k in shape):
            raise SystemExit(
                f"{folder} holds another model's shape than {config_name}: remove it or pick another --work"
            )
        return folder
    from safetensors.torch import save_file
    from transformers import BitsAndBytesConfig

    from narrows.core.testing import tiny_tokenizer

    part = folder.with_name(folder.name + ".part")
    part.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = _models.random_nf4_model(_models.load_config(config_name), seed=seed, work_device=device)
    # bitsandbytes' Linear4bit puts its packed quant state into the state dict: transformers' format
    state = model.state_dict()
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in state.items():
        if size and size + t.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += t.nbytes
    weight_map = {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        # plain, unshared CPU copies: safetensors refuses tensor subclasses and shared storage
        tensors = {n: state[n].detach().cpu().as_subclass(torch.Tensor).contiguous().clone() for n in names}
        save_file(tensors, part / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    total = sum(t.nbytes for t in state.values())
    (part / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    config = model.config
    config.quantization_config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    ).to_dict()
    tokenizer = tiny_tokenizer()
    config.pad_token_id, config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    config.save_pretrained(part)
    tokenizer.save_pretrained(part)
    (part / "complete").write_text(json.dumps({"config": config_name, "seed": seed}))
    del model, state
    if folder.exists():  # an incomplete earlier attempt
        import shutil

        shutil.rmtree(folder)
    part.rename(folder)
    return folder


# --- one training loop, for the rows peers.py owns ---------------------------------------------
class TokenStream:
    """stream_qlora.py's batches: a CPU generator seeded 0 draws (batch, seq) ids over the whole
    vocabulary for each micro-batch, warm-up steps included; the labels are the ids."""

    def __init__(self, vocab: int, batch: int, seq: int, seed: int = 0):
        self.gen = torch.Generator().manual_seed(seed)
        self.vocab, self.shape = vocab, (batch, seq)

    def next(self, device: torch.device) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, self.vocab, self.shape, generator=self.gen).to(device)
        return {"input_ids": ids, "labels": ids}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(model, args: argparse.Namespace, vocab: int, device: torch.device) -> dict:
    """Warm-up steps, then timed steps, each one AdamW step over G micro-batches, as
    stream_qlora.run_one trains; the device is synchronised around every timed step."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    stream = TokenStream(vocab, args.batch, args.seq)
    g = args.grad_accum

    def step() -> float:
        total = 0.0
        for _ in range(g):
            loss = model(**stream.next(device)).loss
            (loss / g).backward()
            total = total + loss.detach() / g
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(total)

    for _ in range(args.warmup):
        step()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    for _ in range(args.steps):
        sync(device)
        t = time.perf_counter()
        losses.append(step())
        sync(device)
        times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"step_s": times, "peak_allocated": peak, "final_loss": losses[-1], "losses": losses}


def adapter_fingerprint(model) -> list[float]:
    """Sum and sum of squares of every LoRA A weight, in float64: the same values in two rows mean
    the same initial adapters (B is zero at the start in every mode)."""
    a = [p.detach().double() for n, p in model.named_parameters() if "lora_A" in n]
    return [float(sum(x.sum() for x in a)), float(sum((x * x).sum() for x in a))]


def versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in VERSIONS:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


# --- the rows ----------------------------------------------------------------------------------
def run_peft(args: argparse.Namespace, folder: Path, device: torch.device) -> dict:
    """PEFT as its users run it: transformers loads the pre-quantised folder (bitsandbytes
    Linear4bit), PEFT adds the adapters; `-ckpt`: HF gradient checkpointing, non-reentrant. No
    `prepare_model_for_kbit_training`: it would cast the head and norms to float32, and every
    row computes in bf16."""
    from transformers import AutoModelForCausalLM

    t = time.perf_counter()
    place = {"": torch.cuda.current_device() if device.type == "cuda" else "cpu"}
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.bfloat16, attn_implementation=args.attn, device_map=place
    )
    torch.manual_seed(0)  # as stream_qlora.run_one before add_lora: the same initial adapters
    model = _models.add_lora(model, dropout=args.dropout).train()
    model.config.use_cache = False
    if args.run_one.endswith("-ckpt"):
        stream_qlora.checkpointing(model, offload=False)
        model.enable_input_require_grads()
    load_s = time.perf_counter() - t
    return {
        "load_s": load_s,
        "adapters_init": adapter_fingerprint(model),
        **train(model, args, model.config.vocab_size, device),
    }


def run_unsloth(args: argparse.Namespace, folder: Path, device: torch.device) -> dict:
    """Unsloth as its users run it: FastLanguageModel loads the pre-quantised folder, its
    get_peft_model adds the same adapters with its own gradient checkpointing; then the same
    plain loop as every other row (no TRL trainer: the optimizer and batches stay the same).
    The row says which attention Unsloth found (xformers, flash-attn or PyTorch's SDPA) and
    where it left the input embedding (it may move it to host memory)."""
    from unsloth import FastLanguageModel  # before transformers and peft: it patches them on import
    from unsloth.models import _utils as unsloth_utils

    t = time.perf_counter()
    model, _ = FastLanguageModel.from_pretrained(
        str(folder), max_seq_length=args.seq, dtype=torch.bfloat16, load_in_4bit=True, random_state=0
    )
    model = FastLanguageModel.get_peft_model(
        model,
        r=16,
        lora_alpha=32,
        lora_dropout=args.dropout,
        target_modules=list(_models.TARGETS),
        bias="none",
        use_gradient_checkpointing="unsloth",
        random_state=0,
    )
    FastLanguageModel.for_training(model)
    load_s = time.perf_counter() - t
    attention = (
        "xformers"
        if getattr(unsloth_utils, "xformers", None) is not None
        else "flash-attn"
        if getattr(unsloth_utils, "HAS_FLASH_ATTENTION", False)
        else "sdpa"
    )
    return {
        "load_s": load_s,
        "adapters_init": adapter_fingerprint(model),
        "attention": attention,
        "embedding_device": str(model.get_input_embeddings().weight.device),
        "unmet_requirements": unmet_requirements("unsloth"),
        **train(model, args, model.config.vocab_size, device),
    }


class _StepClock(torch.optim.AdamW):
    """AdamW that notes the time each step completes (device synchronised): the seam through
    which a stream_qlora.run_one mode, whose loop peers.py does not own, gives per-step times.
    Every step of those modes ends in exactly one optimizer step (step modes: their mean)."""

    marks: ClassVar[list[float]] = []

    def step(self, closure=None):
        out = super().step(closure)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        _StepClock.marks.append(time.perf_counter())
        return out


def run_narrows(args: argparse.Namespace, folder: Path, device: torch.device) -> dict:
    """A stream_qlora.py mode, its model read from the folder (narrows' block loader) instead
    of built by `_models.random_nf4_model`: stream_qlora.run_one imports both names at call
    time, so the child swaps them here; nothing else of the mode changes."""
    from narrows.core.io.loader import load_blockwise

    add_lora = _models.add_lora
    seen: dict = {}

    def from_folder(config, *, seed: int = 0, work_device: str = "cpu", attn: str = "sdpa"):
        t = time.perf_counter()
        with torch.random.fork_rng(devices=[]):  # the loader draws nothing the adapters' init would see
            model = load_blockwise(folder, dtype=torch.bfloat16, device=work_device)
        model.set_attn_implementation(attn)
        seen["load_s"] = time.perf_counter() - t
        return model

    def lora(model, **kw):
        if args.dropout:  # the run's dropout over the mode's
            kw["dropout"] = args.dropout
        seen["lora_dropout"] = kw.get("dropout", 0.0)
        model = add_lora(model, **kw)
        seen["adapters_init"] = adapter_fingerprint(model)
        return model

    _models.random_nf4_model, _models.add_lora = from_folder, lora
    if not args.run_one.startswith("step"):  # StepTrainer's host optimizer accepts torch's own classes only
        torch.optim.AdamW = _StepClock
    row = stream_qlora.run_one(
        argparse.Namespace(
            run_one=args.run_one,
            model=args.model,
            seq=args.seq,
            steps=args.steps,
            warmup=args.warmup,
            grad_accum=args.grad_accum,
            batch=args.batch,
            attn=args.attn,
            trace=False,
            profile=False,
            torch_profile=False,
            deterministic=args.deterministic,
            save_adapters=args.save_adapters,
            host_steps=0,  # its optimizer clock synchronises every step: host time would be step time
        )
    )
    marks = _StepClock.marks
    if args.warmup and len(marks) == args.warmup + args.steps:  # one optimizer step a training step
        timed = marks[args.warmup - 1 :]  # the last warm-up step's end starts the first timed step
        row["step_s"] = [b - a for a, b in itertools.pairwise(timed)]
    return {**seen, **row, "lora_dropout": seen.get("lora_dropout")}


def unmet_requirements(package: str) -> list[str]:
    """Every requirement that the distributions in `package`'s site directory declare (markers
    evaluated, no extras) and that this interpreter's packages do not satisfy."""
    import importlib.util
    from importlib.metadata import PackageNotFoundError, distributions, version

    from packaging.requirements import Requirement

    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        return [f"{package} is not importable"]
    site = str(Path(spec.origin).parent.parent)
    unmet = []
    for dist in distributions(path=[site]):
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            try:
                found = version(req.name)
            except PackageNotFoundError:
                unmet.append(f"{dist.metadata['Name']}: {req} (absent)")
                continue
            if req.specifier and not req.specifier.contains(found, prereleases=True):
                unmet.append(f"{dist.metadata['Name']}: {req} (found {found})")
    return sorted(set(unmet))


def run_one(args: argparse.Namespace) -> dict:
    mode = args.run_one
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    folder = Path(args.folder)
    t = time.perf_counter()
    if mode == "unsloth":
        row = run_unsloth(args, folder, device)
    elif mode in ("peft", "peft-ckpt"):
        row = run_peft(args, folder, device)
    else:
        row = run_narrows(args, folder, device)
    row.update(
        mode=mode,
        wall_s=time.perf_counter() - t,
        versions=versions(),
        cublas_workspace_config=os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    )  # costs host time a matmul
    steps = row.get("step_s")
    if steps:
        row["median_s_per_step"] = statistics.median(steps)
    row.setdefault("median_s_per_step", row.get("s_per_step"))  # stream_qlora's mean, where no per-step times
    row["tokens_per_s"] = args.batch * args.seq * args.grad_accum / row["median_s_per_step"]
    return row


# --- the parent --------------------------------------------------------------------------------
def family(mode: str) -> str:
    if mode == "unsloth":
        return "Unsloth"
    if mode.startswith("peft"):
        return "PEFT" + (" + HF checkpointing" if mode.endswith("-ckpt") else "")
    return "narrows, " + ("fast kernels" if "fast" in mode.split("-") else "PEFT's kernels")


def twin_of(mode: str, tile_tokens: int | None = None) -> tuple[str | None, str]:
    """The resident mode whose training a narrows row's must equal bit for bit (the same
    kernels: fast layers or PEFT's, the same loss, the MLP in the tiles the row's plan chose),
    or None and why no twin is run."""
    parts = mode.split("-")
    if mode in ("unsloth", "peft", "peft-ckpt"):
        return None, "not narrows"
    if parts[0] == "resident":
        return None, "a resident row is the twin's own kind"
    kinds = [k for k in ("fast", "f32lora", "lmhead", "fuse") if k in parts]
    tiles = [f"tile{tile_tokens}"] if "tile" in parts and tile_tokens else []
    return "-".join(["resident", "ckpt", *kinds, *tiles]), ""


def equal_twin(args: argparse.Namespace, mode: str, folder: Path) -> dict:
    """`mode` and its resident twin, each for --twin steps with deterministic kernels in a
    process of its own: whether the adapters they train are `torch.equal`."""
    other, why = twin_of(mode)
    if other is None:
        return {"skipped": why}
    saved, row = {}, {}
    for m in (mode, None):
        if m is None:  # the resident twin, with the tiles the streamed run's plan chose
            m = other = twin_of(mode, row.get("tile_tokens"))[0]
        path = Path(args.work) / f"twin-{m}.pt"
        path.unlink(missing_ok=True)
        row = child(args, m, folder, twin=path)
        if "error" in row:
            return {"resident": other, "error": f"{m}: {row['error']}"}
        saved[m] = torch.load(path)
    a, b = saved[mode], saved[other]
    # B starts at zero: a twin whose B moved trained (two runs that both failed to are not "equal")
    trained = any(bool(t.any()) for k, t in a.items() if "lora_B" in k)
    same = a.keys() == b.keys() and trained and all(torch.equal(a[k], b[k]) for k in a)
    return {"resident": other, "steps": args.twin, "equal": same, "trained": trained, "tensors": len(a)}


def child(args: argparse.Namespace, mode: str, folder: Path, twin: Path | None = None) -> dict:
    """One mode in its own process; Unsloth's with Unsloth's own site directory as PYTHONPATH."""
    if mode == "unsloth":
        if not torch.cuda.is_available():
            return {
                "mode": mode,
                "skipped": "Unsloth needs a CUDA GPU (its kernels are Triton); not run on the CPU",
            }
        if not UNSLOTH_ENV.is_file():
            return {
                "mode": mode,
                "error": f"{UNSLOTH_ENV} missing: run benchmarks/stage_unsloth.sh and carry .gpu-unsloth",
            }
    steps, warmup = (args.twin, 0) if twin else (args.steps, args.warmup)
    flags = [
        "--run-one",
        mode,
        "--folder",
        str(folder),
        "--model",
        args.model,
        "--batch",
        str(args.batch),
        "--seq",
        str(args.seq),
        "--grad-accum",
        str(args.grad_accum),
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
        "--attn",
        args.attn,
        "--dropout",
        str(args.dropout),
    ]
    if twin:
        flags += ["--deterministic", "--save-adapters", str(twin)]
    cmd = [sys.executable, __file__, *flags]
    if mode == "unsloth":  # its env sets PYTHONPATH afresh: no narrows, no .gpu/site ahead of its site
        cmd = ["bash", "-c", f'source {shlex.quote(str(UNSLOTH_ENV))} && exec "$@"', "unsloth", *cmd]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"mode": mode, "error": f"timed out after {args.timeout} s"}
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line:
        return json.loads(line[7:])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-6:] or ["no output"]
    return {"mode": mode, "error": " | ".join(tail)[-900:], "returncode": proc.returncode}


def table(rows: list[dict]) -> str:
    gib = 2**30
    ref = next((r for r in rows if r["mode"] == "unsloth" and "final_loss" in r), None)
    lines = [
        "| mode | what | peak GiB | median s/step | tokens/s | final loss | vs Unsloth s/step | = resident |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "final_loss" not in r:
            lines.append(
                f"| `{r['mode']}` | {family(r['mode'])} | {r.get('skipped') or r.get('error', '')[:120]} ||||||"
            )
            continue
        peak = f"{r['peak_allocated'] / gib:.2f}" if r.get("peak_allocated") else "–"
        vs = f"{r['median_s_per_step'] / ref['median_s_per_step']:.2f}" if ref else "–"
        lines.append(
            f"| `{r['mode']}` | {family(r['mode'])} | {peak} | {r['median_s_per_step']:.3f} | "
            f"{r['tokens_per_s']:.0f} | {r['final_loss']:.4f} | {vs} | {twin_cell(r.get('twin'))} |"
        )
    return "\n".join(lines)


def twin_cell(twin: dict | None) -> str:
    """The table's word on a row's twin check: equal, DIFFERS, or why there is none."""
    if not twin:
        return "–"
    if "equal" in twin:
        word = "equal" if twin["equal"] else "DIFFERS" if twin["trained"] else "untrained: no verdict"
        return f"{word} ({twin['steps']} steps)"
    return twin.get("skipped") or f"error: {twin.get('error', '')[:60]}"


def git_commit() -> str | None:
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    return proc.stdout.strip() or None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--shape", choices=sorted(SHAPES), default="7b-8x512", help="model, batch, seq, G and rows"
    )
    ap.add_argument("--model", help="a config of benchmarks/configs (default: the shape's)")
    ap.add_argument("--batch", type=int, help="sequences per micro-batch (default: the shape's)")
    ap.add_argument("--seq", type=int, help="tokens per sequence (default: the shape's)")
    ap.add_argument("--grad-accum", type=int, help="micro-batches per optimizer step (default: the shape's)")
    ap.add_argument("--modes", help="comma-separated rows (default: the shape's)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps (after the warm-up)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--dropout",
        type=float,
        default=0.0,
        help="LoRA dropout of every row's adapters (Unsloth's fast LoRA path wants 0)",
    )
    ap.add_argument("--attn", default="sdpa", help="attention implementation of the narrows and PEFT rows")
    ap.add_argument("--work", default="/tmp/peers", help="where the checkpoint folders are built and kept")
    ap.add_argument("--timeout", type=int, default=420, help="seconds a row may take, loading included")
    ap.add_argument("--out", help="JSON of every row (default: benchmarks/results/peers_<shape>.json)")
    ap.add_argument(
        "--check-unsloth",
        action="store_true",
        help="list the requirements of Unsloth's staged site this interpreter does not meet, and exit",
    )
    ap.add_argument(
        "--twin",
        type=int,
        default=3,
        help="steps of each narrows row's deterministic twin check against resident training "
        "(torch.equal adapters; 0: none)",
    )
    ap.add_argument("--deterministic", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--save-adapters", help=argparse.SUPPRESS)
    ap.add_argument("--run-one", help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.check_unsloth:
        print("\n".join(unmet_requirements("unsloth")) or "every requirement met")
        return
    shape = SHAPES[args.shape]
    for field in ("model", "batch", "seq", "grad_accum", "modes"):
        if getattr(args, field) is None:
            setattr(args, field, getattr(shape, field))
    if args.run_one:
        try:
            row = run_one(args)
        except torch.OutOfMemoryError as e:
            row = {"mode": args.run_one, "error": f"OOM: {str(e)[:160]}"}
        except Exception as e:  # the row says what failed where; the whole traceback goes to stderr
            traceback.print_exc()
            where = traceback.extract_tb(e.__traceback__)[-1]
            row = {
                "mode": args.run_one,
                "error": f"{type(e).__name__}: {str(e)[:400]}",
                "at": f"{where.filename}:{where.lineno}",
            }
        print("RESULT " + json.dumps(row), flush=True)
        return

    out = Path(args.out or f"benchmarks/results/peers_{args.shape}.json")
    t = time.perf_counter()
    folder = build_folder(args.model, Path(args.work) / f"{Path(args.model).name.removesuffix('.json')}-nf4")
    # (not .stem: "qwen2.5-7b" and "qwen2.5-32b" both have the stem "qwen2", and the second reused the first's folder)
    build_s = time.perf_counter() - t
    bw = stream_qlora.pinned_bandwidth()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    run = {
        "shape": args.shape,
        **{
            k: getattr(args, k) for k in ("model", "batch", "seq", "grad_accum", "steps", "warmup", "dropout")
        },
        "folder": str(folder),
        "folder_bytes": folder_bytes(folder),
        "folder_build_s": build_s,
        "pinned_bw": bw,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "commit": git_commit(),
        "versions": versions(),
        "rows": [],
    }
    print(
        f"folder {folder} ({run['folder_bytes'] / 2**30:.2f} GiB, {build_s:.0f} s); pinned H2D {bw / 1e9:.1f} GB/s",
        flush=True,
    )
    for mode in args.modes.split(","):
        row = child(args, mode, folder)
        if args.twin and "error" not in row and "skipped" not in row:
            row["twin"] = equal_twin(args, mode, folder)
        run["rows"].append(row)
        brief = {
            k: row[k]
            for k in (
                "mode",
                "median_s_per_step",
                "peak_allocated",
                "final_loss",
                "wall_s",
                "error",
                "skipped",
                "twin",
            )
            if k in row
        }
        print(json.dumps(brief), flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(run, indent=2))  # after every row: a run cut short keeps what it measured
    g = f", G {args.grad_accum}" if args.grad_accum > 1 else ""
    print(
        f"\n{args.model}, {args.batch}x{args.seq}{g}, NF4, LoRA r16 x7, AdamW; {run['device']}, "
        f"pinned H2D {bw / 1e9:.1f} GB/s; {args.steps} timed steps after {args.warmup}\n"
    )
    print(table(run["rows"]))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
