// Hopper (sm_90a) grouped GEMM on CUTLASS 3.x's pointer-array kernels (grouped_gemm_sm90.cuh), behind a
// CUTLASS-free interface for the op layer (grouped_gemm_cuda.cpp).
//
// Sync-free: one small prepare kernel turns the device-side row offsets into CUTLASS's per-group problem
// shapes, pointers and strides (and zero-fills what no GEMM tile writes), then the persistent CUTLASS kernel
// reads them; the host passes only E, shapes and pointers, never the counts.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace moe_core::cuda::sm90 {

enum class Dtype { kBf16, kFp16 };

enum class Op {
  kForwardKN,   // y_e = x_e @ w_e, w_e [K, N] row-major (weight [E, K, N])
  kForwardNK,   // y_e = x_e @ w_e^T, w_e [N, K] row-major (weight [E, N, K], trans_weight)
  kWgrad,       // d[e] = a_e^T @ b_e over each expert's rows; empty expert -> exact zeros
  kWgradAccum,  // fp32 d[e] += a_e^T @ b_e; empty expert -> untouched
};

// CTA tile and cluster of the persistent kernel (see pick_tile in grouped_gemm_sm90.cu).
enum class Tile {
  k128x256,  // 128x256x64, 2 consumer warpgroups (cooperative), cluster 1x2: large groups
  k128x128,  // 128x128x64, cooperative, cluster 1x1: few tiles per SM (small or few groups)
};

// One grouped product in element units, all tensors contiguous and 16-byte aligned.
// Forward: a = x [T, K], b = weight, d = y [T, N]; m = T, n = N, k = K.
// Wgrad: a = the operand whose columns become d[e]'s rows ([T, m] row-major), b = [T, n] row-major,
// d = [E, m, n]; k = T (unused beyond bounds).
struct Problem {
  Dtype dtype = Dtype::kBf16;
  Op op = Op::kForwardKN;
  Tile tile = Tile::k128x256;
  const void* a = nullptr;
  const void* b = nullptr;
  void* d = nullptr;
  int64_t m = 0, n = 0, k = 0;
  int64_t num_experts = 0;
  const int64_t* row_offsets = nullptr;  // [E + 1] on the device, clamped to [0, T]
};

// True when this build has the sm_90a kernels and `device` is a Hopper GPU (compute capability 9.0).
bool available(int device);

// The tile the heuristics pick for `p` (E, m/n/k and the SM count); MOE_CORE_GEMM_DEBUG=1 prints it.
Tile pick_tile(const Problem& p, int sm_count);

// Bytes of device workspace `launch` needs (group arrays and CUTLASS's own workspace).
size_t workspace_bytes(const Problem& p, int sm_count);

// Enqueues the prepare kernel and the grouped GEMM on `stream`; workspace: workspace_bytes(p) bytes, 256-byte
// aligned, from the caching allocator. Throws (TORCH_CHECK) if CUTLASS rejects the problem.
void launch(const Problem& p, void* workspace, int sm_count, cudaStream_t stream);

}  // namespace moe_core::cuda::sm90
