#!/usr/bin/env bash
# Builds llama.cpp's llama-server for `tandem bench anchor` from the llama.cpp sources that
# llama-cpp-python's sdist vendors (PyPI is the one registry reached here), for this CPU
# (GGML_NATIVE), CPU only. Bench-only: nothing in `make test` or CI needs it.
# Usage: benchmarks/build_llama_server.sh [DIR]   (default DIR: ~/.cache/tandem/llama.cpp)
# LLAMA_ISA=avx2: an AVX2 + FMA build with AVX-512 off (in build-avx2/), the llama-server an
# AVX2-only CPU would run, to set beside `--set engine.cpu_isa=avx2` on an AVX-512 machine.
# Prints the binary's path last; pass it as --llama-server or $TANDEM_LLAMA_SERVER.
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
DIR="${1:-$HOME/.cache/tandem/llama.cpp}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$DIR"
cd "$DIR"
if [ ! -d "llama_cpp_python-$VERSION" ]; then
  "$PYTHON" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d sdist
  tar xzf "sdist/llama_cpp_python-$VERSION.tar.gz"
fi
SRC="$DIR/llama_cpp_python-$VERSION/vendor/llama.cpp"
case "${LLAMA_ISA:-native}" in
  native) BUILD="$SRC/build"; ISA=(-DGGML_NATIVE=ON) ;;
  avx2) BUILD="$SRC/build-avx2"
        ISA=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
             -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF
             -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF) ;;
  *) echo "LLAMA_ISA must be native or avx2" >&2; exit 2 ;;
esac
cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release "${ISA[@]}" -DLLAMA_CURL=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF >&2
cmake --build "$BUILD" --target llama-server -j "$(nproc)" >&2
echo "$BUILD/bin/llama-server"
