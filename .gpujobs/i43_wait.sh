#!/usr/bin/env bash
# issue 43: the copy-event wait in TransferEngine.acquire, caught on the GPU (run from the repo root, .gpu carried)
source .gpu/env
export CUBLAS_WORKSPACE_CONFIG=:4096:8
T=packages/stream/tests/test_stream_gpu_exact.py
K="slow_copies or every_layer_streamed"
E=packages/stream/src/narrows/stream/engine.py
nvidia-smi --query-gpu=name --format=csv,noheader
echo "== as shipped"; python3 -m pytest $T -q -p no:cacheprovider -k "$K" 2>&1 | tee $OUT/shipped.log | tail -4
cp $E /tmp/engine.py
sed -i 's/^            torch.cuda.current_stream(self.device).wait_event(slab.ready)$/            pass  # MUTATION: no wait/' $E
grep -c "MUTATION" $E
echo "== wait removed"; python3 -m pytest $T -q -p no:cacheprovider -k "$K" 2>&1 | tee $OUT/mutated.log | tail -12
cp /tmp/engine.py $E
echo "== new CPU-side tests on this machine"; python3 -m pytest packages/stream/tests/test_engine_protocol.py packages/stream/tests/test_stream_config.py packages/stream/tests/test_step_mode_router.py -q -p no:cacheprovider 2>&1 | tail -4
