// CUDA grouped GEMM kernels: one launch per op whatever the counts, tiles located from device-side offsets.
//
// bf16/fp16: 128x128x32 CTA tiles, 8 warps of 64x32 on WMMA tensor cores (fp32 accumulate), fed by a
// 3-stage cp.async pipeline.
// fp32/fp64: 64x64x16 CTA tiles on FFMA/DFMA (4x4 outputs per thread), so fp32 keeps fp32 accuracy (no TF32).
// Loads are guarded element-wise at every edge (any K, N, row count); 16-byte vector loads are used where the
// host proved them aligned. Forward grid: one CTA per (row tile, column tile) with row tiles numbered across
// experts (ceil(T / BM) + E is an upper bound, surplus CTAs exit), rasterized in groups of row tiles;
// wgrad grid: (tile of dw[e], e), rasterized the same way.
#include <cub/block/block_scan.cuh>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include <c10/cuda/CUDAException.h>

#include "grouped_gemm_kernels.h"

namespace moe_core::cuda {
namespace {

constexpr int kThreads = 256;

// ---- offsets ----

template <typename CountT>
__global__ void __launch_bounds__(kThreads) row_offsets_kernel(const CountT* counts, int64_t num_experts,
                                                                int64_t num_rows, int64_t tile_rows,
                                                                int64_t* row_offsets, int64_t* tile_offsets) {
  using Scan = cub::BlockScan<int64_t, kThreads>;
  __shared__ typename Scan::TempStorage temp;
  __shared__ int64_t carry_rows, carry_tiles;
  if (threadIdx.x == 0) {
    carry_rows = carry_tiles = 0;
    row_offsets[0] = tile_offsets[0] = 0;
  }
  __syncthreads();
  for (int64_t base = 0; base < num_experts; base += kThreads) {
    const int64_t e = base + threadIdx.x;
    // Negative counts count as empty and offsets are clamped to T: bad counts (unchecked, a check would sync)
    // can only mis-assign rows, never touch memory outside x and y.
    // Clamping each count to T keeps the sums from wrapping.
    const int64_t count = e < num_experts ? min(max(static_cast<int64_t>(counts[e]), int64_t{0}), num_rows) : 0;
    int64_t incl, total;
    Scan(temp).InclusiveSum(count, incl, total);
    __syncthreads();
    const int64_t end = min(carry_rows + incl, num_rows);
    const int64_t begin = min(carry_rows + incl - count, num_rows);
    const int64_t tiles = (end - begin + tile_rows - 1) / tile_rows;
    int64_t tiles_incl, tiles_total;
    Scan(temp).InclusiveSum(tiles, tiles_incl, tiles_total);
    if (e < num_experts) {
      row_offsets[e + 1] = end;
      tile_offsets[e + 1] = carry_tiles + tiles_incl;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      carry_rows += total;
      carry_tiles += tiles_total;
    }
    __syncthreads();
  }
}

// ---- element helpers ----

template <typename T> struct Acc { using type = float; };
template <> struct Acc<double> { using type = double; };

template <typename T> __device__ __forceinline__ T from_acc(float v);
template <> __device__ __forceinline__ __half from_acc<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ float from_acc<float>(float v) { return v; }
template <typename T> __device__ __forceinline__ T from_acc(double v) { return static_cast<T>(v); }

template <typename T> __device__ __forceinline__ T zero_value() { return from_acc<T>(0.0f); }
template <> __device__ __forceinline__ double zero_value<double>() { return 0.0; }

// 16 bytes global -> shared without passing through registers; fill == false writes 16 zero bytes instead.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool fill) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(fill ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// smem[r * LDS + c] = g[r * ld + c] for a ROWS x COLS tile (c contiguous in memory), zero outside
// [row_lim, col_lim). ASYNC: whole in-bounds (or wholly out-of-bounds) 16-byte chunks go through cp.async,
// ragged edge chunks element by element.
template <typename T, int ROWS, int COLS, int LDS, bool ASYNC>
__device__ __forceinline__ void load_tile(T* smem, const T* g, int64_t ld, int64_t row_lim, int64_t col_lim,
                                          bool vec) {
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kChunksPerRow = COLS / kVec;
  static_assert(COLS % kVec == 0 && LDS % kVec == 0, "tile rows must hold whole 16-byte chunks");
#pragma unroll
  for (int i = threadIdx.x; i < ROWS * kChunksPerRow; i += kThreads) {
    const int r = i / kChunksPerRow;
    const int c = (i % kChunksPerRow) * kVec;
    T* dst = smem + r * LDS + c;
    const T* src = g + r * ld + c;
    const bool inside = r < row_lim && c + kVec <= col_lim;
    if (ASYNC && vec && (inside || r >= row_lim || c >= col_lim)) {
      cp_async_16(dst, inside ? src : g, inside);
    } else if (vec && inside) {
      *reinterpret_cast<uint4*>(dst) = __ldg(reinterpret_cast<const uint4*>(src));
    } else {
#pragma unroll
      for (int v = 0; v < kVec; ++v) dst[v] = (r < row_lim && c + v < col_lim) ? src[v] : zero_value<T>();
    }
  }
}

// ---- tile location ----

template <typename T>
struct Tile {
  const T* a;        // A at (tile row 0, k 0)
  const T* b;        // B at (k 0, tile column 0)
  int64_t m_lim;     // valid rows of the tile
  int64_t n_lim;     // valid columns
  int64_t k_len;     // reduction length (0: the tile is all zeros)
  int64_t c_offset;  // element offset of the tile's (0, 0) in c
  int64_t ldc;
  bool active;
};

// Grouped rasterization of CTA `pid` into (row tile, column tile): consecutive CTAs sweep every column tile of
// kRowTileGroup row tiles, so those row panels stay in L2 while the column panels stream; row-tile-fastest
// order re-reads the row panels from HBM for every column tile of wide outputs.
constexpr int64_t kRowTileGroup = 8;

struct TileCoord {
  int64_t row, col;
};

__device__ __forceinline__ TileCoord raster(int64_t pid, int64_t row_tiles, int64_t col_tiles) {
  const int64_t per_group = kRowTileGroup * col_tiles;
  const int64_t first = pid / per_group * kRowTileGroup;
  const int64_t group_rows = min(row_tiles - first, kRowTileGroup);
  return {first + pid % per_group % group_rows, pid % per_group / group_rows};
}

template <typename T, int BM, int BN, GemmKind kKind, bool B_ROW>
__device__ __forceinline__ Tile<T> locate_tile(const GroupedGemmArgs& p) {
  Tile<T> t{};
  const T* a = static_cast<const T*>(p.a);
  const T* b = static_cast<const T*>(p.b);
  if constexpr (kKind == GemmKind::kForward) {
    const auto [tile, n_tile] = raster(blockIdx.x, p.row_tile_bound, (p.n + BN - 1) / BN);
    const int64_t n0 = n_tile * BN;
    const int64_t* tiles = p.tile_offsets;
    // Tiles cover the experts' rows only: y's rows past the counts' sum stay unwritten.
    t.active = tile < tiles[p.num_experts];
    if (!t.active) return t;
    // The expert owning this row tile: the last g in [0, E) with tiles[g] <= tile.
    int64_t lo = 0, hi = p.num_experts - 1;
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (tiles[mid] <= tile) lo = mid; else hi = mid - 1;
    }
    const int64_t g = lo;
    const int64_t m0 = p.row_offsets[g] + (tile - tiles[g]) * BM;
    t.m_lim = min(static_cast<int64_t>(BM), p.row_offsets[g + 1] - m0);
    t.n_lim = min(static_cast<int64_t>(BN), p.n - n0);
    t.k_len = p.k;
    t.a = a + m0 * p.lda;
    const T* w = b + (g < p.num_experts ? g * p.b_expert_stride : 0);
    t.b = B_ROW ? w + n0 : w + n0 * p.ldb;
    t.c_offset = m0 * p.n + n0;
    t.ldc = p.n;
  } else {
    const int64_t e = blockIdx.y;
    const auto [m_tile, n_tile] = raster(blockIdx.x, (p.m + BM - 1) / BM, (p.n + BN - 1) / BN);
    const int64_t m0 = m_tile * BM, n0 = n_tile * BN;
    const int64_t r0 = p.row_offsets[e];
    t.k_len = p.row_offsets[e + 1] - r0;
    // An empty expert: wgrad writes its zeros (k_len == 0), the accumulating variant leaves main_grad alone.
    t.active = kKind == GemmKind::kWgrad || t.k_len > 0;
    t.m_lim = min(static_cast<int64_t>(BM), p.m - m0);
    t.n_lim = min(static_cast<int64_t>(BN), p.n - n0);
    t.a = a + r0 * p.lda + m0;
    t.b = b + r0 * p.ldb + n0;
    t.c_offset = e * p.m * p.n + m0 * p.n + n0;
    t.ldc = p.n;
  }
  return t;
}

template <typename T, GemmKind kKind, typename V>
__device__ __forceinline__ void store(const GroupedGemmArgs& p, const Tile<T>& t, int64_t m, int64_t n, V v) {
  const int64_t idx = t.c_offset + m * t.ldc + n;
  if constexpr (kKind == GemmKind::kWgradAccum) {
    static_cast<float*>(p.c)[idx] += static_cast<float>(v);
  } else {
    static_cast<T*>(p.c)[idx] = from_acc<T>(v);
  }
}

// Loads one BK slice of A (BM x BK) and B (BK x BN) into shared memory in the operands' own memory order, so
// global reads stay coalesced for both layouts. Forward: A row-major; wgrad: A column-major, B row-major.
template <typename T, int BM, int BN, int BK, int PAD, bool A_ROW, bool B_ROW, bool ASYNC>
__device__ __forceinline__ void load_slice(T* as, T* bs, const Tile<T>& t, const GroupedGemmArgs& p, int64_t k0) {
  const int64_t k_rem = t.k_len - k0;
  if constexpr (A_ROW) {
    load_tile<T, BM, BK, BK + PAD, ASYNC>(as, t.a + k0, p.lda, t.m_lim, k_rem, p.vec_a);
  } else {
    load_tile<T, BK, BM, BM + PAD, ASYNC>(as, t.a + k0 * p.lda, p.lda, k_rem, t.m_lim, p.vec_a);
  }
  if constexpr (B_ROW) {
    load_tile<T, BK, BN, BN + PAD, ASYNC>(bs, t.b + k0 * p.ldb, p.ldb, k_rem, t.n_lim, p.vec_b);
  } else {
    load_tile<T, BN, BK, BK + PAD, ASYNC>(bs, t.b + k0, p.ldb, t.n_lim, k_rem, p.vec_b);
  }
}

// ---- bf16 / fp16: WMMA ----

namespace wmma = nvcuda::wmma;

constexpr int kWmmaBM = 128, kWmmaBN = 128, kWmmaBK = 32, kWmmaPad = 8, kStages = 3;

template <bool A_ROW, bool B_ROW>
struct WmmaSmem {
  static constexpr int kA = A_ROW ? kWmmaBM * (kWmmaBK + kWmmaPad) : kWmmaBK * (kWmmaBM + kWmmaPad);
  static constexpr int kB = B_ROW ? kWmmaBK * (kWmmaBN + kWmmaPad) : kWmmaBN * (kWmmaBK + kWmmaPad);
  static constexpr int kStage = kA + kB;  // elements of one pipeline stage
  static constexpr int kBytes = kStages * kStage * 2;
};

template <typename T, GemmKind kKind, bool A_ROW, bool B_ROW>
__global__ void __launch_bounds__(kThreads) wmma_grouped_gemm(const GroupedGemmArgs p) {
  constexpr int BM = kWmmaBM, BN = kWmmaBN, BK = kWmmaBK, PAD = kWmmaPad;
  using Smem = WmmaSmem<A_ROW, B_ROW>;
  static_assert(Smem::kBytes >= (kThreads / 32) * 16 * 16 * int(sizeof(float)), "epilogue scratch must fit");
  extern __shared__ __align__(128) unsigned char smem[];
  T* stages = reinterpret_cast<T*>(smem);

  const Tile<T> t = locate_tile<T, BM, BN, kKind, B_ROW>(p);
  if (!t.active) return;

  using ALayout = std::conditional_t<A_ROW, wmma::row_major, wmma::col_major>;
  using BLayout = std::conditional_t<B_ROW, wmma::row_major, wmma::col_major>;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warp_m = (warp / 4) * 64, warp_n = (warp % 4) * 32;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[4][2];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.0f);

