// The row-tile forward and dgrad on sm_90a: y_e = x_e w_e for all experts with static TMA descriptors.
//
// CUTLASS's pointer-array kernels (grouped_gemm_sm90_ptrarray.cuh) keep per-group TMA descriptors in global memory and
// rewrite them on the device, which runs slower than CUTLASS's plain (non-array) kernel on the same tile and
// product (docs/kernels.md). This path therefore runs the plain kernel as a batched product over
// L = E experts in which every expert sees all of x and y (batch stride 0) and w_e is batch e: each TMA
// descriptor is built once on the host. A work tile is (first row r, column tile j, expert e), one per 128 of
// e's rows from e's first row on (TMA coordinates are element indices, so r need not be tile-aligned), listed
// by a prepare kernel from the device-side counts; the epilogue stores only the tile's rows that belong to e.
// Expert-aligned tiles pad each expert to whole tiles, as the pointer-array kernel does; tiles aligned to x's
// rows would compute a tile split between experts once per expert. An expert's last row tile with at most 64 of
// its rows runs as a 64-row half tile: the two consumer warpgroups split the columns instead of the rows, so it
// issues half the wgmmas. No host sync; the grid is the SM count whatever the counts.
#pragma once

#include "grouped_gemm_sm90_common.cuh"

#if defined(MOE_CORE_WITH_SM90)

#include <cub/block/block_scan.cuh>

#include "cutlass/arch/grid_dependency_control.h"
#include "cutlass/epilogue/collective/detail.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"

namespace moe_core::cuda::sm90 {

// One work tile: its first row, then expert << 16 | half << 15 | column tile, where half marks a tile with at
// most kBlockM / 2 of its expert's rows (RowTileScheduler::WorkTileInfo::half).
using RowTileWork = int2;

// The workspace of the row-tile path: row offsets [E + 1] (clamped, as the pointer-array path), the work tiles
// and their count, with room for the most the host-known shapes allow.
struct RowTileArrays {
  int64_t* offsets = nullptr;
  int32_t* count = nullptr;
  RowTileWork* tiles = nullptr;

