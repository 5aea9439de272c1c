"""narrows beside its peers on one GPU: narrows with its fast kernels and with PEFT's,
Unsloth, and PEFT with and without HF gradient checkpointing, on the same random checkpoint and
the same token stream, each mode in its own process.

What every row shares: one checkpoint *folder* per model, built once from seeded random weights
(`_models.random_model`, layer by layer) with a byte-level tokenizer, and loaded by every mode;
LoRA r16, alpha 32, on the same modules in every row; no dropout unless ``--dropout P`` gives
every row's adapters (the twins' too) that dropout; AdamW at lr 1e-4; bf16
compute; seeded random token ids over the model's vocabulary, the same batches in the same order
(stream_qlora.py's stream); G micro-batches per optimizer step, each loss scaled by 1/G.
`base_of` tells the two kinds of model apart, the one place that does:

- a dense model: the folder is pre-quantised bitsandbytes NF4 (transformers' 4-bit serialisation,
  `quantization_config` in config.json), loaded as stored by every mode; LoRA on q, k, v, o,
  gate, up and down.
- a mixture of experts (``qwen3-30b-a3b-6l-8x512``: Qwen3-30B-A3B's shape, 6 of 48 layers):
  bitsandbytes cannot quantise transformers 5's fused 3-D expert stacks, so the folder is bf16
  (`save_pretrained`, ~9 GB) and each mode quantises it as it loads: the main job with ``--quant
  nf4`` and the stream_qlora.py modes through narrows' loader (attention linears and expert
  stacks in NF4), Unsloth with ``load_in_4bit=True`` (its own MoE handling), PEFT through
  transformers' `BitsAndBytesConfig` (NF4, double quant: its expert stacks stay bf16). Every
  row says how its experts ended up (``experts``: tensor classes, dtypes, bytes). LoRA on q, k,
  v and o only, narrows' default on a MoE (routers and routed experts frozen); each row lists
  the modules its adapters sit on (``lora_targets``).

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
PEFT's LoRA on the targets `base_of` names, with HF gradient checkpointing for ``-ckpt``: no
narrows code in the process); any
``finetune-<budget>`` (the main job: see below); any other is a mode of stream_qlora.py run
over the folder (``stream-8GiB-lmhead-fast``, ``stream-min-lmhead``, ``resident-ckpt-fast``,
``resident``, ...: see its docstring).

The main job, ``finetune-<budget>`` (``finetune-8GiB``, ``finetune-min``, ``finetune-off``;
suffixes ``-eager``: ``--no-cuda-graphs``, ``-graphs``: ``--cuda-graphs``, ``-peft``: ``--kernels
peft``): ``python -m narrows.core.app.cli finetune --model FOLDER --data FILE --packing
--gpu-budget <budget> --batch B --grad-accum G --seq-len S --steps <warm-up + timed> --rank 16
--alpha 32 --lr 1e-4 --eval-rows 0 --exact-match 0 ...`` in its own process, as a user runs it:
over a pre-quantised folder no ``--quant`` (its quantization_config says NF4, and the loader
takes its packed weights as they are whatever ``--quant`` says), over a bf16 one ``--quant
nf4``; the default ``--targets all-linear`` (the seven projections on a dense model, attention
on Qwen3-MoE: the row checks its adapter_config.json names the other rows' targets,
``same_lora_as_peers``), the job's own AdamW and cosine
schedule. Its data (written once into --work): text rows of seeded random ASCII, every token
trained, each longer than S tokens under the byte-level tokenizer, so the job truncates each to
S and ``--packing`` fills every sequence with one whole row (B × S real tokens a micro-batch).
The row reads the run folder's metrics.jsonl: ``step_s`` of the steps after the warm-up (the
job times each step with the device synchronised), min / median / max, and the largest
``peak_bytes`` (the job's peak: CUDA's allocated peak plus narrows-stream's graph pool; on a CPU
the process's RSS), beside the process's wall time and summary.json's plan (resident layers,
CUDA graphs and why). ``--host-profile`` runs the job once more in a process of its own through
benchmarks/_profiled_job.py: after the warm-up, --steps steps measure the main thread's CPU
seconds a step without a profiler (its waits on the GPU made to block, not spin, so they cost
no CPU), then --steps more run under cProfile, then one under torch.profiler; the row's
``host_profile`` holds both, the top 30 functions by own time (ms and calls a step) and the
device's side of that step (busy time by kind of kernel, the compute stream's idle gaps), then
one listing the host's waits on the device by the frames that made them; the pstats file and
the torch.profiler step's Chrome trace (``.trace.json.gz``) land beside --out. ``--device-profile``
does the same for the peers' rows (Unsloth, PEFT): one step more under torch.profiler after the
timed ones, its summary in the row's ``device_profile``, its trace beside --out.
Against Unsloth (staged as below, carrying .gpu and .gpu-unsloth), on the GPU machine:

    source .gpu/env && python3 benchmarks/peers.py --shape 7b-8x512 --modes unsloth,finetune-8GiB --host-profile --out $OUT/peers_7b_8x512_main_job.json

Stage here first (PyPI reachable): ../shared/gpu/stage && bash benchmarks/stage_unsloth.sh. Then on
the GPU machine, from the checkout root, carrying .gpu and .gpu-unsloth:

    source .gpu/env && python3 benchmarks/peers.py --shape 7b-8x512 --timeout 240 --out $OUT/peers_7b-8x512.json

The mixture of experts the same way (the bf16 folder takes about a minute to write):

    source .gpu/env && python3 benchmarks/peers.py --shape qwen3-30b-a3b-6l-8x512 --steps 10 --warmup 3 --out $OUT/peers_qwen3-30b-a3b-6l-8x512.json

(`bash -c 'source .gpu-unsloth/env && python3 benchmarks/peers.py --check-unsloth'` lists what
Unsloth's staged packages declare and that machine lacks.) The folder is kept under --work and
reused by the next run of the same model while the machine stays warm.

The smoke form on a CPU (Unsloth's rows are skipped there: its kernels are Triton):

    uv run --no-sync python benchmarks/peers.py --shape tiny --steps 2 --warmup 1 --out /tmp/peers_tiny.json
    uv run --no-sync python benchmarks/peers.py --shape tiny --modes finetune-off,finetune-min --steps 2 --warmup 1 --host-profile --out /tmp/peers_tiny_main_job.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import shutil
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

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
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
    # a mixture of experts: Qwen3-30B-A3B's shape, 6 of its 48 layers (see `base_of`)
    "qwen3-30b-a3b-6l-8x512": Shape(
        "qwen3-30b-a3b-6l", 8, 512, 1, "finetune-8GiB,finetune-min,stream-8GiB-lmhead-fast,unsloth,peft-ckpt"
    ),
    "tiny": Shape(
        "qwen2-tiny", 2, 64, 1, "stream-min-lmhead-fast,resident-ckpt-fast,resident,unsloth,peft,peft-ckpt"
    ),
}

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class Base:
    """What every row of one model shares beyond its shape: how its folder stores the weights
    and which modules every mode's LoRA adapts."""

    moe: bool  # routed experts in fused 3-D stacks (transformers 5)
    stored: str  # the folder's weights: "nf4" (pre-quantised, loaded as stored) or "bf16" (quantised at load)
    targets: tuple[str, ...]  # every row's LoRA targets
    experts: tuple[str, ...] = ()  # with --experts: the routed experts' stacks every row adapts too

    @property
    def unsloth_targets(self) -> list[str]:
        """Unsloth's target_modules: its get_peft_model turns gate/up/down names into the
        routed experts' target_parameters on a mixture of experts."""
        return list(self.targets) + (["gate_proj", "up_proj", "down_proj"] if self.experts else [])