  // kStages-deep cp.async pipeline: slice i + kStages - 1 streams in while slice i is multiplied. One commit
  // group per slice (empty past the end) keeps wait_group's count exact.
  const int64_t num_slices = (t.k_len + BK - 1) / BK;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < num_slices) {
      T* as = stages + s * Smem::kStage;
      load_slice<T, BM, BN, BK, PAD, A_ROW, B_ROW, true>(as, as + Smem::kA, t, p, int64_t{s} * BK);
    }
    cp_async_commit();
  }
  for (int64_t i = 0; i < num_slices; ++i) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // slice i is visible to all, and every warp is done with the stage refilled below
    const int64_t next = i + kStages - 1;
    if (next < num_slices) {
      T* as = stages + (next % kStages) * Smem::kStage;
      load_slice<T, BM, BN, BK, PAD, A_ROW, B_ROW, true>(as, as + Smem::kA, t, p, next * BK);
    }
    cp_async_commit();
    const T* as = stages + (i % kStages) * Smem::kStage;
    const T* bs = as + Smem::kA;
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, ALayout> fa[4];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, BLayout> fb[2];
#pragma unroll
      for (int i2 = 0; i2 < 4; ++i2) {
        const int m = warp_m + i2 * 16;
        if constexpr (A_ROW) wmma::load_matrix_sync(fa[i2], as + m * (BK + PAD) + kk, BK + PAD);
        else wmma::load_matrix_sync(fa[i2], as + kk * (BM + PAD) + m, BM + PAD);
      }
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int n = warp_n + j * 16;
        if constexpr (B_ROW) wmma::load_matrix_sync(fb[j], bs + kk * (BN + PAD) + n, BN + PAD);
        else wmma::load_matrix_sync(fb[j], bs + n * (BK + PAD) + kk, BK + PAD);
      }
