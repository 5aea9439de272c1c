source .gpu/env
export CUBLAS_WORKSPACE_CONFIG=:4096:8 NARROWS_CACHE=/tmp/narrows-cache
NEWPP=$PYTHONPATH
OLDPP="$PWD/.gpu/site"; for s in $PWD/ab_old/packages/*/src; do OLDPP="$s:$OLDPP"; done
for round in 1 2; do for v in old new; do
  if [ $v = old ]; then PP=$OLDPP; D=ab_old; else PP=$NEWPP; D=.; fi
  (cd $D && PYTHONPATH=$PP timeout 150 python3 benchmarks/stream_qlora.py --model qwen2.5-7b --seq 512 --batch 8 --steps 10 --warmup 2 \
    --modes ${MODES:-stream-min-lmhead-fast,stream-8GiB-lmhead-fast} --out $OUT/ab_${v}_$round.json 2>&1 | tail -3 | sed "s/^/$v$round /")
done; done