def base_of(model: str, experts: bool = False) -> Base:
    """The one place that tells a dense model from a mixture of experts. Dense: a pre-quantised
    NF4 folder, LoRA on the seven projections. A mixture of experts: bitsandbytes cannot quantise
    transformers 5's fused 3-D expert stacks, so a pre-quantised folder would hold them in bf16
    anyway; its folder is bf16 and each mode quantises it as it loads, and LoRA is on attention
    only, narrows' default there (`narrows.core.lora_targets`: routers and routed experts
    frozen; with no shared experts, as in Qwen3-MoE, that leaves the attention linears).
    `experts` (--experts) adds the routed experts' stacks to every row's targets, each as PEFT's
    ``target_parameters`` (narrows: ``--targets all-linear,experts``)."""
    config = _models.load_config(model)
    if getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None):
        stacks = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj") if experts else ()
        return Base(moe=True, stored="bf16", targets=ATTENTION, experts=stacks)
    if experts:
        raise SystemExit(f"--experts: {model} is not a mixture of experts")
    return Base(moe=False, stored="nf4", targets=_models.TARGETS)


def folder_of(args: argparse.Namespace) -> Path:
    """The model's folder under --work, named by config and storage."""
    # (not .stem: "qwen2.5-7b" and "qwen2.5-32b" both have the stem "qwen2", and the second reused the first's folder)
    return Path(args.work) / f"{Path(args.model).name.removesuffix('.json')}-{base_of(args.model).stored}"


