// sm_90a grouped GEMM configuration: fp16, kForwardKN, tile 128x128 (see grouped_gemm_sm90.cuh).
#include "grouped_gemm_sm90.cuh"

MOE_CORE_SM90_INSTANTIATE(kFp16, kForwardKN, k128x128)
