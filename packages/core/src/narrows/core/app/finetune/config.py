"""What a run depends on (`FinetuneConfig`, saved in the run folder), its checks, and
which of its settings a resumed run may change without leaving the trajectory it started.

Each setting is a leaf field of one group (`BaseConfig`, `DataConfig`, ...) and carries its
flag once (`setting`): `command` builds the parser from these fields, `checked` refuses
values outside their choices and bounds. A setting's name is unique across the groups, so
files and the resume tables name settings flat (``"steps"``), whatever group holds them."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...errors import NarrowsError
from ...optional import is_available, require
from ...sizes import parse_bytes
from ..data import open_source, parse_columns
from .reporters import parse_report_to

if TYPE_CHECKING:  # narrows-lmhead is optional: imported where --lmhead asks for it
    from narrows.lmhead import LossOptions

__all__ = [
    "FIXED",
    "GROUPS",
    "OVERRIDABLE",
    "RESUMABLE",
    "SETTINGS",
    "BaseConfig",
    "Changes",
    "DataConfig",
    "EvaluationConfig",
    "FinetuneConfig",
    "LoraConfig",
    "MemoryConfig",
    "ReportingConfig",
    "TrainingConfig",
    "flag_of",
    "lmhead_options",
    "resume_changes",
    "setting",
]


def setting(
    default: Any,
    help: str,
    *,
    choices: tuple[str, ...] | Mapping[str, str] | None = None,
    at_least: int | None = None,
    advanced: bool = False,
    metavar: str | None = None,
    default_help: str | None = None,
    flag: bool = True,
) -> Any:
    """A leaf setting: its default and its flag, written once. The flag is ``--name-with-dashes``;
    its parsing follows the annotation (int, float, str; ``bool`` a switch, ``bool | None``
    a switch with its ``--no-`` form, None meaning not asked). `choices` (a mapping: each with
    what it means) and `at_least` bound the value; `advanced` shows it under ``--help-advanced``
    only; `default_help` says what a None default means; `flag=False`: not on the command line."""
    meta = {
        "help": help,
        "choices": choices,
        "at_least": at_least,
        "advanced": advanced,
        "metavar": metavar,
        "default_help": default_help,
        "flag": flag,
    }
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class BaseConfig:
    """The frozen base: which model, how it is held and which kernels run its layers."""

    model: str | None = setting(
        None,
        "local HF model folder or .gguf file",
        metavar="PATH",
        default_help="the embedded SmolLM2-135M-Instruct",
    )
    quant: str = setting(
        "none", "nf4: a QLoRA/QDoRA base, with narrows-core[nf4] installed", choices=("none", "nf4")
    )
    expert_quant: str = setting(
        "auto",
        "with --quant nf4, a mixture of experts' routed experts in nf4, or in nf3 / nf2 (narrows' own codes: "
        "3.5 / 2.5 bits a weight against 4.5, more error, less to hold and stream); auto: nf4, and a "
        "release's MXFP4 experts (gpt-oss) kept as stored, dequantised per pass",
        choices=("auto", "nf4", "nf3", "nf2"),
        advanced=True,
    )
    dtype: str = setting(
        "auto",
        "auto: bf16 on CUDA, fp32 on CPU",
        choices=("auto", "float32", "bfloat16", "float16"),
        advanced=True,
    )
    kernels: str = setting(
        "fast",
        "the decoder layers' kernels: fast (narrows' fast layers — one autograd node a layer, LoRA in bf16 "
        "on tensor cores with float32 masters and gradients — where they cover the model; the run says "
        "which layers and why not the others) or peft (PEFT's modules: PEFT's bits)",
        choices={
            "fast": "narrows' fast decoder layers where they cover the model",
            "peft": "PEFT's modules, PEFT's bits",
        },
        advanced=True,
    )
    lora_dtype: str = setting(
        "auto",
        "the fast layers' adapter arithmetic: auto (the activations' dtype, bf16 on tensor cores, with "
        "float32 masters and gradients) or float32 (PEFT's: the adapters' matmuls and their sum with the "
        "base in float32; slower, and more memory: the plan counts its float32 temporaries)",
        choices={
            "auto": "the fast layers' adapters compute in the activations' dtype",
            "float32": "PEFT's arithmetic for them",
        },
        advanced=True,
    )


@dataclass(frozen=True)
class DataConfig:
    """What the run trains and evaluates on, and how rows become sequences."""

    data: str | None = setting(
        None,
        "training data, a local file (.jsonl, .parquet, .arrow, .csv, .json) or a save_to_disk folder: "
        "messages, ShareGPT conversations, prompt/response or prompt/completion, Alpaca or text rows",
        metavar="PATH",
    )
    eval_data: str | None = setting(None, "held-out data for the eval loss, as --data", metavar="PATH")
    data_split: str | None = setting(
        None,
        "the split of a save_to_disk folder that holds several, e.g. train",
        advanced=True,
        metavar="SPLIT",
    )
    eval_split: str | None = setting(
        None, "the split of --eval-data, e.g. test", advanced=True, metavar="SPLIT"
    )
    columns: str | None = setting(
        None,
        "rename your columns to the fields narrows reads, e.g. prompt=question,response=answer",
        advanced=True,
        metavar="RENAMES",
    )
    packing: bool = setting(
        False,
        "pack several examples into each --seq-len sequence (no padding); positions restart and attention "
        "stays inside each example",
    )
    seq_len: int = setting(512, "tokens per sequence, longer rows are truncated", at_least=1, metavar="N")


@dataclass(frozen=True)
class LoraConfig:
    """The adapter's kind and shape (what PEFT's LoraConfig gets)."""

    adapter: str = setting("lora", "lora, or dora with narrows-dora installed", choices=("lora", "dora"))
    rank: int = setting(16, "adapter rank", at_least=1, metavar="N")
    alpha: float | None = setting(None, "LoRA alpha", advanced=True, default_help="2 x rank")
    dropout: float = setting(0.0, "adapter dropout", advanced=True)
    targets: str = setting(
        "all-linear",
        "all-linear or module names, e.g. q_proj,v_proj; add experts for a mixture of experts' routed experts "
        "(all-linear,experts)",
        advanced=True,
        metavar="MODULES",
    )


@dataclass(frozen=True)
class MemoryConfig:
    """Where the base lives and what the step does to fit a GPU budget; none changes what trains
    except ``lmhead`` (topk) and ``seq_tile`` (summation order)."""

    gpu_budget: str = setting(
        "off",
        "off, fit (what the GPU has free), min (the smallest footprint) or a size like 12GiB: stream the "
        "base with narrows-stream",
        metavar="SIZE",
    )
    host_budget: str | None = setting(
        None,
        "host RAM the streamed base may hold, e.g. 24GiB; layers beyond it are read from the prepared "
        "cache on disk",
        advanced=True,
        metavar="SIZE",
        default_help="85% of available",
    )
    cache: str | None = setting(
        None,
        "folder of the prepared-slab cache of a streamed base; off: none, everything must fit --host-budget",
        advanced=True,
        metavar="DIR",
        default_help="$NARROWS_CACHE/slabs",
    )
    lmhead: str = setting(
        "auto",
        "auto (mask,chunked when narrows-lmhead is installed, else off), off, or e.g. mask,chunked,topk=1000 "
        "with narrows-lmhead",
        advanced=True,
        metavar="SPEC",
    )
    seq_tile: str = setting(
        "off",
        "off, auto (the planner tiles the MLP over the sequence only when --gpu-budget needs it) or tokens "
        "per tile, e.g. 2048, with narrows-stream; equal to untiled training up to summation order",
        advanced=True,
        metavar="TILE",
    )
    step_mode: bool | None = setting(
        None,
        "with --gpu-budget and --grad-accum N: each streamed layer loaded once for the forward of all N "
        "micro-batches and once for their backward (narrows.stream.StepTrainer); the same numbers as "
        "sequential accumulation. Not given: used where narrows-stream predicts it faster (the run says "
        "which and why)",
        advanced=True,
    )
    cuda_graphs: bool | None = setting(
        None,
        "with --gpu-budget: replay the layers narrows-stream runs as CUDA graphs, the same numbers, the plan "
        "counting their memory (faster at short sequences). Not given: the planner uses them where it "
        "predicts them faster (a mixture of experts: wherever a layer is recomputed and the pool costs no "
        "resident layer). A batch width is captured when it comes round again, and the four most recent "
        "are kept (unpacked, each batch is as wide as its longest row; with --packing every batch is "
        "--seq-len wide)",
        advanced=True,
    )
    offload_optimizer: bool = setting(
        False,
        "in step mode (implies it): the optimizer state waits in host memory, each layer updated on the GPU "
        "when its gradients are complete; the same numbers",
        advanced=True,
    )
    offload_adapters: bool = setting(
        False,
        "with --offload-optimizer (implies it): the adapters wait in host memory too, each layer's on the "
        "GPU only for its forward and its backward and update (one device slot, so CUDA graphs still "
        "replay); the same numbers, less GPU memory",
        advanced=True,
    )

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


@dataclass(frozen=True)
class TrainingConfig:
    """The optimizer's steps and schedule, the data order, and the ranks they run on."""

    steps: int = setting(
        40, "optimizer steps; with --resume: where the run now ends", at_least=1, metavar="N"
    )
    batch: int = setting(4, "sequences per micro-batch", at_least=1, metavar="N")
    grad_accum: int = setting(1, "micro-batches per step", at_least=1, metavar="N")
    lr: float = setting(5e-4, "peak learning rate, cosine decay after warmup")
    warmup: int | None = setting(
        None, "warmup steps", advanced=True, metavar="N", default_help="5% of --steps"
    )
    seed: int = setting(0, "seed for the adapter init, data order and dropout", at_least=0, advanced=True)
    save_every: int = setting(10, "checkpoint every N steps", at_least=1, advanced=True, metavar="N")
    deterministic: bool = setting(
        False,
        "deterministic kernels (torch.use_deterministic_algorithms, cuBLAS workspace): on CUDA the "
        "condition for streamed == resident bit for bit; the CPU is deterministic anyway",
    )
    pipeline_stages: int = setting(
        1,
        "split the model's layers into N contiguous blocks, one a rank (torchrun --nproc-per-node N), each "
        "streaming its own block under --gpu-budget; the --grad-accum micro-batches of a step run through "
        "them in flight (torch's 1F1B schedule). Needs --gpu-budget and --packing; the adapters equal one "
        "process accumulating the same micro-batches",
        at_least=1,
        advanced=True,
        metavar="N",
    )
    world_size: int = setting(
        1, "ranks the run trains on (torchrun), set by the launch", at_least=1, flag=False
    )

    @property
    def data_ranks(self) -> int:
        """The ranks each step's micro-batches are shared over: the launch's ranks over its
        pipeline stages (which share every micro-batch)."""
        return self.world_size // self.pipeline_stages


