// The row-range wgrad on sm_90a: d[e] = a_e^T b_e over each expert's rows, with static TMA descriptors.
//
// The pointer-array wgrad (grouped_gemm_sm90_ptrarray.cuh) rewrites a group's TMA descriptors on the device whenever a
// CTA moves to another expert, which with 128 experts is nearly every tile. This path keeps the descriptors
// static for any counts: CUTLASS's plain kernel runs a batch over L = E experts whose A and B descriptors cover
// all T rows (batch stride 0); a work tile (row tile of d, column tile, expert e) reads its k-tiles from e's
// first row on (TMA coordinates are element indices, so the start need not be tile-aligned), and the consumer
// warpgroups zero the rows of the last k-tile that lie past e's rows (the next expert's) in shared memory before
// their MMAs. An expert with no rows runs one k-tile read past T (TMA fills zeros) and its tiles store zeros;
// every d[e] is written by the GEMM.
// No host sync: the counts become row offsets and the experts' order by rows (the costliest walked first) in one
// small kernel, and the work units (expert, cluster of tiles) follow from the shapes. pick_schedule keeps the
// pointer-array kernel only where an expert's rows of x outgrow L2; docs/kernels.md has the measurements against
// it and against cuBLAS's batched kernel.
#pragma once

#include "grouped_gemm_sm90_common.cuh"

#if defined(MOE_CORE_WITH_SM90)

#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_scan.cuh>

#include "cutlass/arch/barrier.h"
#include "cutlass/epilogue/thread/activation.h"
#include "cutlass/fast_math.h"

namespace moe_core::cuda::sm90 {

// The reduction of one work tile: the expert's rows [row_start, row_start + rows) in k-tiles. CUTLASS's kernel
// advances its pipelines by the k-tile count, which this converts to.
struct RowRange {
  int32_t row_start = 0;
  int32_t rows = 0;
  int32_t k_tiles = 0;
  CUTLASS_HOST_DEVICE operator int() const { return k_tiles; }
};

// kEmptyEnds: an empty expert's units end a cluster's walk (the accumulating wgrad, RowRangeScheduler).
template <bool kEmptyEnds>
struct RowRangeSchedulerTag {};

// An expert and its rows [begin, end), as the row offsets hold them.
struct RowBounds {
  int64_t begin = 0, end = 0;
  int32_t expert = 0;
};

// Walks the work units u = (i * units_n + unit column) * units_m + unit row, one per cluster of CM x CN CTAs
// (units_m clusters down d[e]'s rows of tiles, units_n across its columns) of the i-th expert e = order[i] by
// rows, most first, so the clusters running at once share an expert's rows in L2, and the CTAs of a cluster
// share the expert (its row range) and their multicast operand tiles. A unit costs about its expert's k-tiles
// plus a fixed epilogue; walked in rounds (AheadWalk) from the costliest down, every cluster ends near the same
// time however skewed the counts (docs/kernels.md). kEmptyEnds (the accumulating wgrad, which leaves an empty
// expert's d[e] untouched): order lists the empty experts last, and a cluster's walk only moves to later units,
// so its first unit of an empty expert ends it.
template <class ClusterShape, bool kEmptyEnds>
class RowRangeScheduler : public AheadWalk<RowRangeScheduler<ClusterShape, kEmptyEnds>, RowBounds> {
  using Walk = AheadWalk<RowRangeScheduler<ClusterShape, kEmptyEnds>, RowBounds>;
  friend Walk;
  using Base = typename Walk::Base;
  static constexpr int kClusterM = cute::size<0>(ClusterShape{}), kClusterN = cute::size<1>(ClusterShape{});

