#!/usr/bin/env bash
# Stage Unsloth for the lent GPU machine into ./.gpu-unsloth of the checkout, apart from .gpu/site:
# Unsloth's closure (trl, datasets, ...) must never shadow or mix with what our own rows import.
# Run it here (PyPI reachable), after ../shared/gpu/stage; carry .gpu and .gpu-unsloth; on the GPU
# machine `source .gpu-unsloth/env` (benchmarks/peers.py does that for its Unsloth rows) unzips the
# wheels into /tmp/unsloth-site once and points PYTHONPATH there.
#
# Versions: unsloth and unsloth_zoo 2026.10.9 declare torch<2.15, transformers<=5.17.0 (the machine has
# 5.17.0: it is used as it is), peft>=0.18, trl<=1.15.0, datasets<5 but not 4.4.*. The rest of the list
# is `uv pip compile` of those two against the machine's known versions (torch 2.11.0, transformers
# 5.17.0, peft 0.21.0, accelerate 1.15.0, huggingface-hub 1.33.0, numpy 2.5.2, torchvision 0.26.0,
# sentencepiece 0.2.2), minus every package the machine's image already has (KINDS.md lists them:
# accelerate, einops, pillow, protobuf, psutil, pyarrow, pandas, regex, rich, typer, xxhash, fsspec, ...).
#
# Declared, deliberately not staged (peers.py's Unsloth row lists them as unmet requirements; why):
#   bitsandbytes   ours, the CUDA 13 build in .gpu/site, which .gpu-unsloth/env links into Unsloth's
#                  site (the one package of ours it sees; staging it twice would cost ~6 MB a call)
#   xformers       Unsloth's own pin for torch 2.11 + CUDA 13 is xformers 0.0.35 from PyTorch's cu130
#                  index, which is not reachable here; PyPI's 0.0.35 is built for torch 2.10 + cu128
#                  (its _C.so needs libcudart.so.12), so Unsloth would drop it at import anyway. Without
#                  it Unsloth attends with PyTorch's SDPA (peers.py's row records which it used)
#   torchao        only for fp8 / QAT paths, every import guarded; a binary tied to a torch release
#   diffusers, hf_transfer, pydantic, json5, nest-asyncio, structlog
#                  never imported by unsloth/ or unsloth_zoo/ on the LoRA path (downloads, the
#                  Studio web app and the agent CLI, which are trimmed from the wheel below)
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
grep -qx '/.gpu-unsloth/' .git/info/exclude 2>/dev/null || echo '/.gpu-unsloth/' >> .git/info/exclude
UNSLOTH=2026.10.9
closure=(
  "unsloth==$UNSLOTH" "unsloth_zoo==$UNSLOTH"
  trl==1.15.0
  datasets==4.8.5 dill==0.4.1 multiprocess==0.70.19   # datasets' needs the machine lacks
  cut-cross-entropy==25.1.1                           # unsloth_zoo's loss utilities import it when present
  msgspec==0.22.0
  tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1
)
rm -rf .gpu-unsloth
mkdir -p .gpu-unsloth/wheels
wheels=.gpu-unsloth/wheels
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d "$wheels" "${closure[@]}"
# The unsloth wheel also carries Unsloth Studio (a web app: studio/, ~80 MB unpacked) and its agent CLI
# (unsloth_cli/); `import unsloth` reads neither. Keep unsloth/ and its dist-info only: 28 MB -> 2 MB.
python3 - "$wheels"/unsloth-"$UNSLOTH"-py3-none-any.whl <<'PY'
import os, sys, zipfile
path = sys.argv[1]
with zipfile.ZipFile(path) as src, zipfile.ZipFile(path + ".tmp", "w", zipfile.ZIP_DEFLATED) as dst:
    for item in src.infolist():
        if item.filename.split("/")[0] in ("unsloth", f"unsloth-{os.path.basename(path).split('-')[1]}.dist-info"):
            dst.writestr(item, src.read(item))
os.replace(path + ".tmp", path)
PY
cat > .gpu-unsloth/env <<'ENV'
# sourced on the GPU machine from the checkout root: Unsloth's own site, unzipped once into /tmp.
# PYTHONPATH is set, not extended: neither narrows nor anything of .gpu/site is importable there,
# except our bitsandbytes (the CUDA 13 build in .gpu/site), linked into the site: Unsloth needs it.
_site=/tmp/unsloth-site
_stamp=$( (echo "$PWD"; ls "$PWD"/.gpu-unsloth/wheels) | sha256sum | cut -c1-16)
if [ "$(cat "$_site/.stamp" 2>/dev/null)" != "$_stamp" ]; then
  rm -rf "$_site" && mkdir -p "$_site"
  for _w in "$PWD"/.gpu-unsloth/wheels/*.whl; do python3 -m zipfile -e "$_w" "$_site" || return 1; done
  for _p in "$PWD"/.gpu/site/bitsandbytes "$PWD"/.gpu/site/bitsandbytes-*.dist-info; do
    [ -e "$_p" ] || { echo ".gpu-unsloth/env: no $_p: run ../shared/gpu/stage and carry .gpu" >&2; return 1; }
    ln -s "$_p" "$_site/"
  done
  echo "$_stamp" > "$_site/.stamp"
fi
export PYTHONPATH="$_site"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export UNSLOTH_DISABLE_STATISTICS=1   # no usage ping (there is no network there anyway)
export UNSLOTH_COMPILE_LOCATION=/tmp/unsloth_compiled_cache   # its generated modules, not in the checkout
unset _site _stamp _w _p
ENV
ls "$wheels"
du -sh .gpu-unsloth
echo "staged: carry .gpu and .gpu-unsloth; benchmarks/peers.py sources .gpu-unsloth/env for its Unsloth rows"
echo "check there: bash -c 'source .gpu-unsloth/env && python3 benchmarks/peers.py --check-unsloth'"