  // An expert with n rows has ceil(n / bm) row tiles.
  static int64_t max_tiles(const Problem& p, int bm, int bn) {
    return ((p.m + bm - 1) / bm + p.num_experts) * ((p.n + bn - 1) / bn);
  }
  static size_t bytes(const Problem& p, int bm, int bn) {
    using W = WorkspaceCarver;
    return W::bytes((p.num_experts + 1) * sizeof(int64_t)) + W::bytes(sizeof(int32_t)) +
           W::bytes(max_tiles(p, bm, bn) * sizeof(RowTileWork));
  }
  RowTileArrays(void* workspace, const Problem& p) {
    WorkspaceCarver w{static_cast<char*>(workspace)};
    offsets = w.take<int64_t>((p.num_experts + 1) * sizeof(int64_t));
    count = w.take<int32_t>(sizeof(int32_t));
    tiles = reinterpret_cast<RowTileWork*>(w.next);  // the rest: bytes() sized it
  }
};

// The listing kernel: B list blocks (no tile covers the rows past the counts' sum, which stay unwritten). The GEMM
// waits for all of it (PDL), so its latency, not its work, is what counts: every list block scans all the counts itself (no block waits for another), then its warps list
// the tiles of experts b W + w, b W + w + B W, ... (W warps a block), lanes across one expert's tiles.
// Per expert e with rows [r0, r1): row tiles from r0, r0 + bm, ... below r1 times every column tile, walked down
// the rows (a weight slice stays hot while the rows stream past) unless the expert's rows outweigh its weight
// (r1 - r0 > n), then across the columns (a row block stays hot). (A 2x1 cluster sharing weight tiles is slower,
// with each expert's row tiles padded to pairs and without: docs/kernels.md.)
constexpr int kListTileThreads = 256, kListTileWarps = kListTileThreads / 32;
// B = min(ceil(E / W), kMaxListBlocks): a warp then lists at most kExpertsPerWarp experts for E < 32768.
constexpr int kMaxListBlocks = 128, kExpertsPerWarp = 32;

inline int list_blocks(int64_t experts) {
  const int64_t blocks = std::min<int64_t>((experts + kListTileWarps - 1) / kListTileWarps, kMaxListBlocks);
  TORCH_CHECK(experts <= blocks * kListTileWarps * kExpertsPerWarp, "grouped_gemm (sm90 row tiles): ", experts,
              " experts exceed the listing kernel's ", blocks * kListTileWarps * kExpertsPerWarp);
  return static_cast<int>(blocks);
}

template <class CountT>
__global__ void __launch_bounds__(kListTileThreads) list_row_tiles(RowTileArrays g, Problem p, int bm, int bn) {
  wait_for_previous_kernels();               // launched as a programmatic dependent (launch_dependent)
  cutlass::arch::launch_dependent_grids();   // the GEMM may start; its scheduler waits for this kernel's tiles
  const auto* counts = static_cast<const CountT*>(p.counts);
  const int64_t experts = p.num_experts, num_rows = p.num_rows, col_tiles = (p.n + bn - 1) / bn;
  const int64_t blocks = gridDim.x;
  // Each thread's experts: their rows, then their tiles from the clamped row offsets (bad counts may clamp an
  // expert's rows away, so the tiles' scan needs the rows' first).
  const int64_t per_thread = (experts + kListTileThreads - 1) / kListTileThreads;
  const int64_t e0 = min(threadIdx.x * per_thread, experts), e1 = min(e0 + per_thread, experts);
  auto tiles_of = [&](int64_t r0, int64_t r1) { return (r1 - r0 + bm - 1) / bm * col_tiles; };
  using Scan = cub::BlockScan<int64_t, kListTileThreads>;
  __shared__ typename Scan::TempStorage temp;
  int64_t rows = 0, row = 0;
  for (int64_t e = e0; e < e1; ++e) rows += rows_of(counts[e], num_rows);
  Scan(temp).ExclusiveSum(rows, row);
  int64_t tiles = 0, tile = 0;
  for (int64_t e = e0, r = row; e < e1; r += rows_of(counts[e], num_rows), ++e) {
    tiles += tiles_of(min(r, num_rows), min(r + rows_of(counts[e], num_rows), num_rows));
  }
  __syncthreads();  // temp is reused
  Scan(temp).ExclusiveSum(tiles, tile);
  // This block's experts e = (k B + b) W + w go to slot k W + w.
  constexpr int kSlots = kListTileWarps * kExpertsPerWarp;
  __shared__ int64_t first_row[kSlots], end_row[kSlots], first_tile[kSlots];
  for (int64_t e = e0; e < e1; ++e) {
    const int64_t r0 = min(row, num_rows), r1 = min(row + rows_of(counts[e], num_rows), num_rows);
    if (blockIdx.x == 0) g.offsets[e] = r0;
    const int64_t group = e / kListTileWarps;
    if (group % blocks == blockIdx.x) {
      const int64_t slot = group / blocks * kListTileWarps + e % kListTileWarps;
      first_row[slot] = r0;
      end_row[slot] = r1;
      first_tile[slot] = tile;
    }
    row += rows_of(counts[e], num_rows);
    tile += tiles_of(r0, r1);
  }
  if (blockIdx.x == 0 && threadIdx.x == kListTileThreads - 1) {
    g.offsets[experts] = min(row, num_rows);
    *g.count = static_cast<int32_t>(tile);
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t e = blockIdx.x * kListTileWarps + warp, k = 0; e < experts; e += blocks * kListTileWarps, ++k) {
    const int64_t slot = k * kListTileWarps + warp, r0 = first_row[slot], r1 = end_row[slot];
    // 32-bit tile arithmetic: the tile count is an int32 (count).
    const uint32_t row_tiles = static_cast<uint32_t>((r1 - r0 + bm - 1) / bm), cols = static_cast<uint32_t>(col_tiles);
    const bool across = r1 - r0 > p.n;
    RowTileWork* out = g.tiles + first_tile[slot];
    for (uint32_t u = lane; u < row_tiles * cols; u += 32) {
      const uint32_t rt = across ? u / cols : u % row_tiles, ct = across ? u % cols : u / row_tiles;
      const int64_t first = r0 + int64_t{rt} * bm;
      const int64_t half = r1 - first <= bm / 2;
      out[u] = make_int2(static_cast<int>(first), static_cast<int>(e << 16 | half << 15 | ct));
    }
  }
}

// Walks the listed work tiles.
struct RowTileSchedulerTag {};

// A work tile's k-tiles and whether it is a half tile: CUTLASS's kernel hands this to the mainloop's `mma` and,
// converted to the k-tile count, to its pipelines.
struct RowTileK {
  int32_t k_tiles = 0;
  bool half = false;
  CUTLASS_HOST_DEVICE operator int() const { return k_tiles; }
};

class RowTileScheduler : public AheadWalk<RowTileScheduler, RowTileWork> {
  friend AheadWalk<RowTileScheduler, RowTileWork>;