 public:
  struct WorkTileInfo : Base::WorkTileInfo {
    int32_t row_start = 0;
    int32_t rows = 0;
    CUTLASS_HOST_DEVICE static WorkTileInfo invalid_work_tile() { return {}; }
  };
  struct Arguments : Base::Arguments {
    const int64_t* offsets = nullptr;  // [E + 1] row offsets on the device
    const int32_t* order = nullptr;    // [E] the experts by rows, most first
  };
  struct Params : Base::Params {
    const int64_t* offsets = nullptr;
    const int32_t* order = nullptr;
    // Clusters down d[e]'s rows of tiles, and those times the clusters across its columns, as multiply-shift
    // divisors: a work unit's coordinates come from u at every tile, on the consumers' path between the
    // epilogue and the next MMAs, where plain 64-bit divisions stall the tensor cores.
    cutlass::FastDivmodU64 units_m, units_mn;
    uint64_t total = 0;
  };

  template <class ProblemShapeMNKL, class TileShape, class Cluster, class... Rest>
  static Params to_underlying_arguments(ProblemShapeMNKL shape, TileShape tile, Cluster cluster,
                                        cutlass::KernelHardwareInfo const& hw, Arguments const& args, Rest... rest) {
    auto params = Walk::template base_params<Params>(shape, tile, cluster, hw, args, rest...);
    params.offsets = args.offsets;
    params.order = args.order;
    const uint64_t units_m = cute::ceil_div(cute::ceil_div(cute::get<0>(shape), cute::get<0>(tile)), kClusterM);
    const uint64_t units_n = cute::ceil_div(cute::ceil_div(cute::get<1>(shape), cute::get<1>(tile)), kClusterN);
    params.units_m = cutlass::FastDivmodU64(units_m);
    params.units_mn = cutlass::FastDivmodU64(units_m * units_n);
    params.total = units_m * units_n * cute::get<3>(shape);
    return params;
  }

  template <class ProblemShape, class TileShape>
  CUTLASS_HOST_DEVICE static RowRange get_work_k_tile_count(WorkTileInfo const& work, ProblemShape shape,
                                                           TileShape) {
    constexpr int kBlockK = cute::size<2>(TileShape{});
    // An expert without rows (never one under kEmptyEnds) still runs one k-tile, so that its zeros come from the
    // MMAs. It must start at row T, where TMA fills zeros: mma does not mask it (valid == 0), so any other start
    // would sum real rows into d[e].
    if (work.rows == 0) return {static_cast<int32_t>(cute::get<2>(shape)), 0, 1};
    return {work.row_start, work.rows, work.rows / kBlockK + (work.rows % kBlockK != 0)};
  }

  RowRangeScheduler() = default;
  CUTLASS_DEVICE explicit RowRangeScheduler(Params const& params)
      : Walk(params), params_(params), in_cluster_(cute::block_id_in_cluster()) {}

 private:
  CUTLASS_DEVICE uint64_t end() const { return params_.total; }
  CUTLASS_DEVICE RowBounds fetch(uint64_t u) const {
    if (u >= params_.total) return {};
    const int32_t e = params_.order[params_.units_mn.divide(u)];
    return {params_.offsets[e], params_.offsets[e + 1], e};
  }

  // A tile past d[e]'s edge (odd tile counts) still loads and multicasts (TMA fills zeros) and stores nothing.
  CUTLASS_DEVICE WorkTileInfo work(uint64_t u, RowBounds rows) const {
    WorkTileInfo w;
    if (u >= params_.total) return w;
    if constexpr (kEmptyEnds) {
      if (rows.end == rows.begin) return w;
    }
    uint64_t in_expert, row;
    params_.units_mn.divmod(in_expert, u);
    const uint64_t column = params_.units_m.divmod(row, in_expert);
    w.M_idx = static_cast<int32_t>(row) * kClusterM + in_cluster_.x;
    w.N_idx = static_cast<int32_t>(column) * kClusterN + in_cluster_.y;
    w.L_idx = rows.expert;
    w.is_valid_tile = true;
    w.row_start = static_cast<int32_t>(rows.begin);
    w.rows = static_cast<int32_t>(rows.end - rows.begin);
    return w;
  }

  Params params_;
  dim3 in_cluster_;  // read once: each read of the CTA's place in its cluster compiled to a float division
};

}  // namespace moe_core::cuda::sm90

