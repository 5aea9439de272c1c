"""Watching the fast MoE layer dequantise its routed experts' stacks: which, how often, and
how many are alive at once (weak references to each stack it was given)."""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class StackWatch:
    """What `watch_expert_stacks` saw."""

    names: Counter = field(default_factory=Counter)  # stacks dequantised, by name
    most_alive: int = 0  # the most dequantised stacks alive at once (each call's included)
    _alive: list = field(default_factory=list)


@contextmanager
def watch_expert_stacks() -> Iterator[StackWatch]:
    """Count the stacks `narrows.core.kernels.fastlayer.moe` dequantises while the block runs
    (what `MoEParts.stack` hands the block, in its dtype; quantised stacks: a float stack is
    the parameter itself, always alive). Stacks a cache already held are not counted again."""
    from narrows.core.kernels.fastlayer import moe

    watch, original, dequantise = StackWatch(), moe.MoEParts.stack, moe.expert_stacks
    fresh: list[str] = []

    def counted(module, names):
        fresh.extend(names)
        return dequantise(module, names)

    def watched(self, name, like, cache):
        fresh.clear()
        stack = original(self, name, like, cache)
        if fresh:
            watch._alive = [r for r in watch._alive if r() is not None]
            watch.most_alive = max(watch.most_alive, len(watch._alive) + 1)
            watch._alive.append(weakref.ref(stack))
            watch.names.update(fresh)
        return stack

    moe.MoEParts.stack, moe.expert_stacks = watched, counted
    try:
        yield watch
    finally:
        moe.MoEParts.stack, moe.expert_stacks = original, dequantise
