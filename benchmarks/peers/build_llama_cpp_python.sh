#!/usr/bin/env bash
# Build llama-cpp-python (its Python OpenAI server, `python -m llama_cpp.server`) into its own venv,
# third_party/venv-llama-cpp-python, so its extra packages never touch kvserve's environment.
# --system-site-packages reuses the installed fastapi/uvicorn/numpy; torch is not involved.
# Usage: benchmarks/peers/build_llama_cpp_python.sh   (reuses the sdist build_llama_server.sh fetched)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
DEST="$ROOT/third_party"
VENV="$DEST/venv-llama-cpp-python"
mkdir -p "$DEST/downloads"
if ! ls "$DEST"/downloads/llama_cpp_python-*.tar.gz >/dev/null 2>&1; then
    pip download --no-deps --no-binary :all: --dest "$DEST/downloads" llama-cpp-python
fi
sdist="$(ls -t "$DEST"/downloads/llama_cpp_python-*.tar.gz | head -n1)"
[ -x "$VENV/bin/python" ] || python -m venv --system-site-packages "$VENV"
# CPU only, tuned for this machine like llama-server; no multimodal (LLAVA) library: not needed.
export CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_BLAS=OFF -DLLAVA_BUILD=OFF -DLLAMA_CURL=OFF"
export CMAKE_BUILD_PARALLEL_LEVEL="${JOBS:-2}"
"$VENV/bin/pip" install --no-cache-dir "${sdist}[server]"
"$VENV/bin/python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