namespace cutlass::gemm::kernel::detail {
template <class TileShape, class ClusterShape, uint32_t Stages, bool kEmptyEnds>
struct TileSchedulerSelector<moe_core::cuda::sm90::RowRangeSchedulerTag<kEmptyEnds>, arch::Sm90, TileShape,
                             ClusterShape, Stages> {
  using Scheduler = moe_core::cuda::sm90::RowRangeScheduler<ClusterShape, kEmptyEnds>;
};
}  // namespace cutlass::gemm::kernel::detail

namespace moe_core::cuda::sm90 {

// CUTLASS's TMA + wgmma mainloop (`Built`, from its collective builder) with each work tile's k-tiles taken
// from its expert's row range instead of from k = 0, and the rows past the range masked.
template <class Built>
struct RowRangeMainloop : Built {
  using typename Built::MainloopPipeline;
  using typename Built::Params;
  using typename Built::PipelineState;
  using typename Built::SmemLayoutA;
  using typename Built::SmemLayoutB;
  using typename Built::TensorStorage;
  using typename Built::TiledMma;
  using typename Built::TileShape;
  using ClusterShape = typename Built::DispatchPolicy::ClusterShape;
  static constexpr int kBlockM = cute::size<0>(TileShape{});
  static constexpr int kBlockN = cute::size<1>(TileShape{});
  static constexpr int kBlockK = cute::size<2>(TileShape{});
  static constexpr int kThreads = cute::size(TiledMma{});  // the consumer warpgroups
  static constexpr int kVector = 16 / sizeof(typename TiledMma::ValTypeA);
  static constexpr int kMmaK = cute::size<2>(typename TiledMma::AtomShape_MNK{});  // one wgmma's k-rows
  static constexpr uint32_t kMaskBarrier = 0;  // a user named barrier (CUTLASS offsets it past its reserved ones)

  // The kernel's tiled views (BLK, BLK_K, m|n, k, l) plus the untiled TMA tensors (m|n, k, l) this load shifts.
  template <class ProblemShapeMNKL>
  CUTLASS_DEVICE auto load_init(ProblemShapeMNKL const& shape, Params const& params) const {
    const auto tiled = Built::load_init(shape, params);
    auto [M, N, K, L] = shape;
    return cute::make_tuple(cute::get<0>(tiled), cute::get<1>(tiled),
                            params.tma_load_a.get_tma_tensor(cute::make_shape(M, K, L)),
                            params.tma_load_b.get_tma_tensor(cute::make_shape(N, K, L)));
  }

  template <class LoadInputs, class BlockCoord, class KTileIterator>
  CUTLASS_DEVICE void load(Params const& params, MainloopPipeline pipeline, PipelineState write,
                           LoadInputs const& inputs, BlockCoord const& blk_coord, KTileIterator, RowRange range, int,
                           uint32_t block_rank, TensorStorage& shared) {
    using namespace cute;
    if (!elect_one_sync()) return;
    Tensor sA = make_tensor(make_smem_ptr(shared.smem_A.data()), SmemLayoutA{});  // (BLK_M, BLK_K, PIPE)
    Tensor sB = make_tensor(make_smem_ptr(shared.smem_B.data()), SmemLayoutB{});  // (BLK_N, BLK_K, PIPE)
    const auto m = get<0>(blk_coord);
    const auto n = get<1>(blk_coord);
    const auto l = get<3>(blk_coord);
    const auto from_row = make_coord(0, range.row_start, 0);
    Tensor gA = local_tile(domain_offset(from_row, get<2>(inputs)), TileShape{}, make_coord(_, _, _),
                           Step<_1, Underscore, _1>{})(_, _, m, _, l);  // (BLK_M, BLK_K, k)
    Tensor gB = local_tile(domain_offset(from_row, get<3>(inputs)), TileShape{}, make_coord(_, _, _),
                           Step<Underscore, _1, _1>{})(_, _, n, _, l);  // (BLK_N, BLK_K, k)
    // In a CM x CN cluster the CN CTAs of a cluster row share (multicast) the A tile, each loading a slice of
    // it for all; likewise the CM CTAs of a column share B.
    const Layout cluster = Layout<ClusterShape>{};  // (m, n) -> rank
    const int cm = block_rank % size<0>(cluster), cn = block_rank / size<0>(cluster);
    auto tma_a = params.tma_load_a.get_slice(cn);
    auto tma_b = params.tma_load_b.get_slice(cm);
    uint16_t mask_a = 0, mask_b = 0;
    for (int j = 0; j < size<1>(cluster); ++j) mask_a |= uint16_t(1) << cluster(cm, j, 0);
    for (int i = 0; i < size<0>(cluster); ++i) mask_b |= uint16_t(1) << cluster(i, cn, 0);
    Tensor tAgA = tma_a.partition_S(gA);  // (TMA, TMA_M, TMA_K, k)
    Tensor tAsA = tma_a.partition_D(sA);  // (TMA, TMA_M, TMA_K, PIPE)
    Tensor tBgB = tma_b.partition_S(gB);
    Tensor tBsB = tma_b.partition_D(sB);
    CUTLASS_PRAGMA_NO_UNROLL
    for (int kt = 0; kt < range.k_tiles; ++kt) {
      pipeline.producer_acquire(write);
      auto* barrier = pipeline.producer_get_barrier(write);
      copy(params.tma_load_a.with(*barrier, mask_a), tAgA(_, _, _, kt), tAsA(_, _, _, write.index()));
      copy(params.tma_load_b.with(*barrier, mask_b), tBgB(_, _, _, kt), tBsB(_, _, _, write.index()));
      ++write;
    }
  }

