"""CUDA graphs for the layers narrows runs itself: a layer's forward, and its
recompute-and-differentiate in backward, each replayed as one graph (`LayerGraphs`); and a
whole fast layer (kept, not recomputed) as two: its forward, which writes what its backward
reads into buffers of its own in the pool, and that backward (`LayerGraphs.whole`).

Replays give eager's results bit for bit (same kernels, same inputs, the restored RNG).
A shape is captured on its second appearance; at most `max_shapes` keep graphs (least
recently used evicted). A layer that cannot be captured runs eagerly with the reason in
`refused`; a capture that fails anyway raises. On a CPU, `LayerGraphs(emulate=True)` runs
the same buffer path eagerly.

Memory: a replay writes into the graphs' shared scratch pool without allocating, so CUDA's
allocated peak misses the pool; `peak_bytes` adds it. A capture runs the layer eagerly once
(its warm-up) while the pool holds the graphs captured before it, and grows the pool: to see
that, a capture resets CUDA's peak counter around itself and keeps what it measured in
`capture_peak` (see `peak_bytes`).

A whole layer's graphs hold its saved tensors from a forward replay to its backward's. The
pool is shared on the assumption that graphs replay in the order they were captured: what a
whole layer keeps stays referenced by its graphs, so no capture after it reuses those
blocks, but a graph captured before it may use them as scratch. So while a state waits, only
the later whole layers of the same pass replay (a second micro-batch in flight runs the
layers' own forwards), a call's whole layers are captured first to last, and a layer that
needs new graphs has its group's from it on captured again, in order.

why: docs/design.md#cuda-graphs
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from narrows.core import ambient_state, held_token
from narrows.core.kernels.fastlayer import FastCall, FastLayer, read_call
from narrows.core.protocol.anatomy import submodules
from narrows.core.protocol.recorders import recorded_key, recording

from ..config import DEFAULT_SHAPES
from .executor import LayerExecutor, LayerRun, SideGrads, eager_backward, eager_forward

log = logging.getLogger("narrows.stream")

__all__ = ["GraphStats", "LayerGraphs"]

_PLAIN = (type(None), bool, int, float, str)
_REMEMBERED = 256  # shapes seen once, remembered to tell a repeat from a new width


@dataclass
class GraphStats:
    captured: int = 0  # graphs captured
    replays: int = 0
    eager: int = 0  # layer runs that could not use a graph
    first_seen: int = 0  # layer runs (eager) before their batch shape was captured
    evicted: int = 0  # shapes whose graphs were dropped for a newer one
    refused: dict[int, str] = field(default_factory=dict)  # layer → why it runs eagerly

    def as_dict(self) -> dict[str, object]:
        return {
            "captured": self.captured,
            "replays": self.replays,
            "eager": self.eager,
            "first_seen": self.first_seen,
            "evicted": self.evicted,
            "refused": {str(k): v for k, v in self.refused.items()},
        }


@dataclass
class _Graph:
    replay: Callable[[], None]
    ins: list[Tensor]  # static buffers the live tensors are copied into, in leaf order
    outs: list[Tensor | None]  # static results (None: a gradient that does not exist)
    shape: tuple[int, ...] = ()  # the batch shape (of the hidden states) it was captured for


@dataclass
class _Whole:
    """A whole fast layer's graphs: the forward, what it keeps (`compute.Saved`, its
    tensors in the pool, rewritten by each replay), and the backward once captured."""

    forward: _Graph
    index: int  # the layer
    parts: Any  # the `LayerParts` the graphs were captured with
    saved: Any
    grads: list[Tensor]  # static results of the backward: the input's gradient, the adapters'
    backward: _Graph | None = None
    busy: bool = False  # a forward replayed whose backward has not run

    @property
    def shape(self) -> tuple[int, ...]:
        return self.forward.shape

    @property
    def ins(self) -> list[Tensor]:
        return [*self.forward.ins, *(self.backward.ins if self.backward is not None else ())]

    @property
    def outs(self) -> list[Tensor | None]:
        return [*self.forward.outs, *self.grads]


class _Claim:
    """A whole layer's saved tensors claimed by one autograd node: released by its
    backward, or when the node is freed without one. While any is held, graphs of other
    layers do not replay (`LayerGraphs._key`)."""

    def __init__(self, graphs: LayerGraphs, whole: _Whole, index: int):
        self.graphs, self.whole, self.index, self.held = graphs, whole, index, True
        whole.busy = True
        graphs._claims[index] = graphs._claims.get(index, 0) + 1

    def release(self) -> None:
        if self.held:
            self.held = False
            self.whole.busy = False
            left = self.graphs._claims[self.index] - 1
            if left:
                self.graphs._claims[self.index] = left
            else:
                del self.graphs._claims[self.index]

    def __del__(self) -> None:
        self.release()


class _WholeLayer(torch.autograd.Function):
    """autograd node for a whole layer replayed as graphs: ``apply(graphs, whole, tensors,
    params, hidden, *params)``, `tensors` the call's (`_call_tensors`), `params` the
    layer's trainable parameters."""

    @staticmethod
    def forward(ctx, graphs: LayerGraphs, whole: _Whole, tensors: list, params: tuple, hidden: Tensor, *p):
        _fill(whole.forward.ins, tensors)
        whole.forward.replay()
        graphs.stats.replays += 1
        ctx.graphs, ctx.claim, ctx.params = graphs, _Claim(graphs, whole, whole.index), params
        ctx.set_materialize_grads(False)
        return _take(whole.forward.outs[0])

    @staticmethod
    def backward(ctx, grad: Tensor | None):
        claim, ctx.claim = ctx.claim, None
        if claim is None:
            raise RuntimeError(
                "narrows.stream: a whole layer replayed as CUDA graphs was differentiated twice "
                "(retain_graph): its saved tensors are the graphs' and may be overwritten after its "
                "backward. Stream with graphs=False to differentiate twice."
            )
        try:
            if grad is None:
                return (None,) * (5 + len(ctx.params))
            g_x, by_id = ctx.graphs._whole_backward(claim.whole, grad)
        finally:
            claim.release()
        need = ctx.needs_input_grad
        grads = [
            by_id[id(p)].to(p.dtype) if n and id(p) in by_id else None for p, n in zip(ctx.params, need[5:])
        ]
        return None, None, None, None, g_x if need[4] else None, *grads


