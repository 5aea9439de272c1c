"""The causal-LM loss from hidden states: HF's shifted, masked cross-entropy, computed
only where it is needed.

Same reduction as transformers' ``ForCausalLMLoss``: labels shifted left by one (or
``shift_labels`` as given), ``-100`` ignored, a sum divided by ``num_items_in_batch`` when
the Trainer passes it (gradient accumulation), else the mean over trainable tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from narrows.core import HeadSource, NarrowsError, ResidentHead, chunked_logits

from .chunked import (
    DEFAULT_TILE_BYTES,
    cross_entropy_from_logits,
    linear_cross_entropies,
    linear_cross_entropy,
)
from .fused import FUSED_CHOICES, fused_cross_entropy, fused_library
from .topk import subset_head, vocabulary_subset

__all__ = [
    "LossOptions",
    "LossRows",
    "NoTrainableTokensError",
    "causal_lm_loss",
    "loss_rows",
    "rows_loss",
    "rows_losses",
    "shares_head_pass",
    "shift_targets",
]


class NoTrainableTokensError(NarrowsError, ValueError):
    """Every label of the batch is ignored: there is nothing to train on."""


@dataclass(frozen=True)
class LossOptions:
    """`mask`: head only at trainable positions. `chunked`: exact CE without full logits.
    `topk`: train on the union of the targets' k nearest tokens (an approximation)."""

    mask: bool = True
    chunked: bool = True
    topk: int | None = None
    head_rows: int | None = None
    tile_bytes: int = DEFAULT_TILE_BYTES
    ignore_index: int = -100
    fused: str = (
        "auto"  # Liger-Kernel's or Cut Cross-Entropy's where installed and applicable (fused.py); "off";
        # "liger" / "cce": that one or an error
    )

    def __post_init__(self) -> None:
        if self.fused not in FUSED_CHOICES:
            raise ValueError(f"fused must be one of {FUSED_CHOICES}, got {self.fused!r}")

    @classmethod
    def parse(cls, text: str) -> LossOptions:
        """Options from their short form, ``"mask,chunked,topk=1000,fused=off"``: `mask` and
        `chunked` are on where named and off where not; an unknown or malformed part is a
        ValueError naming it."""
        parts: dict[str, object] = {"mask": False, "chunked": False}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, _, value = part.partition("=")
            if part in ("mask", "chunked"):
                parts[part] = True
            elif key == "topk":
                try:
                    parts["topk"] = int(value)
                except ValueError:
                    raise ValueError("topk needs an integer, e.g. topk=1000") from None
            elif key == "fused" and value in FUSED_CHOICES:
                parts["fused"] = value
            else:
                raise ValueError(
                    f"unknown part {part!r}; use mask, chunked, topk=K and/or fused={'|'.join(FUSED_CHOICES)}"
                )
        return cls(**parts)  # type: ignore[arg-type]


def shift_targets(labels: Tensor | None, shift_labels: Tensor | None, ignore_index: int = -100) -> Tensor:
    """What each position predicts: the next label (the last position predicts nothing)."""
    if shift_labels is not None:
        return shift_labels
    if labels is None:
        raise ValueError("causal_lm_loss needs labels or shift_labels")
    return nn.functional.pad(labels[..., 1:], (0, 1), value=ignore_index)


def causal_lm_loss(
    hidden: Tensor,
    labels: Tensor | None,
    source: HeadSource,
    options: LossOptions = LossOptions(),
    *,
    num_items_in_batch: Tensor | int | None = None,
    shift_labels: Tensor | None = None,
    neighbours: Tensor | None = None,
    stats: list[int] | None = None,
) -> Tensor:
    """Loss of a causal LM from its last hidden states [B, S, H] and labels [B, S].

    `neighbours` is the top-k table (`neighbour_table`) when ``options.topk`` is set;
    `stats`, when given, receives the size of each batch's vocabulary subset.
    """
    rows = loss_rows(
        hidden,
        labels,
        source,
        options,
        num_items_in_batch=num_items_in_batch,
        shift_labels=shift_labels,
        neighbours=neighbours,
        stats=stats,
    )
    return rows_loss(rows, options)


@dataclass
class LossRows:
    """What the loss is computed from: the hidden states of the positions it reads, their
    targets, each one's weight in the reduction, and the head (a vocabulary subset with
    top-k)."""

    hidden: Tensor  # [N, H]
    targets: Tensor  # [N]
    weights: Tensor  # [N] fp32
    source: HeadSource
    scale: Tensor | None = None  # fp32 scalar: the one weight of every row that weighs anything