  // Leaves the last k-tile's stage to CUTLASS's mma_tail, as its own mma does (one wgmma batch in flight).
  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState read, FrgTensorC& accum, RowRange range,
                          int thread_idx, TensorStorage& shared, Params const&) {
    using namespace cute;
    Tensor sA = make_tensor(make_smem_ptr(shared.smem_A.data()), SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(shared.smem_B.data()), SmemLayoutB{});
    TiledMma tiled_mma;
    const int warp_group = __shfl_sync(0xffffffff, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
    auto thread_mma = tiled_mma.get_slice(warp_group * cutlass::NumThreadsPerWarpGroup);
    Tensor tCrA = thread_mma.make_fragment_A(thread_mma.partition_A(sA));  // (MMA, MMA_M, MMA_K, PIPE)
    Tensor tCrB = thread_mma.make_fragment_B(thread_mma.partition_B(sB));  // (MMA, MMA_N, MMA_K, PIPE)
    // The first MMA runs with scale-d off and never reads the accumulators, so they get a definition that costs no
    // instruction. Left undefined, they reach warpgroup_fence_operand (an asm that reads them) as undef, which NVVM
    // materializes as zeros: 64 CS2R a thread at every tile start. Do not clear them in a branch either: NVVM
    // hoists the zeros above it to the same effect, and opaque zeros there make ptxas serialize every wgmma (C7515).
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(accum); ++i) asm volatile("" : "=f"(accum(i)));
    PipelineState release = read;
    tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
    warpgroup_fence_operand(accum);
    // One k-tile's MMAs. A partial k-tile (the expert's last) is masked and skips the wgmmas whose k-rows all lie
    // past the expert, save the first, which sets the accumulators; an empty expert's only k-tile (TMA's zeros)
    // needs no mask. It runs after the loop over the full k-tiles: ptxas fences every wgmma that a branch can skip
    // (C7519), so keep such branches out of the loop, where the fences would slow every tile, equal counts included.
    auto k_tile = [&](int kt, auto partial) {
      pipeline.consumer_wait(read, pipeline.consumer_try_wait(read));
      const int stage = read.index();
      const int valid = range.rows - kt * kBlockK;
      if constexpr (decltype(partial)::value) {
        if (valid > 0) mask_rows_from(sA, sB, stage, valid, thread_idx);
      }
      warpgroup_fence_operand(accum);
      warpgroup_arrive();
      CUTLASS_PRAGMA_UNROLL
      for (int kb = 0; kb < size<2>(tCrA); ++kb) {
        if (!decltype(partial)::value || kb == 0 || kb * kMmaK < valid) {
          gemm(tiled_mma, tCrA(_, _, kb, stage), tCrB(_, _, kb, stage), accum);
          tiled_mma.accumulate_ = GMMA::ScaleOut::One;
        }
      }
      end_k_tile(kt, pipeline, read, release, accum);
    };
    const int full = range.rows / kBlockK;
    CUTLASS_PRAGMA_NO_UNROLL
    for (int kt = 0; kt < full; ++kt) k_tile(kt, cute::false_type{});
    if (full < range.k_tiles) k_tile(full, cute::true_type{});
    warpgroup_fence_operand(accum);
  }