def _group(key: tuple) -> tuple:
    """A whole layer's key without its layer and parts: what every whole layer of one call
    shares (what is differentiated, the training mode, the mask; the arguments' layouts, the
    ambient settings)."""
    requires_grad, _, training, no_mask = key[5]
    return requires_grad, training, no_mask, key[-2], key[-1]


def _flat(gradients: tuple[Tensor, list[Tensor]]) -> list[Tensor]:
    """`FastLayer.gradients`' results as one list: the input's, then the adapters'."""
    return [gradients[0], *gradients[1]]


def _call_tensors(hidden: Tensor, call: FastCall) -> list[Tensor]:
    """What a whole layer's graphs read of a call: the hidden states, the rotary tables and
    the mask (where there is one)."""
    return [hidden, call.cos, call.sin] + ([call.mask] if call.mask is not None else [])


def _fill(buffers: Sequence[Tensor | None], values: Sequence[Tensor | None]) -> None:
    """Copy each value into its static buffer (a missing gradient has neither). Without
    grad: a differentiable copy would hang each call's autograd graph on the long-lived
    buffer, chaining every step's graph (and its saved tensors) to the next."""
    with torch.no_grad():
        for buf, value in zip(buffers, values):
            if buf is not None and buf.data_ptr() != value.data_ptr():
                buf.copy_(value)


def _take(result: Tensor | None) -> Tensor | None:
    """A result out of its graph buffer: the next replay overwrites the buffer."""
    return None if result is None else result.clone()


_fork = torch.random.fork_rng  # the warm-up and capture leave the global RNG where it was


@contextmanager
def _swapped(layer: nn.Module, params: Sequence[Tensor], aliases: Sequence[Tensor]) -> Iterator[None]:
    """`layer`'s parameters `params` replaced by `aliases` for the block."""
    by_id = {id(p): a for p, a in zip(params, aliases)}
    saved = []
    for module in layer.modules():
        for name, p in module._parameters.items():
            if p is not None and id(p) in by_id:
                saved.append((module, name, p))
    try:
        for module, name, p in saved:
            module._parameters[name] = by_id[id(p)]
        yield
    finally:
        for module, name, p in saved:
            module._parameters[name] = p


