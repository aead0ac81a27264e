"""tools/gen_sm90_instances.py: the committed sm_90a instantiation files are exactly what its table generates, and
setup.py builds the tuning kernels only when asked."""

import importlib.util
import os
import shutil
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gen():
    return _load("gen_sm90_instances", os.path.join(ROOT, "tools", "gen_sm90_instances.py"))


def test_committed_files_match_the_table(gen):
    assert gen.problems() == [], "run python3 tools/gen_sm90_instances.py"


def test_check_names_missing_changed_and_stale_files(gen, tmp_path):
    # The negative control: a copy of the generated files with one missing, one edited and one the table lacks.
    for name in gen.expected_files():
        shutil.copy(os.path.join(gen.CUDA_DIR, name), tmp_path)
    names = sorted(n for n in gen.expected_files() if n.endswith(".cu"))
    os.remove(tmp_path / names[0])
    with open(tmp_path / names[1], "a") as f:
        f.write("// edited\n")
    (tmp_path / "grouped_gemm_sm90_ptrarray_fwd_kn_bf16_64x64x64_c1x1.cu").write_text(f"{gen.MARKER}\n")
    (tmp_path / "handwritten.cuh").write_text("// not generated\n")
    assert gen.problems(str(tmp_path)) == [f"missing: {names[0]}", f"differs: {names[1]}",
                                           "not in the table: grouped_gemm_sm90_ptrarray_fwd_kn_bf16_64x64x64_c1x1.cu"]
    gen.write(str(tmp_path))
    assert gen.problems(str(tmp_path)) == [] and (tmp_path / "handwritten.cuh").exists()


def test_every_file_names_its_family_and_instantiates_what_the_list_says(gen):
    files = gen.expected_files()
    listed = [line for line in files[gen.LIST_FILE].splitlines() if line.startswith("MOE_CORE_SM90_INSTANCE(")]
    units = {name: text for name, text in files.items() if name.endswith(".cu")}
    assert len(listed) == len(units)
    for name, text in units.items():
        family = name.split("_")[3]
        assert family in ("rowtile", "rowrange", "ptrarray")
        assert f'#include "grouped_gemm_sm90_{family}.cuh"' in text
        args = text.split("MOE_CORE_SM90_INSTANTIATE(")[1].split(")")[0]
        tuning = "true" if name.endswith("_tuning.cu") else "false"
        assert f"MOE_CORE_SM90_INSTANCE({args}, {tuning})" in listed


def test_tuning_kernels_are_built_only_when_asked(monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["setup.py"])
    setup_py = _load("moe_core_setup", os.path.join(ROOT, "setup.py"))
    default, tuning = setup_py.cuda_sources(tuning=False), setup_py.cuda_sources(tuning=True)
    left_out = sorted(set(tuning) - set(default))
    assert left_out and all(s.endswith("_tuning.cu") for s in left_out)
    assert not any(s.endswith("_tuning.cu") for s in default)
    assert "csrc/cuda/grouped_gemm_sm90_schedule.cpp" in default
