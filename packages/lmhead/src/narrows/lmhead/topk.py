"""Top-k softmax approximation: the loss over the union of the targets' nearest neighbours.

`neighbour_table` caches an int32 [V, k] table of each token's k nearest tokens by cosine
similarity (the token itself first) on disk under a hash of the matrix; `vocabulary_subset`
and `subset_head` serve the batch's rows. An approximation of the training loss:
evaluation always uses the full softmax.

why: docs/design.md#top-k-softmax
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path

import torch
from torch import Tensor

from narrows.core import HeadSource, ResidentHead

__all__ = ["neighbour_table", "subset_head", "vocabulary_subset"]

log = logging.getLogger("narrows.lmhead")

DEFAULT_TABLE_BUDGET = 256 * 2**20  # bytes of one fp32 similarity tile


def matrix_key(matrix: Tensor) -> str:
    """A content hash of the matrix (shape, dtype and bytes)."""
    t = matrix.detach().to("cpu").contiguous()
    h = hashlib.sha256(f"{tuple(t.shape)}:{t.dtype}".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:24]


def _compute(matrix: Tensor, k: int, budget_bytes: int, device: torch.device) -> Tensor:
    e = matrix.detach().to(device, torch.float32)
    e = e / e.norm(dim=1, keepdim=True).clamp_min(1e-12)
    v = e.shape[0]
    rows = max(1, budget_bytes // (4 * v))
    out = torch.empty(v, k, dtype=torch.int32)
    for start in range(0, v, rows):
        stop = min(start + rows, v)
        sim = e[start:stop] @ e.t()
        idx = torch.arange(start, stop, device=device)
        sim[idx - start, idx] = torch.inf  # each token is its own first neighbour, whatever ties exist
        out[start:stop] = sim.topk(k, dim=1).indices.to("cpu", torch.int32)
    return out


def neighbour_table(
    matrix: Tensor,
    k: int,
    *,
    cache_dir: str | os.PathLike | None = None,
    budget_bytes: int = DEFAULT_TABLE_BUDGET,
    device: torch.device | str | None = None,
) -> Tensor:
    """int32 [V, k]: row i holds token i, then its k-1 nearest tokens by cosine similarity.

    Computed on `device` (default: CUDA when available — on a CPU a 150K vocabulary takes
    minutes) in row tiles of at most `budget_bytes`, cached in `cache_dir` (default
    ``$NARROWS_CACHE`` or ``~/.cache/narrows``) under a hash of the matrix.
    """
    v = matrix.shape[0]
    if not 1 <= k <= v:
        raise ValueError(f"topk={k} must be between 1 and the vocabulary size {v}")
    cache = Path(cache_dir or os.environ.get("NARROWS_CACHE") or Path.home() / ".cache" / "narrows")
    path = cache / f"neighbours-{matrix_key(matrix)}-k{k}.pt"
    if path.exists():
        return torch.load(path)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    log.info("narrows.lmhead: computing the top-%d neighbour table for %d tokens on %s", k, v, dev)
    table = _compute(matrix, k, budget_bytes, dev)
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache, suffix=".tmp")
    os.close(fd)
    torch.save(table, tmp)
    os.replace(tmp, path)  # atomic: a reader sees the whole table or none
    return table


def vocabulary_subset(targets: Tensor, table: Tensor) -> Tensor:
    """The union of the targets' neighbour rows: sorted int64 vocabulary ids, on the
    targets' device. Every target is in it (each row starts with its own token)."""
    rows = table.index_select(0, targets.to(table.device).long())
    return torch.unique(rows.long()).to(targets.device)


def subset_head(source: HeadSource, ids: Tensor) -> ResidentHead:
    """The rows `ids` of `source`, gathered once per batch and served like a resident head."""
    weight, bias = source.gather(ids)
    return ResidentHead(weight, bias, math=source.math)
