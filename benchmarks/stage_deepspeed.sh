#!/usr/bin/env bash
# Stage DeepSpeed (the ZeRO-3 offload peer of shared_host.py and stream_qlora.py) for the lent GPU
# machine into ./.gpu-deepspeed of the checkout, apart from .gpu/site. Run it here (PyPI reachable),
# after ../shared/gpu/stage; carry .gpu and .gpu-deepspeed; on the GPU machine `source
# .gpu-deepspeed/env` after `source .gpu/env` unzips the wheels into /tmp/deepspeed-site once and
# puts it last on PYTHONPATH (nothing there shadows what our rows import).
#
# PyPI publishes DeepSpeed as source only: its wheel is built here, pure Python (DS_BUILD_OPS unset:
# no op is compiled ahead; the peer uses torch's AdamW on the GPU, no CPU Adam). Its needs the
# machine's image lacks (KINDS.md lists the image): hjson, pydantic and pydantic's own.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
grep -qx '/.gpu-deepspeed/' .git/info/exclude 2>/dev/null || echo '/.gpu-deepspeed/' >> .git/info/exclude
DEEPSPEED=0.19.8
rm -rf .gpu-deepspeed
mkdir -p .gpu-deepspeed/wheels
dl=$(mktemp -d)
python3 -m pip download -q --no-deps --no-binary :all: -d "$dl" "deepspeed==$DEEPSPEED"
python3 -m pip wheel -q --no-deps -w .gpu-deepspeed/wheels "$dl"/deepspeed-*.tar.gz
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d .gpu-deepspeed/wheels \
  hjson==3.1.0 pydantic==2.12.5 pydantic-core==2.41.5 annotated-types==0.7.0 typing-inspection==0.4.2
rm -rf "$dl"
cat > .gpu-deepspeed/env <<'ENV'
# sourced on the GPU machine from the checkout root, after .gpu/env: DeepSpeed's site, unzipped once
_site=/tmp/deepspeed-site
_stamp=$( (echo "$PWD"; ls "$PWD"/.gpu-deepspeed/wheels) | sha256sum | cut -c1-16)
if [ "$(cat "$_site/.stamp" 2>/dev/null)" != "$_stamp" ]; then
  rm -rf "$_site" && mkdir -p "$_site"
  for _w in "$PWD"/.gpu-deepspeed/wheels/*.whl; do python3 -m zipfile -e "$_w" "$_site" || return 1; done
  echo "$_stamp" > "$_site/.stamp"
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$_site" DS_ACCELERATOR=cuda
unset _site _stamp _w
ENV
du -sh .gpu-deepspeed
