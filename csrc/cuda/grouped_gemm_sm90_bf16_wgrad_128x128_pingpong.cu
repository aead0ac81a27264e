// sm_90a grouped GEMM configuration: bf16, kWgrad, tile 128x128_pingpong (see grouped_gemm_sm90.cuh).
#include "grouped_gemm_sm90.cuh"

MOE_CORE_SM90_INSTANTIATE(kBf16, kWgrad, k128x128_pingpong)