def _parameters(layer: nn.Module, modules: list[nn.Module]) -> list[nn.Parameter]:
    """`layer.parameters()`'s parameters (each once) from its submodules `modules`."""
    seen, out = set(), []
    for mod in (layer, *modules):
        for p in mod._parameters.values():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def _hooks(modules: list[nn.Module]) -> tuple[bool, set[str]]:
    """Hooks a replay would skip, those of a layer's submodules `modules` (and global ones):
    whether there are any but transformers' output recorders, and the outputs those record.
    The layer's own run around the call narrows replays, as they do eagerly."""
    from torch.nn.modules import module as m

    if m._global_forward_hooks or m._global_forward_pre_hooks:
        return True, set()
    other, recorded = False, set()
    for mod in modules:
        if not (mod._forward_pre_hooks or mod._forward_hooks):
            continue
        other = other or bool(mod._forward_pre_hooks)
        for hook in mod._forward_hooks.values():
            key = recorded_key(hook)
            other = other or key is None
            if key is not None:
                recorded.add(key)
    return other, recorded


class LayerGraphs(LayerExecutor):
    """The layer executor that captures and replays one graph per layer call signature
    (see the module doc), and runs a call it cannot capture eagerly."""

    def __init__(self, device: torch.device, *, emulate: bool = False, max_shapes: int = DEFAULT_SHAPES):
        if max_shapes < 1:
            raise ValueError(f"max_shapes={max_shapes}: keep graphs for at least one batch shape")
        self.device = device
        self.emulate = emulate or device.type != "cuda"
        self.max_shapes = max_shapes
        self.stats = GraphStats()
        self._graphs: dict[tuple, _Graph] = {}
        self._buffers: dict[tuple, Tensor] = {}
        self._shapes: OrderedDict[tuple[int, ...], None] = OrderedDict()  # captured, least recent first
        self._seen: OrderedDict[tuple[int, ...], set[int]] = OrderedDict()  # not yet: layers that ran it
        self._paused = False
        self._claims: dict[int, int] = {}  # layer -> whole graphs of it whose state waits for a backward
        self._regroup: dict[tuple, int] = {}  # a whole group's graphs dropped at this layer, this pass
        self._whole_first: dict[tuple, int] = {}  # a whole group's first layer
        self._first = 1 << 30  # the first layer that runs through graphs: a shape's captures start there
        self.capture_peak = 0  # bytes in use during captures and before them, since `reset_peak`
        if not self.emulate:
            # a pool the warm-ups allocate from too, so a capture reuses its warm-up's blocks
            # rather than holding a second working set beside them
            self._mempool = torch.cuda.MemPool()
            self.pool = self._mempool.id
            self.stream = torch.cuda.Stream(device)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Every layer eager for the block: a dispatch mode that records ops (step mode
        learning a shape's random draws) sees nothing of a replay."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    @contextmanager
    def released(self) -> Iterator[None]:
        """Every graph dropped, and the block run eagerly in the pool they used: an
        evaluation between training steps runs in the memory the graphs held, not beside
        it. Safe, since no graph is left to replay over what the block allocates there;
        the graphs captured after it keep clear of what stays allocated. A batch shape
        captured before is captured again at its next call (the plan's `eager_beside_graphs`
        False counts on this around every pass without gradients)."""
        if self._claims:
            raise RuntimeError(
                "narrows.stream: the CUDA graphs cannot be released while a whole layer's saved tensors "
                "wait for their backward: release them between training steps"
            )
        self._drop_all()
        was, self._paused = self._paused, True
        try:
            if self.emulate:
                yield
            else:
                with torch.cuda.use_mem_pool(self._mempool):
                    yield
        finally:
            self._paused = was

    def _drop_all(self) -> None:
        """Drop every graph and static buffer; the shapes they were captured for are
        remembered as seen, so their next call captures again."""
        if not self.emulate:
            torch.cuda.synchronize(self.device)  # no replay still reads or writes what is freed
        for shape in self._shapes:
            self._seen[shape] = {self._first}
        self._shapes.clear()
        self._graphs.clear()
        self._buffers.clear()
        self._regroup.clear()

    # ---- what the layers call ---------------------------------------------------------
    def forward(self, run: LayerRun, hidden: Tensor) -> Tensor:
        """`eager_forward`, through a graph when the layer can be captured."""
        index, layer, fn, args, kwargs = run.index, run.layer, run.fn, run.args, run.kwargs
        leaves = [hidden, *pytree.tree_leaves((args, kwargs))]
        key = self._key("fwd", index, layer, leaves, args, kwargs, hidden.requires_grad)
        if key is None:
            return eager_forward(fn, hidden, args, kwargs)

        def body(ins: list[Tensor]) -> list[Tensor | None]:
            h, a, k = self._rebuild(ins, args, kwargs, hidden.requires_grad)
            return [eager_forward(fn, h, a, k)]

        return self._run(key, index, body, leaves)[0]

    def backward(
        self,
        run: LayerRun,
        hidden: Tensor,
        grad_out: Tensor | None,
        params: Sequence[Tensor],
        side: SideGrads | None = None,
    ) -> list[Tensor | None]:
        """`eager_backward`, through a graph when the layer can be captured. A call whose
        output has no gradient or whose side outputs have one runs eagerly, uncounted."""
        index, layer, fn, args, kwargs = run.index, run.layer, run.fn, run.args, run.kwargs
        leaves = [hidden, *pytree.tree_leaves((args, kwargs)), grad_out]
        extra = (hidden.requires_grad, tuple(id(p) for p in params))
        eager = grad_out is None or (side is not None and len(side.grads) > 0)
        key = None if eager else self._key("bwd", index, layer, leaves, args, kwargs, extra)
        if key is None:
            return eager_backward(fn, hidden, args, kwargs, grad_out, params, side)

        def body(ins: list[Tensor]) -> list[Tensor | None]:
            h, a, k = self._rebuild(ins[:-1], args, kwargs, hidden.requires_grad)
            # fresh leaves over the parameters' storage: the parameters' own gradient
            # accumulators belong to the outer graph's stream, which a capture cannot touch
            aliases = [p.detach().requires_grad_() for p in params]
            with _swapped(layer, params, aliases):
                return eager_backward(fn, h, a, k, ins[-1], aliases)

        return self._run(key, index, body, leaves)

    def whole(self, run: LayerRun, hidden: Tensor, params: Sequence[Tensor]) -> Tensor | None:
        """A whole (kept, not recomputed) fast layer's call through its graphs: the output,
        differentiable in `hidden` and `params` (its trainable parameters); None where it
        runs as the caller's own forward instead (not covered, not captured yet or not
        capturable, or graphs' saved tensors wait for a backward: see `_key`)."""
        fast = FastLayer.of(run.layer)
        parts = fast.parts()
        call = None if parts is None else read_call(run.layer, run.args, run.kwargs)
        if call is None or call.kv is not None:
            return None
        leaves = [hidden, *pytree.tree_leaves((run.args, run.kwargs))]
        extra = (hidden.requires_grad, id(parts), run.layer.training, call.mask is None)
        key = self._key("whole", run.index, run.layer, leaves, run.args, run.kwargs, extra)
        if key is None:
            return None
        tensors = _call_tensors(hidden, call)
        whole = self._graphs.get(key)
        if whole is None and not self._may_capture_whole(key, run.index):
            self.stats.eager += 1
            return None
        if whole is None:
            whole = self._capture_whole(key, run.index, parts, tensors)
            if whole is None:
                self.stats.eager += 1
                return None
        if whole.busy:
            self.stats.eager += 1
            return None
        return _WholeLayer.apply(self, whole, tensors, tuple(params), hidden, *params)

    def _may_capture_whole(self, key: tuple, index: int) -> bool:
        """Whether a whole layer's graphs may be captured now: in the order they replay.

        The whole layers of one call (a group: the same shapes, grad and training modes,
        mask or not) are captured in one pass, first to last, each while the states of those
        before it are alive. Where this layer, or a later one, of the group has graphs
        already (its parts were rebuilt, an adapter moved), a state captured now could lie in
        their scratch and be overwritten before its backward: those graphs go, and this pass
        runs eagerly from here; the next captures them again from this layer on. Whole
        graphs of one batch shape at a time: another shape's go first (their states stay in
        the pool, which the plan prices once)."""
        group = _group(key)
        mark = self._regroup.get(group)
        if mark is not None:
            if index > mark:
                return False  # the rest of the pass that dropped them
            del self._regroup[group]
        same = [(k, g) for k, g in self._graphs.items() if isinstance(g, _Whole) and _group(k) == group]
        later = [k for k, _ in same if k[1] >= index]
        if later:
            for k in later:
                del self._graphs[k]  # none is busy: `_key` lets no earlier layer run while one is
            self._regroup[group] = index
            return False
        if not same:  # a group starts at its first whole layer
            first = self._whole_first.setdefault(group, index)
            self._whole_first[group] = min(first, index)
            if index != self._whole_first[group]:
                return False
            shape = key[-2][0][0]
            for other in {g.shape for g in self._graphs.values() if isinstance(g, _Whole)} - {shape}:
                if other in self._shapes:
                    self._evict(other)
        return True

    def _whole_backward(self, whole: _Whole, grad: Tensor) -> tuple[Tensor, dict[int, Tensor]]:
        """A whole layer's input gradient and its adapters' (by parameter id), from its
        forward's saved tensors; the backward graph captured at its first use."""
        if whole.backward is None:
            whole.backward = self._capture_whole_backward(whole, grad)
        graph = whole.backward
        _fill(graph.ins, [grad])
        graph.replay()
        self.stats.replays += 1
        g_x, *grads = (_take(o) for o in whole.grads)
        return g_x, {id(p): g for p, g in zip(whole.parts.params(), grads)}

    def _capture_whole(self, key: tuple, index: int, parts: Any, tensors: list[Tensor]) -> _Whole | None:
        """A whole layer's forward graph (its inputs in buffers of its own: what it keeps
        reads them). The warm-up runs the forward and a backward eagerly, so the backward's
        capture, later, needs none (a warm-up would write over the saved tensors)."""
        ins = self._static(("whole", index), tensors)
        whole = _Whole(_Graph(lambda: None, ins, []), index, parts, None, [])

        def forward() -> tuple[Tensor, Any] | None:
            return FastLayer.keeping(
                parts, ins[0], FastCall(ins[1], ins[2], ins[3] if len(ins) > 3 else None)
            )

        def warm_up() -> list[Tensor] | None:
            _fill(ins, tensors)
            kept = forward()
            if kept is None:
                self._refuse(index, "its attention records more than one node (SDPA's math path)")
                return None
            return [kept[0], *_flat(FastLayer.gradients(parts, kept[0], saved=kept[1]))]

        def settle(warm: list[Tensor]) -> None:
            whole.forward.outs = self._static("out", warm[:1])
            whole.grads = self._static("whole-grad", warm[1:])

        def capture() -> None:
            out, whole.saved = forward()
            _fill(whole.forward.outs, [out])

        replay = self._graph(index, capture, warm_up, settle)
        if replay is None:
            return None
        whole.forward.replay, whole.forward.shape = replay, tuple(tensors[0].shape)
        self._graphs[key] = whole
        self.stats.captured += 1
        return whole

    def _device_index(self) -> int:
        return self.device.index if self.device.index is not None else torch.cuda.current_device()

    def _capture_whole_backward(self, whole: _Whole, grad: Tensor) -> _Graph:
        """The backward graph of `whole`'s forward, reading its saved tensors and writing
        its results into `whole.grads` (no warm-up: the forward's ran this backward)."""
        ins = self._static("grad", [grad])

        def capture() -> None:
            _fill(whole.grads, _flat(FastLayer.gradients(whole.parts, ins[0], saved=whole.saved)))

        replay = self._graph(whole.index, capture)
        assert replay is not None  # refused only at a warm-up
        self.stats.captured += 1
        return _Graph(replay, ins, whole.grads)

    def _graph(
        self,
        index: int,
        capture: Callable[[], None],
        warm_up: Callable[[], list[Tensor | None] | None] | None = None,
        settle: Callable[[list[Tensor | None]], None] | None = None,
    ) -> Callable[[], None] | None:
        """What replays `capture`: its CUDA graph (`_cuda_graph`, which says what `warm_up`
        and `settle` are); emulated, `capture` itself after the same warm-up. None where
        the warm-up refused the layer."""
        if not self.emulate:
            g = self._cuda_graph(index, capture, warm_up, settle)
            return None if g is None else g.replay
        with _fork(devices=[]):
            if warm_up is not None:
                warm = warm_up()
                if warm is None:
                    return None
                if settle is not None:
                    settle(warm)
        return capture

    def _cuda_graph(
        self,
        index: int,
        capture: Callable[[], None],
        warm_up: Callable[[], list[Tensor | None] | None] | None = None,
        settle: Callable[[list[Tensor | None]], None] | None = None,
    ) -> torch.cuda.CUDAGraph | None:
        """`capture` captured as a CUDA graph on the capture stream, into the shared pool.
        First `warm_up` runs there eagerly (lazy initialisation stays out of the graph, and a
        call that waits for the host, which no graph can hold, shows itself: refused), its
        allocations in the pool too, so the capture reuses its blocks; it returns its
        results, or None where it refused the layer (saying why). `settle(results)` then
        makes the static buffers, outside the pool. None where refused; a capture that fails
        raises, since it leaves the CUDA generator and the pool unusable.

        Peaks: every allocation of the warm-up and the capture lands in the pool (see
        `_in_pool`), so the stretch's peak is what lay outside the pool before it plus the
        pool at its largest (it only grows)."""
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        active = self.pool_bytes() - self.pool_free_bytes()  # what whole layers keep in it now
        self._reset_allocator_peak()  # what ran since the last reset, beside the pool
        # the warm-up and the capture draw random numbers too: the global RNG must not move
        try:
            with _fork(devices=[self._device_index()], device_type="cuda"), torch.cuda.stream(self.stream):
                if warm_up is not None:
                    mode = torch.cuda.get_sync_debug_mode()
                    torch.cuda.set_sync_debug_mode("error")
                    try:
                        with self._in_pool() as routed:
                            warm = warm_up()
                        if warm is None:
                            return None
                        if settle is not None:
                            settle(warm)
                        del warm
                    except RuntimeError as e:
                        if "synchroniz" not in str(e):
                            raise
                        self._refuse(index, "its forward waits for the host (a graph cannot hold a sync)")
                        return None
                    finally:
                        torch.cuda.set_sync_debug_mode(mode)
                    if routed:
                        torch.cuda.reset_peak_memory_stats(self.device)  # its peak: see below
                    else:  # the autograd engine's thread allocated beside the pool: a bound
                        self._reset_allocator_peak(active)
                before = torch.cuda.memory_allocated(self.device)
                g = torch.cuda.CUDAGraph()
                try:
                    with torch.cuda.graph(
                        g, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"
                    ):
                        capture()
                except Exception as e:
                    raise RuntimeError(
                        f"narrows.stream: capturing layer {index} as a CUDA graph failed ({type(e).__name__}: "
                        f"{str(e).splitlines()[0][:200]}). Stream with graphs=False to run every layer eagerly."
                    ) from e
        finally:
            current.wait_stream(self.stream)
        self.capture_peak = max(self.capture_peak, before + self.pool_bytes() - active)
        torch.cuda.reset_peak_memory_stats(self.device)
        return g

    @contextmanager
    def _in_pool(self) -> Iterator[bool]:
        """Every allocation on the capture stream goes to the graphs' pool for the block,
        from any thread (the autograd engine's, which runs a backward, too); yields True.
        Where torch has no such routing, this thread's allocations alone (yields False)."""
        begin = getattr(torch._C, "_cuda_beginAllocateCurrentStreamToPool", None)
        if begin is None:
            with torch.cuda.use_mem_pool(self._mempool):
                yield False
            return
        device = self._device_index()
        begin(device, self.pool)
        try:
            yield True
        finally:
            torch._C._cuda_endAllocateToPool(device, self.pool)
            torch._C._cuda_releasePool(device, self.pool)

    # ---- capture and replay -----------------------------------------------------------
    @staticmethod
    def _rebuild(
        ins: list[Tensor], args: tuple, kwargs: dict, requires_grad: bool
    ) -> tuple[Tensor, tuple, dict]:
        """The call's arguments with every tensor replaced by its static buffer."""
        rest = iter(ins[1:])
        a, k = pytree.tree_map(lambda x: next(rest) if isinstance(x, Tensor) else x, (args, kwargs))
        return ins[0].detach().requires_grad_(requires_grad), a, k

    def _key(
        self,
        kind: str,
        index: int,
        layer: nn.Module,
        leaves: list[Any],
        args: tuple,
        kwargs: dict,
        extra: object,
    ) -> tuple | None:
        if self._paused:
            return None
        if self._claims and (kind != "whole" or index <= max(self._claims)):
            # whole layers' states wait in the pool for their backward: the only graphs that
            # replay meanwhile are later whole layers' of the same pass (and the backwards),
            # captured while those states were alive; any other may use their blocks as scratch
            self.stats.eager += 1
            return None
        if index in self.stats.refused:
            self.stats.eager += 1
            return None
        why = None
        modules = submodules(layer)
        other_hooks, recorded = _hooks(modules)
        if other_hooks:
            why = "forward hooks inside the layer (a replay would not call them)"
        elif recorded and recording(recorded):  # this call collects what the hooks record
            self.stats.eager += 1
            return None
        sig = []
        for x in leaves:
            if isinstance(x, Tensor):
                if any(st == 0 and n > 1 for st, n in zip(x.stride(), x.shape)):
                    why = why or "an argument whose elements overlap in memory (an expanded tensor)"
                sig.append((tuple(x.shape), x.stride(), x.dtype, x.device))
            elif isinstance(x, _PLAIN):
                sig.append((type(x), x))
            else:
                why = (
                    why
                    or f"an argument of type {type(x).__name__} (only tensors and plain values are captured)"
                )
        if why is not None:
            self._refuse(index, why)
            self.stats.eager += 1
            return None
        if not self._admit(kind, index, tuple(leaves[0].shape)):
            self.stats.first_seen += 1
            return None
        spec = pytree.tree_structure((args, kwargs))
        params = _parameters(layer, modules)
        first = next((p for p in params if not p.requires_grad), None)
        where = first.data_ptr() if first is not None else 0
        # the adapters' addresses: in host memory between uses (step mode's offload_adapters)
        # they come back to the same device slot, and a replay reads what it captured
        trained = tuple((p.data_ptr(), p.shape, p.dtype) for p in params if p.requires_grad)
        # held_token: the 4-bit weights read from the held dequantised copies (step mode)
        return (
            kind,
            index,
            where,
            trained,
            held_token(layer),
            extra,
            str(spec),
            tuple(sig),
            ambient_state(self.device),
        )

    def _admit(self, kind: str, index: int, shape: tuple[int, ...]) -> bool:
        """Whether this batch shape runs through graphs: it has them already, or this layer's
        forward sees it a second time (then the least recently used shape may be evicted)."""
        if shape in self._shapes:
            self._shapes.move_to_end(shape)
            return True
        seen = self._seen.setdefault(shape, set())
        self._seen.move_to_end(shape)
        if kind != "bwd":
            self._first = min(self._first, index)
        # captured from the first layer on, in the order the graphs replay (whole layers'
        # states lie in the pool: a graph captured out of that order could share their blocks)
        if kind == "bwd" or index not in seen or index != self._first:
            if kind != "bwd":
                seen.add(index)
            while len(self._seen) > _REMEMBERED:
                self._seen.popitem(last=False)
            return False
        del self._seen[shape]
        if len(self._shapes) >= self.max_shapes:
            self._evict(next(iter(self._shapes)))
        self._shapes[shape] = None
        return True

    def _evict(self, shape: tuple[int, ...]) -> None:
        """Drop `shape`'s graphs and every buffer no remaining graph uses."""
        if not self.emulate:
            torch.cuda.synchronize(self.device)  # no replay still reads or writes what is freed
        del self._shapes[shape]
        for key in [k for k, g in self._graphs.items() if g.shape == shape]:
            del self._graphs[key]
        used = {id(b) for g in self._graphs.values() for b in (*g.ins, *g.outs) if b is not None}
        for key in [k for k, b in self._buffers.items() if id(b) not in used]:
            del self._buffers[key]
        self.stats.evicted += 1

    def _refuse(self, index: int, why: str) -> None:
        if index not in self.stats.refused:
            log.warning("narrows.stream: layer %d runs without CUDA graphs: %s", index, why)
        self.stats.refused[index] = why

    def _run(
        self, key: tuple, index: int, body: Callable[[list[Tensor]], list[Tensor | None]], leaves: list[Any]
    ) -> list[Tensor | None]:
        live = [x for x in leaves if isinstance(x, Tensor)]
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._capture(key, index, body, live)
            if graph is None:
                self.stats.eager += 1
                return body(live)
        _fill(graph.ins, live)
        graph.replay()
        self.stats.replays += 1
        return [_take(o) for o in graph.outs]

    def _static(self, role: str, tensors: list[Tensor | None]) -> list[Tensor | None]:
        """One buffer per (role, position, layout), shared by every graph: replays are
        serial. None (a gradient that does not exist) stays None."""
        bufs: list[Tensor | None] = []
        for j, x in enumerate(tensors):
            k = (role, j, tuple(x.shape), x.stride(), x.dtype) if x is not None else None
            if k is not None and k not in self._buffers:
                self._buffers[k] = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
            bufs.append(self._buffers[k] if k is not None else None)
        return bufs

    def _capture(
        self, key: tuple, index: int, body: Callable[[list[Tensor]], list[Tensor | None]], live: list[Tensor]
    ) -> _Graph | None:
        ins = self._static("in", live)
        graph = _Graph(lambda: None, ins, [], tuple(live[0].shape))

        def warm_up() -> list[Tensor | None]:
            _fill(ins, live)
            return body(ins)

        def settle(warm: list[Tensor | None]) -> None:
            graph.outs = self._static("out", warm)

        replay = self._graph(index, lambda: _fill(graph.outs, body(ins)), warm_up, settle)
        if replay is None:
            return None
        graph.replay = replay
        self._graphs[key] = graph
        self.stats.captured += 1
        return graph

    def _reset_allocator_peak(self, active: int | None = None) -> None:
        """Fold CUDA's allocated peak since its last reset, with the pool's bytes no tensor
        held beside it, into `capture_peak`, and reset it. `active`: the pool's bytes in use
        before a warm-up that allocated from the pool (its own are in the allocated peak);
        else those in use now."""
        total, now = self._pool_sizes()
        peak = torch.cuda.max_memory_allocated(self.device) + total - (now if active is None else active)
        self.capture_peak = max(self.capture_peak, peak)
        torch.cuda.reset_peak_memory_stats(self.device)

    def reset_peak(self) -> None:
        """Start a new window for `peak_bytes` (after `narrows.core.reset_peaks`)."""
        self.capture_peak = 0

    def peak_bytes(self, allocated_peak: int) -> int:
        """The most device memory in use since `reset_peak`, given CUDA's allocated peak
        since the same moment (`allocated_peak`, read now): the peak beside the pool as it is
        now, or a capture's (`capture_peak`: each capture resets CUDA's counter, so
        `allocated_peak` counts only what ran after the last one)."""
        return max(self.capture_peak, allocated_peak + self.pool_free_bytes())

    def pool_bytes(self) -> int:
        """Device memory the graphs' shared pool holds (0 when emulated)."""
        return self._pool_sizes()[0]

    def pool_free_bytes(self) -> int:
        """The pool's bytes no tensor holds now: CUDA's allocated count already has the rest
        (what whole layers' graphs keep), so the device's use is the allocated bytes plus
        these."""
        total, active = self._pool_sizes()
        return total - active

    def _pool_sizes(self) -> tuple[int, int]:
        """The pool's bytes, and those of its blocks in use."""
        if self.emulate:
            return 0, 0
        pool = tuple(self.pool)
        segments = [s for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", ())) == pool]
        active = sum(b["size"] for s in segments for b in s["blocks"] if b["state"] == "active_allocated")
        return sum(s["total_size"] for s in segments), active