 private:
  // Zeros the k-rows [valid, end of valid's 16-row wgmma) of both operands in `stage`: they hold the next
  // expert's rows (or TMA's zeros past T), and zeroing both keeps a non-finite value there out of this expert's
  // sum (0 x inf is NaN). The rows of the wgmmas that mma skips are never read: leave them, zeroing them only
  // adds shared stores before the barrier. All consumer threads take part and meet before any MMA reads the
  // stage; the fence orders the writes before wgmma's (async proxy) reads.
  template <class TensorA, class TensorB>
  CUTLASS_DEVICE static void mask_rows_from(TensorA& sA, TensorB& sB, int stage, int valid, int thread_idx) {
    const int end = (valid + kMmaK - 1) / kMmaK * kMmaK;
    zero_rows<kBlockM>(sA, stage, valid, end, thread_idx);
    zero_rows<kBlockN>(sB, stage, valid, end, thread_idx);
    cutlass::arch::fence_view_async_shared();
    cutlass::arch::NamedBarrier::sync(kThreads, kMaskBarrier);
  }

  // Zeros k-rows [begin, end). 16-byte vectors: both operands are M/N-major (a and b are row-major [T, m] and
  // [T, n]), so 8 consecutive m (or n) of one k share a swizzle unit.
  template <int kExtent, class SmemTensor>
  CUTLASS_DEVICE static void zero_rows(SmemTensor& s, int stage, int begin, int end, int thread_idx) {
    constexpr int kPerRow = kExtent / kVector;
    for (int i = thread_idx; i < (end - begin) * kPerRow; i += kThreads) {
      *reinterpret_cast<uint4*>(&s(i % kPerRow * kVector, begin + i / kPerRow, stage)) = make_uint4(0, 0, 0, 0);
    }
  }
  static_assert(cutlass::gemm::detail::is_major<0, typename Built::StrideA>() &&
                cutlass::gemm::detail::is_major<0, typename Built::StrideB>(), "A and B must be M/N-major");
};

// kRowRange, 128x256x32 cooperative, cluster 2x1 (the dy tile multicast to two row tiles of d[e]), with CUTLASS's
// TMA epilogue in 128x32 subtiles. 32-row k-tiles fit 8 stages of 24 KB where 64-row ones fit 4 of 48 KB: 168 KB
// of loads can run ahead of the MMAs instead of 144, a tile's last wgmma batch is half as long to wait for, and an
// expert's last k-tile loads at most 31 rows past it instead of 63. Shared memory sets the mainloop's depth: an
// epilogue that takes more of it costs stages. Both operands are M/N-major, so their 128-byte swizzle does not
// depend on the k-tile; the forward's K-major operands would drop to a 64-byte one. The tiles, clusters, k-tile
// heights and epilogues measured against this one are in docs/kernels.md.
//
// The wgrad's epilogue only converts (d = acc, in ElementD: the operands' 16-bit type, or float32), with 32 KB
// of store stages, 4 of 16-bit subtiles instead of the builder's 2 (fewer waits on the previous subtile's store),
// 2 of float32 ones, so the mainloop keeps its depth: LinearCombination's alpha = 1 would cost a multiply per
// element, 128 a thread per tile while the tensor cores wait.
template <class ElementD, class TileShape, bool kAccum>
struct RowRangeEpilogue {
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementD>::value;
  static constexpr int kStagesD = sizeof(ElementD) == 4 ? 2 : 4;
  using CollectiveOp = typename cutlass::epilogue::collective::detail::Sm90TmaBuilderImpl<
      TileShape, cute::Shape<cute::_128, cute::_32>, float, float, void, LayoutD, kAlignD, ElementD, LayoutD,
      kAlignD,
      cutlass::epilogue::fusion::Sm90EVT<
          cutlass::epilogue::fusion::Sm90Compute<cutlass::epilogue::thread::Identity, ElementD, float,
                                                 cutlass::FloatRoundStyle::round_to_nearest>,
          cutlass::epilogue::fusion::Sm90AccFetch>,
      // StagesC (no source: unused), StagesD, values per thread per subtile, ReuseSmemC, DelayTmaStore
      cutlass::epilogue::Sm90TmaWarpSpecialized<4, kStagesD, 16, false, true>>::CollectiveOp;
};