#pragma unroll
      for (int i2 = 0; i2 < 4; ++i2)
#pragma unroll
        for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i2][j], fa[i2], fb[j], acc[i2][j]);
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the stages become epilogue scratch

  // Each warp stages one 16x16 accumulator at a time in its own scratch and writes it with edge guards.
  float* scratch = reinterpret_cast<float*>(smem) + warp * 256;
  const int r = lane / 2, c = (lane % 2) * 8;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      wmma::store_matrix_sync(scratch, acc[i][j], 16, wmma::mem_row_major);
      __syncwarp();
      const int64_t m = warp_m + i * 16 + r;
      const int64_t n = warp_n + j * 16 + c;
      T* dst = static_cast<T*>(p.c) + t.c_offset + m * t.ldc + n;
      if (kKind != GemmKind::kWgradAccum && m < t.m_lim && n + 8 <= t.n_lim &&
          reinterpret_cast<uintptr_t>(dst) % 16 == 0) {
        alignas(16) T packed[8];
#pragma unroll
        for (int v = 0; v < 8; ++v) packed[v] = from_acc<T>(scratch[r * 16 + c + v]);
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(packed);
      } else {
#pragma unroll
        for (int v = 0; v < 8; ++v) {
          if (m < t.m_lim && n + v < t.n_lim) store<T, kKind>(p, t, m, n + v, scratch[r * 16 + c + v]);
        }
      }
      __syncwarp();
    }
  }
}

