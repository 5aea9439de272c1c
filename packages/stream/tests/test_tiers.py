"""Host tiers on the CPU: `from_pretrained` loads a checkpoint folder block by block into
pinned RAM and a disk tier (the prepared-slab cache), and training streamed from those
tiers is bit-identical (`torch.equal`) to the same model loaded by `load_blockwise` and
trained fully resident. Also: the cache is read back on a warm run (no re-quantising),
stale or damaged caches are refused and rebuilt, an interrupted write leaves nothing
behind, bad settings are refused with a NarrowsError that says why, disk-tier layers cost
no RAM (their homes map the cache file), and the DiskReader's ring serves any order.

Tier placement is made deterministic by reporting a process RSS of 0 and no margin: with
a layer slab of S bytes and a ring of R read buffers, a host budget of (R + k) * S pins
exactly k layers (spread evenly) and puts the rest on disk.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import assert_identical, train
from safetensors.torch import load_file, save_file

import narrows.core as nc
import narrows.core.io.loader as loader_module
import narrows.stream as ns
import narrows.stream.storage.cache as cache_module
import narrows.stream.storage.pretrained as pretrained_module
from narrows.core import CheckpointFolder, NarrowsError, SlabLayout, anatomy_of, format_bytes, fuse_layers
from narrows.core.io.loader import load_blockwise
from narrows.core.testing import tiny_batch, tiny_model, with_adapter
from narrows.stream.planning import spread
from narrows.stream.storage.cache import PreparedCache, SlabCacheWriter, frozen_layer_slots
from narrows.stream.storage.tiers import DiskReader

F32 = torch.float32
LAYERS = 6
RING = 3  # from_pretrained's default ring of disk read buffers
PINNED = 2  # layers kept in host RAM under the tiered budget; the other four go to disk
FUSED_MOE = ("mixtral", "qwen3_moe")  # PEFT adapts their fused expert parameters and refuses dropout there
WEIGHT = "model.layers.1.mlp.down_proj.weight"


# --- fixtures and helpers -------------------------------------------------------------------
@pytest.fixture(autouse=True)
def deterministic_tiers(monkeypatch, tmp_path):
    """Placement that depends only on the budget; nothing written outside tmp_path."""
    monkeypatch.setattr(pretrained_module, "host_rss_bytes", lambda: 0)
    monkeypatch.setattr(pretrained_module, "HOST_MARGIN", 0)
    monkeypatch.setenv("NARROWS_CACHE", str(tmp_path / "default-cache"))


_REFERENCES: dict[tuple[str, str | None, str | None], SimpleNamespace] = {}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """arch -> a saved float32 checkpoint folder of a tiny `arch` with LAYERS layers (shared:
    copy it before changing it)."""
    folders: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in folders:
            folders[arch] = tmp_path_factory.mktemp(f"{arch}-ckpt")
            tiny_model(arch, num_hidden_layers=LAYERS).save_pretrained(folders[arch])
        return folders[arch]

    return get


def dropout_for(arch: str) -> float:
    return 0.0 if arch in FUSED_MOE else 0.1


def slab_bytes(model) -> int:
    sizes = {SlabLayout.of(frozen_layer_slots(layer)).nbytes for layer in anatomy_of(model).layers}
    assert len(sizes) == 1, "the tier arithmetic below assumes equal layers"
    return sizes.pop()


def state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def reference(
    folder: Path, quant: str | None, arch: str = "llama", experts: str | None = None
) -> SimpleNamespace:
    """`load_blockwise` of `folder` kept resident: its slab size, frozen state and the
    record of its (unstreamed) training — computed once per folder and settings."""
    key = (str(folder), quant, experts)
    if key not in _REFERENCES:
        model = load_blockwise(folder, dtype=F32, quant=quant, experts=experts)
        ref = SimpleNamespace(slab=slab_bytes(model), state=state(model))
        resident = with_adapter(model, "lora", dropout=dropout_for(arch)).train()
        fuse_layers(resident)  # streamed with the default kernels: the fast layers' bits
        ref.record = train(resident, steps=2, grad_accum=2)
        _REFERENCES[key] = ref
    return _REFERENCES[key]


def fresh_state(folder: Path, quant: str | None) -> dict[str, torch.Tensor]:
    return state(load_blockwise(folder, dtype=F32, quant=quant))


def tiered(
    folder: Path,
    quant: str | None,
    slab: int,
    cache,
    *,
    pinned: int = PINNED,
    ring: int = RING,
    experts: str | None = None,
):
    """from_pretrained under a budget that pins `pinned` layers; the rest on disk."""
    budget = (ring + pinned) * slab
    return ns.from_pretrained(
        folder, quant=quant, experts=experts, dtype=F32, host_budget=budget, cache=cache, ring=ring
    )


def expected_disk(pinned: int = PINNED) -> tuple[int, ...]:
    return tuple(i for i in range(LAYERS) if i not in spread(pinned, LAYERS))


def train_streamed(model, arch: str = "llama", device: str = "cpu", **stream_kwargs) -> dict:
    """The reference's training, streamed from the tiers `model` was loaded into."""
    peft_model = with_adapter(model, "lora", dropout=dropout_for(arch)).train()
    record = train(peft_model, steps=2, grad_accum=2, stream_kwargs=stream_kwargs, device=device)
    handle, tiers = peft_model.narrows_stream, model.narrows.tiers
    assert handle.plan.disk == tiers.disk
    assert [s.on_disk for s in handle.stores] == [i in tiers.disk for i in range(LAYERS)]
    if tiers.disk:
        assert handle.stats.bytes_disk > 0
    else:
        assert handle.stats.bytes_disk == 0
    return record


