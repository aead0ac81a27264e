// pick_schedule: which sm_90a kernel runs a grouped product, and how it walks, from host-known numbers only.
#include "grouped_gemm_sm90_schedule.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace moe_core::cuda::sm90 {
namespace {

struct Instance {
  Dtype dtype;
  Op op;
  KernelConfig kernel;
  bool tuning;
};

constexpr Instance kInstances[] = {
#define MOE_CORE_SM90_INSTANCE(DTYPE, OP, FAMILY, BM, BN, BK, CM, CN, MMA, TUNING) \
  {Dtype::DTYPE, Op::OP, {Family::FAMILY, {BM, BN, BK}, {CM, CN}, Mma::MMA}, TUNING},
#include "grouped_gemm_sm90_instances.inc"
#undef MOE_CORE_SM90_INSTANCE
};

#if defined(MOE_CORE_SM90_TUNING)
constexpr bool kTuningBuilt = true;
#else
constexpr bool kTuningBuilt = false;
#endif

bool is_forward(Op op) { return op == Op::kForwardKN || op == Op::kForwardNK; }

bool debug() {
  const char* flag = std::getenv("MOE_CORE_GEMM_DEBUG");
  return flag != nullptr && std::strcmp(flag, "0") != 0;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Output tiles of `p` for a BM x BN tile, from host-known numbers only: forward rows split into E groups waste
// about half a row tile each; wgrad counts every expert as non-empty.
int64_t tiles(const Problem& p, int64_t bm, int64_t bn) {
  const int64_t row_tiles = is_forward(p.op) ? ceil_div(p.m, bm) + p.num_experts / 2
                                             : p.num_experts * ceil_div(p.m, bm);
  return row_tiles * ceil_div(p.n, bn);
}

// The row kernel of an op: row tiles for the forward and dgrad, row ranges for the wgrads.
KernelConfig rows_kernel(Op op) { return is_forward(op) ? kRowTile : kRowRange; }

// Whether the row kernel can take `p`. The row tiles need rows (T > 0, T < 2^31: CUTLASS's int problem shape)
// and expert and column-tile indices that fit their work-tile fields (15 bits each, beside the half-tile flag);
// the row ranges need rows too (T > 0: their descriptors cover x's rows; T = 0 keeps the pointer-array kernel,
// whose prepare kernel streams the zeros).
bool rows_fit(const Problem& p) {
  if (is_forward(p.op)) {
    return p.m > 0 && p.m < (int64_t{1} << 31) && p.num_experts < 32768 && ceil_div(p.n, 256) < 32768;
  }
  return p.num_rows > 0 && p.num_rows < (int64_t{1} << 31);
}

// MOE_CORE_GEMM_TILE's values for the pointer-array kernels, and what runs where the dtype and op lack one.
struct Forced {
  const char* name;
  KernelConfig kernel;
  KernelConfig fallback;
};
constexpr Forced kForced[] = {
    {"128x256", kPtrArray128x256, kPtrArray128x256},
    {"128x128", kPtrArray128x128, kPtrArray128x128},
    {"128x256c21", kPtrArray128x256c21, kPtrArray128x256},
    {"128x128pp", kPtrArray128x128pp, kPtrArray128x128},
    {"256x128c21", kPtrArray256x128c21, kPtrArray128x256},
};

const char* name(Family family) {
  switch (family) {
    case Family::kRowTile: return "row-tile";
    case Family::kRowRange: return "row-range";
    case Family::kPtrArray: return "pointer-array";
  }
  return "?";
}

}  // namespace

bool listed(Dtype dtype, Op op, const KernelConfig& kernel, bool* tuning) {
  for (const Instance& instance : kInstances) {
    if (instance.dtype == dtype && instance.op == op && instance.kernel == kernel) {
      if (tuning != nullptr) *tuning = instance.tuning;
      return true;
    }
  }
  return false;
}

bool built(Dtype dtype, Op op, const KernelConfig& kernel) {
  bool tuning = false;
  return listed(dtype, op, kernel, &tuning) && (!tuning || kTuningBuilt);
}

Schedule pick_default(const Problem& p, int sm_count) {
  const bool forward = is_forward(p.op);
  // The 2x1 cluster multicasts the 256-wide B tile to two row tiles (64 KiB of L2 reads per pair and k-step
  // against 80 KiB for 1x2), but pads every expert to an even count of row tiles: take it only from about four
  // row tiles per expert (T / E >= 512). The 1x2 cluster pairs column tiles instead, so an odd count of 256-wide
  // column tiles idles some pairs: take the narrow tile then, and below two waves of wide tiles, where it
  // balances the SMs better.
  const bool even_pairs = ceil_div(p.n, 256) % 2 == 0;
  const bool many_tiles = tiles(p, 128, 256) >= 2 * sm_count;
  Schedule s;
  s.kernel = even_pairs && many_tiles ? kPtrArray128x256 : kPtrArray128x128;
  // Wgrad rows are weight rows (m = K or N of the weight), whole 256-row pairs in every model shape, so the 2x1
  // cluster pads nothing there.
  const bool wide_groups = forward ? p.m >= 512 * p.num_experts : ceil_div(p.m, 128) % 2 == 0;
  if (built(p.dtype, p.op, kPtrArray128x256c21) && many_tiles && wide_groups) s.kernel = kPtrArray128x256c21;
  // Walking along M keeps a B tile (a weight slice) hot while the group's rows stream past it, but re-reads
  // the group's A rows for every column of tiles: right while A_e (T/E rows of K) is smaller than B_e (K x N),
  // as in every benchmark shape. Past that (few experts, many rows each: T/E > N) A_e outgrows L2 and the
  // walk along N, which keeps a row block hot instead, reads each operand about once. The wgrad's operands
  // share the reduction (the expert's rows), so A_e (m of them) outweighs B_e (n) when m > n: walk along N then,
  // or the larger operand comes from DRAM again for every column of tiles (docs/kernels.md).
  s.raster = (forward ? p.m > p.n * p.num_experts : p.m > p.n) ? Raster::kAlongN : Raster::kAlongM;
  // bf16/fp16 forward and dgrad: the row-tile kernel (static TMA descriptors instead of per-group ones) wherever
  // it fits, unless one expert's 16-bit weight passes 64 MiB (Mixtral's fc1 and fc2) where the 2x1 cluster
  // applies. With uneven counts the row-tile walk then re-reads an operand far larger than L2 for every row or
  // column of tiles, where the 2x1 pointer-array kernel's swizzle-4 walk keeps neighbouring tiles on shared
  // operand blocks (measured, docs/kernels.md); with even counts the row tiles stay a little ahead.
  constexpr int64_t kLargeWeightBytes = int64_t{64} << 20;
  const bool large_weight = forward && s.kernel == kPtrArray128x256c21 && p.k * p.n * 2 > kLargeWeightBytes;
  if (large_weight) s.swizzle = 4;
  // bf16/fp16 wgrad (not the accumulating one): the row-range kernel, which walks each column of an
  // expert's tiles down the rows of d[e], so the expert's rows of x (m wide) come from L2 for every column after
  // the first only while they fit there: take it while the mean expert's rows of x are at most 32 MiB (a bound by
  // that reasoning, not a measured crossover); past it the pointer-array kernel, whose walk can run along N,
  // keeps the case.
  constexpr int64_t kL2RowsBytes = int64_t{32} << 20;
  const bool rows_pay = forward ? !large_weight : p.num_rows / p.num_experts * p.m * 2 <= kL2RowsBytes;
  if (p.op != Op::kWgradAccum && built(p.dtype, p.op, rows_kernel(p.op)) && rows_fit(p) && rows_pay) {
    s.kernel = rows_kernel(p.op);
  }
  return s;
}

Schedule pick_schedule(const Problem& p, int sm_count) {
  Schedule s = pick_default(p, sm_count);
  if (const char* forced = std::getenv("MOE_CORE_GEMM_TILE")) {
    if (std::strcmp(forced, "rows") == 0) {
      if (built(p.dtype, p.op, rows_kernel(p.op)) && rows_fit(p)) s.kernel = rows_kernel(p.op);
    }
    for (const Forced& f : kForced) {
      if (std::strcmp(forced, f.name) == 0) s.kernel = listed(p.dtype, p.op, f.kernel) ? f.kernel : f.fallback;
    }
  }
  if (const char* forced = std::getenv("MOE_CORE_GEMM_RASTER")) {
    s.raster = std::strcmp(forced, "n") == 0 ? Raster::kAlongN : Raster::kAlongM;
  }
  if (const char* forced = std::getenv("MOE_CORE_GEMM_SWIZZLE")) {
    const int swizzle = std::atoi(forced);
    if (swizzle == 1 || swizzle == 2 || swizzle == 4 || swizzle == 8) s.swizzle = swizzle;
  }
  if (debug()) {
    std::fprintf(stderr, "[moe_core] grouped_gemm sm90 %s: E=%lld m=%lld n=%lld k=%lld -> %s\n", describe(p.op),
                 static_cast<long long>(p.num_experts), static_cast<long long>(p.m), static_cast<long long>(p.n),
                 static_cast<long long>(p.k), describe(s).c_str());
  }
  return s;
}

std::string describe(const KernelConfig& kernel) {
  char text[96];
  std::snprintf(text, sizeof(text), "%s %dx%dx%d %s cluster %dx%d", name(kernel.family), kernel.tile.m,
                kernel.tile.n, kernel.tile.k, kernel.mma == Mma::kPingpong ? "pingpong" : "cooperative",
                kernel.cluster.m, kernel.cluster.n);
  return text;
}

std::string describe(const Schedule& schedule) {
  std::string text = describe(schedule.kernel);
  if (schedule.kernel.family == Family::kPtrArray) {
    text += schedule.raster == Raster::kAlongN ? ", raster along N" : ", raster along M";
    text += ", swizzle " + std::to_string(schedule.swizzle);
  }
  return text;
}

const char* describe(Op op) {
  switch (op) {
    case Op::kForwardKN: return "forward (weight [E, K, N])";
    case Op::kForwardNK: return "forward (weight [E, N, K])";
    case Op::kWgrad: return "wgrad";
    case Op::kWgradAccum: return "wgrad accumulate";
    case Op::kWgradFp32: return "wgrad in fp32";
  }
  return "?";
}

}  // namespace moe_core::cuda::sm90