 public:
  struct WorkTileInfo : Base::WorkTileInfo {
    bool half = false;  // at most BLK_M / 2 of the expert's rows: RowStartMainloop's and RowTileEpilogue's half tile
    CUTLASS_HOST_DEVICE static WorkTileInfo invalid_work_tile() { return {}; }
  };
  struct Arguments : Base::Arguments {
    const RowTileWork* tiles = nullptr;
    const int32_t* count = nullptr;
  };
  struct Params : Base::Params {
    const RowTileWork* tiles = nullptr;
    const int32_t* count = nullptr;
  };

  template <class ProblemShapeMNKL, class TileShape, class ClusterShape, class... Rest>
  static Params to_underlying_arguments(ProblemShapeMNKL shape, TileShape tile, ClusterShape cluster,
                                        cutlass::KernelHardwareInfo const& hw, Arguments const& args, Rest... rest) {
    auto params = base_params<Params>(shape, tile, cluster, hw, args, rest...);
    params.tiles = args.tiles;
    params.count = args.count;
    return params;
  }

  template <class ProblemShape, class TileShape>
  CUTLASS_HOST_DEVICE static RowTileK get_work_k_tile_count(WorkTileInfo const& work, ProblemShape shape,
                                                            TileShape tile) {
    return {static_cast<int32_t>(cute::ceil_div(cute::get<2>(shape), cute::get<2>(tile))), work.half};
  }

  RowTileScheduler() = default;
  CUTLASS_DEVICE explicit RowTileScheduler(Params const& params)
      : AheadWalk(params), tiles_(params.tiles), count_(*params.count) {}

 private:
  CUTLASS_DEVICE uint64_t end() const { return count_; }
  CUTLASS_DEVICE RowTileWork fetch(uint64_t t) const { return t < count_ ? tiles_[t] : RowTileWork{}; }
  CUTLASS_DEVICE WorkTileInfo work(uint64_t t, RowTileWork w) const {
    WorkTileInfo info;
    if (t >= count_) return info;
    info.M_idx = w.x;
    info.N_idx = w.y & 0x7fff;
    info.L_idx = static_cast<int32_t>(static_cast<uint32_t>(w.y) >> 16);
    info.is_valid_tile = true;
    info.half = w.y >> 15 & 1;
    return info;
  }

