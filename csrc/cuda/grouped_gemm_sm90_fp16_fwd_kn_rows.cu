// sm_90a row-tile forward: fp16, kForwardKN (see grouped_gemm_sm90_rows.cuh).
#include "grouped_gemm_sm90_rows.cuh"

MOE_CORE_SM90_INSTANTIATE_ROWS(kFp16, kForwardKN)
