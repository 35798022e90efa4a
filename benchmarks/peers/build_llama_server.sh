#!/usr/bin/env bash
# Build llama.cpp's C++ `llama-server` (CPU only, Release) from the llama.cpp sources vendored in the
# llama-cpp-python sdist on PyPI -- the one route to llama.cpp that needs no GitHub access.
# Output: third_party/llama.cpp/build/bin/llama-server   (third_party/ is git-ignored)
# Usage:  benchmarks/peers/build_llama_server.sh [VERSION]   (default: latest sdist on PyPI)
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
DEST="$ROOT/third_party"
JOBS="${JOBS:-2}"
VERSION="${1:-}"
mkdir -p "$DEST/downloads"

spec="llama-cpp-python${VERSION:+==$VERSION}"
if ! ls "$DEST"/downloads/llama_cpp_python-*.tar.gz >/dev/null 2>&1; then
    # --no-binary: we want the sdist, which carries vendor/llama.cpp; --no-deps: nothing else.
    pip download --no-deps --no-binary :all: --dest "$DEST/downloads" "$spec"
fi
sdist="$(ls -t "$DEST"/downloads/llama_cpp_python-*.tar.gz | head -n1)"
echo "sdist: $sdist"

src="$DEST/llama.cpp"
if [ ! -f "$src/CMakeLists.txt" ]; then
    tmp="$(mktemp -d "$DEST/unpack.XXXX")"
    tar -xzf "$sdist" -C "$tmp"
    rm -rf "$src"
    mv "$tmp"/llama_cpp_python-*/vendor/llama.cpp "$src"
    rm -rf "$tmp"
fi

# No CUDA/Metal/BLAS: the comparison is CPU against CPU. GGML_NATIVE tunes for this machine's ISA,
# as kvserve's torch kernels do. No curl: the server only reads local files.
cmake -S "$src" -B "$src/build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_BLAS=OFF \
    -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DBUILD_SHARED_LIBS=OFF
cmake --build "$src/build" --target llama-server -j "$JOBS"

bin="$src/build/bin/llama-server"
"$bin" --version || true
echo "built: $bin"