  const RowTileWork* tiles_ = nullptr;
  uint64_t count_ = 0;
};

// Stores the rows of a (row tile, expert) work tile that belong to the expert, 64 columns at a time through
// two 128x64 staging buffers in shared memory (CUTLASS's 128-byte swizzle, so the accumulator writes hit every
// bank once). A tile whose 128 rows all belong to the expert, the common case, leaves by one TMA store per
// buffer, as CUTLASS's own epilogue does; a tile shared with other experts by 16-byte stores of the expert's
// rows only. One named barrier per buffer: before it, thread 0 waits until the TMA store of the buffer
// written one step earlier has read it, so after it that buffer is free for the next step; nobody waits for the
// last store of a tile (RowTileAdapter::store_tail waits once, before the CTA exits). A half tile (at most BM / 2
// of the expert's rows; `HalfMma`, the two warpgroups side by side along N, computed it into the first half of
// each thread's accumulators) stacks the warpgroups' 64-row halves in each buffer: two steps instead of four.
template <class ElementD_, int BM, int BN, class HalfMma>
class RowTileEpilogue {
 public:
  using ElementC = void;
  using ElementD = ElementD_;
  using StrideC = cute::Stride<int64_t, cute::_1, int64_t>;
  using StrideD = StrideC;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;
  using ThreadEpilogueOp = cutlass::epilogue::thread::LinearCombination<ElementD, 1, float, float>;  // a plain copy
  static constexpr int kCols = 64;       // one 128-byte swizzle row of 16-bit elements
  static constexpr int kThreads = 256;   // the two consumer warpgroups
  using SmemBox = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<ElementD>{},
                                               cute::Shape<cute::Int<BM>, cute::Int<kCols>>{}));
  using GmemLayout = cute::Layout<cute::Shape<int, int>, cute::Stride<int64_t, cute::_1>>;
  using TmaStore = decltype(cute::make_tma_copy(cute::SM90_TMA_STORE{},
                                                cute::make_tensor(cute::make_gmem_ptr<ElementD>(nullptr), GmemLayout{}),
                                                SmemBox{}));
  struct SharedStorage {
    alignas(1024) ElementD box[2][BM * kCols];
  };
  using TensorStorage = SharedStorage;
  struct Arguments {
    ElementD* ptr_d = nullptr;
    int64_t ld = 0;
    const int64_t* offsets = nullptr;
  };
  struct Params {
    TmaStore tma;
    ElementD* ptr_d = nullptr;
    int64_t ld = 0;
    const int64_t* offsets = nullptr;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& shape, Arguments const& args, void*) {
    using namespace cute;
    const GmemLayout y{make_shape(static_cast<int>(get<0>(shape)), static_cast<int>(get<1>(shape))),
                       make_stride(args.ld, _1{})};
    return {make_tma_copy(SM90_TMA_STORE{}, make_tensor(make_gmem_ptr(args.ptr_d), y), SmemBox{}), args.ptr_d,
            args.ld, args.offsets};
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) { return 0; }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const&) { return true; }

  CUTLASS_HOST_DEVICE explicit RowTileEpilogue(Params const& params, SharedStorage const& = SharedStorage())
      : params_(params) {}
  CUTLASS_DEVICE bool is_source_needed() { return false; }

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem, BlockShapeMNK, BlockCoordMNKL coord,
                                 cute::Tensor<FrgEngine, FrgLayout> const& accumulators, TiledMma tiled_mma,
                                 ResidueMNK, int thread_idx, char* smem) {
    using namespace cute;
    // wgmma's accumulator layout (CUTLASS's GMMA CLayout_64xN): value i of a thread lies in column block i / 4
    // (8 columns), so the values of 64-column box q are i in [32q, 32q + 32), pairs of adjacent columns.
    static_assert(size(TiledMma{}) == kThreads && size(HalfMma{}) == kThreads && BN % (2 * kCols) == 0);
    static_assert(size<0, 0>(FrgLayout{}) == 2 && size<0, 2>(FrgLayout{}) == BN / 8 && size<1>(FrgLayout{}) == 1 &&
                  size<2>(FrgLayout{}) == 1, "one m64nBNk16 atom per warpgroup");
    const auto [m_coord, n_coord, k_coord, l_coord] = coord;  // m_coord: the tile's first row (RowStartMainloop)
    // The same rule as the listing's half flag (list_row_tiles), from the same offsets.
    const int rows = static_cast<int>(min<int64_t>(params_.offsets[l_coord + 1] - m_coord, BM));
    if (rows <= BM / 2) {
      using Half = decltype(partition_fragment_C(HalfMma{}, Shape<Int<BM / 2>, Int<BN>>{}));
      store<BM / 2>(problem, coord, rows, make_tensor(accumulators.data(), typename Half::layout_type{}),
                    HalfMma{}, thread_idx, smem);
    } else {
      store<BM>(problem, coord, rows, accumulators, tiled_mma, thread_idx, smem);
    }
  }

 private:
  // The tile's TileM x BN accumulators, as `mma` lays them out, in BM / TileM stacks of BN * TileM / BM columns
  // (one per warpgroup for a half tile, TileM = BM / 2), a stack's TileM rows below the previous one's in each box.
  template <int TileM, class ProblemShapeMNKL, class BlockCoordMNKL, class Accumulators, class Mma>
  CUTLASS_DEVICE void store(ProblemShapeMNKL problem, BlockCoordMNKL coord, int rows, Accumulators const& acc,
                            Mma mma, int thread_idx, char* smem) {
    using namespace cute;
    constexpr int kStackCols = BN * TileM / BM;
    const auto [m_coord, n_coord, k_coord, l_coord] = coord;
    const int64_t tile_row = m_coord, tile_col = int64_t(n_coord) * BN;
    const int cols = static_cast<int>(min<int64_t>(int64_t(get<1>(problem)) - tile_col, BN));
    const bool whole = rows == BM;
    auto& storage = *reinterpret_cast<SharedStorage*>(smem);
    Tensor where = mma.get_thread_slice(thread_idx).partition_C(make_identity_tensor(Shape<Int<TileM>, Int<BN>>{}));
    Tensor mY = params_.tma.get_tma_tensor(make_shape(static_cast<int>(get<0>(problem)),
                                                      static_cast<int>(get<1>(problem))));
    Tensor gY = local_tile(domain_offset(make_coord(m_coord, 0), mY), Shape<Int<BM>, Int<kCols>>{},
                           make_coord(0, _));  // (BM, kCols, box)
    auto tma = params_.tma.get_slice(0);
    cutlass::NumericArrayConverter<ElementD, float, 2> convert;
    CUTLASS_PRAGMA_UNROLL
    for (int q = 0; q < kStackCols / kCols; ++q) {
      Tensor box = make_tensor(make_smem_ptr(storage.box[q % 2]), SmemBox{});  // (BM, kCols)
      CUTLASS_PRAGMA_UNROLL
      for (int v = 0; v < kCols / 2; v += 2) {  // constant bounds: unrolled, so the accumulators stay registers
        const int i = q * kCols / 2 + v;
        cutlass::Array<float, 2> pair;
        pair[0] = acc(i);
        pair[1] = acc(i + 1);
        const auto packed = convert(pair);
        const int c = get<1>(where(i));
        const int r = get<0>(where(i)) + c / kStackCols * TileM;
        *reinterpret_cast<uint32_t*>(&box(r, c % kStackCols - q * kCols)) = reinterpret_cast<uint32_t const&>(packed);
      }
      cutlass::arch::fence_view_async_shared();  // the writes above, to the TMA store
      if (thread_idx == 0) tma_store_wait<0>();  // the other buffer's store has read it
      cutlass::arch::NamedBarrier::sync(kThreads, cutlass::arch::ReservedNamedBarriers::EpilogueBarrier);
      if (TileM == BM && whole) {
        if (thread_idx == 0) {
          copy(params_.tma, tma.partition_S(box), tma.partition_D(gY(_, _, n_coord * (BN / kCols) + q)));
          tma_store_arrive();
        }
      } else {
        constexpr int kChunk = 16 / sizeof(ElementD);  // a swizzle unit: 16 bytes stay together
        CUTLASS_PRAGMA_UNROLL
        for (int i = thread_idx; i < BM * kCols / kChunk; i += kThreads) {
          const int r = i / (kCols / kChunk), c = i % (kCols / kChunk) * kChunk;
          const int row = r % TileM, col = r / TileM * kStackCols + q * kCols + c;
          if (row < rows && col < cols) {
            *reinterpret_cast<uint4*>(params_.ptr_d + (tile_row + row) * params_.ld + tile_col + col) =
                *reinterpret_cast<uint4 const*>(&box(r, c));
          }
        }
      }
    }
  }

  Params const& params_;  // the kernel's grid-constant parameters: TMA needs its descriptor there
};