def assert_same_state(got: dict, ref: dict) -> None:
    assert sorted(got) == sorted(ref)
    for k, r in ref.items():
        assert got[k].dtype == r.dtype and torch.equal(got[k], r), k


def cache_file(cache: Path) -> Path:
    files = sorted(cache.glob("*.slabs"))
    assert len(files) == 1, files
    return files[0]


def leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir()) if cache.exists() else []


def boom(*args, **kwargs):
    raise AssertionError("a warm load must not quantise or write the cache again")


def spy_quantisation(monkeypatch) -> list[int]:
    """One entry per decoder layer the loader quantises from here on."""
    quantised: list[int] = []
    original = loader_module.quantize_layer_nf4
    monkeypatch.setattr(
        loader_module, "quantize_layer_nf4", lambda *a, **k: quantised.append(1) or original(*a, **k)
    )
    return quantised


def spy_layer_reads(monkeypatch) -> list[str]:
    """Names of the decoder-layer tensors the loader reads from the checkpoint from now on (not
    the few-byte quant-state blobs of a pre-quantised checkpoint, which its header checks read)."""
    names: list[str] = []
    read = loader_module.read_tensor

    def spy(folder, name):
        if ".layers." in name and ".quant_state." not in name:
            names.append(name)
        return read(folder, name)

    monkeypatch.setattr(loader_module, "read_tensor", spy)
    return names


# --- 1. exactness: training streamed from the tiers == resident training ------------------------
EXACT = [
    pytest.param(
        arch,
        quant,
        ring,
        id=f"{arch}-{quant or 'float32'}-ring{ring}",
        marks=[pytest.mark.bnb] if quant else [],
    )
    for arch, quant, ring in [
        ("llama", "nf4", RING),
        ("llama", None, RING),
        ("llama", None, 1),  # a ring of one read buffer
        ("qwen2", "nf4", RING),  # attention biases, tied head
        ("gemma2", None, RING),  # softcapping, sliding layers
        ("mixtral", "nf4", RING),  # fused expert parameters (PEFT ParamWrapper)
        ("phi", "nf4", RING),  # biases everywhere
        ("phi", None, RING),
    ]
]


