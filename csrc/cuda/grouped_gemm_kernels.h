// Launchers of the CUDA grouped GEMM kernels (grouped_gemm_kernels.cu); the op layer is grouped_gemm_cuda.cpp.
//
// Every kernel reads the per-expert row offsets from device memory (written by launch_row_offsets), so no
// launch depends on the counts' values and every call is CUDA-graph capturable.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace moe_core::cuda {

enum class GemmKind {
  kForward,      // y[rows of e] = x_e @ B_e; tiles walk each expert's rows
  kWgrad,        // dw[e] = A_e^T-style reduction over each expert's rows; empty expert -> exact zeros
  kWgradAccum,   // main_grad[e] += the same in fp32; empty expert -> untouched
};

// One grouped product in element units. Forward: a = x [T, K] row-major, b = weight (row-major [K, N] per
// expert, or column-major i.e. [N, K] rows when !b_row_major), c = y [T, N]. Wgrad: a is the operand whose
// columns become dw's rows, read column-major (a[r * lda + m]); b row-major (b[r * ldb + n]); c = dw [E, m, n].
struct GroupedGemmArgs {
  const void* a = nullptr;
  const void* b = nullptr;
  void* c = nullptr;
  int64_t lda = 0, ldb = 0;
  int64_t b_expert_stride = 0;  // forward: elements between two experts' weights
  int64_t m = 0, n = 0, k = 0;  // forward: m = T rows, k = K; wgrad: dw[e] is [m, n], k unused
  int64_t num_experts = 0;
  int64_t row_tile_bound = 0;  // forward: row tiles launched (set by the launcher)
  const int64_t* row_offsets = nullptr;   // [E + 1] on the device
  const int64_t* tile_offsets = nullptr;  // [E + 1] on the device, forward only
  bool b_row_major = true;
  bool vec_a = false, vec_b = false;      // 16-byte vector loads are legal (aligned base, ld and strides)
};

// Rows per forward output tile for `dtype`; launch_row_offsets counts tiles in these units.
int64_t forward_tile_rows(at::ScalarType dtype);

// Fills workspace [2E + 2] int64: row offsets [E + 1] (clamped to [0, num_rows]) then forward tile offsets
// [E + 1] (no tile covers the rows past the counts' sum). counts: [E] int32/int64.
void launch_row_offsets(const at::Tensor& counts, const at::Tensor& workspace, int64_t num_rows,
                        int64_t tile_rows, cudaStream_t stream);

void launch_grouped_gemm(at::ScalarType dtype, GemmKind kind, const GroupedGemmArgs& args, cudaStream_t stream);

}  // namespace moe_core::cuda
