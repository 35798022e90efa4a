#!/usr/bin/env bash
# Build llama.cpp's C++ `llama-server` (CPU only, Release) from the llama.cpp sources vendored in the
# llama-cpp-python sdist on PyPI -- the one route to llama.cpp that needs no GitHub access.
# Output: third_party/llama.cpp/build/bin/llama-server   (third_party/ is git-ignored)
#         third_party/llama.cpp/build-avx2/bin/llama-server with ISA=avx2
# Usage:  [ISA=native|avx2] benchmarks/peers/build_llama_server.sh [VERSION]   (default: latest sdist on PyPI)
# ISA=avx2 builds for AVX2 + FMA + F16C with AVX-512 off, whatever this CPU has: the peer for kvserve's AVX2
# kernels (KVSERVE_CPU_ISA=avx2) on an AVX-512 machine, so both sides use the same instructions.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
DEST="$ROOT/third_party"
JOBS="${JOBS:-2}"
VERSION="${1:-}"
ISA="${ISA:-native}"
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
# as kvserve's kernels do. No curl: the server only reads local files.
case "$ISA" in
    native) build="$src/build"; isa_flags=(-DGGML_NATIVE=ON) ;;
    avx2) build="$src/build-avx2"
          isa_flags=(-DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
                     -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF
                     -DGGML_AVX512_VBMI=OFF -DGGML_AVX_VNNI=OFF) ;;
    *) echo "ISA must be native or avx2, got $ISA" >&2; exit 2 ;;
esac
cmake -S "$src" -B "$build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release "${isa_flags[@]}" \
    -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_BLAS=OFF \
    -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DBUILD_SHARED_LIBS=OFF
cmake --build "$build" --target llama-server -j "$JOBS"

bin="$build/bin/llama-server"
"$bin" --version || true
echo "built: $bin"
