"""transformers' output recorders: the forward hooks it installs on the modules whose
outputs a model can return (an MoE layer's router for ``router_logits``, attention for
``attentions``). One does nothing unless the forward running asked for its output, so a
layer may run without its hooked modules while none is recording.

why: docs/design.md#side-outputs
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

__all__ = ["recorded_key", "recording", "replaying"]

# what a recomputed forward recorded the first time (narrows.stream's backward recompute)
_REPLAYED: ContextVar[frozenset[str]] = ContextVar("narrows_replayed_recorders", default=frozenset())


def recorded_key(hook: Callable[..., Any]) -> str | None:
    """The output a transformers output-recording hook collects (``router_logits``,
    ``attentions``, …), or None for any other hook."""
    fn = inspect.unwrap(hook)
    if getattr(fn, "__module__", "") != "transformers.utils.output_capturing" or not fn.__closure__:
        return None
    cells = dict(zip(fn.__code__.co_freevars, fn.__closure__, strict=True))
    key = cells.get("key")
    return key.cell_contents if key is not None and isinstance(key.cell_contents, str) else None


@contextmanager
def replaying(keys: Iterable[str]) -> Iterator[None]:
    """Inside: `recording` answers for `keys` as the forward being recomputed found it, so
    a recompute takes the path its forward took."""
    token = _REPLAYED.set(frozenset(keys))
    try:
        yield
    finally:
        _REPLAYED.reset(token)


def recording(keys: Iterable[str]) -> bool:
    """Whether a forward running now collects any of `keys` (transformers' output recorder),
    or a recompute of one that did (`replaying`)."""
    keys = set(keys)
    if keys & _REPLAYED.get():
        return True
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # another transformers: take every recording hook as live
        return True
    collected = _active_collector.get()
    return collected is not None and any(k in collected for k in keys)