@dataclass(frozen=True)
class EvaluationConfig:
    """What is scored on held-out rows, and when."""

    eval_rows: int = setting(32, "held-out rows for the eval loss", at_least=0, advanced=True, metavar="N")
    eval_every: int | None = setting(
        None,
        "held-out loss every N steps, plus step 0 and the last",
        at_least=1,
        advanced=True,
        metavar="N",
        default_help="a quarter of --steps, 5 points in loss.png for the default 40",
    )
    exact_match: int = setting(
        8, "held-out GSM8K problems generated and scored, 0: off", at_least=0, advanced=True, metavar="N"
    )


@dataclass(frozen=True)
class ReportingConfig:
    """Where the run is written and shown."""

    out: str = setting("runs/default", "run folder, new or empty", metavar="DIR")
    report_to: str = setting(
        "none",
        "where the run shows up besides metrics.jsonl, as transformers' report_to: tensorboard (event files "
        "in RUN/tensorboard, needs narrows-core[tensorboard]), wandb (honours WANDB_MODE, WANDB_PROJECT; "
        "default project narrows; needs narrows-core[wandb]), comma-separated, all (those installed) or none, "
        "as transformers 5's TrainingArguments",
        metavar="LIST",
    )


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
    "pipeline_stages": "how the layers are split over the ranks (checkpoints hold the whole model's adapter "
    "and optimizer state); the numbers trained are one process accumulating the step's micro-batches",
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
    "expert_quant": "the routed experts are quantised to the new scheme from the resumed step on: the adapter goes "
    "on training against other base weights",
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