@pytest.mark.parametrize(("arch", "quant", "ring"), EXACT)
def test_streamed_from_disk_tier_equals_resident(arch, quant, ring, checkpoint, tmp_path):
    if quant == "nf4":
        pytest.importorskip("bitsandbytes")
    folder = checkpoint(arch)
    ref = reference(folder, quant, arch)
    model = tiered(folder, quant, ref.slab, tmp_path / "cache", ring=ring)
    tiers = model.narrows.tiers
    assert [lay.nbytes for lay in tiers.layouts] == [ref.slab] * LAYERS
    assert tiers.disk == expected_disk()
    assert_same_state(state(model), ref.state)
    assert_identical(ref.record, train_streamed(model, arch))
    plan = model.narrows_stream.plan
    assert plan.resident == () and plan.disk_bytes_per_step > 0
    # the base's tiers (RSS reported as 0) and the offloaded saved inputs
    assert (
        plan.predicted_host_bytes - plan.host_activation_bytes
        == (ring + PINNED) * ref.slab
        == plan.host_budget
    )
    assert (
        plan.host_activation_bytes == len(plan.offloaded) * -(-plan.activation_bytes // 2 // 4096) * 4096 > 0
    )


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_predicted_disk_read_is_the_measured_steady_state(prefetch, checkpoint, tmp_path):
    """Per forward+backward, the engine takes from the disk tier what the plan predicts, and
    the reader reads nothing more than that (no read-ahead thrown away)."""
    folder = checkpoint("llama")
    ref = reference(folder, None)
    model = with_adapter(tiered(folder, None, ref.slab, tmp_path / "cache"), "lora").train()
    ns.stream(model, device="cpu", prefetch=prefetch)
    handle = model.narrows_stream
    taken, read = [], []
    for seed in range(3):
        before = handle.stats.bytes_disk, handle.engine.reader.bytes_read
        model(**tiny_batch(seed=seed)).loss.backward()
        taken.append(handle.stats.bytes_disk - before[0])
        read.append(handle.engine.reader.bytes_read - before[1])
    assert taken[1] == taken[2] == handle.plan.disk_bytes_per_step
    assert read[1:] == taken[1:]


def test_disk_tier_layers_made_resident_are_read_once(checkpoint, tmp_path):
    """gpu_budget="fit" (everything fits when the device is the CPU): the disk layers are read
    from the cache once, into their resident copies, and never again."""
    folder = checkpoint("llama")
    ref = reference(folder, None)
    model = tiered(folder, None, ref.slab, tmp_path / "cache")
    assert_identical(ref.record, train_streamed(model, gpu_budget="fit"))
    handle = model.narrows_stream
    assert handle.plan.resident == tuple(range(LAYERS))
    assert handle.stats.bytes_disk == len(expected_disk()) * ref.slab


def test_a_ring_of_no_buffers_is_refused(checkpoint, tmp_path):
    folder = checkpoint("llama")
    ref = reference(folder, None)
    with pytest.raises(NarrowsError):
        model = tiered(folder, None, ref.slab, tmp_path / "cache", ring=0)
        train_streamed(model)


# --- 2. cold, then warm: the warm run reads the cache ------------------------------------------
@pytest.mark.bnb
@pytest.mark.parametrize(
    ("arch", "experts"),
    [
        ("llama", None),
        ("qwen3_moe", None),  # + NF4 expert stacks, rebuilt from the cache
        ("qwen3_moe", "nf2"),  # + NF2 expert stacks (codes and scales), rebuilt from the cache
    ],
)
def test_warm_load_reads_the_cache_and_trains_identically(arch, experts, checkpoint, tmp_path, monkeypatch):
    pytest.importorskip("bitsandbytes")
    folder, cache = checkpoint(arch), tmp_path / "cache"
    ref = reference(folder, "nf4", arch, experts)
    cold = tiered(folder, "nf4", ref.slab, cache, experts=experts)
    path = cold.narrows.tiers.cache.path
    assert path == cache_file(cache)
    written = path.stat().st_mtime_ns
    precision = str(nc.precision(cold))
    assert nc.precision(cold).stacks(experts or "nf4").count == (2 * LAYERS if arch == "qwen3_moe" else 0)
    del cold

    monkeypatch.setattr(loader_module, "quantize_layer_nf4", boom)
    monkeypatch.setattr(SlabCacheWriter, "__init__", boom)
    reads = spy_layer_reads(monkeypatch)
    warm = tiered(folder, "nf4", ref.slab, cache, experts=experts)
    assert reads == [], "a warm load reads the layers from the cache, not the checkpoint"
    assert warm.narrows.tiers.disk == expected_disk()
    assert str(nc.precision(warm)) == precision
    assert_same_state(state(warm), ref.state)
    assert_identical(ref.record, train_streamed(warm, arch))
    if experts is not None:  # another scheme is another cache: this one is not read for it
        other, why = PreparedCache.open(path, pretrained_module._expect(CheckpointFolder(folder), F32, "nf4"))
        assert other is None and "settings" in why

    pinned = ns.from_pretrained(
        folder, quant="nf4", experts=experts, dtype=F32, host_budget="1TiB", cache=cache
    )
    assert pinned.narrows.tiers.disk == ()
    assert_identical(ref.record, train_streamed(pinned, arch))
    assert path.stat().st_mtime_ns == written and leftovers(cache) == [path.name]


# --- 3. stale or damaged caches are refused and rebuilt, never used -------------------------------
def _flip(index: int):
    def damage(path: Path) -> None:
        entry = PreparedCache.open(path, {})[0].layers[index]  # no expectations: any footer
        with open(path, "r+b") as f:
            f.seek(entry.offset + entry.layout.nbytes // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))

    return damage


def _truncate(cut):
    def damage(path: Path) -> None:
        size = path.stat().st_size
        os.truncate(path, size - cut(size))

    return damage


DAMAGE = {
    "flip-byte-in-disk-layer": _flip(expected_disk()[0]),
    "flip-byte-in-pinned-layer": _flip(spread(PINNED, LAYERS)[0]),
    "truncate-10-bytes": _truncate(lambda size: 10),
    "truncate-half": _truncate(lambda size: size // 2),
}


@pytest.mark.bnb
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_cache_is_rebuilt_not_used(damage, checkpoint, tmp_path, monkeypatch, capsys):
    pytest.importorskip("bitsandbytes")
    folder, cache = checkpoint("llama"), tmp_path / "cache"
    ref = reference(folder, "nf4")
    path = tiered(folder, "nf4", ref.slab, cache).narrows.tiers.cache.path
    DAMAGE[damage](path)
    capsys.readouterr()

    quantised = spy_quantisation(monkeypatch)
    model = tiered(folder, "nf4", ref.slab, cache)
    assert "rebuilding" in capsys.readouterr().out
    assert len(quantised) == LAYERS
    assert model.narrows.tiers.disk == expected_disk()
    assert_same_state(state(model), ref.state)
    rebuilt, why = PreparedCache.open(path, {})
    assert rebuilt is not None, why
    assert not rebuilt.verify(list(range(LAYERS)), lambda i: rebuilt.mapped(i))
    assert leftovers(cache) == [path.name]
    if damage == "flip-byte-in-disk-layer":  # the one damage that could slip into training
        assert_identical(ref.record, train_streamed(model))


@pytest.mark.bnb
def test_cache_from_another_narrows_version_is_rebuilt(checkpoint, tmp_path, monkeypatch, capsys):
    pytest.importorskip("bitsandbytes")
    folder, cache = checkpoint("llama"), tmp_path / "cache"
    ref = reference(folder, "nf4")
    path = tiered(folder, "nf4", ref.slab, cache).narrows.tiers.cache.path
    capsys.readouterr()
    monkeypatch.setattr(nc, "__version__", "0.0.0-other")
    quantised = spy_quantisation(monkeypatch)
    model = tiered(folder, "nf4", ref.slab, cache)
    assert "rebuilding" in capsys.readouterr().out
    assert len(quantised) == LAYERS
    assert PreparedCache.open(path, {})[0].meta["narrows"] == "0.0.0-other"
    assert_same_state(state(model), ref.state)


def test_cache_whose_layers_do_not_match_the_model_is_rebuilt(checkpoint, tmp_path, capsys):
    """A footer whose slot names are not this model's, as a transformers version that named the
    modules differently would have written it (transformers' version is not in the footer)."""
    folder, cache = checkpoint("llama"), tmp_path / "cache"
    ref = reference(folder, None)
    path = tiered(folder, None, ref.slab, cache).narrows.tiers.cache.path
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[-8:])
    meta = json.loads(data[-16 - n : -16])
    for layer in meta["layers"]:
        for entry in layer["entries"]:
            entry[0] = entry[0].replace("down_proj", "proj_down")
    footer = json.dumps(meta).encode()
    path.write_bytes(data[: -16 - n] + footer + data[-16:-8] + struct.pack("<Q", len(footer)))
    capsys.readouterr()
    model = tiered(folder, None, ref.slab, cache)
    assert "rebuilding" in capsys.readouterr().out
    assert_same_state(state(model), ref.state)


def _modify(folder: Path, dtype: torch.dtype | None) -> None:
    """Re-save the checkpoint with one weight changed (and cast to `dtype`, if given)."""
    file = folder / "model.safetensors"
    tensors = load_file(file)
    tensors[WEIGHT] = tensors[WEIGHT] * -2.0
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.mark.bnb
@pytest.mark.parametrize(
    "dtype",
    [
        pytest.param(torch.bfloat16, id="resaved-in-bf16"),
        pytest.param(None, id="resaved-same-header"),
    ],
)
def test_changed_source_is_rebuilt_with_the_new_weights(dtype, checkpoint, tmp_path, capsys):
    pytest.importorskip("bitsandbytes")
    folder, cache = tmp_path / "ckpt", tmp_path / "cache"
    shutil.copytree(checkpoint("llama"), folder)
    ref = reference(checkpoint("llama"), "nf4")
    tiered(folder, "nf4", ref.slab, cache)
    _modify(folder, dtype)
    capsys.readouterr()
    model = tiered(folder, "nf4", ref.slab, cache)
    new = fresh_state(folder, "nf4")
    assert not torch.equal(new[WEIGHT], ref.state[WEIGHT])
    assert_same_state(state(model), new)
    assert "rebuilding" in capsys.readouterr().out


# --- 4. the write is atomic ----------------------------------------------------------------------
class _FullDisk:
    """A file whose writes fail with ENOSPC once the first layer's slab (padded to 4096
    bytes, where the second layer starts) is in."""

    def __init__(self, file):
        self._file = file

    def write(self, data):
        at = self._file.tell()
        if at > 0 and at % cache_module.FILE_ALIGNMENT == 0 and len(data):
            raise OSError(errno.ENOSPC, "No space left on device")
        return self._file.write(data)

    def __getattr__(self, name):
        return getattr(self._file, name)


def test_disk_full_mid_write_leaves_no_cache_and_a_later_call_succeeds(checkpoint, tmp_path, monkeypatch):
    folder, cache = checkpoint("llama"), tmp_path / "cache"
    ref = reference(folder, None)

    def full_disk_open(file, mode="r", *args, **kwargs):
        f = open(file, mode, *args, **kwargs)  # noqa: SIM115 (the writer keeps it open)
        return _FullDisk(f) if "w" in mode else f

    with monkeypatch.context() as m:
        m.setattr(cache_module, "open", full_disk_open, raising=False)
        with pytest.raises(NarrowsError, match=r"(?i)free space") as err:
            tiered(folder, None, ref.slab, cache)
    first = -(-ref.slab // cache_module.FILE_ALIGNMENT) * cache_module.FILE_ALIGNMENT
    assert f"after {format_bytes(first)}" in str(err.value)  # the second layer's write failed
    assert leftovers(cache) == []
    model = tiered(folder, None, ref.slab, cache)
    assert model.narrows.tiers.disk == expected_disk()
    assert_same_state(state(model), ref.state)
    assert leftovers(cache) == [cache_file(cache).name]


def test_too_little_free_space_is_refused_before_writing(checkpoint, tmp_path, monkeypatch):
    folder, cache = checkpoint("llama"), tmp_path / "cache"
    ref = reference(folder, None)
    added = []
    monkeypatch.setattr(
        cache_module.shutil, "disk_usage", lambda p: SimpleNamespace(total=1 << 20, used=0, free=1000)
    )
    original_add = SlabCacheWriter.add
    monkeypatch.setattr(SlabCacheWriter, "add", lambda *a, **k: added.append(1) or original_add(*a, **k))
    with pytest.raises(NarrowsError) as err:
        tiered(folder, None, ref.slab, cache)
    assert f"needs about {format_bytes(LAYERS * ref.slab)}" in str(err.value)
    assert f"{format_bytes(1000)} free" in str(err.value)
    assert added == [] and leftovers(cache) == []


# --- 5. bad input --------------------------------------------------------------------------------
def test_host_budget_below_the_minimum_is_refused_stating_it(checkpoint, tmp_path):
    folder, cache = checkpoint("llama"), tmp_path / "cache"
    ref = reference(folder, None)
    minimum = (RING + 2) * ref.slab  # the ring and two layers' source tensors (RSS and margin are 0 here)
    with pytest.raises(NarrowsError, match=f"the minimum is {format_bytes(minimum)}"):
        ns.from_pretrained(folder, dtype=F32, host_budget=minimum - 1, cache=cache)
    assert leftovers(cache) == []
    model = ns.from_pretrained(folder, dtype=F32, host_budget=minimum, cache=cache)
    assert model.narrows.tiers.disk == expected_disk(2)


def test_no_cache_with_a_budget_too_small_for_every_layer_is_refused(checkpoint, tmp_path):
    folder = checkpoint("llama")
    ref = reference(folder, None)
    with pytest.raises(NarrowsError, match=r"cache=False"):
        ns.from_pretrained(folder, dtype=F32, host_budget=(LAYERS - 1) * ref.slab, cache=False)
    model = ns.from_pretrained(folder, dtype=F32, host_budget=LAYERS * ref.slab, cache=False)
    assert model.narrows.tiers.disk == () and model.narrows.tiers.cache is None
    assert_same_state(state(model), ref.state)
    assert leftovers(tmp_path / "default-cache") in ([], ["slabs"]) and not list(tmp_path.rglob("*.slabs"))


def test_unwritable_cache_folder_is_refused(checkpoint, tmp_path):
    folder = checkpoint("llama")
    ref = reference(folder, None)
    (tmp_path / "file.txt").write_text("not a folder")
    with pytest.raises(NarrowsError, match="cannot write the prepared cache"):
        tiered(folder, None, ref.slab, tmp_path / "file.txt" / "cache")


# --- 6. disk-tier homes cost no RAM; the DiskReader ----------------------------------------------
def _file_maps() -> list[tuple[int, int, str]]:
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append((lo, hi, parts[5].strip()))
    return out


@pytest.mark.parametrize("run", ["cold", "warm"])
def test_disk_tier_homes_map_the_cache_file(run, checkpoint, tmp_path):
    if not Path("/proc/self/maps").exists():
        pytest.skip("needs /proc/self/maps")
    folder, cache = checkpoint("llama"), tmp_path / "cache"
    ref = reference(folder, None)
    model = tiered(folder, None, ref.slab, cache)
    if run == "warm":
        del model
        model = tiered(folder, None, ref.slab, cache)
    tiers = model.narrows.tiers
    path = str(cache_file(cache).resolve())
    maps = _file_maps()
    for i, home in enumerate(tiers.homes):
        ptr = home.data_ptr()
        region = [name for lo, hi, name in maps if lo <= ptr and ptr + tiers.layouts[i].nbytes <= hi]
        if i in tiers.disk:
            assert region == [path], (i, region)
        else:
            assert region == [] or region[0] != path, (i, region)


def _slab_cache(tmp_path: Path, sizes: list[int]) -> PreparedCache:
    """A prepared cache of random slabs of the given element counts (float32 linears)."""
    g = torch.Generator().manual_seed(3)
    writer = SlabCacheWriter(tmp_path / "t.slabs", {"format": "test"})
    for n in sizes:
        layer = torch.nn.Linear(n, 8, bias=False)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(8, n, generator=g))
        slots = frozen_layer_slots(layer)
        layout = SlabLayout.of(slots)
        slab = layout.empty()
        layout.pack([s.tensor for s in slots], slab)
        writer.add(layer, layout, slab)
    writer.commit()
    cache, why = PreparedCache.open(tmp_path / "t.slabs", {"format": "test"})
    assert cache is not None, why
    return cache


def test_disk_reader_serves_any_order_with_a_small_ring(tmp_path):
    cache = _slab_cache(tmp_path, [64, 200, 32, 512, 128, 96])
    reader = DiskReader(cache, list(range(6)), ring=2, pin=False)

    def take(i: int) -> torch.Tensor:
        buf = reader.take(i)
        n = cache.layers[i].layout.nbytes
        assert torch.equal(buf[:n], cache.mapped(i)), f"layer {i}"
        return buf

    try:
        assert reader.request(3) and reader.request(1)
        assert not reader.request(5)  # the ring holds two
        assert reader.request(3)  # already under way
        b1 = take(1)
        assert not reader.request(5)  # nothing given back yet
        reader.give_back(b1, None)
        assert reader.request(5)
        b5 = take(5)  # taken before 3, requested earlier
        b3 = take(3)
        reader.give_back(b3, None)
        reader.give_back(b5, None)
        assert reader.request(2) and reader.request(4)  # the ring is full of read-aheads
        b0 = take(0)  # never requested: a read-ahead makes room
        reader.give_back(b0, None)
        for i in (4, 2):  # one of them was dropped to make room: read again
            reader.give_back(take(i), None)
        b2 = take(2)  # twice in a row, never requested
        b3 = take(3)
        reader.give_back(b2, None)
        reader.give_back(b3, None)
        for i in reversed(range(6)):
            reader.request(i)
            reader.give_back(take(i), None)
    finally:
        reader.close()


# --- 7. prepare ------------------------------------------------------------------------------------
@pytest.mark.bnb
def test_prepare_writes_once_and_from_pretrained_uses_it(checkpoint, tmp_path, monkeypatch):
    pytest.importorskip("bitsandbytes")
    folder, cache = checkpoint("llama"), tmp_path / "cache"
    ref = reference(folder, "nf4")
    path = ns.prepare(folder, quant="nf4", dtype=F32, cache=cache)
    assert path == cache_file(cache)
    written = path.stat().st_mtime_ns
    monkeypatch.setattr(loader_module, "quantize_layer_nf4", boom)
    monkeypatch.setattr(SlabCacheWriter, "__init__", boom)
    assert ns.prepare(folder, quant="nf4", dtype=F32, cache=cache) == path
    assert path.stat().st_mtime_ns == written
    model = tiered(folder, "nf4", ref.slab, cache)
    assert model.narrows.tiers.cache.path == path and model.narrows.tiers.disk == expected_disk()
    assert_identical(ref.record, train_streamed(model))
    assert path.stat().st_mtime_ns == written and leftovers(cache) == [path.name]


# --- 8. a pre-quantised checkpoint saved by transformers ----------------------------------------------
@pytest.mark.bnb
def test_prequantized_checkpoint_streams_from_disk_tier(checkpoint, tmp_path, monkeypatch):
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=F32,
    )
    folder, cache = tmp_path / "prequantized", tmp_path / "cache"
    AutoModelForCausalLM.from_pretrained(
        checkpoint("llama"), quantization_config=config, dtype=F32, device_map="cpu"
    ).save_pretrained(folder)
    ref = reference(folder, None)
    cold = tiered(folder, None, ref.slab, cache)
    assert cold.narrows.tiers.disk == expected_disk()
    assert_same_state(state(cold), ref.state)
    assert_identical(ref.record, train_streamed(cold))
    monkeypatch.setattr(SlabCacheWriter, "__init__", boom)
    reads = spy_layer_reads(monkeypatch)
    warm = tiered(folder, None, ref.slab, cache)
    assert reads == []
    assert warm.narrows.tiers.disk == expected_disk()
    assert_same_state(state(warm), ref.state)
    assert_identical(ref.record, train_streamed(warm))
    # in place: the packed weights and their statistics are read from the checkpoint itself,
    # so the cache holds only what the checkpoint lacks (a few bytes per layer)
    entries = warm.narrows.tiers.cache.layers
    assert all(e.parts is not None for e in entries)
    slab_total = sum(e.layout.nbytes for e in entries)
    inline = sum(e.layout.entries[k].nbytes for e in entries for k, f, _ in e.parts if f is None)
    assert inline < slab_total / 20  # what the checkpoint lacks: offsets, and norms in another dtype
    packed = [k for e in entries for k, f, _ in e.parts if e.layout.entries[k].name.endswith("proj.weight")]
    assert packed and all(f is not None for e in entries for k, f, _ in e.parts if k in packed)
    # shared by the ranks of a machine: one contiguous map per slab, so the cache is written
    # again with every slab whole (in parts there is no single map to share)
    monkeypatch.undo()
    shared = ns.from_pretrained(folder, dtype=F32, host_budget="1TiB", cache=cache, share=True)
    assert shared.narrows.tiers.shared == tuple(range(LAYERS))
    assert all(e.parts is None for e in shared.narrows.tiers.cache.layers)
    assert_same_state(state(shared), ref.state)
    assert_identical(ref.record, train_streamed(shared))


@pytest.mark.gpu
def test_shared_maps_are_page_locked_for_the_gpu_and_train_exactly(checkpoint, tmp_path):
    """On CUDA each shared home is the cache file's read-only map, registered with CUDA in
    place (pinned, not copied); streaming from it trains what a private pinned copy does."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from narrows.core import deterministic

    deterministic()
    folder, cache = checkpoint("llama"), tmp_path / "cache"
    records = {}
    for share in (False, True):
        model = ns.from_pretrained(folder, dtype=F32, host_budget="1TiB", cache=cache, share=share)
        tiers = model.narrows.tiers
        assert tiers.shared == (tuple(range(LAYERS)) if share else ())
        assert all(h.is_pinned() for h in tiers.homes)
        if share:  # the map of the file, not a copy of it
            base = cache_module._whole_file(tiers.cache.path, 0).data_ptr()
            assert all(base <= h.data_ptr() < base + tiers.cache.path.stat().st_size for h in tiers.homes)
        records[share] = train_streamed(model, device="cuda")
    assert_identical(records[False], records[True])


def test_ranks_that_do_not_share_split_the_default_host_budget(checkpoint, monkeypatch):
    """Several ranks of one machine each holding their own copy (no cache to share): each
    takes its share of the default budget, not all of it."""
    monkeypatch.setattr(pretrained_module, "default_host_budget", lambda: 1 << 40)
    folder = checkpoint("llama")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    split = ns.from_pretrained(folder, dtype=F32, cache=False).narrows.tiers
    assert split.shared == () and split.host_budget == 1 << 39
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert ns.from_pretrained(folder, dtype=F32, cache=False).narrows.tiers.host_budget == 1 << 40


def test_a_pinned_buffer_is_unregistered_before_its_mapping_goes(tmp_path):
    """`aligned_pinned`'s buffer is unregistered from CUDA while its pages are still mapped
    (a CUDA stand-in reads the first byte at the address it is asked to unregister: after
    the unmap, that read kills the process). Unregistered after the unmap, another mapping
    that took the address in between would be unpinned, its own registration refused."""
    import subprocess
    import sys

    script = """
import ctypes, gc, torch
import narrows.stream.storage.tiers as tiers

calls = []
class Cudart:
    def cudaHostRegister(self, ptr, n, flags):
        calls.append(("register", ptr))
        return 0
    def cudaHostUnregister(self, ptr):
        calls.append(("unregister", ptr, ctypes.string_at(ptr, 1)))
        return 0
torch.cuda.cudart = lambda: Cudart()
buf = tiers.aligned_pinned(5000, pin=True)
buf[0] = 7
ptr = buf.data_ptr()
del buf
gc.collect()
assert calls == [("register", ptr), ("unregister", ptr, b"\\x07")], calls
print("ok")
"""
    from narrows.core.testing import child_env

    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=child_env(), timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stderr[-2000:])
