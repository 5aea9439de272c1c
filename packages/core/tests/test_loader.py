"""The block-streamed loader against transformers' own loading: every tensor, buffer and
tie of `load_blockwise` equals ``from_pretrained`` (and, quantised, ``quantize_nf4`` of it
or transformers' bitsandbytes load), the layers arrive one at a time, and a damaged or
unsupported folder is refused with a NarrowsError that names what is wrong."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM

from narrows.core import (
    NarrowsError,
    anatomy_of,
    disable_cpu_repacking,
    expert_names,
    is_nf4_linear,
    precision,
    quantize_experts,
    quantize_nf4,
)
from narrows.core.io.loader import load_blockwise
from narrows.core.io.models import load_causal_lm
from narrows.core.testing import TINY_ARCHITECTURES, tiny_batch, tiny_model
from narrows.core.testing.folders import mxfp4_folder, tiny_model_folder

BF16 = torch.bfloat16


# --- helpers ---------------------------------------------------------------------------
def assert_same_tensors(got: dict, ref: dict, what: str = "state_dict") -> None:
    """Same keys; every tensor of the same dtype, shape and values (bit for bit)."""
    assert sorted(got) == sorted(ref), f"{what} keys differ: {sorted(set(got) ^ set(ref))}"
    for key, r in ref.items():
        g = got[key]
        assert g.dtype == r.dtype, f"{what}[{key!r}]: dtype {g.dtype}, expected {r.dtype}"
        assert g.shape == r.shape, f"{what}[{key!r}]: shape {tuple(g.shape)}, expected {tuple(r.shape)}"
        assert torch.equal(g, r), f"{what}[{key!r}] differs"


def is_tied(model: nn.Module) -> bool:
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


def assert_same_model(got: nn.Module, ref: nn.Module, *, requires_grad: bool = True) -> None:
    """Same class, state_dict, buffers and tie; parameters of the same kind on the same device
    (and with the same requires_grad, unless told not to compare it)."""
    assert type(got) is type(ref)
    assert_same_tensors(got.state_dict(), ref.state_dict())
    assert_same_tensors(dict(got.named_buffers()), dict(ref.named_buffers()), "named_buffers")
    assert is_tied(got) == is_tied(ref)

    def kinds(model):
        return {
            n: (type(p), p.device, p.requires_grad or not requires_grad) for n, p in model.named_parameters()
        }

    assert kinds(got) == kinds(ref)


def save(path: Path, arch: str = "llama", dtype: torch.dtype = BF16, **kw) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tiny_model(arch, **kw).to(dtype).save_pretrained(path)
    return path


def edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def rewrite_safetensors(file: Path, edit) -> None:
    """Load every tensor of `file`, let `edit(tensors)` change the dict, write it back."""
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def decoder_linears(model: nn.Module) -> list[nn.Module]:
    return [m for layer in anatomy_of(model).layers for m in layer.modules() if isinstance(m, nn.Linear)]


def hf_nf4(folder: Path) -> nn.Module:
    """transformers' own bitsandbytes NF4 load (double quantisation, bf16 compute) on the CPU."""
    from transformers import BitsAndBytesConfig

    config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=BF16,
    )
    model = AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=config, dtype=BF16, device_map="cpu"
    )
    disable_cpu_repacking(model)  # before any forward: see nf4.py
    return model


# --- 1. every architecture, float and NF4 -------------------------------------------------
@pytest.mark.bnb
@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_every_architecture_loads_as_from_pretrained_does(arch, tmp_path):
    save(tmp_path, arch)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=BF16)
    got = load_blockwise(tmp_path, dtype=BF16)
    assert_same_model(got, ref)
    assert not got.training
    batch = {k: v for k, v in tiny_batch().items() if k != "labels"}
    with torch.no_grad():  # float model: no bitsandbytes repacking to fear
        assert torch.equal(got(**batch).logits, ref(**batch).logits)

    quantize_nf4(ref, compute_dtype=BF16)
    got = load_blockwise(tmp_path, dtype=BF16, quant="nf4", device="cpu")
    assert_same_model(got, ref)
    assert got.is_loaded_in_4bit
    assert any(is_nf4_linear(m) for m in got.modules())


