"""The lm-evaluation-harness model ``narrows``: lm-eval's own Hugging Face backend (HFLM:
loglikelihood, loglikelihood_rolling, generate_until, batching, caching) over a model built
by `load_for_eval` — base + adapter, NF4 or float, resident or streamed.

    lm_eval --model narrows --model_args pretrained=PATH,adapter=runs/NAME,gpu_budget=8GiB ...
    lm_eval --model narrows --model_args adapter=runs/NAME,checkpoint=latest ...   # the run's base
"""

from __future__ import annotations

import sys

# lm-eval registers its own models lazily on the first lookup, and only when its registry
# is empty: load that table first, so adding ours does not hide them
import lm_eval.models  # noqa: F401
import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from .loading import AdapterChoice, load_for_eval

__all__ = ["NarrowsLM"]


def _none(value):
    return None if value in (None, "", "none", "None", "off") else value


@register_model("narrows")
class NarrowsLM(HFLM):
    """``--model_args``: ``pretrained`` (HF folder or .gguf; default: the base of the run given
    as ``adapter``), ``adapter`` (PEFT folder, or a ``narrows finetune`` run: its final adapter,
    refused while the run is unfinished), ``checkpoint`` (a run's checkpoint step, or ``latest``),
    ``gpu_budget`` (stream the base: ``8GiB``, ``fit``, ``min``),
    ``host_budget`` (host RAM for the streamed base, e.g. ``24GiB``; the rest is read from disk),
    ``quant`` (``nf4``), ``dtype`` (``auto``: bf16 on CUDA, fp32 on CPU), ``device``,
    ``batch_size``, ``max_length`` and the rest of HFLM's own arguments."""

    def __init__(
        self,
        pretrained=None,
        tokenizer=None,
        adapter: str | AdapterChoice | None = None,
        checkpoint: str | int | None = None,
        gpu_budget: str | None = None,
        host_budget: str | None = None,
        quant: str | None = None,
        dtype: str = "auto",
        device: str | None = None,
        batch_size: int | str = 1,
        max_length: int | None = None,
        **kwargs,
    ) -> None:
        device = _none(device)
        if device is not None and device.startswith("cuda") and not torch.cuda.is_available():
            device = "cpu"  # lm-eval's CLI passes --device cuda by default
        loaded = load_for_eval(
            _none(pretrained),
            tokenizer=tokenizer,
            adapter=_none(adapter),
            checkpoint=_none(checkpoint),
            dtype=dtype,
            quant=_none(quant),
            gpu_budget=_none(gpu_budget),
            host_budget=_none(host_budget),
            device=device,
            seq_len=int(max_length or 2048),
            batch_size=int(batch_size) if str(batch_size).isdigit() else 1,
        )
        self.narrows = loaded
        if loaded.choice is not None and not isinstance(adapter, AdapterChoice):  # (narrows eval said it)
            print(f"narrows: scoring {loaded.choice.describe()}", file=sys.stderr, flush=True)
        super().__init__(
            pretrained=loaded.model,
            tokenizer=loaded.tokenizer,
            backend="causal",
            batch_size=batch_size,
            max_length=max_length,
            **kwargs,
        )
        # a streamed model's parameters stay in host memory; its inputs and logits live on the device
        self._device = loaded.device

    def get_model_info(self) -> dict:
        """What lm-eval records under ``config`` in its results: adapter and streaming plan."""
        choice = self.narrows.choice
        info = {
            "narrows_adapter": self.narrows.adapter,
            "narrows_streamed": self.narrows.streamed,
            "narrows_adapter_step": choice.step if choice else None,
            "narrows_checkpoint": choice.checkpoint if choice else None,
            "narrows_base_differs": self.narrows.base_differs,
            "model_dtype": str(next(self.narrows.model.parameters()).dtype),
        }
        handle = getattr(self.narrows.model, "narrows_stream", None)
        if handle is not None:
            info["narrows_stream_plan"] = str(handle.plan)
        return info
