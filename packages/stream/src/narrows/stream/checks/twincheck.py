"""narrows-stream's check for an unannounced architecture (core's `verify`): its shrunk
twin trained streamed and resident — adapter dropout on, gradient accumulation 2, two
AdamW steps, MoE router logits and their aux loss on where the config has them — must
agree with `torch.equal` on every loss, gradient and final weight."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from narrows.core import (
    ArchitectureCheckError,
    fuse_layers,
    register_architecture_check,
    shrunk_twin,
    side_output_overrides,
    unwrap_model,
)

__all__ = ["check_stream"]


def _batches(vocab: int, device: torch.device) -> list[dict[str, Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(4):
        ids = torch.randint(0, vocab, (2, 10), generator=g)
        mask = torch.ones_like(ids)
        mask[1, :3] = 0  # a left-padded row
        labels = ids.masked_fill(mask == 0, -100)
        out.append(
            {k: v.to(device) for k, v in dict(input_ids=ids, attention_mask=mask, labels=labels).items()}
        )
    return out


def _train(model: nn.Module, streamed: bool, device: torch.device) -> dict[str, Tensor]:
    from ..api import stream

    if streamed:
        stream(model, None, device=device, check=False)
    else:  # the kernels the stream runs by default: the fast layers where they cover the layers
        fuse_layers(model.to(device))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW([p for _, p in named], lr=1e-2)
    record: dict[str, Tensor] = {}
    torch.manual_seed(0)
    batches = _batches(unwrap_model(model).config.get_text_config().vocab_size, device)
    for step in range(2):
        for micro in range(2):
            loss = model(**batches[2 * step + micro]).loss / 2
            loss.backward()
            record[f"loss of step {step}, micro-batch {micro}"] = loss.detach().cpu()
        for n, p in named:
            if p.grad is not None:  # None: unused here (a multimodal model's vision adapters)
                record[f"gradient of {n} at step {step}"] = p.grad.detach().cpu().clone()
        opt.step()
        opt.zero_grad()
    for n, p in named:
        record[f"final {n}"] = p.detach().cpu().clone()
    return record


def check_stream(model: nn.Module) -> None:
    """Streamed == resident on the twin of `model`, or ArchitectureCheckError naming the first difference."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    over = side_output_overrides(model)
    resident = _train(shrunk_twin(model, **over), False, device)
    streamed = _train(shrunk_twin(model, **over), True, device)
    if resident.keys() != streamed.keys():
        raise ArchitectureCheckError("streamed and resident training updated different adapter parameters")
    for key, a in resident.items():
        b = streamed[key]
        if not torch.equal(a, b):
            hint = (
                "; on CUDA, turn on deterministic kernels (deterministic=True / --deterministic)"
                if device.type == "cuda" and not torch.are_deterministic_algorithms_enabled()
                else ""
            )
            raise ArchitectureCheckError(
                f"streamed and resident training differ in the {key} "
                f"(max {(a.double() - b.double()).abs().max().item():.3g}){hint}"
            )


register_architecture_check("stream", check_stream)  # on import: `api` imports this module
