#!/usr/bin/env bash
# Add the fused-loss libraries the LM-head benchmark compares against (Liger-Kernel, Cut
# Cross-Entropy: pure-Python wheels over Triton) to .gpu/site, after ../shared/gpu/stage.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
dl=$(mktemp -d)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform any -d "$dl" liger-kernel==0.8.5 cut-cross-entropy==25.1.1
for w in "$dl"/*.whl; do python3 -m zipfile -e "$w" .gpu/site; done
rm -rf "$dl"
