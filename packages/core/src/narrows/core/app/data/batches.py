"""Batches: unpacked examples padded to the longest in the batch, or packed sequences
(`pack`, ``--packing``) that hold several examples each, with attention kept inside each
example; and the seeded, endless stream of micro-batches a run (and its resume) reads."""

from __future__ import annotations

import hashlib
import random
from bisect import bisect_left, insort
from collections.abc import Iterator, Sequence
from types import MappingProxyType

import torch
from torch import Tensor

from .encode import IGNORE, Example
from .formats import DataError

__all__ = ["TRAINING", "Packed", "check_packing", "collate", "micro_batches", "pack_bins"]

# What every training (and eval-loss) forward passes besides the batch. No KV cache: with
# one, transformers (5.x) skips its packed-sequence detection and lets packed examples
# attend to each other, silently.
TRAINING = MappingProxyType({"use_cache": False})


def collate(examples: Sequence[Example], pad_id: int, width: int | None = None) -> dict[str, Tensor]:
    """One batch, right-padded to `width` (default: the longest sequence) with label -100.

    Unpacked: ``input_ids``, ``attention_mask``, ``labels``. Packed: ``input_ids``,
    ``position_ids`` and ``labels`` and no attention mask: positions restart at 0 for each
    example (and for the padding), which transformers reads as packed sequences and masks
    attention block-diagonally (or runs flash-attention's varlen path), so no token attends
    across an example boundary.
    """
    packed = bool(examples[0].segments)
    if any(bool(e.segments) != packed for e in examples):
        raise ValueError("collate: a batch mixes packed and unpacked sequences")
    width = width or max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    extra = torch.zeros((len(examples), width), dtype=torch.long)  # attention mask, or positions
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids)
        labels[i, :n] = torch.tensor(e.labels)
        if not packed:
            extra[i, :n] = 1
            continue
        at = 0
        for length in (*e.segments, width - n):  # the padding is a segment of its own
            extra[i, at : at + length] = torch.arange(length)
            at += length
    if packed:
        return {"input_ids": ids, "position_ids": extra, "labels": labels}
    return {"input_ids": ids, "attention_mask": extra, "labels": labels}


@torch.no_grad()
def check_packing(model, device: torch.device, vocab: int) -> None:
    """Refuse a model whose attention would cross packed examples' boundaries.

    Two rows of four tokens, each two examples of two, share their second example and
    differ in their first. Where attention stays inside each example, the second example's
    logits are the same in both rows (the same inputs, positions and operations); where it
    crosses, they differ at the scale of the logits.
    """
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randint(min(vocab, 1000), (2,), generator=g) for _ in range(3))
    ids = torch.stack([torch.cat([a, c]), torch.cat([b, c])]).to(device)
    positions = torch.tensor([[0, 1, 0, 1]] * 2, device=device)
    was_training = model.training
    model.eval()
    try:
        logits = model(input_ids=ids, position_ids=positions, **TRAINING).logits[:, 2:].float()
    finally:
        model.train(was_training)
    scale = float(logits.abs().max())
    if not torch.allclose(logits[0], logits[1], rtol=1e-2, atol=1e-2 * scale):
        name = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise DataError(
            f"--packing: this model ({name}) lets packed examples attend to each other: its attention "
            "does not restart at position 0 as transformers' packed-sequence masks do. Drop --packing "
            "(each example is then padded to its batch)"
        )


def pack_bins(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing: indices of `lengths` grouped so each group sums to at most
    `capacity`. Longest first, each into the open bin it fills most tightly; ties go by
    index, so the packing depends only on the lengths."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    rooms: list[int] = []  # the distinct free spaces of open bins, sorted
    open_bins: dict[int, list[int]] = {}  # free space -> bins with that much
    for i in order:
        size = lengths[i]
        if size > capacity:
            raise ValueError(f"pack_bins: length {size} exceeds the capacity {capacity}")
        k = bisect_left(rooms, size)
        if k < len(rooms):
            room = rooms[k]
            b = open_bins[room].pop()
            if not open_bins[room]:
                del open_bins[room]
                rooms.pop(k)
        else:
            b, room = len(bins), capacity
            bins.append([])
        bins[b].append(i)
        room -= size
        if room > 0:
            if room not in open_bins:
                insort(rooms, room)
                open_bins[room] = []
            open_bins[room].append(b)
    return bins


class Packed(Sequence[Example]):
    """`examples` packed into sequences of at most `seq_len` tokens (`pack_bins`).

    Sequence b concatenates its examples; each example's first label is -100 (so the
    token before it, the end of the previous example, predicts nothing across the boundary,
    as label 0 of an unpacked example never trains) and its length is a segment. Built
    lazily from `examples`, so packing holds no second copy of the tokens.
    """

    def __init__(self, examples: Sequence[Example], seq_len: int) -> None:
        self.examples = examples
        self._lengths = (
            examples.lengths() if hasattr(examples, "lengths") else [len(e.input_ids) for e in examples]
        )
        self.bins = [tuple(b) for b in pack_bins(self._lengths, seq_len)]
        self.seq_len = seq_len

    def __len__(self) -> int:
        return len(self.bins)

    def __getitem__(self, b):  # type: ignore[override]
        if isinstance(b, slice):
            return [self[i] for i in range(*b.indices(len(self)))]
        members = [self.examples[i] for i in self.bins[b]]
        ids = tuple(t for e in members for t in e.input_ids)
        labels = tuple(y for e in members for y in (IGNORE, *e.labels[1:]))
        where = f"packed sequence {b} ({members[0].where} and {len(members) - 1} more)"
        return Example(ids, labels, where, tuple(len(e.input_ids) for e in members))

    def digest(self) -> str:
        base = self.examples.digest() if hasattr(self.examples, "digest") else ""
        return hashlib.sha256(f"{base}|{self.seq_len}|{self.bins}".encode()).hexdigest()[:16]

    def fill(self) -> float:
        """Share of the packed sequences' tokens that are real (not padding to `seq_len`)."""
        return sum(self._lengths) / (len(self) * self.seq_len)


def micro_batches(
    examples: Sequence[Example], batch_size: int, seed: int, start: int = 0
) -> Iterator[list[Example]]:
    """Micro-batch `start`, `start`+1, ... of an endless, seeded stream of epochs.

    Epoch e is a permutation drawn from ``random.Random(seed + e)``; micro-batch k holds
    positions ``k*batch_size ... k*batch_size + batch_size - 1`` of the epochs laid end to
    end. The stream depends on nothing but (seed, k), so a resumed run only needs k.
    """
    n = len(examples)
    pos = start * batch_size
    epoch, perm = -1, []
    while True:
        batch = []
        for p in range(pos, pos + batch_size):
            e, i = divmod(p, n)
            if e != epoch:
                epoch, perm = e, random.Random(seed + e).sample(range(n), n)
            batch.append(examples[perm[i]])
        pos += batch_size
        yield batch