# --- 2. shards, source dtype, ties --------------------------------------------------------
@pytest.mark.bnb
@pytest.mark.parametrize(("arch", "tie"), [("llama", False), ("llama", True), ("mixtral", False)])
def test_sharded_checkpoint_loads_as_the_single_file(arch, tie, tmp_path):
    single = save(tmp_path / "single", arch, tie_word_embeddings=tie)
    sharded = tmp_path / "sharded"
    tiny_model(arch, tie_word_embeddings=tie).to(BF16).save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert not (sharded / "model.safetensors").exists()
    assert len(list(sharded.glob("model-*.safetensors"))) > 3

    ref = AutoModelForCausalLM.from_pretrained(sharded, dtype=BF16)
    assert is_tied(ref) == tie
    got = load_blockwise(sharded, dtype=BF16)
    assert_same_model(got, ref)
    assert_same_model(got, load_blockwise(single, dtype=BF16))
    assert is_tied(got) == tie

    quantize_nf4(ref, compute_dtype=BF16)
    assert_same_model(load_blockwise(sharded, dtype=BF16, quant="nf4", device="cpu"), ref)


@pytest.mark.bnb
def test_fp32_checkpoint_is_cast_as_from_pretrained_casts(tmp_path):
    save(tmp_path, "qwen2", dtype=torch.float32)  # attention biases and a tied head
    assert {t.dtype for t in load_file(tmp_path / "model.safetensors").values()} == {torch.float32}
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=BF16)
    got = load_blockwise(tmp_path, dtype=BF16)
    assert_same_model(got, ref)
    assert {p.dtype for p in got.parameters()} == {BF16}

    quantize_nf4(ref, compute_dtype=BF16)
    assert_same_model(load_blockwise(tmp_path, dtype=BF16, quant="nf4", device="cpu"), ref)


# --- 3. transformers' own 4-bit load, and the checkpoint it saves ------------------------------
@pytest.fixture(scope="module")
def hf_quantized(tmp_path_factory):
    """arch -> (float folder, transformers' NF4 load of it, the pre-quantised folder that load
    saved), built once per architecture."""
    pytest.importorskip("bitsandbytes")
    made = {}

    def get(arch: str):
        if arch not in made:
            float_folder = save(tmp_path_factory.mktemp(f"{arch}-float"), arch)
            ref = hf_nf4(float_folder)
            folder = tmp_path_factory.mktemp(f"{arch}-prequantized")
            ref.save_pretrained(folder)
            made[arch] = float_folder, ref, folder
        return made[arch]

    return get


@pytest.fixture
def prequantized(hf_quantized):
    return hf_quantized("llama")


def prequantized_copy(prequantized, tmp_path) -> Path:
    folder = tmp_path / "copy"
    shutil.copytree(prequantized[2], folder)
    return folder


WEIGHT = "model.layers.1.mlp.down_proj.weight"  # a 4-bit weight of the pre-quantised llama


@pytest.mark.bnb
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mixtral"])
def test_nf4_load_equals_transformers_bitsandbytes_load(arch, hf_quantized):
    """Linears as transformers' bitsandbytes load quantises them; fused expert stacks, which
    it leaves in bf16, in NF4 as `quantize_experts` makes them from its bf16 ones."""
    folder, ref, _ = hf_quantized(arch)
    got = load_blockwise(folder, dtype=BF16, quant="nf4", device="cpu")
    stacks = [m for m in ref.modules() if expert_names(m)]
    assert (arch == "mixtral") == bool(stacks)
    for m in stacks:
        quantize_experts(m)
    assert precision(got).expert_stacks == 2 * len(stacks)
    # quantize_layer_nf4 freezes a quantised linear's bias, transformers leaves it trainable
    assert_same_model(got, ref, requires_grad=False)


@pytest.mark.bnb
@pytest.mark.parametrize(("arch", "quant"), [("llama", None), ("llama", "nf4"), ("qwen2", None)])
def test_prequantized_checkpoint_loads_as_stored(arch, quant, hf_quantized):
    _, ref, folder = hf_quantized(arch)
    stored = load_file(folder / "model.safetensors")
    assert f"{WEIGHT}.quant_state.bitsandbytes__nf4" in stored and f"{WEIGHT}.nested_absmax" in stored
    got = load_blockwise(folder, dtype=BF16, quant=quant)
    assert_same_model(got, ref)
    assert got.is_loaded_in_4bit
    assert all(is_nf4_linear(m) for m in decoder_linears(ref))
    assert all(is_nf4_linear(m) for m in decoder_linears(got))

    batch = tiny_batch()
    ref.train()  # train mode, grad enabled: the path a fine-tune runs
    got.train()
    try:
        out_ref, out_got = ref(**batch), got(**batch)
    finally:
        ref.eval()
    assert torch.equal(out_got.logits, out_ref.logits)
    assert torch.equal(out_got.loss, out_ref.loss)
    assert_same_model(got, ref)  # the forward changed nothing in place


