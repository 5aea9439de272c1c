"""What the run measures besides its training loss: the held-out loss and, for the
embedded GSM8K default, exact-match accuracy of generated answers."""

from __future__ import annotations

import torch
from torch import nn

from ..data import TRAINING, Example, collate
from ..memory import read_peaks, reset_peaks

__all__ = ["eval_loss", "eval_row", "exact_match", "graph_captures", "measured_peak", "to_device"]


def to_device(batch: dict, device: torch.device) -> dict:
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
        out = model(**to_device(collate(chunk, pad_id), device), **TRAINING)
        total += float(out.loss) * n
        count += n
    model.train(was_training)
    return total / count


def eval_row(
    model: nn.Module, examples: list[Example], batch: int, pad_id: int, device: torch.device
) -> dict:
    """`eval_loss` and, on a CUDA device, the evaluation's own peak of allocated bytes
    (``eval_peak_bytes``): an evaluation runs outside the steps' peaks, and a budget
    holds for it too."""
    reset_peaks(device, host=False)
    row = {"eval_loss": eval_loss(model, examples, batch, pad_id, device)}
    if device.type == "cuda":
        row["eval_peak_bytes"] = measured_peak(model, device)
    return row


def _graphs(model: nn.Module):
    """narrows-stream's CUDA graphs of `model`, or None (not streamed, or no graphs)."""
    return getattr(getattr(model, "narrows_stream", None), "graphs", None)


def graph_captures(model: nn.Module) -> int:
    """How many CUDA graphs narrows-stream has captured so far (0 without graphs)."""
    graphs = _graphs(model)
    return graphs.stats.captured if graphs is not None else 0


def measured_peak(model: nn.Module, device: torch.device, captures: int | None = None) -> int:
    """Peak bytes since the last `reset_peaks`: CUDA's allocated peak, plus the scratch
    pool of narrows-stream's CUDA graphs, which replays use without allocating (so the
    allocator's peak does not see it) — unless graphs were captured since `captures`
    (`graph_captures` at the window's start): a capture allocates in the pool, and the
    peak counts those blocks already. On a CPU, the process's RSS high-water mark."""
    peaks = read_peaks(device)
    if device.type != "cuda":
        return peaks.host_rss
    graphs = _graphs(model)
    if graphs is None or (captures is not None and graphs.stats.captured != captures):
        return peaks.cuda_allocated
    return peaks.cuda_allocated + graphs.pool_bytes()


@torch.no_grad()
def exact_match(
    model: nn.Module, tokenizer, rows: list[dict], device: torch.device, max_new_tokens: int = 200
) -> float:
    """Share of GSM8K problems whose generated final answer (after ####) is right.

    Greedy, all problems in one left-padded batch (one generate call, not one per problem).
    """
    from ..bundled import gsm8k_answer

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