// The accumulating wgrad's: d[e] (fp32 main_grad) = acc + d[e], the source read through the same 128x32 subtiles
// (an add, no alpha or beta multiplies), with the stages CUTLASS's builder picks for a 32-bit source and
// destination: 4 loads whose buffers the 2 stores in flight reuse.
template <class TileShape>
struct RowRangeEpilogue<float, TileShape, true> {
  using LayoutD = cutlass::layout::RowMajor;
  using CollectiveOp = typename cutlass::epilogue::collective::detail::Sm90TmaBuilderImpl<
      TileShape, cute::Shape<cute::_128, cute::_32>, float, float, float, LayoutD, 4, float, LayoutD, 4,
      cutlass::epilogue::fusion::Sm90EVT<
          cutlass::epilogue::fusion::Sm90Compute<cutlass::plus, float, float,
                                                 cutlass::FloatRoundStyle::round_to_nearest>,
          cutlass::epilogue::fusion::Sm90AccFetch, cutlass::epilogue::fusion::Sm90SrcFetch<float>>,
      cutlass::epilogue::Sm90TmaWarpSpecialized<4, 2, 16, true, false>>::CollectiveOp;
};

template <Dtype D, Op O, class K>
struct RowRangeConfig {
  static_assert(O == Op::kWgrad || O == Op::kWgradAccum || O == Op::kWgradFp32);
  static_assert(K::value.mma == Mma::kCooperative, "RowRangeMainloop's k-loop is the cooperative one");
  static constexpr bool kAccum = O == Op::kWgradAccum;
  using Element = typename ElementOf<D>::type;
  using ElementD = std::conditional_t<kAccum || O == Op::kWgradFp32, float, Element>;
  using TileShape = cute::Shape<cute::Int<K::value.tile.m>, cute::Int<K::value.tile.n>, cute::Int<K::value.tile.k>>;
  using ClusterShape = cute::Shape<cute::Int<K::value.cluster.m>, cute::Int<K::value.cluster.n>, cute::_1>;
  using LayoutA = typename LayoutsOf<O>::A;
  using LayoutB = typename LayoutsOf<O>::B;
  using Epilogue = typename RowRangeEpilogue<ElementD, TileShape, kAccum>::CollectiveOp;
  using Built = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, 8, Element, LayoutB, 8, float,
      TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, RowRangeMainloop<Built>,
                                                      Epilogue, RowRangeSchedulerTag<kAccum>>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

// The wgrad's one-block offsets kernel (row_offsets below).
constexpr int kListThreads = 1024;

// Row offsets [E + 1] of the experts, clamped to [0, num_rows] (rows_of), computed by every thread of a block
// of `Threads` threads; on return all threads see them.
template <int Threads, class CountT>
__device__ void scan_row_offsets(const CountT* counts, int64_t experts, int64_t num_rows, int64_t* offsets) {
  using Scan = cub::BlockScan<int64_t, Threads>;
  __shared__ typename Scan::TempStorage temp;
  const int64_t per_thread = (experts + Threads - 1) / Threads;
  const int64_t e0 = min(threadIdx.x * per_thread, experts), e1 = min(e0 + per_thread, experts);
  int64_t mine = 0;
  for (int64_t e = e0; e < e1; ++e) mine += rows_of(counts[e], num_rows);
  int64_t before = 0;
  Scan(temp).ExclusiveSum(mine, before);
  for (int64_t e = e0; e < e1; ++e) {
    offsets[e] = min(before, num_rows);
    before += rows_of(counts[e], num_rows);
  }
  if (threadIdx.x == Threads - 1) offsets[experts] = min(before, num_rows);
  __syncthreads();
}

// order_by_rows ranks up to kSortedExperts experts (one a thread of the listing block); past it they keep their
// own order (with kEmptyLast, the empty ones moved last) and the balance rests on the round walk alone.
constexpr int kSortedExperts = kListThreads;
constexpr int kCountedExperts = 256;

// order: the experts with rows in their own order, then the empty ones (a stable partition); every thread of the
// listing block takes part.
inline __device__ void order_empty_last(const int64_t* offsets, int64_t experts, int32_t* order) {
  using Scan = cub::BlockScan<int64_t, kListThreads>;
  __shared__ typename Scan::TempStorage temp;
  const int64_t per_thread = (experts + kListThreads - 1) / kListThreads;
  const int64_t e0 = min(threadIdx.x * per_thread, experts), e1 = min(e0 + per_thread, experts);
  int64_t mine = 0;
  for (int64_t e = e0; e < e1; ++e) mine += offsets[e + 1] > offsets[e];
  int64_t with_rows = 0, all_with_rows = 0;
  Scan(temp).ExclusiveSum(mine, with_rows, all_with_rows);
  int64_t without_rows = all_with_rows + e0 - with_rows;
  for (int64_t e = e0; e < e1; ++e) {
    order[offsets[e + 1] > offsets[e] ? with_rows++ : without_rows++] = static_cast<int32_t>(e);
  }
}

// order[i]: the expert with the i-th most rows, ties by index. The GEMM waits for it. Up to kCountedExperts, an
// expert's place is the number of experts ahead of it (more rows, or as many and a lower index), its compares
// split over up to a warp of threads and summed by shuffles; above, cub's stable radix sort, descending, over
// the bits num_rows (< 2^31, the row-range rule) can set, which costs the same at any E. (One thread per expert
// counting all the others grows with E^2.)
// Ranked, the empty experts come last; kEmptyLast moves them last in the unranked order too.
template <bool kEmptyLast>
__device__ void order_by_rows(const int64_t* offsets, int64_t experts, int64_t num_rows, int32_t* order) {
  const int count = static_cast<int>(experts), e = threadIdx.x;
  if (experts > kSortedExperts) {
    if constexpr (kEmptyLast) {
      order_empty_last(offsets, experts, order);
    } else {
      for (int64_t i = e; i < experts; i += kListThreads) order[i] = static_cast<int32_t>(i);
    }
  } else if (experts > kCountedExperts) {
    using Sort = cub::BlockRadixSort<uint32_t, kListThreads, 1, int32_t>;
    __shared__ typename Sort::TempStorage temp;
    // Padding threads sort as empty experts behind the real ones (the sort is stable).
    uint32_t rows[1] = {e < count ? static_cast<uint32_t>(offsets[e + 1] - offsets[e]) : 0u};
    int32_t expert[1] = {e};
    Sort(temp).SortDescending(rows, expert, 0, 32 - __clz(static_cast<int>(num_rows)));
    if (e < count) order[e] = expert[0];
  } else {
    __shared__ uint32_t rows[kCountedExperts];
    if (e < count) rows[e] = static_cast<uint32_t>(offsets[e + 1] - offsets[e]);
    __syncthreads();
    // 2^shift threads per expert (at most a warp), each with 8 compares or more (fewer cost more than the shuffles).
    int shift = 0;
    while (shift < 5 && (2 * count << shift) <= kListThreads && (16 << shift) <= count) ++shift;
    const int mine = e >> shift, split = 1 << shift;
    int place = 0;
    for (int j = e & (split - 1); mine < count && j < count; j += split) {
      place += rows[j] > rows[mine] || (rows[j] == rows[mine] && j < mine);
    }
    for (int s = split / 2; s > 0; s /= 2) place += __shfl_down_sync(0xffffffffu, place, s, split);
    if (mine < count && (e & (split - 1)) == 0) order[place] = mine;
  }
}

template <class CountT, bool kEmptyLast>
__global__ void __launch_bounds__(kListThreads) row_offsets(const CountT* counts, Problem p, int64_t* offsets,
                                                            int32_t* order) {
  wait_for_previous_kernels();               // launched as a programmatic dependent (launch_dependent)
  cutlass::arch::launch_dependent_grids();   // the GEMM may start; its scheduler waits for the offsets
  scan_row_offsets<kListThreads>(counts, p.num_experts, p.num_rows, offsets);
  order_by_rows<kEmptyLast>(offsets, p.num_experts, p.num_rows, order);
}

template <Dtype D, Op O, class K>
struct Runner<D, O, K, Family::kRowRange> {
  using C = RowRangeConfig<D, O, K>;

