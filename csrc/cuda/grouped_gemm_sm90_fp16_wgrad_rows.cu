// sm_90a row-range wgrad: fp16 (see grouped_gemm_sm90_wgrad_rows.cuh).
#include "grouped_gemm_sm90_wgrad_rows.cuh"

MOE_CORE_SM90_INSTANTIATE_ROWS(kFp16, kWgrad)
