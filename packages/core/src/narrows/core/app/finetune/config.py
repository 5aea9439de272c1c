"""What a run depends on (`FinetuneConfig`, saved in the run folder), its checks, and
which of its fields a resumed run may change without leaving the trajectory it started."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ...errors import NarrowsError
from ...optional import require
from ...sizes import parse_bytes
from ..data import open_source, parse_columns
from .reporters import parse_report_to

__all__ = [
    "ADAPTERS",
    "FIXED",
    "OVERRIDABLE",
    "QUANTS",
    "RESUMABLE",
    "Changes",
    "FinetuneConfig",
    "LMHeadSpec",
    "parse_lmhead",
    "resume_changes",
]

ADAPTERS = ("lora", "dora")
QUANTS = ("none", "nf4")

# What a resumed run may change, field by field (`resume_changes`; README "Resuming a run").
# Freely: the run still trains what it would have trained.
RESUMABLE = {
    "steps": "the run ends at the new step count; the learning-rate schedule decays over it from here on",
    "save_every": "checkpoints are written at the new interval",
    "exact_match": "only the final report changes",
    "eval_every": "only the steps the held-out loss is measured at change",
    "gpu_budget": "where the frozen base lives; streamed training computes what resident training does",
    "host_budget": "where the frozen base lives; the numbers trained are the same",
    "cache": "where the prepared slabs live; the numbers trained are the same",
    "step_mode": "the order the step's layers and micro-batches run in; the numbers trained are the same",
    "cuda_graphs": "how the layers' kernels are launched; the numbers trained are the same",
    "offload_optimizer": "where the optimizer state waits between steps; the numbers trained are the same",
    "offload_adapters": "where the adapters wait between steps; the numbers trained are the same",
    "report_to": "where the metrics are shown besides metrics.jsonl; the numbers trained are the same",
}
# With --override: the run trains something else from the resumed step on, and says what.
OVERRIDABLE = {
    "lr": "the schedule's peak: from the resumed step on the optimizer's rate is the new peak times the "
    "warmup-and-cosine schedule at that step",
    "warmup": "the schedule's warmup: from the resumed step on the rate follows the schedule with the new warmup",
    "seed": "the data order and dropout draws of the micro-batches from the resumed step on (the stream "
    "keeps its place; the checkpoint's random state is restored as saved)",
    "batch": "sequences per micro-batch from the resumed step on; the data stream keeps its micro-batch count, "
    "so examples of this epoch may be skipped or seen twice",
    "grad_accum": "micro-batches per step from the resumed step on; the data stream keeps its micro-batch "
    "count, so examples of this epoch may be skipped or seen twice",
    "seq_len": "rows are cut or packed at the new length from the resumed step on",
    "packing": "batches are packed (or padded) from the resumed step on",
    "dropout": "the adapters' dropout from the resumed step on",
    "alpha": "the adapters' scale (alpha / rank) from the resumed step on: the trained weights are kept, so "
    "each adapter's contribution changes by the ratio at once",
    "quant": "the frozen base is quantised (or not) from the resumed step on: the adapter goes on training "
    "against other base weights",
    "dtype": "the base's and the activations' dtype from the resumed step on; the adapters and the optimizer "
    "state are restored as saved and cast",
    "kernels": "the decoder layers' kernels from the resumed step on (other last bits)",
    "lora_dtype": "the fast layers' adapter arithmetic from the resumed step on (other last bits)",
    "lmhead": "how the loss is computed from the resumed step on (mask and chunked: equal up to summation "
    "order; topk: another loss)",
    "seq_tile": "the MLP's tiling over the sequence from the resumed step on (equal up to summation order)",
    "deterministic": "deterministic kernels (or not) from the resumed step on",
    "eval_rows": "the held-out rows scored from the resumed step on: the eval loss is another average",
    "data_split": "the training rows from the resumed step on",
    "eval_split": "the held-out rows scored from the resumed step on",
    "columns": "the training rows from the resumed step on",
    "model": "the base's weights from the resumed step on (a moved model whose content is the same needs no "
    "--override: name it with --model)",
    "data": "the training rows from the resumed step on (moved data whose content is the same needs no "
    "--override: name it with --data)",
    "eval_data": "the held-out rows scored from the resumed step on (moved data whose content is the same "
    "needs no --override: name it with --eval-data)",
    "world_size": "the ranks each step's micro-batches are shared over from the resumed step on (their "
    "gradients summed in another order)",
}
# Never, not even with --override: the checkpoints cannot go on under another value.
FIXED = {
    "adapter": "the checkpoints hold the other adapter's tensors (DoRA adds a magnitude per output)",
    "rank": "the checkpoints' adapter matrices and optimizer state have the run's rank",
    "targets": "the checkpoints hold adapters on the run's modules; others would start untrained, "
    "outside the optimizer state",
    "out": "it is the run folder itself: resume the run where it is",
}


@dataclass
class FinetuneConfig:
    """Everything a run depends on; saved in the run folder's ``config.json``."""

    model: str | None = None  # None: the embedded default (SmolLM2-135M-Instruct)
    data: str | None = None  # None with model None: GSM8K train split
    eval_data: str | None = None
    data_split: str | None = None  # the split of a save_to_disk folder holding several
    eval_split: str | None = None
    columns: str | None = None  # renames of dataset columns, e.g. prompt=question,response=answer
    packing: bool = False  # several examples per sequence, attention kept inside each
    adapter: str = "lora"
    rank: int = 16
    alpha: float | None = None  # None: 2 * rank
    dropout: float = 0.0
    targets: str = "all-linear"
    quant: str = "none"
    gpu_budget: str = "off"  # off | fit | min (the smallest footprint) | a size such as 12GiB
    host_budget: str | None = (
        None  # host RAM for a streamed base (default: 85% of available); the rest on disk
    )
    cache: str | None = None  # prepared-slab cache folder (default $NARROWS_CACHE/slabs); "off": none
    lmhead: str = (
        "auto"  # auto: mask,chunked when narrows-lmhead is installed; off; or e.g. mask,chunked,topk=1000
    )
    steps: int = 40
    batch: int = 4
    grad_accum: int = 1
    seq_len: int = 512
    seq_tile: str = "off"  # off | auto (when the GPU budget needs it) | tokens per MLP tile
    # block-major accumulation (narrows.stream.StepTrainer) over the streamed base (None: where it is predicted faster)
    step_mode: bool | None = None
    # the layers narrows-stream runs replayed as CUDA graphs (None: the planner's choice)
    cuda_graphs: bool | None = None
    # the decoder layers' kernels: "fast" (narrows' fast layers where they cover the layer) or "peft"
    kernels: str = "fast"
    # the fast layers' adapter arithmetic: "auto" (the activations' dtype) or "float32" (PEFT's)
    lora_dtype: str = "auto"
    offload_optimizer: bool = False  # step mode: optimizer state in host memory between layer updates
    offload_adapters: bool = False  # and the adapters too (implies offload_optimizer)
    lr: float = 5e-4
    warmup: int | None = None  # None: 5% of the steps
    seed: int = 0
    save_every: int = 10
    eval_rows: int = 32  # held-out rows used for the eval loss
    eval_every: int | None = None  # held-out loss every N steps, 0 and the last too (None: steps / 4)
    exact_match: int = 8  # held-out problems generated and scored (embedded default only)
    dtype: str = "auto"  # auto: bf16 on CUDA, fp32 on the CPU
    deterministic: bool = False  # deterministic kernels: on CUDA, what makes runs reproducible bit for bit
    out: str = "runs/default"
    report_to: str = "none"  # tensorboard, wandb (comma-separated), all (those installed) or none
    world_size: int = 1  # ranks the run trains on (torchrun); not a flag: set by the launch

    @classmethod
    def from_dict(cls, fields: dict, where: str) -> FinetuneConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise NarrowsError(
                f"{where}: unknown settings {unknown}; it was written by another narrows version"
            )
        if "kernels" not in fields:  # written before fast layers: that run trained PEFT's kernels
            fields = {**fields, "kernels": "peft"}
        return cls(**fields)

    @property
    def eval_interval(self) -> int:
        """Steps between held-out evaluations: a newcomer's 40 steps show 5 points (0, 10, ..., 40)."""
        return self.eval_every if self.eval_every is not None else max(1, self.steps // 4)

    @property
    def warmup_steps(self) -> int:
        return self.warmup if self.warmup is not None else max(1, self.steps // 20)

    def checked(self) -> FinetuneConfig:
        """This configuration checked, returned as a new one with what its settings imply
        filled in (``--offload-adapters`` implies ``--offload-optimizer``, which implies step
        mode); a bad one is refused (`NarrowsError`) before anything is loaded. The
        configuration it is called on is left as it is."""
        cfg = dataclasses.replace(self)
        cfg._refuse_or_fill()
        return cfg

    def _refuse_or_fill(self) -> None:
        if self.adapter not in ADAPTERS:
            raise NarrowsError(f"--adapter must be one of {ADAPTERS}, got {self.adapter!r}")
        if self.quant not in QUANTS:
            raise NarrowsError(f"--quant must be one of {QUANTS}, got {self.quant!r}")
        for name in ("rank", "steps", "batch", "grad_accum", "seq_len", "save_every", "world_size"):
            if getattr(self, name) < 1:
                raise NarrowsError(f"--{_flag(name)} must be at least 1, got {getattr(self, name)}")
        if self.eval_every is not None and self.eval_every < 1:
            raise NarrowsError(
                f"--eval-every must be at least 1 (steps between held-out evaluations), got {self.eval_every}"
            )
        for name in ("eval_rows", "exact_match", "seed"):
            if getattr(self, name) < 0:
                raise NarrowsError(f"--{_flag(name)} must be 0 or more, got {getattr(self, name)}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise NarrowsError(f"--lr must be a positive number (e.g. 5e-4), got {self.lr}")
        if self.warmup is not None and not 0 <= self.warmup <= self.steps:
            raise NarrowsError(f"--warmup must be between 0 and --steps ({self.steps}), got {self.warmup}")
        if not (math.isfinite(self.dropout) and 0 <= self.dropout < 1):
            raise NarrowsError(f"--dropout must be in [0, 1), got {self.dropout}")
        if self.alpha is not None and not (math.isfinite(self.alpha) and self.alpha > 0):
            raise NarrowsError(f"--alpha must be a positive number, got {self.alpha}")
        if not self.targets.strip(", "):
            raise NarrowsError("--targets is empty; give all-linear or module names such as q_proj,v_proj")
        if self.model is None and self.data is not None:
            raise NarrowsError(
                "--data needs --model too (the embedded default model comes with its own data)"
            )
        if self.model is not None and self.data is None:
            raise NarrowsError(
                "--model needs --data (a local JSONL, parquet, arrow, csv or json file, or a "
                "save_to_disk folder)"
            )
        for flag, split, of, source in (
            ("--data-split", self.data_split, "--data", self.data),
            ("--eval-split", self.eval_split, "--eval-data", self.eval_data),
        ):
            if split is not None and source is None:
                raise NarrowsError(f"{flag} chooses a split of {of}: give {of} too, or drop {flag}")
        if self.columns is not None:
            if self.data is None:
                raise NarrowsError(
                    "--columns renames the columns of --data: give --data too, or drop --columns"
                )
            parse_columns(self.columns)
        if self.data is not None:
            open_source(self.data, self.data_split)  # a local path, of a kind narrows reads
        if self.eval_data is not None:
            open_source(self.eval_data, self.eval_split, flag="--eval-data")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise NarrowsError(f"--dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.kernels not in ("fast", "peft"):
            raise NarrowsError(
                f"--kernels must be fast (narrows' fast decoder layers where they cover the model) "
                f"or peft (PEFT's modules, PEFT's bits), got {self.kernels!r}"
            )
        if self.lora_dtype not in ("auto", "float32"):
            raise NarrowsError(
                f"--lora-dtype must be auto (the fast layers' adapters compute in the activations' "
                f"dtype) or float32 (PEFT's arithmetic for them), got {self.lora_dtype!r}"
            )
        if self.lora_dtype == "float32" and self.kernels != "fast":
            raise NarrowsError(
                "--lora-dtype float32 is the fast layers' option; with --kernels peft PEFT computes "
                "the adapters in their own dtype already: give --lora-dtype auto (or leave it out)"
            )
        if self.adapter == "dora":
            require("narrows.dora", "--adapter dora")
        if self.quant == "nf4":
            require("bitsandbytes", "--quant nf4")
        if self.gpu_budget != "off":
            require("narrows.stream", "--gpu-budget")
            if self.gpu_budget not in ("fit", "min"):
                size("--gpu-budget", self.gpu_budget)
        if self.host_budget is not None:
            if self.gpu_budget == "off":
                raise NarrowsError(
                    "--host-budget bounds the host copy of a streamed base: add --gpu-budget "
                    "(e.g. --gpu-budget 12GiB), or drop --host-budget"
                )
            size("--host-budget", self.host_budget)
        if self.cache is not None and self.gpu_budget == "off":
            raise NarrowsError(
                "--cache holds the prepared slabs of a streamed base: add --gpu-budget, or drop --cache"
            )
        for flag, on in (
            ("step-mode", self.step_mode),
            ("offload-optimizer", self.offload_optimizer),
            ("offload-adapters", self.offload_adapters),
            ("cuda-graphs", self.cuda_graphs),
        ):
            if on and self.gpu_budget == "off":
                raise NarrowsError(
                    f"--{flag} applies to the layers of a streamed base: add --gpu-budget "
                    f"(e.g. --gpu-budget 12GiB), or drop --{flag}"
                )
        flag = "--step-mode"
        hosted = "--offload-adapters" if self.offload_adapters else "--offload-optimizer"
        if self.offload_adapters:
            if self.grad_accum < 2:
                raise NarrowsError(
                    "--offload-adapters keeps one layer's adapters on the GPU at a time, which a "
                    "block-major step of several micro-batches does: add --grad-accum N (N ≥ 2), "
                    "or use --offload-optimizer alone"
                )
            self.offload_optimizer = True  # each layer's adapters go back to host memory after its update
        if self.offload_optimizer and self.step_mode is None:
            self.step_mode = True  # the optimizer state waits in host memory between a step's layer updates
            flag = f"{hosted} (which runs in step mode)"
        if self.step_mode and self.world_size > 1:
            raise NarrowsError(
                f"{flag} is not supported on several ranks yet (this run has {self.world_size}): step mode writes "
                f"each layer's gradients itself, past DistributedDataParallel's all-reduce. Drop {flag.split()[0]}, "
                "or run it in one process"
            )
        if self.offload_optimizer and self.step_mode is False:
            raise NarrowsError(
                f"{hosted} updates each layer inside a step-mode step, and step mode is off "
                "(--no-step-mode, or the settings a resumed run started with): add --step-mode, or "
                f"drop {hosted}"
            )
        if self.lmhead not in ("auto", "off"):
            require("narrows.lmhead", "--lmhead")
            parse_lmhead(self.lmhead)
        self.tile()
        parse_report_to(self.report_to)

    def tile(self) -> int | str | None:
        """``--seq-tile`` as narrows-stream takes it: None, "auto" or tokens per tile."""
        value = self.seq_tile
        if value == "off":
            return None
        if value == "auto":
            if self.gpu_budget == "off":
                raise NarrowsError(
                    "--seq-tile auto lets the planner of a streamed base decide: add --gpu-budget "
                    "(e.g. --gpu-budget 6GiB), or give a tile size such as --seq-tile 2048"
                )
            require("narrows.stream", "--seq-tile")
            return value
        if not value.isdigit() or int(value) < 1:
            raise NarrowsError(
                f"--seq-tile must be off, auto or a number of tokens such as 2048, got {value!r}"
            )
        require("narrows.stream", "--seq-tile")
        return int(value)


def _flag(name: str) -> str:
    return name.replace("_", "-")


def size(flag: str, text: str) -> int:
    """A byte size given on the command line; a malformed one is a NarrowsError naming the flag."""
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise NarrowsError(f"{flag} {text}: {e}") from None


@dataclass(frozen=True)
class Changes:
    """What a resume changes, each ``{field: (old, new)}``: `free` (RESUMABLE), `overridden`
    (OVERRIDABLE: needs ``--override``) and `fixed` (FIXED: refused whatever is given)."""

    free: dict
    overridden: dict
    fixed: dict

    @property
    def all(self) -> dict:
        return {**self.free, **self.overridden, **self.fixed}


def resume_changes(started: FinetuneConfig, wanted: dict[str, object]) -> Changes:
    """Sort the settings a resume asks for (`wanted`: flags, or the run's config.json edited
    by hand) into changes of the settings the run last `started` with; values equal to
    those, and None (a flag not given), are no change."""
    free, overridden, fixed = {}, {}, {}
    for name, new in wanted.items():
        old = getattr(started, name)
        if new is None or new == old:
            continue
        kind = free if name in RESUMABLE else overridden if name in OVERRIDABLE else fixed
        kind[name] = (old, new)
    return Changes(free, overridden, fixed)


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
            raise NarrowsError(
                f"--lmhead {text!r}: unknown part {part!r}; use mask, chunked, topk=K and/or "
                "fused=auto|off|cce"
            )
    return LMHeadSpec(**spec)  # type: ignore[arg-type]
