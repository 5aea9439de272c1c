"""What the run measures besides its training loss: the held-out loss (at several steps)
and, for the embedded GSM8K default, generated answers scored two ways: whether they end
in the ``#### N`` line of a GSM8K answer (the format the model learns within the default
budget) and whether that number is right (exact match). Each shows a bar or a line as it
goes: a CPU evaluation takes minutes."""

from __future__ import annotations

import re
import sys
import time
from contextlib import nullcontext

import torch
from torch import nn

from ...memory import read_peaks, reset_peaks
from ..data import TRAINING, Example, collate

__all__ = [
    "answer_scores",
    "eval_loss",
    "eval_row",
    "exact_match",
    "generate_answers",
    "measured_peak",
    "reset_step_peaks",
    "to_device",
]


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


def say(message: str) -> None:
    """One ``narrows: ...`` line on stderr, as every stage of a run prints."""
    print(f"narrows: {message}", file=sys.stderr, flush=True)


def progress_bar(total: float, desc: str, unit: str, show: bool | None):
    """A tqdm bar that disappears when done (`show` True), else None: `show` False prints
    plain lines instead (``--no-progress``), None prints nothing (library use)."""
    if not show:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, leave=False, dynamic_ncols=True, file=sys.stderr)


@torch.no_grad()
def eval_loss(
    model: nn.Module,
    examples: list[Example],
    batch: int,
    pad_id: int,
    device: torch.device,
    show: bool | None = None,
    forward=None,
) -> float:
    """Mean cross-entropy per trainable token over `examples`, full softmax, eval mode.
    `show`: a bar over the batches (True), a line (False) or nothing (None). `forward(batch)`:
    a batch's mean loss (default: the model's own); None where this process computes none
    (a pipeline stage before the last, whose share of the mean is 0)."""
    if not examples:
        return float("nan")
    forward = forward or (lambda b: model(**b, **TRAINING).loss)
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    batches = range(0, len(examples), batch)
    bar = progress_bar(len(batches), "held-out loss", "batch", show)
    if show is False:
        say(f"held-out loss: {len(examples)} rows in {len(batches)} batches")
    try:
        with graphs_released(model):
            for i in batches:
                chunk = examples[i : i + batch]
                n = sum(e.trainable for e in chunk)
                loss = forward(to_device(collate(chunk, pad_id), device))
                if loss is not None:
                    total += float(loss) * n
                count += n
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        model.train(was_training)
    return total / count


def eval_row(
    model: nn.Module,
    examples: list[Example],
    batch: int,
    pad_id: int,
    device: torch.device,
    show: bool | None = None,
    forward=None,
) -> dict:
    """`eval_loss` and, on a CUDA device, the evaluation's own peak of allocated bytes
    (``eval_peak_bytes``): an evaluation runs outside the steps' peaks, and a budget
    holds for it too. `forward`: as `eval_loss` takes it."""
    reset_step_peaks(model, device)
    row = {"eval_loss": eval_loss(model, examples, batch, pad_id, device, show, forward)}
    if device.type == "cuda":
        row["eval_peak_bytes"] = measured_peak(model, device)
    return row


def _graphs(model: nn.Module):
    """narrows-stream's CUDA graphs of `model`, or None (not streamed, or no graphs)."""
    return getattr(getattr(model, "narrows_stream", None), "graphs", None)


def graphs_released(model: nn.Module):
    """A block without narrows-stream's CUDA graphs, run in the memory their pool held
    (`LayerGraphs.released`): an evaluation's forwards, which run eagerly, then share the
    training's room instead of needing their own beside the pool (the plan counts on it:
    `eager_beside_graphs`). The next training step captures the graphs again."""
    graphs = _graphs(model)
    return nullcontext() if graphs is None else graphs.released()


def reset_step_peaks(model: nn.Module, device: torch.device) -> None:
    """Start a window for `measured_peak`: CUDA's peaks (the host's stays whole-process,
    loading included) and what narrows-stream's CUDA graphs saw while capturing."""
    reset_peaks(device, host=False)
    graphs = _graphs(model)
    if graphs is not None:
        graphs.reset_peak()


