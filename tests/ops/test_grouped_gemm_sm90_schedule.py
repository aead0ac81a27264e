"""pick_schedule (csrc/cuda/grouped_gemm_sm90_schedule.cpp), compiled with the host's C++ compiler (no GPU, no
nvcc): the sm_90a kernel and walk it picks for the benchmark's shapes and for the other branches of its rules,
the MOE_CORE_GEMM_* overrides and the MOE_CORE_GEMM_DEBUG line.

The expected picks are those of the rules before the kernel tree was reorganised around KernelConfig: any
change to a default pick must show here.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import bench_grouped_gemm as bench  # noqa: E402

CUDA_DIR = ROOT / "csrc" / "cuda"
SM_COUNT = 132  # H100 SXM and H200

# Reads "dtype op E T m n k sm_count" lines; prints describe(pick_schedule(...)) for each.
DRIVER = r"""
#include <cstdio>
#include <iostream>
#include <string>
#include "grouped_gemm_sm90_schedule.h"
using namespace moe_core::cuda::sm90;
int main() {
  std::string dtype, op;
  long long e, t, m, n, k;
  int sm_count;
  while (std::cin >> dtype >> op >> e >> t >> m >> n >> k >> sm_count) {
    Problem p;
    p.dtype = dtype == "bf16" ? Dtype::kBf16 : Dtype::kFp16;
    p.op = op == "fwd_kn" ? Op::kForwardKN : op == "fwd_nk" ? Op::kForwardNK
         : op == "wgrad" ? Op::kWgrad : Op::kWgradAccum;
    p.num_experts = e, p.num_rows = t, p.m = m, p.n = n, p.k = k;
    std::printf("%s\n", describe(pick_schedule(p, sm_count)).c_str());
  }
}
"""

ROW_TILE = "row-tile 128x256x64 cooperative cluster 1x1"
ROW_RANGE = "row-range 128x256x32 cooperative cluster 2x1"
WIDE = "pointer-array 128x256x64 cooperative cluster 1x2"
NARROW = "pointer-array 128x128x64 cooperative cluster 1x1"
WIDE_2X1 = "pointer-array 128x256x64 cooperative cluster 2x1"
ALONG_M, ALONG_N = ", raster along M, swizzle 1", ", raster along N, swizzle 1"


@pytest.fixture(scope="module")
def pick(tmp_path_factory):
    """pick(lines, **env) -> the schedule picked for each "dtype op E T m n k sm_count" line under env."""
    cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    folder = tmp_path_factory.mktemp("sm90_schedule")
    (folder / "driver.cpp").write_text(DRIVER)
    exe = folder / "driver"
    subprocess.run([cxx, "-std=c++17", "-O0", f"-I{CUDA_DIR}", str(CUDA_DIR / "grouped_gemm_sm90_schedule.cpp"),
                    str(folder / "driver.cpp"), "-o", str(exe)], check=True, capture_output=True, timeout=120)

    def run(lines, **env):
        clean = {k: v for k, v in os.environ.items() if not k.startswith("MOE_CORE_GEMM_")}
        out = subprocess.run([str(exe)], input="\n".join(lines), env={**clean, **env}, capture_output=True,
                             text=True, check=True, timeout=60)
        return out.stdout.splitlines() if not env.get("MOE_CORE_GEMM_DEBUG") else out.stderr.splitlines()

    return run


def pass_lines(spec: dict, dtype: str = "bf16") -> list[str]:
    """The problems of the benchmark's fwd, dgrad, wgrad and wgrad_accum passes for one shape, as the op layer
    (csrc/cuda/grouped_gemm_cuda.cpp) builds them: dgrad is the forward with the [E, K, N] weight transposed."""
    k, n, e, t = spec["k"], spec["n"], spec["e"], spec["t"]
    return [f"{dtype} fwd_kn {e} {t} {t} {n} {k} {SM_COUNT}", f"{dtype} fwd_nk {e} {t} {t} {k} {n} {SM_COUNT}",
            f"{dtype} wgrad {e} {t} {k} {n} 0 {SM_COUNT}", f"{dtype} wgrad_accum {e} {t} {k} {n} 0 {SM_COUNT}"]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_benchmark_shapes_keep_their_kernels(pick, dtype):
    # Forward and dgrad on row tiles, bf16 experts with a weight past 64 MiB (Mixtral) on the 2x1 pointer-array
    # tile with swizzle 4; wgrad on row ranges; the accumulating wgrad on the wide pointer-array tile, walking
    # along N where dW[e] has more rows than columns (K > N).
    for spec in bench.shapes(quick=False):
        along = ALONG_N if spec["k"] > spec["n"] else ALONG_M
        large = dtype == "bf16" and spec["k"] * spec["n"] * 2 > 64 << 20
        forward = WIDE_2X1 + ", raster along M, swizzle 4" if large else ROW_TILE
        assert pick(pass_lines(spec, dtype)) == [forward, forward, ROW_RANGE, WIDE + along], spec["name"]
    assert any(spec["k"] * spec["n"] * 2 > 64 << 20 for spec in bench.shapes(quick=False))


@pytest.mark.parametrize("line,expected", [
    ("bf16 fwd_kn 8 16384 16384 28672 4096 132", WIDE_2X1 + ", raster along M, swizzle 4"),
    ("bf16 fwd_nk 8 16384 16384 4096 28672 132", WIDE_2X1 + ", raster along M, swizzle 4"),
    ("bf16 fwd_kn 8 16384 16384 8192 4096 132", ROW_TILE),  # exactly 64 MiB
    ("fp16 fwd_kn 8 16384 16384 28672 4096 132", ROW_TILE),  # fp16 has no 2x1 cluster
    ("bf16 fwd_kn 8 2048 2048 28672 4096 132", ROW_TILE),  # 256 rows per expert: the 2x1 cluster would pad
])
def test_forward_experts_past_64_mib_take_the_swizzled_pointer_array_kernel(pick, line, expected):
    assert pick([line]) == [expected]


@pytest.mark.parametrize("line,expected", [
    ("bf16 fwd_kn 128 0 0 1536 2048 132", WIDE + ALONG_M),  # T = 0: pointer-array, its fill blocks
    ("bf16 wgrad 8 0 4096 28672 0 132", WIDE_2X1 + ALONG_M),  # T = 0, bf16: 2x1 where 128-row tiles pair up
    ("fp16 wgrad 8 0 4096 28672 0 132", WIDE + ALONG_M),  # fp16 has no 2x1 cluster
    ("bf16 wgrad 1 16384 1088 64 0 132", NARROW + ALONG_N),  # the mean expert's rows of x past 32 MiB
    ("bf16 wgrad 2 65536 1024 2048 0 132", NARROW + ALONG_M),  # ... with under two waves of wide tiles
    ("bf16 wgrad 8 131072 4096 28672 0 132", WIDE_2X1 + ALONG_M),
    ("bf16 wgrad 8 131072 28672 4096 0 132", WIDE_2X1 + ALONG_N),
    ("bf16 fwd_kn 32768 65536 65536 4096 2048 132", WIDE + ALONG_M),  # E past the row tiles' 15 bits
    ("bf16 fwd_nk 16 2147483648 2147483648 4096 2048 132", WIDE_2X1 + ALONG_N),  # T = 2^31
    ("bf16 wgrad_accum 2 64 72 40 0 132", NARROW + ALONG_N),  # one 40-wide column tile: no pairs
    ("fp16 wgrad_accum 8 8192 14336 4096 0 132", WIDE + ALONG_N),
])
def test_the_pointer_array_kernel_takes_what_the_row_kernels_cannot(pick, line, expected):
    assert pick([line]) == [expected]


FWD_BF16, FWD_FP16 = "bf16 fwd_kn 128 65536 65536 1536 2048 132", "fp16 fwd_kn 128 65536 65536 1536 2048 132"
WGRAD, ACCUM = "bf16 wgrad 128 65536 2048 1536 0 132", "bf16 wgrad_accum 128 65536 2048 1536 0 132"


@pytest.mark.parametrize("tile,expected", [
    ("128x256", [WIDE + ALONG_M, WIDE + ALONG_M, WIDE + ALONG_N, WIDE + ALONG_N]),
    ("128x128", [NARROW + ALONG_M, NARROW + ALONG_M, NARROW + ALONG_N, NARROW + ALONG_N]),
    ("128x256c21", [WIDE_2X1 + ALONG_M, WIDE + ALONG_M, WIDE_2X1 + ALONG_N, WIDE + ALONG_N]),
    # Tuning kernels stay picked in every build (launch raises where the build left them out); where no dtype and
    # op has them, a built tile runs.
    ("128x128pp", ["pointer-array 128x128x64 pingpong cluster 1x2" + ALONG_M, NARROW + ALONG_M,
                   "pointer-array 128x128x64 pingpong cluster 1x2" + ALONG_N, NARROW + ALONG_N]),
    ("256x128c21", ["pointer-array 256x128x64 cooperative cluster 2x1" + ALONG_M, WIDE + ALONG_M,
                    "pointer-array 256x128x64 cooperative cluster 2x1" + ALONG_N, WIDE + ALONG_N]),
    ("rows", [ROW_TILE, ROW_TILE, ROW_RANGE, ROW_RANGE]),  # the accumulating wgrad's row ranges: forced only
    ("unknown", [ROW_TILE, ROW_TILE, ROW_RANGE, WIDE + ALONG_N]),
])
def test_forced_tiles(pick, tile, expected):
    # bf16 forward, fp16 forward, bf16 wgrad, bf16 accumulating wgrad.
    assert pick([FWD_BF16, FWD_FP16, WGRAD, ACCUM], MOE_CORE_GEMM_TILE=tile) == expected


def test_forced_rows_only_where_the_row_kernels_fit(pick):
    assert pick(["bf16 fwd_kn 128 0 0 1536 2048 132"], MOE_CORE_GEMM_TILE="rows") == [WIDE + ALONG_M]
    # Past the wgrad's 32 MiB rule the row ranges still fit, so forcing them takes them.
    assert pick(["bf16 wgrad 1 16384 1088 64 0 132"], MOE_CORE_GEMM_TILE="rows") == [ROW_RANGE]


def test_forced_walk(pick):
    assert pick([ACCUM, ACCUM], MOE_CORE_GEMM_RASTER="m", MOE_CORE_GEMM_SWIZZLE="4") == [WIDE + ", raster along M, "
                                                                                       "swizzle 4"] * 2
    # Swizzles other than 1, 2, 4 and 8 are ignored; a raster other than n walks along M.
    assert pick([ACCUM], MOE_CORE_GEMM_RASTER="x", MOE_CORE_GEMM_SWIZZLE="3") == [WIDE + ALONG_M]
    assert pick([ACCUM], MOE_CORE_GEMM_TILE="128x128", MOE_CORE_GEMM_SWIZZLE="8") == [NARROW + ", raster along N, "
                                                                                     "swizzle 8"]


def test_debug_line_names_the_problem_and_the_schedule(pick):
    lines = pick([FWD_BF16, "bf16 fwd_nk 128 65536 65536 2048 1536 132", ACCUM], MOE_CORE_GEMM_DEBUG="1")
    assert lines == [
        "[moe_core] grouped_gemm sm90 forward (weight [E, K, N]): E=128 m=65536 n=1536 k=2048 -> " + ROW_TILE,
        "[moe_core] grouped_gemm sm90 forward (weight [E, N, K]): E=128 m=65536 n=2048 k=1536 -> " + ROW_TILE,
        "[moe_core] grouped_gemm sm90 wgrad accumulate: E=128 m=2048 n=1536 k=0 -> " + WIDE + ALONG_N,
    ]