@dataclass(frozen=True)
class FinetuneConfig:
    """Everything a run depends on, by concern; saved in the run folder's ``config.json``
    with each setting under its own name (`settings`)."""

    base: BaseConfig = field(default_factory=BaseConfig)
    dataset: DataConfig = field(default_factory=DataConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    reporting: ReportingConfig = field(default_factory=ReportingConfig)

    @classmethod
    def of(cls, **settings: Any) -> FinetuneConfig:
        """The defaults with `settings` (by name: ``steps=200``) in their groups; an unknown
        name is a TypeError."""
        return cls().replace(**settings)

    @classmethod
    def from_dict(cls, settings: Mapping[str, Any], where: str) -> FinetuneConfig:
        """A configuration from a file's settings by name (`configfile` checks them first)."""
        unknown = sorted(set(settings) - set(SETTINGS))
        if unknown:
            raise NarrowsError(
                f"{where}: unknown settings {unknown}; it was written by another narrows version"
            )
        if "kernels" not in settings:  # written before fast layers: that run trained PEFT's kernels
            settings = {**settings, "kernels": "peft"}
        return cls.of(**settings)

    def replace(self, **settings: Any) -> FinetuneConfig:
        """A copy with `settings` (by name) changed; this one stays as it is."""
        changed: dict[str, dict[str, Any]] = {}
        for name, value in settings.items():
            if name not in SETTINGS:
                raise TypeError(f"FinetuneConfig has no setting {name!r}")
            changed.setdefault(SETTINGS[name], {})[name] = value
        groups = {g: dataclasses.replace(getattr(self, g), **v) for g, v in changed.items()}
        return dataclasses.replace(self, **groups)

    def settings(self) -> dict[str, Any]:
        """Every setting by name, group after group (what ``config.json`` holds)."""
        return {name: getattr(getattr(self, group), name) for name, group in SETTINGS.items()}

    @property
    def eval_interval(self) -> int:
        """Steps between held-out evaluations: a newcomer's 40 steps show 5 points (0, 10, ..., 40)."""
        every = self.evaluation.eval_every
        return every if every is not None else max(1, self.training.steps // 4)

    @property
    def warmup_steps(self) -> int:
        warmup = self.training.warmup
        return warmup if warmup is not None else max(1, self.training.steps // 20)

    def checked(self) -> FinetuneConfig:
        """This configuration checked, returned as a new one with what its settings imply
        filled in (``--offload-adapters`` implies ``--offload-optimizer``, which implies step
        mode); a bad one is refused (`NarrowsError`) before anything is loaded. The
        configuration it is called on is left as it is."""
        for name, value, meta in _bounded(self):
            choices = meta["choices"]
            if choices is not None and value not in choices:
                raise NarrowsError(f"--{flag_of(name)} must be {_either(choices)}, got {value!r}")
            least = meta["at_least"]
            if least is not None and value is not None and value < least:
                more = "at least 1" if least == 1 else f"{least} or more"
                raise NarrowsError(f"--{flag_of(name)} must be {more}, got {value}")
        b, a, m, t = self.base, self.lora, self.memory, self.training
        if not (math.isfinite(t.lr) and t.lr > 0):
            raise NarrowsError(f"--lr must be a positive number (e.g. 5e-4), got {t.lr}")
        if t.warmup is not None and not 0 <= t.warmup <= t.steps:
            raise NarrowsError(f"--warmup must be between 0 and --steps ({t.steps}), got {t.warmup}")
        if not (math.isfinite(a.dropout) and 0 <= a.dropout < 1):
            raise NarrowsError(f"--dropout must be in [0, 1), got {a.dropout}")
        if a.alpha is not None and not (math.isfinite(a.alpha) and a.alpha > 0):
            raise NarrowsError(f"--alpha must be a positive number, got {a.alpha}")
        if not a.targets.strip(", "):
            raise NarrowsError("--targets is empty; give all-linear or module names such as q_proj,v_proj")
        if "experts" in (t.strip() for t in a.targets.split(",")) and (a.dropout or a.adapter != "lora"):
            raise NarrowsError(
                "--targets with experts: PEFT's LoRA on fused expert stacks takes no dropout and no DoRA; "
                "give --dropout 0 and --adapter lora, or leave experts out of --targets"
            )
        self._check_inputs()
        if b.lora_dtype == "float32" and b.kernels != "fast":
            raise NarrowsError(
                "--lora-dtype float32 is the fast layers' option; with --kernels peft PEFT computes "
                "the adapters in their own dtype already: give --lora-dtype auto (or leave it out)"
            )
        if a.adapter == "dora":
            require("narrows.dora", "--adapter dora")
        if b.expert_quant not in ("auto", "nf4") and b.quant != "nf4":
            raise NarrowsError(
                f"--expert-quant {b.expert_quant} sets how a mixture of experts' routed experts are quantised "
                "along with the rest of the base: give --quant nf4 too (or leave --expert-quant out)"
            )
        if b.quant == "nf4":
            require("bitsandbytes", "--quant nf4")
        self._check_stages()  # before the memory's checks: their refusals of several ranks are data parallel's
        memory = self._checked_memory()
        if m.lmhead not in ("auto", "off"):  # auto and off import nothing: the CLI stays without torch
            lmhead_options(m.lmhead)
        m.tile()
        parse_report_to(self.reporting.report_to)
        return dataclasses.replace(self, memory=memory)

    def _check_inputs(self) -> None:
        b, d = self.base, self.dataset
        if b.model is None and d.data is not None:
            raise NarrowsError(
                "--data needs --model too (the embedded default model comes with its own data)"
            )
        if b.model is not None and d.data is None:
            raise NarrowsError(
                "--model needs --data (a local JSONL, parquet, arrow, csv or json file, or a "
                "save_to_disk folder)"
            )
        for flag, split, of, source in (
            ("--data-split", d.data_split, "--data", d.data),
            ("--eval-split", d.eval_split, "--eval-data", d.eval_data),
        ):
            if split is not None and source is None:
                raise NarrowsError(f"{flag} chooses a split of {of}: give {of} too, or drop {flag}")
        if d.columns is not None:
            if d.data is None:
                raise NarrowsError(
                    "--columns renames the columns of --data: give --data too, or drop --columns"
                )
            parse_columns(d.columns)
        if d.data is not None:
            open_source(d.data, d.data_split)  # a local path, of a kind narrows reads
        if d.eval_data is not None:
            open_source(d.eval_data, d.eval_split, flag="--eval-data")

    def _check_stages(self) -> None:
        """``--pipeline-stages``: what its stages need and what they do not cover yet."""
        t, m, d = self.training, self.memory, self.dataset
        n = t.pipeline_stages
        if n == 1:
            return
        if t.world_size != n:
            raise NarrowsError(
                f"--pipeline-stages {n} puts one block of layers on each rank: launch {n} ranks "
                f"(torchrun --nproc-per-node {n} -m narrows.core.app.cli finetune ...); this launch has "
                f"{t.world_size}. Pipeline stages do not combine with data parallelism yet"
            )
        if t.grad_accum < n:
            raise NarrowsError(
                f"--pipeline-stages {n} runs each step's --grad-accum micro-batches through the stages, at least one "
                f"a stage (torch's 1F1B schedule): give --grad-accum {n} or more (now {t.grad_accum}); more "
                f"micro-batches leave the stages idle less, ({n} - 1) of every --grad-accum + {n} - 1 slots"
            )
        needs = [
            (
                m.gpu_budget == "off",
                "--gpu-budget (each stage streams its layers within it, e.g. 16GiB or min)",
            ),
            (
                not d.packing,
                "--packing (every micro-batch one --seq-len wide, so the stages' buffers fit each)",
            ),
        ]
        refused = [
            (self.lora.dropout > 0, "--dropout (the stages draw masks at other moments than one process)"),
            (
                m.step_mode is True,
                "--step-mode (block-major accumulation; the schedule runs the micro-batches)",
            ),
            (
                m.offload_optimizer or m.offload_adapters,
                "--offload-optimizer and --offload-adapters (they run in step mode)",
            ),
        ]
        missing = [what for off, what in needs if off]
        if missing:
            raise NarrowsError(f"--pipeline-stages {n} needs " + " and ".join(missing))
        given = [what for on, what in refused if on]
        if given:
            raise NarrowsError(
                f"--pipeline-stages {n} does not run with "
                + "; nor with ".join(given)
                + ": drop it, or the stages"
            )

    def _checked_memory(self) -> MemoryConfig:
        """The memory settings checked, with the offloads' implications filled in."""
        m, t = self.memory, self.training
        if m.gpu_budget != "off":
            require("narrows.stream", "--gpu-budget")
            if m.gpu_budget not in ("fit", "min"):
                size("--gpu-budget", m.gpu_budget)
        if m.host_budget is not None:
            if m.gpu_budget == "off":
                raise NarrowsError(
                    "--host-budget bounds the host copy of a streamed base: add --gpu-budget "
                    "(e.g. --gpu-budget 12GiB), or drop --host-budget"
                )
            size("--host-budget", m.host_budget)
        if m.cache is not None and m.gpu_budget == "off":
            raise NarrowsError(
                "--cache holds the prepared slabs of a streamed base: add --gpu-budget, or drop --cache"
            )
        for flag, on in (
            ("step-mode", m.step_mode),
            ("offload-optimizer", m.offload_optimizer),
            ("offload-adapters", m.offload_adapters),
            ("cuda-graphs", m.cuda_graphs),
        ):
            if on and m.gpu_budget == "off":
                raise NarrowsError(
                    f"--{flag} applies to the layers of a streamed base: add --gpu-budget "
                    f"(e.g. --gpu-budget 12GiB), or drop --{flag}"
                )
        flag = "--step-mode"
        hosted = "--offload-adapters" if m.offload_adapters else "--offload-optimizer"
        if m.offload_adapters:
            if t.grad_accum < 2:
                raise NarrowsError(
                    "--offload-adapters keeps one layer's adapters on the GPU at a time, which a "
                    "block-major step of several micro-batches does: add --grad-accum N (N ≥ 2), "
                    "or use --offload-optimizer alone"
                )
            # each layer's adapters go back to host memory after its update
            m = dataclasses.replace(m, offload_optimizer=True)
        if m.offload_optimizer and m.step_mode is None:
            m = dataclasses.replace(m, step_mode=True)  # the optimizer state waits in host memory
            flag = f"{hosted} (which runs in step mode)"
        if m.step_mode and t.world_size > 1:
            raise NarrowsError(
                f"{flag} is not supported on several ranks yet (this run has {t.world_size}): step mode writes "
                f"each layer's gradients itself, past DistributedDataParallel's all-reduce. Drop {flag.split()[0]}, "
                "or run it in one process"
            )
        if m.offload_optimizer and m.step_mode is False:
            raise NarrowsError(
                f"{hosted} updates each layer inside a step-mode step, and step mode is off "
                "(--no-step-mode, or the settings a resumed run started with): add --step-mode, or "
                f"drop {hosted}"
            )
        return m


GROUPS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(FinetuneConfig)}  # type: ignore[misc]
# setting name -> the group that holds it; the names are unique across the groups
SETTINGS: dict[str, str] = {f.name: group for group, kind in GROUPS.items() for f in dataclasses.fields(kind)}
assert not set(SETTINGS) & set(GROUPS), "a group is named like a setting"


def leaves() -> Iterator[tuple[str, dataclasses.Field]]:
    """(group, field) of every setting, group after group."""
    for group, kind in GROUPS.items():
        for f in dataclasses.fields(kind):
            yield group, f


def _bounded(cfg: FinetuneConfig) -> Iterator[tuple[str, Any, Mapping[str, Any]]]:
    for group, f in leaves():
        yield f.name, getattr(getattr(cfg, group), f.name), f.metadata


def _either(choices: tuple[str, ...] | Mapping[str, str]) -> str:
    """``a, b or c``; with what each means where `choices` says: ``a (this) or b (that)``."""
    said = [f"{c} ({choices[c]})" if isinstance(choices, Mapping) else c for c in choices]
    return ", ".join(said[:-1]) + " or " + said[-1]


def flag_of(name: str) -> str:
    """A setting's flag without its dashes: ``grad_accum`` -> ``grad-accum``."""
    return name.replace("_", "-")


def lmhead_options(text: str) -> LossOptions | None:
    """``--lmhead`` as narrows-lmhead's own `LossOptions` (None: off); ``auto`` is
    ``mask,chunked`` where narrows-lmhead is installed and off where it is not. A value other
    than auto or off needs narrows-lmhead; a malformed one is a `NarrowsError` naming the flag."""
    if text == "auto":
        text = "mask,chunked" if is_available("narrows.lmhead") else "off"
    if text == "off":
        return None
    lmhead = require("narrows.lmhead", "--lmhead")
    try:
        return lmhead.LossOptions.parse(text)
    except ValueError as e:
        raise NarrowsError(f"--lmhead {text!r}: {e}") from None


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
    before = started.settings()
    for name, new in wanted.items():
        old = before[name]
        if new is None or new == old:
            continue
        kind = free if name in RESUMABLE else overridden if name in OVERRIDABLE else fixed
        kind[name] = (old, new)
    return Changes(free, overridden, fixed)
