#!/usr/bin/env bash
# Builds llama.cpp's llama-server for `tandem bench anchor` from the llama.cpp sources that
# llama-cpp-python's sdist vendors (PyPI is the one registry reached here), for this CPU
# (GGML_NATIVE), CPU only. Bench-only: nothing in `make test` or CI needs it.
# Usage: benchmarks/build_llama_server.sh [DIR]   (default DIR: ~/.cache/tandem/llama.cpp)
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
cmake -S "$SRC" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF >&2
cmake --build "$SRC/build" --target llama-server -j "$(nproc)" >&2
echo "$SRC/build/bin/llama-server"
