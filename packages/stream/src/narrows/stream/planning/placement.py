"""Which layers: resident layers spread evenly through the stack (so every streamed
layer's copy can hide behind its neighbours' compute), disk-tier layers made resident
first (a resident layer is read once instead of twice a step), whole layers last (the
streamed layer before them is still in its slab when backward turns)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["most_resident", "spread"]


def spread(count: int, total: int) -> tuple[int, ...]:
    """`count` indices spread evenly over range(total)."""
    if count <= 0:
        return ()
    if count >= total:
        return tuple(range(total))
    return tuple(sorted({int((i + 0.5) * total / count) for i in range(count)}))


def most_resident(
    whole: int, n: int, disk: Sequence[int], fits: Callable[[tuple[int, ...]], bool]
) -> tuple[int, ...] | None:
    """The largest resident set holding the last `whole` layers that `fits` (None if even
    those alone do not): the whole layers plus resident layers chosen among the others."""
    tail = tuple(range(n - whole, n))
    if fits(tuple(range(n))):
        return tuple(range(n))  # no streamed layer left: no device slabs either
    if not fits(tail):
        return None
    head_disk = [i for i in disk if i < n - whole]  # disk layers among the ones not whole
    lo, hi = 0, n - whole - 1  # binary search: below all-resident, fits() is monotone
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(_choose(mid, n - whole, head_disk) + tail):
            lo = mid
        else:
            hi = mid - 1
    return _choose(lo, n - whole, head_disk) + tail


def _choose(count: int, n: int, disk: Sequence[int]) -> tuple[int, ...]:
    """`count` resident layers: disk-tier layers first (spread among them), then the rest."""
    disk = sorted(disk)
    if count <= len(disk):
        return tuple(sorted(disk[i] for i in spread(count, len(disk))))
    others = [i for i in range(n) if i not in set(disk)]
    return tuple(sorted(disk + [others[i] for i in spread(count - len(disk), len(others))]))