def loss_rows(
    hidden: Tensor,
    labels: Tensor | None,
    source: HeadSource,
    options: LossOptions = LossOptions(),
    *,
    num_items_in_batch: Tensor | int | None = None,
    shift_labels: Tensor | None = None,
    neighbours: Tensor | None = None,
    stats: list[int] | None = None,
) -> LossRows:
    """The shifted, masked rows `causal_lm_loss` computes its loss from."""
    targets = shift_targets(labels, shift_labels, options.ignore_index).reshape(-1).to(hidden.device)
    flat = hidden.reshape(-1, hidden.shape[-1])
    valid = targets != options.ignore_index
    count = int(valid.sum())
    if count == 0:
        raise NoTrainableTokensError(
            "this batch has no trainable token: every label is -100 after the causal shift (labels[t+1] is "
            "what position t predicts). Check the prompt masking and truncation — a response cut off by "
            "--seq-len / max_length leaves nothing to learn — or drop such rows from the data."
        )
    denominator = torch.as_tensor(
        num_items_in_batch if num_items_in_batch is not None else count,
        dtype=torch.float32,
        device=hidden.device,
    )
    # gather the trainable rows unless nearly all train: then the gathered copy (and its
    # gradient) would cost more memory than the few wasted rows cost compute
    if options.mask and count < 0.9 * valid.numel():
        keep = torch.nonzero(valid)[:, 0]
        flat, targets = flat.index_select(0, keep), targets.index_select(0, keep)
        weights = torch.ones(targets.shape, dtype=torch.float32, device=hidden.device) / denominator
    else:
        weights = valid.float() / denominator
        targets = torch.where(valid, targets, 0)
    if options.topk is not None:
        if neighbours is None:
            raise ValueError(
                "LossOptions.topk is set: pass the neighbour table (narrows.lmhead.neighbour_table)"
            )
        if source.trainable_weight is not None:
            raise NarrowsError("top-k softmax needs a frozen LM head (the neighbour table is built from it)")
        ids = vocabulary_subset(targets[weights > 0], neighbours)
        targets = torch.searchsorted(ids, targets).clamp_max(ids.numel() - 1)  # ignored rows: any index
        source = subset_head(source, ids)
        if stats is not None:
            stats.append(ids.numel())
    return LossRows(flat, targets, weights, source, scale=1 / denominator)


def rows_loss(rows: LossRows, options: LossOptions, ran: set[str] | None = None) -> Tensor:
    """The loss of `rows`: fused, chunked or from logits, as `options` say; `ran`, when
    given, receives which ("liger", "cce", "tiles" or "logits")."""
    flat, targets, source, weights = rows.hidden, rows.targets, rows.source, rows.weights
    said = ran if ran is not None else set()
    if options.chunked and options.fused != "off":
        library, why_not = fused_library(flat, source, options.fused)
        if library is not None:
            said.add(library)
            return fused_cross_entropy(
                flat,
                targets,
                source,
                weights,
                library,
                options.tile_bytes,
                scale=rows.scale,  # type: ignore[arg-type]
            )
        if options.fused != "auto":
            raise NarrowsError(
                f"fused={options.fused!r} cannot run here: {why_not}; use fused='auto' to fall back"
            )
    if options.chunked:
        said.add("tiles")
        return linear_cross_entropy(
            flat, targets, source, weights, head_rows=options.head_rows, tile_bytes=options.tile_bytes
        )
    said.add("logits")
    weight = source.trainable_weight
    if weight is None:  # frozen (maybe streamed) head: logits for the kept positions, chunk by chunk
        logits = chunked_logits(flat, source, options.head_rows)
    else:
        logits = nn.functional.linear(flat, weight, getattr(source, "bias", None))
    return cross_entropy_from_logits(logits, targets, weights, source.math)


def shares_head_pass(rows: LossRows, options: LossOptions) -> bool:
    """Whether `rows_loss` would read a streamed frozen head chunk by chunk, so that the
    loss can share its pass over the head with other micro-batches' (`rows_losses`)."""
    source = rows.source
    return (
        options.chunked
        and options.topk is None
        and not isinstance(source, ResidentHead)
        and source.trainable_weight is None
        and (
            options.fused == "off"
            or (options.fused == "auto" and fused_library(rows.hidden, source, "auto")[0] is None)
        )
    )


def rows_losses(many: list[LossRows], options: LossOptions) -> list[Tensor]:
    """`rows_loss` of several rows that share a head (`shares_head_pass`), in one pass."""
    items = [(r.hidden, r.targets, r.weights) for r in many]
    return linear_cross_entropies(
        items, many[0].source, head_rows=options.head_rows, tile_bytes=options.tile_bytes
    )
