"""Builds moe_core._C from csrc/: the C++ CPU kernels always, the CUDA kernels when torch has CUDA and nvcc exists.

MOE_CORE_CUDA=1 forces the CUDA build (fails without nvcc), MOE_CORE_CUDA=0 skips it. MOE_CORE_SM90_TUNING=1 also
builds the sm_90a tuning kernels (those the heuristics never pick; MOE_CORE_GEMM_TILE forces them).
CUTLASS headers come from the installed ``nvidia-cutlass`` wheel, or from ``CUTLASS_PATH``.
Install with ``pip install --no-build-isolation -e .`` so the build uses the torch already installed.
"""

import glob
import os
import shutil

import torch
from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension


def _want_cuda() -> bool:
    flag = os.environ.get("MOE_CORE_CUDA")
    if flag is not None:
        return flag == "1"
    return torch.version.cuda is not None and shutil.which("nvcc") is not None


def _cutlass_include() -> list[str]:
    root = os.environ.get("CUTLASS_PATH")
    if root is None:
        try:
            import cutlass_library  # the nvidia-cutlass wheel ships its headers beside this package

            root = os.path.join(os.path.dirname(cutlass_library.__file__), "source")
        except ImportError:
            return []
    return [os.path.join(root, "include"), os.path.join(root, "tools", "util", "include")]


def cuda_sources(tuning: bool) -> list[str]:
    """csrc/cuda's translation units; the sm_90a tuning kernels (``*_tuning.cu``) only when ``tuning``."""
    sources = sorted(glob.glob("csrc/cuda/*.cu")) + sorted(glob.glob("csrc/cuda/*.cpp"))
    return [s for s in sources if tuning or not s.endswith("_tuning.cu")]


def _extension():
    cxx_flags = ["-O3"]  # torch.utils.cpp_extension picks the C++ standard torch was built with
    sources = sorted(glob.glob("csrc/*.cpp"))
    if not _want_cuda():
        return CppExtension("moe_core._C", sources, extra_compile_args={"cxx": cxx_flags + ["-fopenmp"]},
                            extra_link_args=["-fopenmp"])
    tuning = os.environ.get("MOE_CORE_SM90_TUNING") == "1"
    # MOE_CORE_CUDA_ARCHS="90a" (space-separated) builds fewer targets, e.g. for a quick build on one GPU.
    archs = os.environ.get("MOE_CORE_CUDA_ARCHS", "80 89 90a").split()
    nvcc_flags = [
        # NDEBUG: device-side assert() calls would make ptxas serialize the wgmma pipeline (warning C7510).
        "-O3", "-DNDEBUG", "--expt-relaxed-constexpr", "--expt-extended-lambda", "-lineinfo",
        f"--threads={len(archs)}",
    ] + [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    cutlass = _cutlass_include()
    macros = [("MOE_CORE_WITH_CUDA", "1")]
    # The Hopper kernels (csrc/cuda/grouped_gemm_sm90*) need CUTLASS and the sm_90a target; without either the
    # portable kernels serve every GPU.
    if "90a" in archs and cutlass:
        macros.append(("MOE_CORE_WITH_SM90", "1"))
        # CUTLASS's kernels then wait for and release programmatic dependents (PDL; see launch_dependent).
        macros.append(("CUTLASS_ENABLE_GDC_FOR_SM90", "1"))
        if tuning:
            macros.append(("MOE_CORE_SM90_TUNING", "1"))
    return CUDAExtension(
        "moe_core._C", sources + cuda_sources(tuning),
        include_dirs=[os.path.abspath("csrc")] + cutlass,
        define_macros=macros,
        extra_compile_args={"cxx": cxx_flags + ["-fopenmp"], "nvcc": nvcc_flags},
        extra_link_args=["-fopenmp"],
    )


# Guarded so that tools/check_cuda_compile.py can import _extension() without building; pip and
# setuptools.build_meta run this file as __main__.
if __name__ == "__main__":
    setup(
        name="moe_core",
        version="0.1.0",
        description="Empty-group-safe grouped GEMM, token dispatch and grouped MLP for Mixture-of-Experts training",
        packages=find_packages(include=["moe_core", "moe_core.*"]),
        python_requires=">=3.10",
        ext_modules=[_extension()],
        cmdclass={"build_ext": BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)},
    )
