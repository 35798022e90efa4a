#!/usr/bin/env bash
# Serve the default model with llama-cpp-python's own OpenAI server (`python -m llama_cpp.server`):
# one model instance, requests served one at a time. Same F16 GGUF and threads as llama-server.
# Usage: benchmarks/peers/llama_cpp_python_server.sh PORT [THREADS=2] [N_CTX=4096] [GGUF]
# Needs: benchmarks/peers/build_llama_cpp_python.sh and export_default.py first.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
PORT="${1:?port}"
THREADS="${2:-2}"
N_CTX="${3:-4096}"
GGUF="${4:-$ROOT/third_party/models/SmolLM2-135M-Instruct.F16.gguf}"
# --interrupt_requests False: by default a new request cuts off the one streaming; queue it instead.
# It has no ignore_eos and streams no usage: benchmark it with `--ignore-eos-via logit-bias`
# (output tokens are then counted by re-tokenizing the streamed text).
exec "$ROOT/third_party/venv-llama-cpp-python/bin/python" -m llama_cpp.server \
    --model "$GGUF" --model_alias SmolLM2-135M-Instruct \
    --host 127.0.0.1 --port "$PORT" \
    --n_threads "$THREADS" --n_threads_batch "$THREADS" --n_ctx "$N_CTX" \
    --interrupt_requests False