  static typename C::Gemm::Arguments arguments(const Problem& p, const int64_t* offsets, const int32_t* order,
                                               int sm_count) {
    typename C::Kernel::StrideA stride_a{};  // a [T, m]: M-contiguous, every expert reads all T rows
    cute::get<1>(stride_a) = p.m;
    typename C::Kernel::StrideB stride_b{};  // b [T, n]: N-contiguous
    cute::get<1>(stride_b) = p.n;
    typename C::Kernel::StrideD stride_d{};  // d [E, m, n]
    cute::get<0>(stride_d) = p.n;
    cute::get<2>(stride_d) = p.m * p.n;
    cutlass::KernelHardwareInfo hw;
    hw.sm_count = sm_count;
    typename C::Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {static_cast<int>(p.m), static_cast<int>(p.n), static_cast<int>(p.num_rows),
         static_cast<int>(p.num_experts)},
        {static_cast<const typename C::Element*>(p.a), stride_a, static_cast<const typename C::Element*>(p.b),
         stride_b},
        {{}, nullptr, stride_d, static_cast<typename C::ElementD*>(p.d), stride_d},
        hw};
    if constexpr (C::kAccum) args.epilogue.ptr_C = static_cast<const float*>(p.d);  // d[e] += acc: the source is d
    // The walk is RowRangeScheduler's own; AlongM only fixes the launch grid's shape (a 1-D row of clusters).
    args.scheduler.raster_order = decltype(args.scheduler.raster_order)::AlongM;
    args.scheduler.offsets = offsets;
    args.scheduler.order = order;
    return args;
  }