@pytest.mark.bnb
def test_prequantized_multimodal_checkpoint_with_a_quantised_vision_tower(tmp_path):
    """transformers quantises Gemma 3's vision tower too; those 4-bit layers lie outside the
    decoder layers and must load as stored all the same."""
    float_folder = save(tmp_path / "float", "gemma3")
    ref = hf_nf4(float_folder)
    assert any(is_nf4_linear(m) for m in ref.model.vision_tower.modules())
    ref.save_pretrained(tmp_path / "q")
    got = load_blockwise(tmp_path / "q", dtype=BF16)
    assert_same_model(got, ref)


# --- 4. on_layer ------------------------------------------------------------------------
def _is_meta(module: nn.Module) -> bool:
    return any(p.device.type == "meta" for p in module.parameters())


@pytest.mark.bnb
@pytest.mark.parametrize("quant", [None, "nf4"])
def test_on_layer_sees_each_layer_complete_before_the_next_is_read(quant, tmp_path, monkeypatch):
    import narrows.core.io.loader as loader_module

    save(tmp_path, "llama", num_hidden_layers=4)
    built: list[nn.Module] = []  # the model load_blockwise builds, to look at the other layers
    skeleton = loader_module.skeleton

    def spy(*args, **kwargs):
        built.append(skeleton(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(loader_module, "skeleton", spy)
    calls = []

    def on_layer(i, path, layer):
        model = built[0]
        layers = anatomy_of(model).layers
        assert layer is layers[i]
        assert not _is_meta(layer)
        assert not any(_is_meta(done) for done in layers[:i])
        for todo in layers[i + 1 :]:  # not read yet: every parameter still on the meta device
            assert all(p.device.type == "meta" for p in todo.parameters())
        assert not _is_meta(model.get_input_embeddings())  # the parts outside the layers come first
        linears = [m for m in layer.modules() if isinstance(m, nn.Linear)]
        assert linears and all(is_nf4_linear(m) == (quant == "nf4") for m in linears)
        if quant == "nf4":
            assert all(m.weight.quant_state is not None and m.weight.device.type == "cpu" for m in linears)
        calls.append((i, path))

    model = load_blockwise(tmp_path, dtype=BF16, quant=quant, device="cpu", on_layer=on_layer)
    assert built == [model]
    assert calls == [(i, f"model.layers.{i}") for i in range(4)]
    assert [p for _, p in calls] == list(anatomy_of(model).layer_paths)


@pytest.mark.bnb
def test_on_layer_on_a_prequantized_checkpoint(prequantized):
    seen = []

    def on_layer(i, path, layer):
        linears = [m for m in layer.modules() if isinstance(m, nn.Linear)]
        assert linears and all(is_nf4_linear(m) and not _is_meta(m) for m in linears)
        seen.append(i)

    load_blockwise(prequantized[2], dtype=BF16, on_layer=on_layer)
    assert seen == [0, 1, 2]


# --- 5. refusals --------------------------------------------------------------------------
@pytest.fixture
def weights_read(monkeypatch):
    """Names of the tensors load_blockwise reads (not counting the few-byte quant-state blobs
    of a pre-quantised checkpoint): a folder refused from its headers reads none."""
    import narrows.core.io.loader as loader_module

    names: list[str] = []
    read = loader_module.read_tensor

    def spy(folder, name):
        if ".quant_state." not in name:
            names.append(name)
        return read(folder, name)

    monkeypatch.setattr(loader_module, "read_tensor", spy)
    return names


def test_index_naming_a_missing_shard_is_refused(tmp_path, weights_read):
    tiny_model("llama").to(BF16).save_pretrained(tmp_path, max_shard_size="20KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[1].unlink()
    with pytest.raises(NarrowsError, match=shards[1].name):
        load_blockwise(tmp_path, dtype=BF16)
    assert weights_read == []


def test_truncated_safetensors_is_refused(tmp_path, weights_read):
    file = save(tmp_path) / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(NarrowsError, match=r"model\.safetensors is truncated"):
        load_blockwise(tmp_path, dtype=BF16)
    assert weights_read == []


def test_file_shorter_than_its_header_is_refused(tmp_path, weights_read):
    file = save(tmp_path) / "model.safetensors"
    file.write_bytes(file.read_bytes()[:20])
    with pytest.raises(NarrowsError, match=r"model\.safetensors is truncated"):
        load_blockwise(tmp_path, dtype=BF16)
    assert weights_read == []


@pytest.mark.parametrize(
    ("arch", "field", "tensor"),
    [
        ("llama", "intermediate_size", r"mlp\.(gate|up|down)_proj\.weight"),
        ("mixtral", "intermediate_size", "experts"),  # fused by a converter: checked on load
        ("llama", "vocab_size", r"lm_head\.weight|embed_tokens\.weight"),
    ],
    ids=["llama-intermediate_size", "mixtral-intermediate_size", "llama-vocab_size"],
)
def test_tensor_shape_disagreeing_with_config_is_refused(arch, field, tensor, tmp_path, weights_read):
    save(tmp_path, arch)
    edit_config(tmp_path, **{field: 192 if field == "intermediate_size" else 320})
    with pytest.raises(NarrowsError, match=tensor):
        load_blockwise(tmp_path, dtype=BF16)
    if arch != "mixtral":  # a converted tensor's shape is checked as it is loaded
        assert weights_read == []


@pytest.mark.parametrize(
    ("quantization_config", "message"),
    [
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}, "'gptq'"),
        ({"quant_method": "bitsandbytes", "load_in_8bit": True}, "8-bit"),
    ],
    ids=["gptq", "bnb-8bit"],
)
def test_unsupported_quantisation_is_refused(quantization_config, message, tmp_path, weights_read):
    save(tmp_path)
    edit_config(tmp_path, quantization_config=quantization_config)
    with pytest.raises(NarrowsError, match=message):
        load_blockwise(tmp_path, dtype=BF16)
    assert weights_read == []


def test_unknown_quant_argument_is_refused(tmp_path):
    with pytest.raises(NarrowsError, match="int8"):
        load_blockwise(save(tmp_path), dtype=BF16, quant="int8")


@pytest.mark.parametrize(
    "key", ["model.layers.1.mlp.up_proj.weight", "model.layers.2.self_attn.q_proj.bias", "model.norm.weight"]
)
def test_checkpoint_missing_a_tensor_is_refused_naming_it(key, tmp_path, weights_read):
    save(tmp_path, "qwen2")  # qwen2: attention biases
    rewrite_safetensors(tmp_path / "model.safetensors", lambda t: t.pop(key))
    with pytest.raises(NarrowsError, match=key.replace(".", r"\.")):
        load_blockwise(tmp_path, dtype=BF16)
    assert weights_read == []


def test_moe_checkpoint_missing_an_expert_tensor_is_refused_naming_it(tmp_path):
    save(tmp_path, "mixtral")
    key = "model.layers.1.block_sparse_moe.experts.0.w1.weight"
    rewrite_safetensors(tmp_path / "model.safetensors", lambda t: t.pop(key))
    with pytest.raises(NarrowsError, match=key.replace(".", r"\.")):
        load_blockwise(tmp_path, dtype=BF16)


def test_header_dtype_disagreeing_with_the_data_size_is_refused(tmp_path, weights_read):
    """A header edited from F32 to F16 (same length) declares half the bytes its span holds."""
    save(tmp_path, dtype=torch.float32)
    file = tmp_path / "model.safetensors"
    data = file.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    key = "model.layers.1.self_attn.q_proj.weight"
    header[key]["dtype"] = "F16"
    raw = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(raw) == n
    file.write_bytes(data[:8] + raw + data[8 + n :])
    shape = header[key]["shape"]
    with pytest.raises(NarrowsError) as e:
        load_blockwise(tmp_path, dtype=BF16)
    said = str(e.value)
    for part in (
        str(file),
        repr(key),
        "F16",
        str(shape),
        f"{2 * shape[0] * shape[1]} bytes",
        f"spans {4 * shape[0] * shape[1]} bytes",
        "re-download",
    ):
        assert part in said, (part, said)
    assert weights_read == []


def test_unknown_model_type_is_refused_naming_config_json(tmp_path, weights_read):
    save(tmp_path)
    edit_config(tmp_path, model_type="no-such-type")
    with pytest.raises(NarrowsError, match=r"config\.json: model_type 'no-such-type' is not a model type"):
        load_blockwise(tmp_path, dtype=BF16)
    assert weights_read == []


def test_unsupported_tensor_dtype_is_refused(tmp_path):
    save(tmp_path)
    key = "model.layers.0.input_layernorm.weight"

    def to_fp8(tensors):
        tensors[key] = tensors[key].to(torch.float8_e4m3fn)

    rewrite_safetensors(tmp_path / "model.safetensors", to_fp8)
    with pytest.raises(NarrowsError, match=key):
        load_blockwise(tmp_path, dtype=BF16)


@pytest.mark.bnb
def test_fp4_prequantized_weight_is_refused(prequantized, tmp_path, weights_read):
    folder = prequantized_copy(prequantized, tmp_path)

    def rename(tensors):
        blob = tensors.pop(f"{WEIGHT}.quant_state.bitsandbytes__nf4")
        tensors[f"{WEIGHT}.quant_state.bitsandbytes__fp4"] = blob

    rewrite_safetensors(folder / "model.safetensors", rename)
    with pytest.raises(NarrowsError, match=rf"{WEIGHT}.*FP4"):
        load_blockwise(folder, dtype=BF16)
    assert weights_read == []


@pytest.mark.bnb
@pytest.mark.parametrize(("key", "cut"), [(WEIGHT, 1), (WEIGHT, 2048), (f"{WEIGHT}.absmax", 1)])
def test_prequantized_tensor_not_matching_its_quant_state_is_refused(key, cut, prequantized, tmp_path):
    folder = prequantized_copy(prequantized, tmp_path)

    def shorten(tensors):
        tensors[key] = tensors[key][:-cut].clone()

    rewrite_safetensors(folder / "model.safetensors", shorten)
    with pytest.raises(NarrowsError, match=rf"{WEIGHT}.*does not match its quantisation state"):
        load_blockwise(folder, dtype=BF16)


@pytest.mark.bnb
@pytest.mark.parametrize("stat", ["absmax", "quant_map"])
def test_prequantized_weight_missing_its_statistics_is_refused(stat, prequantized, tmp_path, weights_read):
    folder = prequantized_copy(prequantized, tmp_path)
    rewrite_safetensors(folder / "model.safetensors", lambda t: t.pop(f"{WEIGHT}.{stat}"))
    with pytest.raises(NarrowsError, match=rf"{WEIGHT}.*{stat}"):
        load_blockwise(folder, dtype=BF16)
    assert weights_read == []


@pytest.mark.bnb
@pytest.mark.parametrize("stat", ["nested_absmax", "nested_quant_map"])
def test_prequantized_weight_missing_its_nested_statistics_is_refused(stat, prequantized, tmp_path):
    folder = prequantized_copy(prequantized, tmp_path)
    rewrite_safetensors(folder / "model.safetensors", lambda t: t.pop(f"{WEIGHT}.{stat}"))
    with pytest.raises(NarrowsError, match=rf"{WEIGHT}.*{stat}"):
        load_blockwise(folder, dtype=BF16)


@pytest.mark.bnb
def test_prequantized_checkpoint_missing_a_packed_weight_is_refused(prequantized, tmp_path, weights_read):
    folder = prequantized_copy(prequantized, tmp_path)
    rewrite_safetensors(folder / "model.safetensors", lambda t: t.pop(WEIGHT))
    with pytest.raises(NarrowsError, match=WEIGHT):
        load_blockwise(folder, dtype=BF16)
    assert weights_read == []


@pytest.mark.bnb
@pytest.mark.parametrize("quant", [None, "nf4"])
def test_float_weights_under_a_4bit_quantization_config_are_not_passed_off_as_4bit(quant, tmp_path):
    save(tmp_path)
    edit_config(
        tmp_path,
        quantization_config={
            "quant_method": "bitsandbytes",
            "load_in_4bit": True,
            "bnb_4bit_quant_type": "nf4",
            "bnb_4bit_use_double_quant": True,
            "bnb_4bit_compute_dtype": "bfloat16",
        },
    )
    try:
        model = load_blockwise(tmp_path, dtype=BF16, quant=quant, device="cpu")
    except NarrowsError:
        return  # refusing the contradiction is fine too
    if getattr(model, "is_loaded_in_4bit", False):
        assert all(is_nf4_linear(m) for m in decoder_linears(model))


# --- 6. load_causal_lm --------------------------------------------------------------------
@pytest.mark.bnb
def test_load_causal_lm_quantises_and_returns_the_tokenizer(tmp_path):
    folder = tiny_model_folder(tmp_path)
    model, tokenizer = load_causal_lm(folder, dtype=torch.float32, quant="nf4", device="cpu")
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    quantize_nf4(ref, compute_dtype=torch.float32)
    assert_same_model(model, ref)
    assert model.is_loaded_in_4bit and not model.training
    assert all(is_nf4_linear(m) for m in decoder_linears(ref))
    assert all(is_nf4_linear(m) for m in decoder_linears(model))
    ids = tokenizer("hello")["input_ids"]
    assert ids and max(ids) < model.config.vocab_size
    assert tokenizer.decode(ids) == "hello"


def test_map_tensor_is_the_checkpoint_bytes_where_they_lie(tmp_path):
    """`map_tensor`: the tensor `read_tensor` reads, as a read-only map of its file."""
    from narrows.core.io.checkpoint import CheckpointFolder
    from narrows.core.io.loader import map_tensor, read_tensor
    from narrows.core.testing import mapped_file

    folder = CheckpointFolder(tiny_model_folder(tmp_path / "m"))
    for name, info in folder.tensors.items():
        mapped = map_tensor(folder, name)
        assert torch.equal(mapped, read_tensor(folder, name)), name
        assert mapped_file(mapped.data_ptr()) == str(info.file.resolve()), name


# --- gpt-oss's MXFP4 release ------------------------------------------------------------
def test_mxfp4_experts_stay_mxfp4_and_dequantise_to_the_bf16_values_their_codes_stand_for(tmp_path):
    """A release's MXFP4 stacks load as stored: their codes and scales are the file's bytes,
    and each pass dequantises them, exactly, to the stack its codes and scales name (computed
    by the test from the E2M1 table, not by the code narrows uses); everything else loads as
    stored. Asked for NF3, the stacks are those values quantised again. A stack whose scales
    are missing is refused, naming it; 'mxfp4' on a folder with none is refused."""
    from narrows.core import expert_scheme, lowbit_stacks, moe_blocks
    from narrows.core.quant.experts import expert_stacks
    from narrows.core.quant.lowbit import dequantize_reference, quantize

    want = mxfp4_folder(tmp_path / "m")  # the stacks computed from the E2M1 table
    stored = load_file(tmp_path / "m" / "model.safetensors")
    model = load_blockwise(tmp_path / "m", dtype=BF16)
    held = {}
    for layer_path, layer in zip(*_layers(model)):
        for block in moe_blocks(layer):
            names = tuple(lowbit_stacks(block.experts))
            assert names and {expert_scheme(block.experts, n) for n in names} == {"mxfp4"}
            for name, stack in zip(names, expert_stacks(block.experts, names)):
                key = f"{layer_path}.{block.name}.{block.experts_name}.{name}"
                held[key] = stack
                codes = block.experts._parameters[name]
                assert torch.equal(codes.flatten(), stored[f"{key}_blocks"].flatten())
    assert held.keys() == want.keys() and all(torch.equal(held[k], w) for k, w in want.items())
    state = model.state_dict()
    assert all(
        torch.equal(state[k], v.to(BF16)) for k, v in stored.items() if k in state and v.is_floating_point()
    )

    again = load_blockwise(tmp_path / "m", dtype=BF16, quant="nf4", experts="nf3")
    for layer_path, layer in zip(*_layers(again)):
        for block in moe_blocks(layer):
            for name, stack in lowbit_stacks(block.experts).items():
                assert stack.scheme == "nf3"
                key = f"{layer_path}.{block.name}.{block.experts_name}.{name}"
                codes, absmax = quantize(want[key], 3)
                assert torch.equal(
                    expert_stacks(block.experts, (name,))[0], dequantize_reference(codes, absmax, stack)
                )

    with pytest.raises(NarrowsError, match="has none"):
        load_blockwise(tiny_model_folder(tmp_path / "dense"), dtype=BF16, experts="mxfp4")
    tensors = load_file(tmp_path / "m" / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    gap = "down_proj_blocks' has no 'model.layers.1.mlp.experts.down_proj_scales'"
    with pytest.raises(NarrowsError, match=re.escape(gap)):
        load_blockwise(tmp_path / "m", dtype=BF16)


def _layers(model):
    from narrows.core import anatomy_of

    anat = anatomy_of(model)
    return anat.layer_paths, anat.layers
