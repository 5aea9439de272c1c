"""`from_pretrained`: a user's checkpoint folder loaded block by block straight into its
host tiers (pinned RAM within a host budget, the rest on disk in the prepared-slab
cache), and `prepare`, which builds that cache ahead of time.

The first run reads and quantises each layer (core's block-streamed loader), writes its
slab to the cache and keeps it pinned or drops it to the disk tier; later runs read the
slabs back (CRC-checked) instead of quantising. The float model never exists; peak host
memory is the final footprint plus about two layers' source tensors.

Several ranks on one machine (torchrun) share one host copy: with ``share`` each rank maps
the cache file's slabs read-only and page-locks the map for its GPU, so the kernel's page
cache holds the base once however many ranks map it. The first rank to take the cache's
lock builds the file; the others wait for it, then map it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from torch import Tensor, nn

from narrows.core import NarrowsError, SlabLayout, anatomy_of, assign, format_bytes, parse_bytes
from narrows.core.io.checkpoint import CheckpointFolder
from narrows.core.io.files import build_lock, cache_dir
from narrows.core.io.loader import load_blockwise, map_tensor
from narrows.core.io.models import resolve_model_path
from narrows.core.memory import host_rss_bytes
from narrows.core.protocol.handle import state_of

from ..planning.measure import default_host_budget
from ..planning.placement import spread
from .cache import PreparedCache, SlabCacheWriter, crc32, frozen_layer_slots
from .tiers import Tiers, aligned_pinned, pin_shared, restore_layer

log = logging.getLogger("narrows.stream")

__all__ = ["HOST_MARGIN", "default_host_budget", "from_pretrained", "prepare"]

FORMAT = "narrows-slabs/1"
HOST_MARGIN = (
    1 << 30
)  # host memory kept free of slabs: tokenised data, adapters' host copies, allocator slack


class _Stale(Exception):
    """A cached slab failed its CRC: rebuild the cache."""


def _expect(
    folder: CheckpointFolder, dtype: torch.dtype, quant: str | None, experts: str | None = None
) -> dict:
    import transformers

    from narrows.core import __version__

    stored = folder.check_quantization()
    nf4 = quant == "nf4" or stored
    return {
        "format": FORMAT,
        "narrows": __version__,
        "transformers": transformers.__version__,  # it names and shapes the modules a slab fills
        "source": folder.identity(),
        "settings": {
            "dtype": str(dtype),
            "quant": "nf4" if nf4 else "none",
            "prequantized": stored is not None,
            "blocksize": 64,
            "double_quant": True,
            # the fused expert stacks' scheme: the loader quantises them with the linears, or
            # keeps a release's MXFP4 ones
            "experts": experts or ("mxfp4" if folder.packed else "nf4" if nf4 else "none"),
        },
    }


def experts_scheme(expect: dict) -> str | None:
    """The expert stacks' scheme the loader is asked for (None: it quantises none)."""
    scheme = expect["settings"]["experts"]
    return None if scheme == "none" else scheme


def cache_path(folder: CheckpointFolder, expect: dict, cache: str | os.PathLike | None) -> Path:
    """One cache file per (model folder, settings): a changed source is found stale in it."""
    root = Path(cache).expanduser() if cache is not None else cache_dir("slabs")
    key = json.dumps([str(folder.path.resolve()), expect["settings"]], sort_keys=True)
    return root / f"{folder.path.name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.slabs"


