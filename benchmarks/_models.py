"""Real architectures' shapes with seeded random weights, built one layer at a time: quantised
to NF4 so the full-precision model never exists (a 72B bf16 model would not fit host RAM), or
kept in bf16 where it fits (`random_model(..., nf4=False)`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

CONFIGS = Path(__file__).parent / "configs"


def load_config(name: str):
    from transformers import AutoConfig

    path = Path(name) if name.endswith(".json") else CONFIGS / f"{name}.json"
    spec = json.loads(path.read_text())
    return AutoConfig.for_model(**spec)


def random_nf4_model(
    config, *, seed: int = 0, work_device: str = "cpu", attn: str = "sdpa", experts: str = "nf4"
):
    """A causal LM of `config`'s shape on the CPU: decoder linears in NF4 (double quant), a
    mixture of experts' fused expert stacks in `experts` ("nf4", "nf3", "nf2"), everything
    else bf16. Each layer is materialised and quantised on `work_device`, then parked on the
    CPU before the next one exists (a frontier-size model never exists in bf16)."""
    return random_model(config, seed=seed, work_device=work_device, attn=attn, nf4=True, experts=experts)


@torch.no_grad()
def random_model(
    config,
    *,
    seed: int = 0,
    work_device: str = "cpu",
    attn: str = "sdpa",
    nf4: bool = True,
    experts: str = "nf4",
):
    """`random_nf4_model`, or with ``nf4=False`` the same seeded weights left in bf16 (the whole
    model on the CPU at the end: its bf16 size in host RAM)."""
    from transformers import AutoModelForCausalLM

    from narrows.core import anatomy_of, quantize_nf4

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation=attn)
    gen = torch.Generator(device=work_device).manual_seed(seed)

    def init_(module: torch.nn.Module) -> None:
        for name, p in module.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(
                    torch.randn(p.shape, generator=gen, device=work_device, dtype=torch.float32).mul_(0.02)
                )

    anat = anatomy_of(model)
    for part in {id(m): m for m in (anat.embed, anat.norm, anat.head)}.values():
        part.to_empty(device=work_device)
        init_(part)
        part.to("cpu")
    rotary = getattr(anat.decoder, "rotary_emb", None)
    if rotary is not None:
        with torch.device("cpu"):  # its inverse frequencies are computed, not loaded
            anat.decoder.rotary_emb = type(rotary)(config=anat.model.config)
    for path, layer in zip(anat.layer_paths, anat.layers):
        layer.to_empty(device=work_device)
        init_(layer)
        if nf4:
            quantize_nf4(
                model,
                compute_dtype=torch.bfloat16,
                device=work_device,
                filter_fn=lambda name, _, p=path + ".": name.startswith(p),
                experts=experts,
            )
        layer.to("cpu")
    return model.eval()


TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)  # every benchmark's LoRA


def add_lora(
    model,
    *,
    rank: int = 16,
    dropout: float = 0.0,
    targets: tuple[str, ...] | None = None,
    parameters: tuple[str, ...] = (),
):
    """LoRA on `targets`; by default on `TARGETS`, or on a mixture of experts narrows' default
    targets (attention, dense MLPs and shared experts; routers and routed experts frozen); and
    on the fused expert stacks `parameters` (PEFT's ``target_parameters``)."""
    from peft import LoraConfig, get_peft_model

    if targets is None:
        from narrows.core import lora_targets

        found = lora_targets(model).modules
        targets = TARGETS if found == "all-linear" else found
    modules = list(targets)
    cfg = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        lora_dropout=dropout,
        target_modules=modules,
        target_parameters=list(parameters) or None,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, cfg)
