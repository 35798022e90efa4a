#!/usr/bin/env bash
# Serve the default model (HF export) with `transformers serve --continuous-batching`, offline, on
# CPU with THREADS torch threads (the same count kvserve and llama-server get).
# Usage: benchmarks/peers/transformers_serve.sh PORT [THREADS=2] [DTYPE=float32]
# Clients must send model=<the HF dir path as given here> and, to generate exactly max_tokens,
# `kvserve bench ... --ignore-eos-via generation-config` (it rejects the ignore_eos field).
# Needs: transformers[serving] (fastapi, uvicorn, openai, rich, accelerate) and
# benchmarks/peers/export_default.py first.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
PORT="${1:?port}"
THREADS="${2:-2}"
DTYPE="${3:-float32}"
cd "$ROOT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS="$THREADS" MKL_NUM_THREADS="$THREADS"
exec transformers serve third_party/models/SmolLM2-135M-Instruct-hf \
    --continuous-batching --device cpu --dtype "$DTYPE" \
    --host 127.0.0.1 --port "$PORT" --log-level warning
