// Hopper (sm_90a) grouped GEMM on CUTLASS 3.x kernels, behind a CUTLASS-free interface for the op layer
// (grouped_gemm_cuda.cpp): the pointer-array kernels (grouped_gemm_sm90.cuh), the row-tile forward
// (grouped_gemm_sm90_rows.cuh) and the row-range wgrad (grouped_gemm_sm90_wgrad_rows.cuh).
//
// Sync-free, two launches per op: one small kernel turns the device-side counts into what the GEMM reads
// (CUTLASS's per-group problem shapes, pointers and strides, or row offsets and a work list) and zero-fills what
// no GEMM tile writes, then the persistent CUTLASS kernel reads them; the host passes only E, shapes and
// pointers, never the counts.
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

// CTA tile, schedule and cluster of the persistent kernel (see pick_schedule in grouped_gemm_sm90.cu). The first
// two are built for every dtype and op, the next three for bf16 forward and wgrad only (tuning candidates), the
// last for bf16 and fp16 forward and wgrad.
enum class Tile {
  k128x256,            // 128x256x64, 2 consumer warpgroups on one tile (cooperative), cluster 1x2: the A tile
                       // (an expert's rows) is multicast to two column tiles
  k128x128,            // 128x128x64, cooperative, cluster 1x1: odd column-tile counts, few tiles
  k128x256_2x1,        // 128x256x64, cooperative, cluster 2x1: the B tile is multicast to two row tiles
  k128x128_pingpong,   // 128x128x64, 2 consumer warpgroups on alternate tiles (one's epilogue overlaps the
                       // other's MMAs), cluster 1x2
  k256x128_2x1,        // 256x128x64, cooperative (each warpgroup 128 rows), cluster 2x1: a B tile serves 512
                       // rows, half the weight traffic into the SMs of 128x256_2x1 for the same tile area
  kRows128x256,        // bf16/fp16 default for T > 0: 128x256x64 cooperative on CUTLASS's plain kernel with static
                       // TMA descriptors over all of x, row tiles for the forward/dgrad
                       // (grouped_gemm_sm90_rows.cuh), each expert's row range for wgrad
                       // (grouped_gemm_sm90_wgrad_rows.cuh)
};

// How the persistent kernel walks each group's output tiles (CUTLASS's group tile scheduler): along M (down
// a column of tiles, so a B tile, e.g. a weight slice, is reused while hot) or along N, in strips of
// `swizzle` (1, 2, 4 or 8) tiles across the other dimension.
struct Schedule {
  Tile tile = Tile::k128x256;
  bool along_n = false;
  int swizzle = 1;
};

// One grouped product in element units, all tensors contiguous and 16-byte aligned.
// Forward: a = x [T, K], b = weight, d = y [T, N]; m = T, n = N, k = K.
// Wgrad: a = the operand whose columns become d[e]'s rows ([T, m] row-major), b = [T, n] row-major,
// d = [E, m, n]; k unused (each expert's reduction length comes from the counts).
// The counts stay on the device: the prepare kernel turns them into row ranges (negative counts count as
// empty, each count is clamped to num_rows before the prefix sums, which cannot wrap, and ranges are clamped
// to [0, num_rows]: bad counts can mis-assign rows, never touch memory outside).
struct Problem {
  Dtype dtype = Dtype::kBf16;
  Op op = Op::kForwardKN;
  Schedule schedule;
  const void* a = nullptr;
  const void* b = nullptr;
  void* d = nullptr;
  int64_t m = 0, n = 0, k = 0;
  int64_t num_experts = 0;
  int64_t num_rows = 0;                 // T, the rows the counts split
  const void* counts = nullptr;         // tokens_per_expert [E] on the device, int32 or int64
  bool counts_int32 = false;
};

// True when this build has the sm_90a kernels (the caller checks that the GPU is compute capability 9.0).
bool compiled();

// The schedule the heuristics pick for `p` from host-known numbers (E, m/n/k, the SM count; never the
// counts). For tuning, MOE_CORE_GEMM_TILE=128x256|128x128|128x256c21|128x128pp|256x128c21|rows overrides the tile
// (one not built for the dtype and op falls back to 128x256 or 128x128), MOE_CORE_GEMM_RASTER=m|n and
// MOE_CORE_GEMM_SWIZZLE=1|2|4|8 the walk; MOE_CORE_GEMM_DEBUG=1 prints the choice.
Schedule pick_schedule(const Problem& p, int sm_count);

// Bytes of device workspace `launch` needs (group arrays and CUTLASS's own workspace).
size_t workspace_bytes(const Problem& p, int sm_count);

// Enqueues the prepare kernel and the grouped GEMM on `stream`; workspace: workspace_bytes(p) bytes, 256-byte
// aligned, from the caching allocator. Throws (TORCH_CHECK) if CUTLASS rejects the problem.
void launch(const Problem& p, void* workspace, int sm_count, cudaStream_t stream);

namespace detail {
// One configuration's entry points, defined in grouped_gemm_sm90.cuh and instantiated by one .cu file each.
template <Dtype D, Op O, Tile T>
size_t workspace_bytes(const Problem& p, int sm_count);
template <Dtype D, Op O, Tile T>
void launch(const Problem& p, void* workspace, int sm_count, cudaStream_t stream);
}  // namespace detail

}  // namespace moe_core::cuda::sm90
