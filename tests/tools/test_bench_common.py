"""The benchmarks' kernel categories: kernel names as CUDA profiles spell them land in the right bucket, template
arguments never decide it, and the first matching category wins."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from _bench_common import ATTENTION, GEMM, OPTIMIZER, breakdown, kernel_head  # noqa: E402

PRETRAIN = {"attention": ATTENTION, "gemm": GEMM, "optimizer": OPTIMIZER}
KERNELS = {
    "void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cute::tuple<int, int, int, int>>>(T1::Params)":
        "gemm",
    "nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NTN": "gemm",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off": "gemm",
    "void moe_core::cuda::(anonymous namespace)::wmma_grouped_gemm<__nv_bfloat16>(moe_core::cuda::GroupedGemmArgs)":
        "gemm",
    "aten::mm": "gemm",
    "aten::_grouped_mm": "gemm",
    # cutlass and gemm only in template arguments: not a GEMM.
    "void moe_core::cuda::sm90::prepare_groups<moe_core::cuda::sm90::Config<cutlass::bfloat16_t>, int>"
    "(moe_core::cuda::sm90::GroupArrays<cutlass::gemm::GemmShape>, moe_core::cuda::sm90::Problem)": "rest",
    # A grouped GEMM's setup kernel: "gemm" in its own name, yet no GEMM.
    "void at::cuda::detail::prepare_grouped_gemm_data<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, float, "
    "cute::tuple<int, int, int>>(__nv_bfloat16*, __nv_bfloat16*)": "rest",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
    "FusedAdamMathFunctor<float, 4>>(at::native::TensorListMetadata<4>)": "optimizer",
    "aten::_foreach_mul_": "optimizer",
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>, true>(Flash_fwd_params)":
        "attention",
    # A GEMM pattern in the name, yet attention: the order of the categories decides.
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_cga1x1x1_kernel0_0":
        "attention",
    "fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t>::Params)":
        "attention",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, "
    "at::detail::Array<char*, 3>>(int, at::native::CUDAFunctor_add<c10::BFloat16>, at::detail::Array<char*, 3>)":
        "rest",
    "triton_poi_fused_mul_silu_0": "rest",
}


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_lands_in_its_category(name):
    split = breakdown({name: 1.5}, PRETRAIN)
    assert split["ranked"] == [dict(name=name, ms=1.5, category=KERNELS[name])]
    assert split["ms"][KERNELS[name]] == 1.5 and split["total_ms"] == 1.5


def test_kernel_head_drops_void_namespaces_templates_and_parameters():
    assert kernel_head("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::Foo<float>>(int)") == \
        "at::native::::multi_tensor_apply_kernel"
    assert kernel_head("nvjet_tst_64x8_64x16_4x1_v_bz_TNN") == "nvjet_tst_64x8_64x16_4x1_v_bz_TNN"


def test_breakdown_sums_by_category_and_ranks_longest_first():
    kernels = {"aten::mm": 2.0, "aten::add": 0.5, "aten::_grouped_mm": 1.0, "aten::mul": 0.25}
    split = breakdown(kernels, {"gemm": GEMM})
    assert split["ms"] == {"gemm": 3.0, "rest": 0.75}
    assert split["total_ms"] == 3.75
    assert [k["name"] for k in split["ranked"]] == ["aten::mm", "aten::_grouped_mm", "aten::add", "aten::mul"]