// CUTLASS's adapter for RowTileEpilogue, whose last TMA store of each tile is left in flight: the CTA waits
// for it once, before it exits.
template <class Epilogue>
struct RowTileAdapter : cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<Epilogue> {
  using Base = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<Epilogue>;
  using Base::Base;
  template <class LoadPipeline, class LoadState, class StorePipeline, class StoreState>
  CUTLASS_DEVICE auto store_tail(LoadPipeline, LoadState load_state, StorePipeline, StoreState store_state) {
    cute::tma_store_wait<0>();
    return cute::make_tuple(load_state, store_state);
  }
};

// CUTLASS's TMA + wgmma mainloop (`Built`, from its collective builder) for work tiles that start at any row:
// A's tiled view steps one row per M index instead of one tile, so the scheduler's M index is the first row.
// A half tile loads the same stages (the A tile's last BLK_M / 2 rows unused) and runs `HalfMma`, BLK_M / 2 x
// BLK_N with the warpgroups side by side along N, into the first half of each thread's accumulators.
template <class Built, class HalfMma>
struct RowStartMainloop : Built {
  using typename Built::MainloopPipeline;
  using typename Built::Params;
  using typename Built::PipelineState;
  using typename Built::SmemLayoutA;
  using typename Built::SmemLayoutB;
  using typename Built::TensorStorage;

