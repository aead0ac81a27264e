// The sm_90a grouped GEMM's problem description and schedule choice, free of CUDA and CUTLASS: the op layer
// (grouped_gemm_cuda.cpp) builds a Problem, pick_schedule (grouped_gemm_sm90_schedule.cpp) names the kernel and
// its walk, and grouped_gemm_sm90.h launches it. Pure host code, so tests compile it without a GPU.
#pragma once

#include <cstdint>
#include <string>

namespace moe_core::cuda::sm90 {

enum class Dtype { kBf16, kFp16 };

enum class Op {
  kForwardKN,   // y_e = x_e @ w_e, w_e [K, N] row-major (weight [E, K, N])
  kForwardNK,   // y_e = x_e @ w_e^T, w_e [N, K] row-major (weight [E, N, K], trans_weight)
  kWgrad,       // d[e] = a_e^T @ b_e over each expert's rows; empty expert -> exact zeros
  kWgradAccum,  // fp32 d[e] += a_e^T @ b_e; empty expert -> untouched
  kWgradFp32,   // fp32 d[e] = a_e^T @ b_e (the float32 weight's gradient under autocast); empty -> exact zeros
};

// The kernel families (docs/kernels.md).
enum class Family {
  kRowTile,   // forward/dgrad: CUTLASS's plain kernel over static TMA descriptors of all of x, row tiles listed
              // on the device (grouped_gemm_sm90_rowtile.cuh)
  kRowRange,  // wgrad: the same with each expert's rows as the reduction (grouped_gemm_sm90_rowrange.cuh)
  kPtrArray,  // CUTLASS's pointer-array grouped GEMM, per-group descriptors written on the device
              // (grouped_gemm_sm90_ptrarray.cuh)
};

// The consumer warpgroups: both on one tile (cooperative) or on alternate tiles (pingpong: one's epilogue
// overlaps the other's MMAs).
enum class Mma { kCooperative, kPingpong };

// The CTA tile: m x n outputs, reduced in k-deep k-tiles.
struct CtaTile {
  int m = 0, n = 0, k = 0;
  friend constexpr bool operator==(const CtaTile& a, const CtaTile& b) {
    return a.m == b.m && a.n == b.n && a.k == b.k;
  }
  friend constexpr bool operator!=(const CtaTile& a, const CtaTile& b) { return !(a == b); }
};

// CTAs per cluster along M (they share, by TMA multicast, the B tile) and along N (they share the A tile).
struct ClusterDims {
  int m = 1, n = 1;
  friend constexpr bool operator==(const ClusterDims& a, const ClusterDims& b) { return a.m == b.m && a.n == b.n; }
  friend constexpr bool operator!=(const ClusterDims& a, const ClusterDims& b) { return !(a == b); }
};

// What one instantiation compiles. The instantiations built, for which dtypes and ops, are listed in
// grouped_gemm_sm90_instances.inc, which tools/gen_sm90_instances.py writes.
struct KernelConfig {
  Family family = Family::kPtrArray;
  CtaTile tile;
  ClusterDims cluster;
  Mma mma = Mma::kCooperative;
  friend constexpr bool operator==(const KernelConfig& a, const KernelConfig& b) {
    return a.family == b.family && a.tile == b.tile && a.cluster == b.cluster && a.mma == b.mma;
  }
  friend constexpr bool operator!=(const KernelConfig& a, const KernelConfig& b) { return !(a == b); }
};

// A KernelConfig as a type (its ::value), the template argument of a kernel's entry points: the code must
// build as C++17 (torch's extension builder picks the standard torch was built with), where a class-type value
// cannot be a template parameter.
template <Family F, int BM, int BN, int BK, int CM, int CN, Mma M>
struct ConfigType {
  static constexpr KernelConfig value{F, {BM, BN, BK}, {CM, CN}, M};
};

// The kernels pick_schedule names.
inline constexpr KernelConfig kRowTile{Family::kRowTile, {128, 256, 64}, {1, 1}, Mma::kCooperative};
inline constexpr KernelConfig kRowRange{Family::kRowRange, {128, 256, 32}, {2, 1}, Mma::kCooperative};
inline constexpr KernelConfig kPtrArray128x256{Family::kPtrArray, {128, 256, 64}, {1, 2}, Mma::kCooperative};
inline constexpr KernelConfig kPtrArray128x128{Family::kPtrArray, {128, 128, 64}, {1, 1}, Mma::kCooperative};
inline constexpr KernelConfig kPtrArray128x256c21{Family::kPtrArray, {128, 256, 64}, {2, 1}, Mma::kCooperative};
inline constexpr KernelConfig kPtrArray128x128pp{Family::kPtrArray, {128, 128, 64}, {1, 2}, Mma::kPingpong};
inline constexpr KernelConfig kPtrArray256x128c21{Family::kPtrArray, {256, 128, 64}, {2, 1}, Mma::kCooperative};

// How the pointer-array kernel walks each group's output tiles (CUTLASS's group tile scheduler): along M (down
// a column of tiles, so a B tile, e.g. a weight slice, is reused while hot) or along N, in strips of `swizzle`
// (1, 2, 4 or 8) tiles across the other dimension. The row-tile and row-range kernels walk their own way.
enum class Raster { kAlongM, kAlongN };

struct Schedule {
  KernelConfig kernel = kPtrArray128x256;
  Raster raster = Raster::kAlongM;
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

// Whether grouped_gemm_sm90_instances.inc lists `kernel` for `dtype` and `op`, and whether it is a tuning
// kernel: one the heuristics never pick, built only with MOE_CORE_SM90_TUNING (setup.py).
bool listed(Dtype dtype, Op op, const KernelConfig& kernel, bool* tuning = nullptr);

// Whether this build has `kernel` for `dtype` and `op`: listed, and not a tuning kernel left out.
bool built(Dtype dtype, Op op, const KernelConfig& kernel);

// The heuristics' schedule for `p` from host-known numbers (E, T, m/n/k, the SM count; never the counts).
Schedule pick_default(const Problem& p, int sm_count);

// pick_default with the tuning overrides: MOE_CORE_GEMM_TILE=128x256|128x128|128x256c21|128x128pp|256x128c21|rows
// forces a kernel (one not listed for the dtype and op falls back to a pointer-array tile, `rows` applies
// only where the row kernels fit; a tuning kernel this build left out stays, and launch raises),
// MOE_CORE_GEMM_RASTER=m|n and MOE_CORE_GEMM_SWIZZLE=1|2|4|8 the walk; MOE_CORE_GEMM_DEBUG=1 prints the choice.
Schedule pick_schedule(const Problem& p, int sm_count);

// E.g. "pointer-array 128x256x64 cooperative cluster 1x2"; the walk follows for the pointer-array kernel.
std::string describe(const KernelConfig& kernel);
std::string describe(const Schedule& schedule);
const char* describe(Op op);

}  // namespace moe_core::cuda::sm90