# --- the checkpoint folder ---------------------------------------------------------------------
def build_folder(config_name: str, folder: Path, *, seed: int = 0, shard_bytes: int = 4 << 30) -> Path:
    """A checkpoint folder of `config_name`'s shape with seeded random weights
    (`_models.random_model`) and a byte-level tokenizer, stored as `base_of` says. NF4: a
    pre-quantised folder, as transformers saves a bitsandbytes 4-bit model: each packed weight
    beside its quant state (absmax, quant_map, nested_absmax, nested_quant_map,
    quant_state.bitsandbytes__nf4), the embedding and head in bf16, `quantization_config` in
    config.json. bf16 (a mixture of experts): transformers' `save_pretrained` of the bf16 model,
    no quantization_config (the whole model passes through host RAM: ~9 GB for Qwen3-30B-A3B's
    6 layers). Kept and reused while its `complete` marker is there."""
    if (folder / "complete").is_file():
        kept = json.loads((folder / "config.json").read_text())
        want = _models.load_config(config_name)
        shape = ("hidden_size", "num_hidden_layers", "intermediate_size")
        if any(kept.get(k) != getattr(want, k) for k in shape):
            raise SystemExit(
                f"{folder} holds another model's shape than {config_name}: remove it or pick another --work"
            )
        return folder
    from narrows.core.testing import tiny_tokenizer

    part = folder.with_name(folder.name + ".part")
    if part.exists():  # an interrupted earlier attempt
        shutil.rmtree(part)
    part.mkdir(parents=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    nf4 = base_of(config_name).stored == "nf4"
    model = _models.random_model(_models.load_config(config_name), seed=seed, work_device=device, nf4=nf4)
    tokenizer = tiny_tokenizer()
    model.config.pad_token_id, model.config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    if nf4:
        save_nf4(model, part, shard_bytes)
    else:
        model.save_pretrained(part, max_shard_size=shard_bytes)
    tokenizer.save_pretrained(part)
    (part / "complete").write_text(json.dumps({"config": config_name, "seed": seed}))
    del model
    if folder.exists():  # an incomplete earlier attempt
        shutil.rmtree(folder)
    part.rename(folder)
    return folder


def save_nf4(model, part: Path, shard_bytes: int) -> None:
    """A bitsandbytes NF4 model's tensors and config, as transformers saves a 4-bit model."""
    from safetensors.torch import save_file
    from transformers import BitsAndBytesConfig

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
    config.save_pretrained(part)


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
    row = {"step_s": times, "peak_allocated": peak, "final_loss": losses[-1], "losses": losses}
    if getattr(args, "device_trace", None) and device.type == "cuda":
        # one step more, after the timed ones, under torch.profiler: where this row's device time goes
        from _profiled_job import start_device_profile, stop_device_profile

        sync(device)
        prof, t = start_device_profile(), time.perf_counter()
        step()
        sync(device)
        row["device_profile"] = stop_device_profile(prof, time.perf_counter() - t, args.device_trace)
    return row


def adapter_fingerprint(model) -> list[float]:
    """Sum and sum of squares of every LoRA A weight, in float64: the same values in two rows mean
    the same initial adapters (B is zero at the start in every mode)."""
    a = [p.detach().double() for n, p in model.named_parameters() if "lora_A" in n]
    return [float(sum(x.sum() for x in a)), float(sum((x * x).sum() for x in a))]


def lora_modules(model) -> list[str]:
    """The names (last part) of the modules that carry LoRA adapters: every row's, to compare."""
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if hasattr(m, "lora_A")})


