// sm_90a grouped GEMM configuration: bf16, kForwardKN, tile 256x128_2x1 (see grouped_gemm_sm90.cuh).
#include "grouped_gemm_sm90.cuh"

MOE_CORE_SM90_INSTANTIATE(kBf16, kForwardKN, k256x128_2x1)
