"""What fingerprinting a base's weights costs (`narrows.core.io.fingerprint`), at 7B and 72B:
the sampled hash a run records and checks on every resume and evaluation, against hashing
every byte.

Qwen2.5-7B's tensors (bf16, 339 tensors, 15.2 GB) are written in full as one safetensors
file of random bytes, flushed, and their pages dropped from the page cache
(``posix_fadvise(DONTNEED)``) before each cold read; Qwen2.5-72B's (963 tensors, 145 GB)
do not fit this disk, so they are written as a sparse file: its reads cost the CPU side of
the sampling only (no disk), and its cold cost is the 7B one scaled by the tensor count
(the sampled bytes are the same per tensor: 64 KiB). The full hash is timed on the first
GiB of the 7B file read from disk and scaled to each size. CPU only.

    python benchmarks/fingerprint_cost.py --dir /tmp --out /tmp/fingerprint_cost.json
    python benchmarks/results.py add cpu /tmp/fingerprint_cost.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import struct
import subprocess
import sys
import time
from pathlib import Path

SHAPES = {  # layers, hidden, intermediate, key/value width, vocabulary
    "qwen2.5-7b": (28, 3584, 18944, 512, 152064),
    "qwen2.5-72b": (80, 8192, 29568, 1024, 152064),
}


def tensors(layers: int, h: int, inter: int, kv: int, vocab: int) -> dict[str, tuple[int, ...]]:
    out = {"model.embed_tokens.weight": (vocab, h), "lm_head.weight": (vocab, h), "model.norm.weight": (h,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out |= {
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.q_proj.bias": (h,),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    return out


def write(path: Path, shapes: dict[str, tuple[int, ...]], sparse: bool) -> int:
    """A bf16 safetensors file of these shapes: random bytes, or holes (`sparse`)."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        n = 2
        for d in shape:
            n *= d
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        if sparse:
            f.truncate(8 + len(head) + offset)
        else:
            block, left = os.urandom(1 << 24), offset
            while left:
                f.write(block[: min(left, len(block))])
                left -= min(left, len(block))
        f.flush()
        os.fsync(f.fileno())
    return path.stat().st_size


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def sampled_seconds(path: Path, cold: bool) -> float:
    from narrows.core.io import fingerprint

    fingerprint._MEMO.clear()
    if cold:
        drop_cache(path)
    t = time.perf_counter()
    fingerprint.weights_sample_sha256(path)
    return time.perf_counter() - t


def full_rate(path: Path, nbytes: int = 1 << 30) -> float:
    """Bytes a second of sha256 over the file's first `nbytes`, read cold from disk."""
    drop_cache(path)
    digest, done = hashlib.sha256(), 0
    t = time.perf_counter()
    with open(path, "rb") as f:
        while done < nbytes and (chunk := f.read(1 << 23)):
            digest.update(chunk)
            done += len(chunk)
    return done / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp", help="where the checkpoints are written (15 GB free at least)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from narrows.core.io.fingerprint import SAMPLE_BYTES, SAMPLES, SAMPLING

    rows = []
    seven = Path(args.dir) / "fingerprint_cost_7b.safetensors"
    try:
        size = write(seven, tensors(*SHAPES["qwen2.5-7b"]), sparse=False)
        cold = [sampled_seconds(seven, cold=True) for _ in range(args.repeats)]
        warm = [sampled_seconds(seven, cold=False) for _ in range(args.repeats)]
        rate = full_rate(seven)
    finally:
        seven.unlink(missing_ok=True)
    n7 = len(tensors(*SHAPES["qwen2.5-7b"]))
    rows.append(
        {
            "model": "qwen2.5-7b",
            "bytes": size,
            "tensors": n7,
            "sampled_bytes": n7 * SAMPLES * SAMPLE_BYTES,
            "sampled_cold_s": min(cold),
            "sampled_cold_s_all": cold,
            "sampled_warm_s": min(warm),
            "full_sha256_s": size / rate,
            "how": "written in full; cold: pages dropped before each read",
        }
    )
    big = Path(args.dir) / "fingerprint_cost_72b.safetensors"
    try:
        size = write(big, tensors(*SHAPES["qwen2.5-72b"]), sparse=True)
        warm = [sampled_seconds(big, cold=False) for _ in range(args.repeats)]
    finally:
        big.unlink(missing_ok=True)
    n72 = len(tensors(*SHAPES["qwen2.5-72b"]))
    rows.append(
        {
            "model": "qwen2.5-72b",
            "bytes": size,
            "tensors": n72,
            "sampled_bytes": n72 * SAMPLES * SAMPLE_BYTES,
            "sampled_cold_s": min(cold) * n72 / n7,
            "sampled_warm_s": min(warm),
            "full_sha256_s": size / rate,
            "how": "sparse file: warm is the sampling's CPU side; cold and full scaled from the 7B reads",
        }
    )
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit,
        "device": platform.processor() or platform.machine(),
        "cpu": _cpu(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "sampling": SAMPLING,
        "full_sha256_bytes_per_s": rate,
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for r in rows:
        print(
            f"{r['model']:12} {r['tensors']:4} tensors  sampled {r['sampled_bytes'] / 2**20:5.1f} MiB: "
            f"cold {r['sampled_cold_s']:.2f} s, warm {r['sampled_warm_s']:.3f} s; every byte {r['full_sha256_s']:.0f} s"
        )


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


if __name__ == "__main__":
    main()