def experts_stored(model) -> dict | None:
    """How a mixture of experts' routed experts are held once a mode has loaded the model: the
    tensors under an ``experts`` module, their classes and dtypes, and their bytes as held (a
    4-bit tensor's quant state apart). None on a dense model."""
    held = [
        t
        for n, t in itertools.chain(model.named_parameters(), model.named_buffers())
        if ".experts." in f".{n}"
    ]
    if not held:
        return None
    kinds = sorted({f"{type(t).__name__} {t.dtype}" for t in held})
    return {"tensors": len(held), "kinds": kinds, "bytes": sum(t.nbytes for t in held)}


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
    """PEFT as its users run it: transformers loads the folder in NF4 (bitsandbytes Linear4bit:
    the pre-quantised folder as stored; a bf16 folder quantised as it loads, through
    `BitsAndBytesConfig`, which leaves a mixture of experts' fused expert stacks in bf16: the
    row's `experts` says), PEFT adds the adapters; `-ckpt`: HF gradient checkpointing,
    non-reentrant. No `prepare_model_for_kbit_training`: it would cast the head and norms to
    float32, and every row computes in bf16."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    base = base_of(args.model, args.experts)
    t = time.perf_counter()
    place = {"": torch.cuda.current_device() if device.type == "cuda" else "cpu"}
    quant = {}
    if base.stored != "nf4":
        quant["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        )
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.bfloat16, attn_implementation=args.attn, device_map=place, **quant
    )
    experts = experts_stored(model)
    torch.manual_seed(0)  # as stream_qlora.run_one before add_lora: the same initial adapters
    model = _models.add_lora(
        model, dropout=args.dropout, targets=base.targets, parameters=base.experts
    ).train()
    model.config.use_cache = False
    if args.run_one.endswith("-ckpt"):
        stream_qlora.checkpointing(model, offload=False)
        model.enable_input_require_grads()
    load_s = time.perf_counter() - t
    return {
        "load_s": load_s,
        "adapters_init": adapter_fingerprint(model),
        "lora_targets": lora_modules(model),
        "experts": experts,
        **train(model, args, model.config.vocab_size, device),
    }


def run_unsloth(args: argparse.Namespace, folder: Path, device: torch.device) -> dict:
    """Unsloth as its users run it: FastLanguageModel loads the folder in 4 bits (the
    pre-quantised folder as stored; a bf16 folder quantised as it loads, a mixture of experts'
    fused expert stacks as Unsloth does: the row's `experts` says how they ended up), its
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
    experts = experts_stored(model)
    model = FastLanguageModel.get_peft_model(
        model,
        r=16,
        lora_alpha=32,
        lora_dropout=args.dropout,
        target_modules=base_of(args.model, args.experts).unsloth_targets,
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
        "lora_targets": lora_modules(model),
        "experts": experts,
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
    """A stream_qlora.py mode, its model read from the folder (narrows' block loader, in NF4: a
    pre-quantised folder as stored, a bf16 one quantised layer by layer as it loads, a mixture
    of experts' expert stacks included) instead of built by `_models.random_nf4_model`, its
    adapters on the run's targets: stream_qlora.run_one imports both names at call time, so
    the child swaps them here; nothing else of the mode changes."""
    from narrows.core.io.loader import load_blockwise

    add_lora = _models.add_lora
    seen: dict = {}

    def from_folder(config, *, seed: int = 0, work_device: str = "cpu", attn: str = "sdpa"):
        t = time.perf_counter()
        with torch.random.fork_rng(devices=[]):  # the loader draws nothing the adapters' init would see
            model = load_blockwise(folder, dtype=torch.bfloat16, quant="nf4", device=work_device)
        model.set_attn_implementation(attn)
        seen["load_s"] = time.perf_counter() - t
        seen["experts"] = experts_stored(model)
        return model

    def lora(model, **kw):
        if args.dropout:  # the run's dropout over the mode's
            kw["dropout"] = args.dropout
        seen["lora_dropout"] = kw.get("dropout", 0.0)
        model = add_lora(model, targets=base_of(args.model).targets, **kw)
        seen["adapters_init"] = adapter_fingerprint(model)
        seen["lora_targets"] = lora_modules(model)
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
    spread(row, args)
    return row


def spread(row: dict, args: argparse.Namespace) -> None:
    """The row's min / median / max seconds a step over its timed steps, and tokens a second
    at the median."""
    steps = row.get("step_s")
    if steps:
        row.update(
            min_s_per_step=min(steps), median_s_per_step=statistics.median(steps), max_s_per_step=max(steps)
        )
    row.setdefault("median_s_per_step", row.get("s_per_step"))  # stream_qlora's mean, where no per-step times
    row["tokens_per_s"] = args.batch * args.seq * args.grad_accum / row["median_s_per_step"]


# --- the main job: `narrows finetune`, each run its own process -------------------------------
JOB_SUFFIXES = {"eager": ["--no-cuda-graphs"], "graphs": ["--cuda-graphs"], "peft": ["--kernels", "peft"]}


def is_job(mode: str) -> bool:
    return mode.split("-")[0] == "finetune"


def job_data(work: Path, seq: int, rows: int) -> Path:
    """Training data the main job reads, written once: `rows` text rows (every token trains) of
    seeded random ASCII, each `seq` + 64 characters, one token a character under the folder's
    byte-level tokenizer: the job truncates each to `seq` tokens and `--packing` puts one whole
    row in each sequence."""
    import random
    import string

    path = work / f"finetune-text-{seq}x{rows}.jsonl"
    if not path.is_file():
        rng = random.Random(0)
        chars = string.ascii_letters + string.digits + " .,;:!?-"
        part = path.with_name(path.name + ".part")
        with part.open("w") as f:
            for _ in range(rows):
                f.write(json.dumps({"text": "".join(rng.choices(chars, k=seq + 64))}) + "\n")
        part.rename(path)
    return path


def job_argv(
    args: argparse.Namespace, mode: str, folder: Path, data: Path, out: Path, steps: int
) -> list[str]:
    """The CLI's arguments for `mode` (finetune-<budget>[-suffix...]): what a user types."""
    budget, *suffixes = mode.split("-")[1:]
    unknown = [x for x in suffixes if x not in JOB_SUFFIXES]
    if unknown:
        raise ValueError(f"{mode}: unknown suffix {unknown}; known: {sorted(JOB_SUFFIXES)}")
    # a pre-quantised folder: no --quant (its quantization_config says NF4, loaded as it is);
    # a bf16 one (a mixture of experts'): --quant nf4, the linears and expert stacks quantised as it loads
    quant = ["--quant", "nf4"] if base_of(args.model).stored != "nf4" else []
    argv = ["finetune", "--model", str(folder), *quant]
    argv += ["--data", str(data), "--packing", "--gpu-budget", budget]
    argv += ["--batch", str(args.batch), "--grad-accum", str(args.grad_accum), "--seq-len", str(args.seq)]
    argv += ["--steps", str(steps), "--rank", "16", "--alpha", "32", "--dropout", str(args.dropout)]
    argv += ["--lr", "1e-4", "--eval-rows", "0", "--exact-match", "0", "--save-every", str(steps)]
    argv += ["--targets", "all-linear,experts"] if args.experts else []
    argv += ["--no-progress", "--out", str(out)]
    return argv + [flag for x in suffixes for flag in JOB_SUFFIXES[x]]


def run_job(args: argparse.Namespace, mode: str, folder: Path, prof: Path | None = None) -> dict:
    """The main job in its own process over the folder, then its run folder read: the timed
    steps' ``step_s`` and ``peak_bytes`` (metrics.jsonl), the plan it chose (summary.json), the
    adapters it trained (adapter_config.json). With `prof`: `host_profile` too."""
    work = Path(args.work)
    micro = args.batch * args.grad_accum  # rows a step: enough for every run's steps, none twice
    data = job_data(work, args.seq, max(64, micro * (max(1, args.warmup) + 2 * args.steps + 2)))
    run_dir = work / f"run-{mode}"
    total = args.warmup + args.steps
    try:
        argv = job_argv(args, mode, folder, data, run_dir, total)
    except ValueError as e:
        return {"mode": mode, "error": str(e)}
    shutil.rmtree(run_dir, ignore_errors=True)  # the job wants a new or empty run folder
    row: dict = {"mode": mode, "command": shlex.join(["python", "-m", "narrows.core.app.cli", *argv])}
    t = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "narrows.core.app.cli", *argv],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=args.timeout,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
    except subprocess.TimeoutExpired:
        return {**row, "error": f"timed out after {args.timeout} s"}
    row.update(wall_s=time.perf_counter() - t, returncode=proc.returncode)
    row["said"] = [x[:300] for x in proc.stderr.splitlines() if x.startswith("narrows:")][:40]
    metrics = run_dir / "metrics.jsonl"
    steps = (
        [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.is_file() else []
    )
    steps = [m for m in steps if "step_s" in m]
    if proc.returncode != 0 or len(steps) != total:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-6:] or ["no output"]
        return {**row, "error": f"{len(steps)} of {total} steps logged: " + " | ".join(tail)[-900:]}
    timed = steps[args.warmup :]
    summary = json.loads((run_dir / "summary.json").read_text())
    lora = json.loads((run_dir / "adapter_config.json").read_text())
    cuda = summary["device"].startswith("cuda")
    peak = max(m["peak_bytes"] for m in timed)
    row.update(
        step_s=[m["step_s"] for m in timed],
        losses=[m["loss"] for m in timed],
        final_loss=timed[-1]["loss"],
        peak_allocated=peak if cuda else None,
        peak_bytes=peak,
        peak_is="CUDA allocated peak + narrows-stream's graph pool"
        if cuda
        else "process RSS high-water mark",
        load_s=summary["setup_s"],  # files checked, data tokenised, model loaded, adapters built
        job={k: summary.get(k) for k in ("device", "dtype", "kernels", "setup_s", "train_s", "tokens_per_s")},
        plan=summary.get("stream"),  # resident layers, CUDA graphs and why, accumulation: streamed runs only
        lora={k: lora.get(k) for k in ("r", "lora_alpha", "lora_dropout")}
        | {
            "target_modules": sorted(lora.get("target_modules") or []),
            "target_parameters": sorted(lora.get("target_parameters") or []),
        },
        same_lora_as_peers=sorted(lora.get("target_modules") or []) == sorted(base_of(args.model).targets)
        and sorted(lora.get("target_parameters") or []) == sorted(base_of(args.model, args.experts).experts)
        and lora.get("r") == 16
        and lora.get("lora_alpha") == 32,
        data={"file": str(data), "format": "text, every token trained", "packing": True},
        versions=versions(),
        printed=[x for x in proc.stdout.splitlines() if x.strip() and not x.startswith("step ")][:40],
    )
    spread(row, args)
    if prof is not None:
        row["host_profile"] = job_host_profile(args, mode, folder, data, prof)
    return row


def job_host_profile(args: argparse.Namespace, mode: str, folder: Path, data: Path, prof: Path) -> dict:
    """The same job once more, in a process of its own through _profiled_job.py: the main
    thread's CPU seconds a step over --steps steps after the warm-up, no profiler, its waits on
    the GPU blocking (no spinning); then --steps steps under cProfile, its top functions by
    own (wall) time a step; the pstats file at `prof`."""
    work = Path(args.work)
    warmup = max(1, args.warmup)  # the measurement starts at a warm-up step's row
    run_dir, stats = work / f"run-{mode}-profiled", work / f"host-profile-{mode}.json"
    argv = job_argv(args, mode, folder, data, run_dir, warmup + 2 * args.steps + 2)
    shutil.rmtree(run_dir, ignore_errors=True)
    stats.unlink(missing_ok=True)
    cmd = [sys.executable, str(HERE / "_profiled_job.py"), "--warmup", str(warmup)]
    cmd += ["--plain", str(args.steps), "--profiled", str(args.steps), "--device-profile", "--sync-debug"]
    cmd += ["--stats", str(stats), "--trace", str(prof.with_suffix(".trace.json.gz"))]
    cmd += ["--prof", str(prof), "--", *argv]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=2 * args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {2 * args.timeout} s"}
    if not stats.is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-6:] or ["no output"]
        return {"error": " | ".join(tail)[-900:], "returncode": proc.returncode}
    out = json.loads(stats.read_text())
    out.pop("argv", None)  # the row's command, with --steps and --out of this run
    if "plain" in out:
        plain, profiled = out["plain"], out["profiled"]
        out.update(
            host_s_per_step=plain["median_thread_cpu_s"],  # the main thread's CPU time, no profiler
            host_run_step_s=plain["median_step_s"],  # those steps' own step_s (this process's)
            profiled_host_s_per_step=profiled["median_thread_cpu_s"],
            profiled_step_s=profiled["median_step_s"],
            pstats=prof.name,
        )
    return out


