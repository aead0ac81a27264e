// Dispatch over the sm_90a grouped GEMM configurations (one per grouped_gemm_sm90_*.cu) and the tile heuristics.
#include <c10/util/Exception.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "grouped_gemm_sm90.h"

namespace moe_core::cuda::sm90 {
namespace {

const char* name(Tile t, Op op) {
  switch (t) {
    case Tile::k128x256: return "128x256x64 cooperative cluster 1x2";
    case Tile::k128x128: return "128x128x64 cooperative cluster 1x1";
    case Tile::k128x256_2x1: return "128x256x64 cooperative cluster 2x1";
    case Tile::k128x128_pingpong: return "128x128x64 pingpong cluster 1x2";
    case Tile::k256x128_2x1: return "256x128x64 cooperative cluster 2x1";
    case Tile::kRows128x256:
      return op == Op::kWgrad ? "128x256x32 cooperative cluster 2x1 row ranges" : "128x256x64 cooperative row tiles";
  }
  return "?";
}

const char* name(Op op) {
  switch (op) {
    case Op::kForwardKN: return "forward (weight [E, K, N])";
    case Op::kForwardNK: return "forward (weight [E, N, K])";
    case Op::kWgrad: return "wgrad";
    case Op::kWgradAccum: return "wgrad accumulate";
  }
  return "?";
}

bool debug() {
  const char* flag = std::getenv("MOE_CORE_GEMM_DEBUG");
  return flag != nullptr && std::strcmp(flag, "0") != 0;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Output tiles of `p` for a BM x BN tile, from host-known numbers only: forward rows split into E groups waste
// about half a row tile each; wgrad counts every expert as non-empty.
int64_t tiles(const Problem& p, int64_t bm, int64_t bn) {
  const bool forward = p.op == Op::kForwardKN || p.op == Op::kForwardNK;
  const int64_t row_tiles = forward ? ceil_div(p.m, bm) + p.num_experts / 2 : p.num_experts * ceil_div(p.m, bm);
  return row_tiles * ceil_div(p.n, bn);
}

template <Dtype D, Op O, Tile T>
void run(const Problem& p, void* workspace, int sm_count, cudaStream_t stream, size_t* bytes) {
  if (bytes) *bytes = detail::workspace_bytes<D, O, T>(p, sm_count);
  else detail::launch<D, O, T>(p, workspace, sm_count, stream);
}

// The tuning candidates are built for bf16 forward and wgrad only, the row-tile kernels for bf16 and fp16 (see Tile).
constexpr bool candidates_built(Dtype d, Op op) { return d == Dtype::kBf16 && op != Op::kWgradAccum; }
constexpr bool rows_built(Dtype, Op op) { return op != Op::kWgradAccum; }

template <Dtype D, Op O>
void dispatch_tile(const Problem& p, void* workspace, int sm_count, cudaStream_t stream, size_t* bytes) {
  if constexpr (rows_built(D, O)) {
    if (p.schedule.tile == Tile::kRows128x256) {
      return run<D, O, Tile::kRows128x256>(p, workspace, sm_count, stream, bytes);
    }
  }
  if constexpr (candidates_built(D, O)) {
    switch (p.schedule.tile) {
      case Tile::k128x256_2x1: return run<D, O, Tile::k128x256_2x1>(p, workspace, sm_count, stream, bytes);
      case Tile::k128x128_pingpong: return run<D, O, Tile::k128x128_pingpong>(p, workspace, sm_count, stream, bytes);
      case Tile::k256x128_2x1: return run<D, O, Tile::k256x128_2x1>(p, workspace, sm_count, stream, bytes);
      default: break;
    }
  }
  if (p.schedule.tile == Tile::k128x128) return run<D, O, Tile::k128x128>(p, workspace, sm_count, stream, bytes);
  run<D, O, Tile::k128x256>(p, workspace, sm_count, stream, bytes);
}

template <Dtype D>
void dispatch_op(const Problem& p, void* workspace, int sm_count, cudaStream_t stream, size_t* bytes) {
  switch (p.op) {
    case Op::kForwardKN: return dispatch_tile<D, Op::kForwardKN>(p, workspace, sm_count, stream, bytes);
    case Op::kForwardNK: return dispatch_tile<D, Op::kForwardNK>(p, workspace, sm_count, stream, bytes);
    case Op::kWgrad: return dispatch_tile<D, Op::kWgrad>(p, workspace, sm_count, stream, bytes);
    case Op::kWgradAccum: return dispatch_tile<D, Op::kWgradAccum>(p, workspace, sm_count, stream, bytes);
  }
}

// bytes != nullptr: report the workspace size; else launch.
void dispatch(const Problem& p, void* workspace, int sm_count, cudaStream_t stream, size_t* bytes) {
#if defined(MOE_CORE_WITH_SM90)
  if (p.dtype == Dtype::kBf16) dispatch_op<Dtype::kBf16>(p, workspace, sm_count, stream, bytes);
  else dispatch_op<Dtype::kFp16>(p, workspace, sm_count, stream, bytes);
#else
  TORCH_CHECK(false, "grouped_gemm: this build has no sm_90a kernels");
#endif
}

}  // namespace

bool compiled() {
#if defined(MOE_CORE_WITH_SM90)
  return true;
#else
  return false;
#endif
}

Schedule pick_schedule(const Problem& p, int sm_count) {
  const bool candidates = candidates_built(p.dtype, p.op);
  const bool forward = p.op == Op::kForwardKN || p.op == Op::kForwardNK;
  // The 2x1 cluster multicasts the 256-wide B tile to two row tiles (64 KiB of L2 reads per pair and k-step
  // against 80 KiB for 1x2), but pads every expert to an even count of row tiles: take it only from about four
  // row tiles per expert (T / E >= 512). The 1x2 cluster pairs column tiles instead, so an odd count of 256-wide
  // column tiles idles some pairs: take the narrow tile then, and below two waves of wide tiles, where it
  // balances the SMs better.
  const bool even_pairs = ceil_div(p.n, 256) % 2 == 0;
  const bool many_tiles = tiles(p, 128, 256) >= 2 * sm_count;
  Schedule s;
  s.tile = even_pairs && many_tiles ? Tile::k128x256 : Tile::k128x128;
  // Wgrad rows are weight rows (m = K or N of the weight), whole 256-row pairs in every model shape, so the 2x1
  // cluster pads nothing there.
  const bool wide_groups = forward ? p.m >= 512 * p.num_experts : ceil_div(p.m, 128) % 2 == 0;
  if (candidates && many_tiles && wide_groups) s.tile = Tile::k128x256_2x1;
  // Walking along M keeps a B tile (a weight slice) hot while the group's rows stream past it, but re-reads
  // the group's A rows for every column of tiles: right while A_e (T/E rows of K) is smaller than B_e (K x N),
  // as in every benchmark shape. Past that (few experts, many rows each: T/E > N) A_e outgrows L2 and the
  // walk along N, which keeps a row block hot instead, reads each operand about once. The wgrad's operands
  // share the reduction (the expert's rows), so A_e (m of them) outweighs B_e (n) when m > n: walk along N then,
  // or the larger operand comes from DRAM again for every column of tiles (docs/kernels.md). The row-range wgrad
  // walks its own way (it runs where an expert's operands fit in L2).
  s.along_n = forward ? p.m > p.n * p.num_experts : p.m > p.n;
  // bf16/fp16 forward and dgrad: the row-tile kernel (static TMA descriptors instead of per-group ones) wherever
  // it can run. It needs rows (T > 0, T < 2^31: CUTLASS's int problem shape) and expert and column-tile indices
  // that fit its work-tile fields (15 bits each, beside the half-tile flag).
  // bf16/fp16 wgrad: the row-range kernel, the same idea with each expert's rows as the reduction (T > 0: its
  // descriptors cover x's rows; T = 0 keeps the pointer-array kernel, whose prepare kernel streams the zeros).
  // It walks each column of an expert's tiles down the rows of d[e], so the expert's rows of x (m wide) come
  // from L2 for every column after the first only while they fit there: take it while the mean expert's rows
  // of x are at most 32 MiB (a bound by that reasoning, not a measured crossover); past it the pointer-array
  // kernel, whose walk can run along N, keeps the case.
  const bool rows_fit = forward ? p.m > 0 && p.m < (int64_t{1} << 31) && p.num_experts < 32768 &&
                                      ceil_div(p.n, 256) < 32768
                                : p.num_rows > 0 && p.num_rows < (int64_t{1} << 31);
  constexpr int64_t kL2RowsBytes = int64_t{32} << 20;
  const bool rows_pay = forward || p.num_rows / p.num_experts * p.m * 2 <= kL2RowsBytes;  // 16-bit rows
  if (rows_built(p.dtype, p.op) && rows_fit && rows_pay) s.tile = Tile::kRows128x256;
  if (const char* forced = std::getenv("MOE_CORE_GEMM_TILE")) {
    if (std::strcmp(forced, "128x256") == 0) s.tile = Tile::k128x256;
    else if (std::strcmp(forced, "128x128") == 0) s.tile = Tile::k128x128;
    else if (std::strcmp(forced, "128x256c21") == 0) s.tile = candidates ? Tile::k128x256_2x1 : Tile::k128x256;
    else if (std::strcmp(forced, "128x128pp") == 0) s.tile = candidates ? Tile::k128x128_pingpong : Tile::k128x128;
    else if (std::strcmp(forced, "256x128c21") == 0) s.tile = candidates ? Tile::k256x128_2x1 : Tile::k128x256;
    else if (std::strcmp(forced, "rows") == 0 && rows_built(p.dtype, p.op) && rows_fit) s.tile = Tile::kRows128x256;
  }
  if (const char* forced = std::getenv("MOE_CORE_GEMM_RASTER")) s.along_n = std::strcmp(forced, "n") == 0;
  if (const char* forced = std::getenv("MOE_CORE_GEMM_SWIZZLE")) {
    const int swizzle = std::atoi(forced);
    if (swizzle == 1 || swizzle == 2 || swizzle == 4 || swizzle == 8) s.swizzle = swizzle;
  }
  if (debug()) {
    std::fprintf(stderr, "[moe_core] grouped_gemm sm90 %s: E=%lld m=%lld n=%lld k=%lld -> tile %s, raster along %s, "
                 "swizzle %d\n", name(p.op), static_cast<long long>(p.num_experts), static_cast<long long>(p.m),
                 static_cast<long long>(p.n), static_cast<long long>(p.k), name(s.tile, p.op), s.along_n ? "N" : "M",
                 s.swizzle);
  }
  return s;
}

size_t workspace_bytes(const Problem& p, int sm_count) {
  size_t bytes = 0;
  dispatch(p, nullptr, sm_count, nullptr, &bytes);
  return bytes;
}

void launch(const Problem& p, void* workspace, int sm_count, cudaStream_t stream) {
  dispatch(p, workspace, sm_count, stream, nullptr);
}

}  // namespace moe_core::cuda::sm90