  template <class ProblemShapeMNKL>
  CUTLASS_DEVICE auto load_init(ProblemShapeMNKL const& shape, typename Built::Params const& params) const {
    using namespace cute;
    const auto tiled = Built::load_init(shape, params);
    const auto a = get<0>(tiled).layout();  // (BLK_M, BLK_K, m, k, l)
    const auto rows = make_layout(get<0>(shape), stride<0>(a));
    return make_tuple(make_tensor(get<0>(tiled).data(), make_layout(layout<0>(a), layout<1>(a), rows, layout<3>(a),
                                                                    layout<4>(a))),
                      get<1>(tiled));
  }

  // As CUTLASS's own mma, it leaves the last k-tile's stage to mma_tail, but with no wgmma in flight: where the
  // two paths join, ptxas may move accumulator registers, and with a wgmma still running it serializes every
  // wgmma of the kernel (C7515).
  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState read, FrgTensorC& accum, RowTileK k,
                          int thread_idx, TensorStorage& shared, Params const& params) {
    using namespace cute;
    if (!k.half) {
      Built::mma(pipeline, read, accum, k.k_tiles, thread_idx, shared, params);
      warpgroup_wait<0>();
      return;
    }
    constexpr int kHalfM = size<0>(SmemLayoutA{}) / 2;
    Tensor sA = make_tensor(make_smem_ptr(shared.smem_A.data()), SmemLayoutA{});  // (BLK_M, BLK_K, PIPE)
    Tensor sB = make_tensor(make_smem_ptr(shared.smem_B.data()), SmemLayoutB{});  // (BLK_N, BLK_K, PIPE)
    Tensor sA_half = local_tile(sA, Shape<Int<kHalfM>, Int<size<1>(SmemLayoutA{})>, Int<size<2>(SmemLayoutA{})>>{},
                                make_coord(0, 0, 0));  // (BLK_M / 2, BLK_K, PIPE)
    HalfMma half_mma;
    const int warp_group = __shfl_sync(0xffffffff, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
    auto thread_mma = half_mma.get_slice(warp_group * cutlass::NumThreadsPerWarpGroup);
    Tensor tCrA = thread_mma.make_fragment_A(thread_mma.partition_A(sA_half));  // (MMA, 1, MMA_K, PIPE)
    Tensor tCrB = thread_mma.make_fragment_B(thread_mma.partition_B(sB));       // (MMA, 1, MMA_K, PIPE)
    using Half = decltype(partition_fragment_C(HalfMma{}, Shape<Int<kHalfM>, Int<size<0>(SmemLayoutB{})>>{}));
    Tensor acc = make_tensor(accum.data(), typename Half::layout_type{});
    PipelineState release = read;
    half_mma.accumulate_ = GMMA::ScaleOut::Zero;
    warpgroup_fence_operand(acc);
    CUTLASS_PRAGMA_NO_UNROLL
    for (int kt = 0; kt < k.k_tiles; ++kt) {
      pipeline.consumer_wait(read, pipeline.consumer_try_wait(read));
      const int stage = read.index();
      warpgroup_fence_operand(acc);
      warpgroup_arrive();
      CUTLASS_PRAGMA_UNROLL
      for (int kb = 0; kb < size<2>(tCrA); ++kb) {
        gemm(half_mma, tCrA(_, _, kb, stage), tCrB(_, _, kb, stage), acc);
        half_mma.accumulate_ = GMMA::ScaleOut::One;
      }
      end_k_tile(kt, pipeline, read, release, acc);
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc);
  }
};