# --- the parent --------------------------------------------------------------------------------
def family(mode: str) -> str:
    if mode == "unsloth":
        return "Unsloth"
    if is_job(mode):
        return "narrows finetune, the main job"
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
    if is_job(mode):
        return None, "the main job: its own data, schedule and seeds"
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
    flags += ["--experts"] if args.experts else []
    if args.device_profile and not twin:
        flags += [
            "--device-trace",
            str(Path(args.out).resolve().with_name(f"{Path(args.out).stem}.{mode}.trace.json.gz")),
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
        "| mode | what | peak GiB | median s/step | min–max | tokens/s | final loss | vs Unsloth s/step "
        "| = resident |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "final_loss" not in r:
            lines.append(
                f"| `{r['mode']}` | {family(r['mode'])} | {r.get('skipped') or r.get('error', '')[:120]} |||||||"
            )
            continue
        peak = f"{r['peak_allocated'] / gib:.2f}" if r.get("peak_allocated") else "–"
        vs = f"{r['median_s_per_step'] / ref['median_s_per_step']:.2f}" if ref else "–"
        span = f"{r['min_s_per_step']:.3f}–{r['max_s_per_step']:.3f}" if "min_s_per_step" in r else "–"
        lines.append(
            f"| `{r['mode']}` | {family(r['mode'])} | {peak} | {r['median_s_per_step']:.3f} | {span} | "
            f"{r['tokens_per_s']:.0f} | {r['final_loss']:.4f} | {vs} | {twin_cell(r.get('twin'))} |"
        )
    for r in rows:
        host = r.get("host_profile") or {}
        if "host_s_per_step" in host:
            waits = host.get("sync_after", host.get("sync"))
            lines.append(
                f"\n`{r['mode']}` host: the main thread's CPU {host['host_s_per_step']:.3f} s a step "
                f"(step_s {host['host_run_step_s']:.3f} s; waits on the device: {waits}; under "
                f"cProfile {host['profiled_host_s_per_step']:.3f} of {host['profiled_step_s']:.3f} s); "
                "top own time a step:"
            )
            lines += [
                f"    {f['tottime_ms_per_step']:8.2f} ms {f['calls_per_step']:8.0f} calls  {f['function']}"
                for f in host["top_tottime"][:10]
            ]
            dev = host.get("device_profile") or {}
            if "compute_stream" in dev:
                cs = dev["compute_stream"]
                lines.append(
                    f"  device, one step of {dev['step_s']:.3f} s: compute stream busy {cs['busy_s']:.3f} s "
                    f"of {cs['span_s']:.3f}; idle by gap {cs['idle_s_by_gap']}; by kind {dev['device_s_by_kind']}"
                )
            syncs = host.get("syncs") or {}
            if "waits" in syncs:
                lines.append(f"  the host's waits on the device in one step: {syncs['waits']}")
                lines += [f"    {n:4d}  {stack}" for n, stack in syncs["by_stack"][:8]]
        elif host:
            lines.append(f"\n`{r['mode']}` host profile: {host.get('error', host)}")
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
    ap.add_argument(
        "--host-profile",
        action="store_true",
        help="finetune-* rows: run the job again for the host seconds a step and its cProfile "
        "(benchmarks/_profiled_job.py; the pstats file beside --out)",
    )
    ap.add_argument(
        "--device-profile",
        action="store_true",
        help="peer rows (unsloth, peft, ...): one step more under torch.profiler after the timed "
        "ones: device time by kind of kernel and the compute stream's idle gaps in the row, the "
        "Chrome trace beside --out (finetune-* rows: --host-profile profiles their device too)",
    )
    ap.add_argument("--device-trace", help=argparse.SUPPRESS)
    ap.add_argument(
        "--experts",
        action="store_true",
        help="a mixture of experts: LoRA on the routed experts' stacks too, in every row",
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

    out = Path(args.out or f"benchmarks/results/peers_{args.shape}{'_experts' if args.experts else ''}.json")
    args.out = str(out)  # the rows' traces go beside it
    out.parent.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    base = base_of(args.model)
    folder = build_folder(args.model, folder_of(args))
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
        "moe": base.moe,
        "folder_stored": base.stored,
        "lora_targets": list(base.targets),
        "experts": args.experts,
        "lora_target_parameters": list(base_of(args.model, args.experts).experts),
        "folder_bytes": folder_bytes(folder),
        "folder_build_s": build_s,
        "pinned_bw": bw,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "commit": git_commit(),
        "versions": versions(),
        "host_profile": args.host_profile,
        "rows": [],
    }
    print(
        f"folder {folder} ({run['folder_bytes'] / 2**30:.2f} GiB, {build_s:.0f} s); pinned H2D {bw / 1e9:.1f} GB/s",
        flush=True,
    )
    for mode in args.modes.split(","):
        if is_job(mode):
            prof = out.with_name(f"{out.stem}.{mode}.prof") if args.host_profile else None
            row = run_job(args, mode, folder, prof)
        else:
            row = child(args, mode, folder)
        if args.twin and "error" not in row and "skipped" not in row:
            row["twin"] = equal_twin(args, mode, folder)
        run["rows"].append(row)
        brief = {
            k: row[k]
            for k in (
                "mode",
                "min_s_per_step",
                "median_s_per_step",
                "max_s_per_step",
                "peak_allocated",
                "final_loss",
                "wall_s",
                "error",
                "skipped",
                "twin",
            )
            if k in row
        }
        if "host_profile" in row:
            brief["host_s_per_step"] = row["host_profile"].get(
                "host_s_per_step", row["host_profile"].get("error")
            )
        print(json.dumps(brief), flush=True)
        out.write_text(json.dumps(run, indent=2))  # after every row: a run cut short keeps what it measured
    g = f", G {args.grad_accum}" if args.grad_accum > 1 else ""
    print(
        f"\n{args.model}, {args.batch}x{args.seq}{g}, NF4, LoRA r16 on {','.join(base.targets)}, AdamW; {run['device']}, "
        f"pinned H2D {bw / 1e9:.1f} GB/s; {args.steps} timed steps after {args.warmup}\n"
    )
    print(table(run["rows"]))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
