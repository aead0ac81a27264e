"""CI's CUDA lane: which translation units tools/check_cuda_compile.py picks for a change (no nvcc needed)."""

import glob
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tool():
    path = os.path.join(ROOT, "tools", "check_cuda_compile.py")
    spec = importlib.util.spec_from_file_location("check_cuda_compile", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sources():
    units = sorted(glob.glob(os.path.join(ROOT, "csrc/cuda/*.cu")) + glob.glob(os.path.join(ROOT, "csrc/cuda/*.cpp")))
    return [os.path.relpath(unit, ROOT) for unit in units]


@pytest.fixture(autouse=True)
def _at_root(monkeypatch):
    monkeypatch.chdir(ROOT)


def test_one_changed_unit_compiles_alone(tool, sources):
    unit = next(s for s in sources if tool.family(s) == "sm90_ptrarray_wgrad")
    assert tool.changed_sources(sources, {unit}) == [unit]


def test_a_header_shared_by_several_families_compiles_everything(tool, sources):
    assert tool.changed_sources(sources, {"csrc/cuda/grouped_gemm_sm90_common.cuh"}) == sorted(sources)


def test_a_kernel_family_header_compiles_one_unit_per_pass(tool, sources):
    picked = tool.changed_sources(sources, {"csrc/cuda/grouped_gemm_sm90_rowtile.cuh"})
    assert len(picked) == 1 and tool.family(picked[0]) == "sm90_rowtile_fwd"
    picked = tool.changed_sources(sources, {"csrc/cuda/grouped_gemm_sm90_rowrange.cuh"})
    assert sorted(map(tool.family, picked)) == ["sm90_rowrange_wgrad", "sm90_rowrange_wgrad_accum"]
    picked = tool.changed_sources(sources, {"csrc/cuda/grouped_gemm_sm90_ptrarray.cuh"})
    assert sorted(map(tool.family, picked)) == ["sm90_ptrarray_fwd", "sm90_ptrarray_wgrad", "sm90_ptrarray_wgrad_accum"]


def test_build_files_compile_one_unit_per_family(tool, sources):
    picked = tool.changed_sources(sources, {"setup.py"})
    families = {tool.family(s) for s in sources}
    assert sorted(tool.family(s) for s in picked) == sorted(families)
    assert len(families) < len(sources)  # the negative control: fewer than everything


def test_unrelated_changes_compile_nothing(tool, sources):
    assert tool.changed_sources(sources, {"moe_core/moe/router.py", "README.md"}) == []