// The half tile (two 64x128 atoms side by side), the epilogue's staging and the scheduler (one CTA a work tile)
// are written for 128x256x64 tiles without clusters: K is kRowTile.
template <Dtype D, Op O, class K>
struct RowTileConfig {
  static_assert(O == Op::kForwardKN || O == Op::kForwardNK);
  static_assert(K::value == kRowTile, "the row-tile kernel is built for kRowTile only");
  using Element = typename ElementOf<D>::type;
  using TileShape = cute::Shape<cute::Int<K::value.tile.m>, cute::Int<K::value.tile.n>, cute::Int<K::value.tile.k>>;
  using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = typename LayoutsOf<O>::B;
  // The half tile's 64 x 256: one m64n128k16 atom per warpgroup, side by side along N.
  using HalfMma = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, cute::Shape<cute::_64, cute::_128, cute::_64>,
                                 cutlass::gemm::collective::detail::gmma_ss_tag_to_major_A<Element, LayoutA>(),
                                 cutlass::gemm::collective::detail::gmma_ss_tag_to_major_B<Element, LayoutB>()>(),
      cute::Layout<cute::Shape<cute::_1, cute::_2, cute::_1>>{}));
  using Epilogue = RowTileAdapter<RowTileEpilogue<Element, K::value.tile.m, K::value.tile.n, HalfMma>>;
  using Mainloop = RowStartMainloop<typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, 8, Element, LayoutB, 8, float,
      TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp, HalfMma>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue,
                                                      RowTileSchedulerTag>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  static constexpr int kBlockM = K::value.tile.m, kBlockN = K::value.tile.n;
};

template <Dtype D, Op O, class K>
struct Runner<D, O, K, Family::kRowTile> {
  using C = RowTileConfig<D, O, K>;

  static typename C::Gemm::Arguments arguments(const Problem& p, const RowTileArrays& g, int sm_count) {
    typename C::Kernel::StrideA stride_a{};
    cute::get<0>(stride_a) = p.k;
    cute::get<2>(stride_a) = 0;  // every expert reads all of x
    typename C::Kernel::StrideB stride_b{};
    if constexpr (O == Op::kForwardKN) cute::get<1>(stride_b) = p.n;  // w_e [K, N]
    else cute::get<0>(stride_b) = p.k;                                // w_e [N, K]
    cute::get<2>(stride_b) = p.k * p.n;
    cutlass::KernelHardwareInfo hw;
    hw.sm_count = sm_count;
    typename C::Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {static_cast<int>(p.m), static_cast<int>(p.n), static_cast<int>(p.k), static_cast<int>(p.num_experts)},
        {static_cast<const typename C::Element*>(p.a), stride_a, static_cast<const typename C::Element*>(p.b),
         stride_b},
        {static_cast<typename C::Element*>(p.d), p.n, g.offsets},
        hw};
    args.scheduler.raster_order = RowTileScheduler::RasterOrderOptions::AlongM;  // a 1-D grid
    args.scheduler.tiles = g.tiles;
    args.scheduler.count = g.count;
    return args;
  }

  static size_t workspace(const Problem& p, int) { return RowTileArrays::bytes(p, C::kBlockM, C::kBlockN); }

  static void launch(const Problem& p, void* workspace, int sm_count, cudaStream_t stream) {
    RowTileArrays g(workspace, p);
    // The listing kernel goes before CUTLASS's initialize, as every sm_90a path orders its launches: the runtime
    // launch makes the device's context current on this thread (autograd's backward thread may not have it yet),
    // which the TMA descriptor encoding, a driver call, needs (initialize first: CUDA_ERROR_INVALID_CONTEXT).
    const auto list = p.counts_int32 ? list_row_tiles<int32_t> : list_row_tiles<int64_t>;
    launch_dependent(list, list_blocks(p.num_experts), kListTileThreads, stream, g, p, int{C::kBlockM},
                     int{C::kBlockN});
    typename C::Gemm gemm;
    cutlass::Status status = gemm.initialize(arguments(p, g, sm_count), nullptr, stream);
    TORCH_CHECK(status == cutlass::Status::kSuccess, "grouped_gemm (sm90 row tiles): CUTLASS initialize failed: ",
                cutlassGetStatusString(status));
    status = gemm.run(stream, nullptr, /*launch_with_pdl=*/true);
    TORCH_CHECK(status == cutlass::Status::kSuccess, "grouped_gemm (sm90 row tiles): CUTLASS run failed: ",
                cutlassGetStatusString(status));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

}  // namespace moe_core::cuda::sm90

namespace cutlass::gemm::kernel::detail {
template <class TileShape, class ClusterShape, uint32_t Stages>
struct TileSchedulerSelector<moe_core::cuda::sm90::RowTileSchedulerTag, arch::Sm90, TileShape, ClusterShape, Stages> {
  using Scheduler = moe_core::cuda::sm90::RowTileScheduler;
};
}  // namespace cutlass::gemm::kernel::detail

#endif  // MOE_CORE_WITH_SM90
