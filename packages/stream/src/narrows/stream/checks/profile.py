"""The overlap audit: per layer, compute time, copy time and the copy time the compute
stream waited for (exposed), over ``with model.narrows_stream.profiling() as prof:`` —
then what the planner would choose with the rates measured there.

Layers run whole are not timed one by one. On the CPU every copy counts as exposed.
Reading the events waits for the device: profile a few steps, not a run.

why: docs/design.md#the-overlap-audit
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from narrows.core import format_bytes

from ..planning import Plan, Rates

__all__ = ["LayerTimes", "Profile"]


@dataclass
class LayerTimes:
    """One layer's totals over the profiled block, in seconds."""

    layer: int
    forward: float = 0.0  # compute of its forward uses
    backward: float = 0.0  # compute of its backward uses (recompute included)
    copy: float = 0.0  # its host→device copies
    exposed: float = 0.0  # what the compute stream waited for those copies
    uses: int = 0
    forward_uses: int = 0  # in step mode one use runs the layer for every micro-batch
    copied_bytes: int = 0


@dataclass
class _Use:
    layer: int
    kind: str
    arrive: Any
    ready: Any  # the copy-finished event of its slab (None: resident)
    end: Any = None


@dataclass
class _Copy:
    layer: int
    nbytes: int
    start: Any
    end: Any


@dataclass
class Profile:
    device: torch.device
    plan: Plan
    replan: Callable[[Rates], Plan] | None = None
    layers: dict[int, LayerTimes] = field(default_factory=dict)
    seconds: float = 0.0  # from the first use's start to the last use's end
    _uses: list[_Use] = field(default_factory=list)
    _copies: list[_Copy] = field(default_factory=list)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    # ---- what the engine calls --------------------------------------------------------
    def stamp(self, stream: Any = None) -> Any:
        """Now: an event on `stream` (default: the compute stream), or the host clock."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        return event

    def copied(self, layer: int, nbytes: int, start: Any, end: Any) -> None:
        self._copies.append(_Copy(layer, nbytes, start, end))

    def begin(self, layer: int, kind: str, arrive: Any, ready: Any) -> _Use:
        use = _Use(layer, kind, arrive, ready)
        self._uses.append(use)
        return use

    def end(self, use: _Use) -> None:
        use.end = self.stamp()

    # ---- after the block ----------------------------------------------------------------
    def finish(self) -> None:
        """Read every timing (waits for the device)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        timed = {id(c.end) for c in self._copies}
        for c in self._copies:
            t = self._times(c.layer)
            t.copy += self._between(c.start, c.end)
            t.copied_bytes += c.nbytes
        for u in self._uses:
            if u.end is None:
                continue
            wall = self._between(u.arrive, u.end)
            if self.cuda:
                # an event recorded before profiling began has no timing: count it as no wait
                exposed = max(0.0, self._between(u.arrive, u.ready)) if id(u.ready) in timed else 0.0
            else:  # synchronous copies: whatever was copied inside the use was waited for
                exposed = sum(
                    self._between(c.start, c.end) for c in self._copies if u.arrive <= c.start <= u.end
                )
            exposed = min(exposed, wall)
            t = self._times(u.layer)
            t.exposed += exposed
            t.uses += 1
            if u.kind == "backward":
                t.backward += wall - exposed
            else:
                t.forward += wall - exposed
                t.forward_uses += 1
        ended = [u for u in self._uses if u.end is not None]
        if ended:
            self.seconds = self._between(ended[0].arrive, ended[-1].end)
        self._uses, self._copies = [], []

    def _times(self, layer: int) -> LayerTimes:
        return self.layers.setdefault(layer, LayerTimes(layer))

    def _between(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1000 if self.cuda else b - a

    # ---- what it says -------------------------------------------------------------------
    @property
    def totals(self) -> LayerTimes:
        t = LayerTimes(-1)
        for x in self.layers.values():
            t.forward += x.forward
            t.backward += x.backward
            t.copy += x.copy
            t.exposed += x.exposed
            t.uses += x.uses
            t.forward_uses += x.forward_uses
            t.copied_bytes += x.copied_bytes
        return t

    def rates(self) -> Rates | None:
        """The measured transfer rate, and the median forward time of a streamed layer per
        use (None when no streamed layer ran a forward with a copy behind it)."""
        streamed = [self.layers[i] for i in self.plan.streamed if i in self.layers]
        copies = [t for t in streamed if t.copy > 0]
        forwards = [t.forward / t.forward_uses for t in streamed if t.forward_uses]
        if not copies or not forwards:
            return None
        h2d = sum(t.copied_bytes for t in copies) / sum(t.copy for t in copies)
        return Rates(h2d=h2d, forward_s=sorted(forwards)[len(forwards) // 2], graphed=self.plan.graphs)

    def advice(self) -> str:
        """What the planner would change with the measured rates, in one sentence."""
        rates = self.rates()
        if rates is None or self.replan is None:
            return "no streamed layer was copied and run in this block: nothing to re-plan"
        new = self.replan(rates)
        measured = f"measured {format_bytes(int(rates.h2d))}/s host→device, {rates.forward_s * 1e3:.1f} ms per layer forward"
        old = self.plan

        def choices(p: Plan) -> tuple:
            return p.resident, p.whole, p.prefetch, p.graphs

        if choices(new) == choices(old):
            return f"{measured}: the plan stands"
        return (
            f"{measured}: the planner would keep {len(new.resident)} layers resident (now {len(old.resident)}), "
            f"{len(new.whole)} whole (now {len(old.whole)}), prefetch depth {new.prefetch} (now {old.prefetch}), "
            f"CUDA graphs {'on' if new.graphs else 'off'} (now {'on' if old.graphs else 'off'})"
        )

    def as_dict(self) -> dict[str, object]:
        t = self.totals
        return {
            "seconds": self.seconds,
            "forward_s": t.forward,
            "backward_s": t.backward,
            "copy_s": t.copy,
            "exposed_copy_s": t.exposed,
            "exposed_fraction": t.exposed / self.seconds if self.seconds else None,
            "layers": [vars(x) for x in sorted(self.layers.values(), key=lambda x: x.layer)],
            "advice": self.advice(),
        }

    def __str__(self) -> str:
        resident, whole = set(self.plan.resident), set(self.plan.whole)
        rows = [
            f"{'layer':>5}  {'where':<8} {'forward ms':>10} {'backward ms':>11} {'copy ms':>8} {'exposed ms':>10}"
        ]
        for t in sorted(self.layers.values(), key=lambda x: x.layer):
            where = "whole" if t.layer in whole else "resident" if t.layer in resident else "streamed"
            rows.append(
                f"{t.layer:>5}  {where:<8} {t.forward * 1e3:>10.2f} {t.backward * 1e3:>11.2f} "
                f"{t.copy * 1e3:>8.2f} {t.exposed * 1e3:>10.2f}"
            )
        t = self.totals
        share = f"{100 * t.exposed / self.seconds:.1f}%" if self.seconds else "n/a"
        rows.append(
            f"{'all':>5}  {'':<8} {t.forward * 1e3:>10.2f} {t.backward * 1e3:>11.2f} {t.copy * 1e3:>8.2f} "
            f"{t.exposed * 1e3:>10.2f}   exposed copy {share} of {self.seconds * 1e3:.1f} ms"
        )
        if whole:
            rows.append(f"layers run whole ({len(whole)}) are not timed one by one")
        rows.append(self.advice())
        return "\n".join(rows)