class _Placer:
    """Decides each layer's host tier as the layers arrive, under the host budget."""

    def __init__(self, n: int, budget: int | None, ring: int, can_spill: bool):
        self.n, self.budget, self.ring, self.can_spill = n, budget, ring, can_spill
        self.pinned: set[int] | None = None
        self.fixed = 0

    def pinned_here(self, index: int, slab_bytes: int) -> bool:
        if self.pinned is None:  # first layer: everything outside the layers is loaded by now
            self.fixed = host_rss_bytes()  # the process, and what is loaded outside the layers
            if self.budget is None:
                self.pinned = set(range(self.n))
            else:
                allow = self.budget - self.fixed - HOST_MARGIN
                count = min(self.n, max(0, allow // slab_bytes)) if allow > 0 else 0
                if count < self.n:  # a disk tier: reserve its ring of read buffers
                    count = min(self.n, max(0, (allow - self.ring * slab_bytes) // slab_bytes))
                minimum = self.fixed + HOST_MARGIN + (self.ring + 2) * slab_bytes
                if count < self.n and (not self.can_spill or self.budget < minimum):
                    why = (
                        "no prepared cache to hold a disk tier (cache=False)"
                        if not self.can_spill
                        else f"the minimum is {format_bytes(minimum)}: what is loaded outside the layers and the "
                        f"process itself ({format_bytes(self.fixed)}), a margin of {format_bytes(HOST_MARGIN)}, "
                        f"{self.ring} disk read buffers and two slabs in flight while loading"
                    )
                    fix = (
                        "enable the cache so layers can spill to disk"
                        if not self.can_spill
                        else "free memory"
                    )
                    raise NarrowsError(
                        f"a host budget of {format_bytes(self.budget)} is too small: {why}. Raise "
                        f"--host-budget, or {fix}."
                    )
                self.pinned = set(spread(count, self.n))
        return index in self.pinned


def from_pretrained(
    path: str | os.PathLike,
    *,
    quant: str | None = None,
    experts: str | None = None,
    dtype: torch.dtype = torch.bfloat16,
    host_budget: str | int | None = None,
    cache: str | os.PathLike | bool | None = True,
    device: torch.device | str | None = None,
    ring: int = 3,
    share: bool | None = None,
) -> nn.Module:
    """Load a causal LM from a local folder (or ``.gguf``) block by block into host tiers.

    `quant="nf4"` quantises the decoder linears (a pre-quantised bitsandbytes NF4 folder
    loads as stored) and a mixture of experts' fused stacks to `experts` ("nf4", the
    default; "nf3" or "nf2": `narrows.core.quantize_nf4`'s codes). `host_budget` (bytes or ``"24GiB"``; default: 85% of available
    memory) bounds the host RAM the base may take: layers that do not fit go to the disk
    tier, read from the prepared-slab cache. `cache`: True (``$NARROWS_CACHE/slabs``), a
    folder, or False (no cache: everything must fit the host budget). `device`: where to
    quantise (default: CUDA if present). Then wrap it with PEFT and call
    `narrows.stream.stream` — it streams from these tiers. `share`: the host-RAM layers are
    read-only maps of the cache file, page-locked by each process, so the ranks of one
    machine hold one copy between them (default: when torchrun started several ranks here,
    ``LOCAL_WORLD_SIZE`` > 1, and there is a cache). Ranks that do not share split the
    default host budget between them.
    """
    if ring < 1:
        raise NarrowsError(f"ring={ring}: the disk tier needs at least one read buffer (default 3)")
    folder_path = resolve_model_path(path)
    folder = CheckpointFolder(folder_path)
    expect = _expect(folder, dtype, quant, experts)
    budget = default_host_budget() if host_budget is None else parse_bytes(host_budget)
    target = (
        cache_path(folder, expect, None if cache is True else cache) if cache not in (False, None) else None
    )
    pin = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)  # ranks torchrun started on this machine
    if share is None:
        share = target is not None and local > 1
    elif share and target is None:
        raise NarrowsError(
            "share=True maps the prepared cache file: give a cache (cache=True or a folder), or share=False"
        )
    if share:
        return _load_shared(folder, expect, dtype, quant, device, budget, target, pin, ring)
    if host_budget is None and local > 1:  # each rank of this machine holds its own copy
        budget //= local
    for _attempt in range(2):
        prepared, why = PreparedCache.open(target, expect) if target is not None else (None, "")
        if target is not None and prepared is None and target.exists():
            log.warning("narrows: prepared cache %s is not usable (%s): rebuilding it", target, why)
            print(f"narrows: prepared cache {target} is not usable ({why}); rebuilding it", flush=True)
        try:
            return _load(folder, expect, dtype, quant, device, budget, target, prepared, pin, ring, keep=True)
        except _Stale as e:
            print(f"narrows: prepared cache {target}: {e}; rebuilding it", flush=True)
            target.unlink(missing_ok=True)
    raise AssertionError("unreachable")


def _load_shared(folder, expect, dtype, quant, device, budget, target, pin, ring) -> nn.Module:
    """`from_pretrained` with ``share``: the cache built first (once, under its lock), then
    every host-RAM layer mapped from it."""
    built = False
    for _attempt in range(2):
        with build_lock(target):
            prepared, why = PreparedCache.open(target, expect)
            if prepared is not None and any(e.parts for e in prepared.layers):
                # slabs read in place from a pre-quantised checkpoint's files: no one contiguous map
                prepared, why = (
                    None,
                    "its slabs lie in the checkpoint's files, in parts; the ranks share whole slabs",
                )
            if prepared is None:
                built = True
                if target.exists():
                    print(
                        f"narrows: prepared cache {target} is not usable ({why}); rebuilding it", flush=True
                    )
                    target.unlink()
                _load(
                    folder,
                    expect,
                    dtype,
                    quant,
                    device,
                    None,
                    target,
                    None,
                    pin,
                    ring,
                    keep=False,
                    share=True,
                )
                prepared, why = PreparedCache.open(target, expect)
                if prepared is None:
                    raise NarrowsError(f"prepared cache {target}: {why} right after it was written")
        try:
            model = _load(
                folder,
                expect,
                dtype,
                quant,
                device,
                budget,
                target,
                prepared,
                pin,
                ring,
                keep=True,
                share=True,
            )
            if built:
                state_of(model).tiers.notes.insert(0, f"this process built {target}")
            mapped = _map_outside_layers(model, folder)
            if mapped:
                state_of(model).tiers.notes.append(f"{', '.join(mapped)} mapped from the checkpoint's files")
                print(f"narrows: {state_of(model).tiers.notes[-1]}", flush=True)
            return model
        except _Stale as e:
            print(f"narrows: prepared cache {target}: {e}; rebuilding it", flush=True)
            with build_lock(target):
                target.unlink(missing_ok=True)
    raise AssertionError("unreachable")


def _map_outside_layers(model: nn.Module, folder: CheckpointFolder) -> list[str]:
    """The frozen tensors outside the decoder layers (embedding, head, norms) that the
    checkpoint holds exactly as loaded become read-only maps of its files, shared by every
    process of the machine like the slabs. A tensor converted on load (another dtype, a
    renamed or fused key) stays this process's own."""
    in_layers = {id(p) for layer in anatomy_of(model).layers for p in layer.parameters()}
    mapped = []
    for name, p in model.named_parameters():
        if id(p) in in_layers or name not in folder.tensors:
            continue
        view = map_tensor(folder, name)
        if view is not None and view.dtype == p.dtype and view.shape == p.shape and torch.equal(view, p.data):
            p.data = view
            mapped.append(name)
    return mapped


def _load(
    folder,
    expect,
    dtype,
    quant,
    device,
    budget,
    target,
    prepared,
    pin,
    ring,
    *,
    keep: bool,
    share: bool = False,
) -> nn.Module:
    from transformers import AutoConfig

    n = AutoConfig.from_pretrained(folder.path).get_text_config().num_hidden_layers
    if pin:  # the CUDA context's host memory belongs to what the budget must leave for the process
        torch.cuda.init()
        torch.empty(1, device="cuda")
    placer = _Placer(n, budget, ring, can_spill=target is not None)
    if not keep:  # prepare: every slab goes to the file only
        placer.pinned = set()
    homes: list[Tensor | None] = [None] * n
    disk: list[int] = []
    layouts: list[SlabLayout | None] = [None] * n
    writer = SlabCacheWriter(target, expect) if target is not None and prepared is None else None
    gpu = torch.device(device).index if device is not None and torch.device(device).type == "cuda" else None
    warm = _WarmReader(prepared, placer, pin, depth=2, share=share, gpu=gpu) if prepared is not None else None
    # packed weights stay where the checkpoint has them (shared: every slab whole in the cache)
    in_place = expect["settings"]["prequantized"] and not share

    def fill(i: int, lpath: str, layer: nn.Module) -> bool:
        if warm is None:
            return False
        entry = prepared.layers[i]
        slab = warm.take(i)  # pinned slab, or None for a disk layer (checked, then dropped)
        if slab is None:  # disk tier: the slots map the bytes where they lie
            disk.append(i)
            slab = prepared.mapped(i)  # one map of the cache file, or None for a layer in parts
        try:
            restore_layer(layer, entry, entry.layout.views(slab) if slab is not None else prepared.views(i))
        except NarrowsError as e:  # written by another narrows/transformers layout of this layer
            raise _Stale(str(e)) from None
        homes[i], layouts[i] = slab, entry.layout
        return True

    def place(i: int, lpath: str, layer: nn.Module) -> None:
        if warm is not None:
            return
        slots = frozen_layer_slots(layer)
        layout = SlabLayout.of(slots)
        sources = _file_sources(layer, slots) if in_place else None
        layer.__dict__.pop("narrows_file_sources", None)
        pinned = placer.pinned_here(i, layout.nbytes)
        slab = aligned_pinned(layout.nbytes, pin and pinned)  # a disk layer's slab only passes through
        assign(slots, layout.pack([s.tensor for s in slots], slab))
        entry = None
        if writer is not None:
            if i == 0:  # what the layers will take in the file (a layer read in place, almost nothing)
                read_in_place = sum(layout.entries[k].nbytes for k in sources or ())
                writer.check_space((layout.nbytes - read_in_place) * n)
            entry = writer.add(layer, layout, slab, sources)
        if not pinned:
            # disk tier: the slots map the bytes where they lie on disk; the RAM copy goes
            slab = writer.home(entry)
            assign(slots, layout.views(slab) if slab is not None else writer.views(entry))
            disk.append(i)
        homes[i], layouts[i] = slab, layout

    try:
        model = load_blockwise(
            folder.path,
            dtype=dtype,
            quant=quant,
            experts=experts_scheme(expect),
            device=device,
            on_layer=place,
            fill_layer=fill,
        )
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    if writer is not None:
        writer.commit()
        prepared, _ = PreparedCache.open(target, expect)
    tiers = Tiers(homes, layouts, tuple(disk), prepared, budget, placer.fixed, ring)
    if warm is not None and share:
        tiers.shared = tuple(sorted(warm.shared))
        unshared = n - len(tiers.disk) - len(tiers.shared)
        tiers.notes.append(
            f"{len(tiers.shared)} of {n} layers mapped from {prepared.path}, one host copy for every "
            "process of this machine"
            + (f"; {unshared} in a copy of this process's own ({warm.why_not})" if unshared else "")
        )
        print(f"narrows: {tiers.notes[-1]}", flush=True)
    if tiers.disk and keep:
        tiers.notes.append(
            f"{len(tiers.disk)} of {n} layers on disk ({prepared.path}), "
            f"{n - len(tiers.disk)} pinned in host RAM"
        )
        print(f"narrows: host budget {format_bytes(budget)}: {tiers.notes[-1]}", flush=True)
    state_of(model).tiers = tiers
    return model


def _file_sources(layer: nn.Module, slots) -> dict[int, tuple[str, int]]:
    """Slab entries whose bytes the loader read verbatim from the checkpoint (it records
    each read tensor's address as ``narrows_file_sources``): index -> (file, offset)."""
    read = getattr(layer, "narrows_file_sources", None) or {}
    out = {}
    for k, s in enumerate(slots):
        t = s.tensor
        hit = read.get(t.data_ptr())
        if hit is not None and t.is_contiguous() and hit[2] == t.numel() * t.element_size():
            out[k] = (hit[0], hit[1])
    return out


class _WarmReader:
    """Reads and checks the cached slabs a few layers ahead on worker threads (zlib and
    file reads release the GIL), so a warm start is bound by the disk, not by one core."""

    def __init__(
        self,
        prepared: PreparedCache,
        placer: _Placer,
        pin: bool,
        depth: int,
        share: bool = False,
        gpu: int | None = None,
    ):
        self.prepared, self.placer, self.pin, self.depth = prepared, placer, pin, depth
        self.pool = ThreadPoolExecutor(max_workers=depth, thread_name_prefix="narrows-warm")
        self.jobs: dict[int, Future] = {}
        self.share = share
        self.shared: set[int] = set()  # layers whose home is the shared map of the cache file
        self.why_not = ""
        # the GPU loaded for (a rank's own): a worker thread's current device is GPU 0, where
        # its CUDA calls would otherwise register the pages and open a context
        self.gpu = gpu if gpu is not None or not pin else torch.cuda.current_device()

    def _job(self, i: int) -> tuple[Tensor | None, bool]:
        if self.gpu is None:
            return self._read(i)
        with torch.cuda.device(self.gpu):
            return self._read(i)

    def _read(self, i: int) -> tuple[Tensor | None, bool]:
        entry = self.prepared.layers[i]
        size = entry.layout.nbytes
        pinned = self.placer.pinned_here(i, size)
        if pinned and self.share:
            mapped = self.prepared.mapped(i)  # whole: _load_shared rebuilds a cache written in parts
            why = pin_shared(mapped) if self.pin else ""
            if not why:
                self.shared.add(i)
                return mapped, crc32(mapped) == entry.crc
            self.why_not = why
        buf = aligned_pinned(size, self.pin and pinned)
        self.prepared.read_into(i, buf)
        return (buf if pinned else None), crc32(buf[:size]) == entry.crc

    def take(self, i: int) -> Tensor | None:
        if not self.jobs:  # the first layer decides the tiers (what is loaded by now counts as fixed)
            size = self.prepared.layers[0].layout.nbytes
            self.placer.pinned_here(0, size)
            for j in range(min(self.depth, len(self.prepared.layers))):
                self.jobs[j] = self.pool.submit(self._job, j)
        slab, ok = self.jobs.pop(i).result()
        nxt = i + self.depth
        if nxt < len(self.prepared.layers):
            self.jobs[nxt] = self.pool.submit(self._job, nxt)
        if not ok:
            self.pool.shutdown(wait=True, cancel_futures=True)
            raise _Stale(f"layer {i} fails its checksum")
        if nxt >= len(self.prepared.layers) and not self.jobs:
            self.pool.shutdown(wait=False)
        return slab


def prepare(
    path: str | os.PathLike,
    *,
    quant: str | None = None,
    experts: str | None = None,
    dtype: torch.dtype = torch.bfloat16,
    cache: str | os.PathLike | None = None,
    device: torch.device | str | None = None,
) -> Path:
    """Build (or check) the prepared-slab cache of a checkpoint; returns the file's path
    (`quant` and `experts` as `from_pretrained` takes them)."""
    folder = CheckpointFolder(resolve_model_path(path))
    expect = _expect(folder, dtype, quant, experts)
    target = cache_path(folder, expect, cache)
    prepared, why = PreparedCache.open(target, expect)
    if prepared is not None:
        bad = prepared.verify(list(range(len(prepared.layers))), lambda i: _read(prepared, i))
        if not bad:
            return target
        why = f"layer {bad[0]} fails its checksum"
    if target.exists():
        print(f"narrows: prepared cache {target} is not usable ({why}); rebuilding it", flush=True)
        target.unlink()
    _load(folder, expect, dtype, quant, device, None, target, None, torch.cuda.is_available(), 3, keep=False)
    return target


def _read(prepared: PreparedCache, index: int) -> Tensor:
    buf = torch.empty(prepared.layers[index].layout.nbytes, dtype=torch.uint8)
    prepared.read_into(index, buf)
    return buf
