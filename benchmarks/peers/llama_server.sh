#!/usr/bin/env bash
# Serve the default model with llama.cpp's llama-server, set up for a fair comparison with kvserve:
# the F16 export (llama.cpp's fastest format under concurrent load), PARALLEL slots with continuous
# batching, the same thread count as kvserve, 127.0.0.1 only.
# Usage: benchmarks/peers/llama_server.sh PORT PARALLEL [THREADS=2] [CTX_PER_SLOT=2048] [GGUF]
# Needs: benchmarks/peers/build_llama_server.sh and benchmarks/peers/export_default.py first.
# LLAMA_SERVER_BIN picks another build (e.g. third_party/llama.cpp/build-avx2/bin/llama-server).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
PORT="${1:?port}"
PARALLEL="${2:?parallel slots}"
THREADS="${3:-2}"
CTX_PER_SLOT="${4:-2048}"
GGUF="${5:-$ROOT/third_party/models/SmolLM2-135M-Instruct.F16.gguf}"
# -c is the total context, split evenly across slots. --alias: the model name clients send.
# Prompt caching stays at llama.cpp's default (on); the benchmark sends distinct prompts per run,
# so it only helps where kvserve's prefix cache would too.
exec "${LLAMA_SERVER_BIN:-$ROOT/third_party/llama.cpp/build/bin/llama-server}" \
    -m "$GGUF" --host 127.0.0.1 --port "$PORT" \
    --parallel "$PARALLEL" -c $((PARALLEL * CTX_PER_SLOT)) --cont-batching \
    --threads "$THREADS" --threads-batch "$THREADS" \
    --alias SmolLM2-135M-Instruct --metrics --no-webui
