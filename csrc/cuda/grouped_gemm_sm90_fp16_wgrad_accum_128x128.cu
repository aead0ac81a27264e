// sm_90a grouped GEMM configuration: fp16, kWgradAccum, tile 128x128 (see grouped_gemm_sm90.cuh).
#include "grouped_gemm_sm90.cuh"

MOE_CORE_SM90_INSTANTIATE(kFp16, kWgradAccum, k128x128)