  // The row offsets [E + 1], then the experts' order [E].
  static size_t workspace(const Problem& p, int) {
    using W = WorkspaceCarver;
    return W::bytes((p.num_experts + 1) * sizeof(int64_t)) + W::bytes(p.num_experts * sizeof(int32_t));
  }

  static void launch(const Problem& p, void* workspace, int sm_count, cudaStream_t stream) {
    WorkspaceCarver w{static_cast<char*>(workspace)};
    auto* offsets = w.take<int64_t>((p.num_experts + 1) * sizeof(int64_t));
    auto* order = w.take<int32_t>(p.num_experts * sizeof(int32_t));
    if (p.counts_int32) {
      launch_dependent(row_offsets<int32_t, C::kAccum>, 1, kListThreads, stream,
                       static_cast<const int32_t*>(p.counts), p, offsets, order);
    } else {
      launch_dependent(row_offsets<int64_t, C::kAccum>, 1, kListThreads, stream,
                       static_cast<const int64_t*>(p.counts), p, offsets, order);
    }
    typename C::Gemm gemm;
    cutlass::Status status = gemm.initialize(arguments(p, offsets, order, sm_count), nullptr, stream);
    TORCH_CHECK(status == cutlass::Status::kSuccess, "grouped_gemm (sm90 row-range wgrad): CUTLASS initialize "
                "failed: ", cutlassGetStatusString(status));
    status = gemm.run(stream, nullptr, /*launch_with_pdl=*/true);
    TORCH_CHECK(status == cutlass::Status::kSuccess, "grouped_gemm (sm90 row-range wgrad): CUTLASS run failed: ",
                cutlassGetStatusString(status));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

}  // namespace moe_core::cuda::sm90

#endif  // MOE_CORE_WITH_SM90
