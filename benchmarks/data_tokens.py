"""The job's data path on a large local dataset: time and peak host memory to tokenise it the
first time (cache built), to map it from the cache, and to pack it; against the same rows
held as Python `Example` objects (how `narrows finetune` held them before the cache), and
against the floor of the imports alone.

Writes N Alpaca rows (GSM8K problems, repeated with an index) as parquet, then runs each
case in its own process and reads its peak RSS. CPU only.

    python benchmarks/data_tokens.py --rows 50000 --tokenizer DIR --out /tmp/data_tokens.json
    python benchmarks/results.py add cpu /tmp/data_tokens.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def write_rows(path: Path, n: int) -> None:
    import datasets

    from narrows.core.app.bundled import gsm8k_split

    train, _ = gsm8k_split()
    rows = []
    for i in range(n):
        chat = train[i % len(train)]["messages"]
        rows.append({"instruction": f"[{i}] {chat[0]['content']}", "input": "", "output": chat[1]["content"]})
    datasets.Dataset.from_list(rows).to_parquet(path)


def case(name: str, data: str, tokenizer: str, seq_len: int) -> dict:
    from transformers import AutoTokenizer

    from narrows.core.app.data import Packed, encode_row, open_source, tokenize

    tok = AutoTokenizer.from_pretrained(tokenizer)
    t = time.perf_counter()
    source = open_source(data)
    if name == "imports":  # the floor every case stands on: torch, transformers, datasets, the tokenizer
        n, how = 0, "no rows read"
    elif name == "python-objects":  # a list of Examples (tuples of Python ints), as before the cache
        held = [encode_row(row, tok, seq_len, where)[1] for where, row in source.rows()]
        n, how = len(held), "list of Example"
    else:
        tokens, how = tokenize(source, tok, seq_len)
        n = len(tokens)
        if name == "packed":
            t = time.perf_counter()  # packing alone, from the cache
            packed = Packed(tokens, seq_len)
            how = f"{len(packed)} sequences, fill {packed.fill():.4f}"
    seconds = time.perf_counter() - t
    return {
        "case": name,
        "rows": n,
        "seconds": seconds,
        "how": how,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=50000)
    ap.add_argument(
        "--tokenizer", required=True, help="a tokenizer folder with a chat template (SmolLM2's, say)"
    )
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--out", default="benchmarks/results/data_tokens.json")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        print(json.dumps(case(args.case, args.data, args.tokenizer, args.seq_len)))
        return
    work = Path(tempfile.mkdtemp(prefix="data_tokens."))
    data = work / "alpaca.parquet"
    write_rows(data, args.rows)
    env = dict(os.environ, NARROWS_CACHE=str(work / "cache"), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    rows = []
    for name in ("imports", "python-objects", "first-run", "cached", "packed"):
        cmd = [
            sys.executable,
            __file__,
            "--case",
            name,
            "--data",
            str(data),
            "--tokenizer",
            args.tokenizer,
            "--seq-len",
            str(args.seq_len),
        ]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
        rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    tokens = sum(p.stat().st_size for p in (work / "cache").rglob("tokens.pt"))
    print(
        f"\n{args.rows} Alpaca rows (parquet {data.stat().st_size / 2**20:.1f} MiB), seq {args.seq_len}; "
        f"cached tokens {tokens / 2**20:.1f} MiB"
    )
    print(f"{'case':<16} {'seconds':>8} {'peak RSS MiB':>13}  how")
    for r in rows:
        print(f"{r['case']:<16} {r['seconds']:>8.2f} {r['peak_rss_bytes'] / 2**20:>13.0f}  {r['how']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "args": vars(args),
        "parquet_bytes": data.stat().st_size,
        "cached_token_bytes": tokens,
        "rows": rows,
    }
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