def measured_peak(model: nn.Module, device: torch.device) -> int:
    """Peak bytes since `reset_step_peaks`: CUDA's allocated peak, plus the scratch pool of
    narrows-stream's CUDA graphs, which replays use without allocating (so the allocator's
    peak does not see it); in a window that captured graphs, the larger of that and what a
    capture held (its warm-up beside the pool, the pool growing). On a CPU, the process's
    RSS high-water mark."""
    peaks = read_peaks(device)
    if device.type != "cuda":
        return peaks.host_rss
    graphs = _graphs(model)
    return peaks.cuda_allocated if graphs is None else graphs.peak_bytes(peaks.cuda_allocated)


# a GSM8K answer ends in a line "#### N": once it is complete, the answer is given
_ANSWER_LINE = re.compile(r"####[^\n]*\d[^\n]*\n")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _answer_done(text: str) -> int | None:
    """Where the answer's ``#### N`` line ends in `text` (its newline), or None."""
    found = _ANSWER_LINE.search(text)
    return found.end() if found else None


@torch.no_grad()
def generate_answers(
    model: nn.Module,
    tokenizer,
    rows: list[dict],
    device: torch.device,
    max_new_tokens: int = 200,
    bar=None,
    label: str = "",
) -> list[str]:
    """Greedy answers to `rows`' questions, one problem at a time: each stops at the end of
    its sequence or once its final ``#### N`` line is complete (then cut there), instead of
    always running `max_new_tokens`. `bar` (tqdm) advances by a fraction per token and a
    whole unit per problem; without one, a line per problem when `label` is given."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class AnswerGiven(StoppingCriteria):
        def __init__(self, start: int):
            self.start, self.moved = start, 0.0

        def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
            if bar is not None and self.moved < 0.99:
                step = min(1 / max_new_tokens, 0.99 - self.moved)
                bar.update(step)
                self.moved += step
            text = tokenizer.decode(input_ids[0, self.start :], skip_special_tokens=True)
            return torch.full((input_ids.shape[0],), _answer_done(text) is not None, device=input_ids.device)

    was_training = model.training
    model.eval()
    texts = []
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    try:
        with graphs_released(model):
            for k, r in enumerate(rows):
                t0 = time.perf_counter()
                prompt = tokenizer.apply_chat_template(
                    r["messages"][:1], tokenize=False, add_generation_prompt=True
                )
                enc = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").to(device)
                start = enc["input_ids"].shape[1]
                stop = AnswerGiven(start)
                out = model.generate(
                    **enc,
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    pad_token_id=pad,
                    stopping_criteria=StoppingCriteriaList([stop]),
                )
                text = tokenizer.decode(out[0, start:], skip_special_tokens=True)
                end = _answer_done(text)
                texts.append(text if end is None else text[:end])
                if bar is not None:
                    bar.update(1 - stop.moved)
                elif label:
                    say(
                        f"{label}: problem {k + 1}/{len(rows)}, {out.shape[1] - start} tokens "
                        f"({time.perf_counter() - t0:.0f} s)"
                    )
    finally:
        model.train(was_training)
    return texts


def answer_scores(texts: list[str], rows: list[dict]) -> tuple[int, int]:
    """(well formed, right): how many `texts` end in a ``#### N`` line with a number, and
    how many of those numbers are `rows`' answers."""
    from ..bundled import gsm8k_answer

    answers = [gsm8k_answer(t) for t in texts]
    formed = sum(a is not None and _NUMBER.fullmatch(a) is not None for a in answers)
    return formed, sum(a == r["answer"] for a, r in zip(answers, rows))


def exact_match(
    model: nn.Module, tokenizer, rows: list[dict], device: torch.device, max_new_tokens: int = 200
) -> float:
    """Share of GSM8K problems whose generated final answer (after ####) is right."""
    if not rows:
        return float("nan")
    return answer_scores(generate_answers(model, tokenizer, rows, device, max_new_tokens), rows)[1] / len(
        rows
    )
