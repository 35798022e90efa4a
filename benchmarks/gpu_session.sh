#!/usr/bin/env bash
# Everything issue 12 asks of a GPU, in one call of a short GPU lease, most valuable first, each part under
# its own time limit so that one that hangs cannot take the rest with it:
#   1. the GPU's tests: Triton kernels (attention, elementwise) on CUDA, the engine on CUDA against
#      transformers (bf16, fp32), graphs;
#   2. benchmarks/gpu.py (decode step vs the HBM bound, graphs vs eager, Triton vs torch attention,
#      throughput vs transformers);
#   3. more of the engine's own tests, which pick CUDA by themselves where it is present.
# Logs and results go to $OUT (default /tmp/kvserve_gpu). Python packages the machine lacks travel as wheels
# in .whl/ (gguf, which the model loader imports).
#
#     bash benchmarks/gpu_session.sh            # TESTS_S, BENCH_S, MORE_S: the parts' limits in seconds;
#                                               # SHAPE=llama3.2-1b: that checkpoint shape instead
#     GIT_REV=$(git rev-parse --short HEAD)     # (set here, passed along) names the commit in the results:
#                                               # a lease's copy of the tree may carry an older .git
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvserve_gpu}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1

{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
    python3 -c "import sys, torch, triton, transformers; print(sys.version.split()[0], 'torch', torch.__version__, \
'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__, \
torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/env.txt"

echo "== 1. GPU tests"
timeout "${TESTS_S:-150}" python3 -m pytest -q -p no:cacheprovider --timeout 120 -rfE --durations=10 \
    tests/test_cuda_engine.py tests/test_triton_attention.py tests/test_triton_elementwise.py \
    tests/test_cuda_graph_padding.py \
    tests/test_model_parity.py tests/test_gemma3_parity.py -k "cuda or triton" 2>&1 | tee "$OUT/tests_gpu.log"

echo "== 2. benchmarks/gpu.py"
timeout "${BENCH_S:-300}" python3 benchmarks/gpu.py --shape "${SHAPE:-qwen3-0.6b}" --hf-batch-size "${HF_BATCH:-128}" \
    2>&1 | tee "$OUT/bench.log"
name=gpu
[ "${SHAPE:-qwen3-0.6b}" = qwen3-0.6b ] || name=gpu_$SHAPE
results=${KVSERVE_BENCH_RESULTS:-benchmarks/results}  # where benchmarks/common.py writes
cp "$results/$name.json" "$results/$name.md" "$OUT/" 2>/dev/null  # at most 8 files come back

echo "== 3. the engine's own tests, on CUDA"
timeout "${MORE_S:-80}" python3 -m pytest -q -p no:cacheprovider --timeout 60 -rfE \
    tests/test_engine_parity.py tests/test_spec_decode_engine.py tests/test_scheduler_behaviour.py \
    2>&1 | tee "$OUT/tests_engine.log"
echo "== done"