// ---- fp32 / fp64: FMA ----

template <typename T, GemmKind kKind, bool A_ROW, bool B_ROW>
__global__ void __launch_bounds__(kThreads) fma_grouped_gemm(const GroupedGemmArgs p) {
  constexpr int BM = 64, BN = 64, BK = 16, PAD = 16 / sizeof(T);
  constexpr int A_LDS = A_ROW ? BK + PAD : BM + PAD;
  constexpr int B_LDS = B_ROW ? BN + PAD : BK + PAD;
  __shared__ __align__(16) T as[A_ROW ? BM * (BK + PAD) : BK * (BM + PAD)];
  __shared__ __align__(16) T bs[B_ROW ? BK * (BN + PAD) : BN * (BK + PAD)];
  using AccT = typename Acc<T>::type;

  const Tile<T> t = locate_tile<T, BM, BN, kKind, B_ROW>(p);
  if (!t.active) return;

  // Thread (ty, tx) owns rows ty + 16 i and columns tx + 16 j: neighbouring threads hit neighbouring columns.
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  AccT acc[4][4] = {};
  for (int64_t k0 = 0; k0 < t.k_len; k0 += BK) {
    load_slice<T, BM, BN, BK, PAD, A_ROW, B_ROW, false>(as, bs, t, p, k0);
    __syncthreads();
#pragma unroll
    for (int k = 0; k < BK; ++k) {
      AccT av[4], bv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int m = ty + 16 * i;
        av[i] = A_ROW ? as[m * A_LDS + k] : as[k * A_LDS + m];
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int n = tx + 16 * j;
        bv[j] = B_ROW ? bs[k * B_LDS + n] : bs[n * B_LDS + k];
      }
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fma(av[i], bv[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t m = ty + 16 * i, n = tx + 16 * j;
      if (m < t.m_lim && n < t.n_lim) store<T, kKind>(p, t, m, n, acc[i][j]);
    }
}

// ---- launch ----

template <typename T>
constexpr bool kTensorCore = std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>;

template <typename T>
constexpr int64_t kTileM = kTensorCore<T> ? kWmmaBM : 64;
template <typename T>
constexpr int64_t kTileN = kTensorCore<T> ? kWmmaBN : 64;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

template <typename T, GemmKind kKind, bool A_ROW, bool B_ROW>
void launch_typed(const GroupedGemmArgs& p, dim3 grid, cudaStream_t stream) {
  if constexpr (kTensorCore<T>) {
    constexpr int bytes = WmmaSmem<A_ROW, B_ROW>::kBytes;
    // Past 48 KiB dynamic shared memory must be opted into, per device; a host-side attribute, no stream work.
    C10_CUDA_CHECK(cudaFuncSetAttribute(wmma_grouped_gemm<T, kKind, A_ROW, B_ROW>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    wmma_grouped_gemm<T, kKind, A_ROW, B_ROW><<<grid, kThreads, bytes, stream>>>(p);
  } else {
    fma_grouped_gemm<T, kKind, A_ROW, B_ROW><<<grid, kThreads, 0, stream>>>(p);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void launch_kind(GemmKind kind, const GroupedGemmArgs& p, cudaStream_t stream) {
  const int64_t bm = kTileM<T>, bn = kTileN<T>;
  if (kind == GemmKind::kForward) {
    // Upper bound on row tiles over all experts: each wastes at most one partial tile.
    GroupedGemmArgs args = p;
    args.row_tile_bound = ceil_div(p.m, bm) + p.num_experts;
    const int64_t ctas = args.row_tile_bound * ceil_div(p.n, bn);
    TORCH_CHECK(ctas < (int64_t{1} << 31), "grouped_gemm: problem too large for one grid");
    const dim3 grid(static_cast<unsigned>(ctas));
    if (p.b_row_major) launch_typed<T, GemmKind::kForward, true, true>(args, grid, stream);
    else launch_typed<T, GemmKind::kForward, true, false>(args, grid, stream);
    return;
  }
  const int64_t ctas = ceil_div(p.n, bn) * ceil_div(p.m, bm);
  TORCH_CHECK(ctas < (int64_t{1} << 31) && p.num_experts <= 65535,
              "grouped_gemm_wgrad: problem too large for one grid");
  const dim3 grid(static_cast<unsigned>(ctas), static_cast<unsigned>(p.num_experts));
  if (kind == GemmKind::kWgrad) launch_typed<T, GemmKind::kWgrad, false, true>(p, grid, stream);
  else launch_typed<T, GemmKind::kWgradAccum, false, true>(p, grid, stream);
}

}  // namespace

int64_t forward_tile_rows(at::ScalarType dtype) {
  return (dtype == at::kBFloat16 || dtype == at::kHalf) ? kTileM<__half> : kTileM<float>;
}

void launch_row_offsets(const at::Tensor& counts, const at::Tensor& workspace, int64_t num_rows,
                        int64_t tile_rows, cudaStream_t stream) {
  const int64_t e = counts.numel();
  int64_t* row_offsets = workspace.data_ptr<int64_t>();
  int64_t* tile_offsets = row_offsets + e + 1;
  if (counts.scalar_type() == at::kLong) {
    row_offsets_kernel<<<1, kThreads, 0, stream>>>(counts.data_ptr<int64_t>(), e, num_rows, tile_rows,
                                                   row_offsets, tile_offsets);
  } else {
    row_offsets_kernel<<<1, kThreads, 0, stream>>>(counts.data_ptr<int32_t>(), e, num_rows, tile_rows,
                                                   row_offsets, tile_offsets);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void launch_grouped_gemm(at::ScalarType dtype, GemmKind kind, const GroupedGemmArgs& args, cudaStream_t stream) {
  switch (dtype) {
    case at::kBFloat16: return launch_kind<__nv_bfloat16>(kind, args, stream);
    case at::kHalf: return launch_kind<__half>(kind, args, stream);
    case at::kFloat: return launch_kind<float>(kind, args, stream);
    case at::kDouble: return launch_kind<double>(kind, args, stream);
    default: TORCH_CHECK(false, "grouped_gemm: unsupported dtype ", dtype);
  }
}

}  // namespace moe_core::cuda
