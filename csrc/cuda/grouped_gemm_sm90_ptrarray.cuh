// The pointer-array kernel on sm_90a: CUTLASS 3.x's pointer-array grouped GEMM (TMA loads, wgmma,
// warp-specialized persistent CTAs, the group tile scheduler) plus the prepare kernel that feeds it from
// device-side offsets. Any CTA tile, cluster and consumer schedule (KernelConfig); the walk (raster, swizzle)
// is a run-time argument. The family that takes what the row kernels cannot (T = 0, the accumulating wgrad,
// very large experts, the limits in docs/kernels.md).
#pragma once

#include "grouped_gemm_sm90_common.cuh"

#if defined(MOE_CORE_WITH_SM90)

#include <array>
#include <mutex>

#include "cutlass/gemm/group_array_problem_shape.hpp"

namespace moe_core::cuda::sm90 {

// CUTLASS's kernel and epilogue schedules for a KernelConfig's Mma: cooperative, both consumer warpgroups on one
// tile; pingpong, each on its own tile, so one's epilogue overlaps the other's MMAs.
template <Mma M> struct PtrArraySchedules {
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
template <> struct PtrArraySchedules<Mma::kPingpong> {
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};

// CUTLASS's shapes of a KernelConfig: the CTA tile and the cluster.
template <class K>
struct CuteShapes {
  using Tile = cute::Shape<cute::Int<K::value.tile.m>, cute::Int<K::value.tile.n>, cute::Int<K::value.tile.k>>;
  using Cluster = cute::Shape<cute::Int<K::value.cluster.m>, cute::Int<K::value.cluster.n>, cute::_1>;
};

template <Dtype D, Op O, class K>
struct PtrArrayConfig {
  static constexpr Op kOp = O;
  static constexpr bool kForward = O == Op::kForwardKN || O == Op::kForwardNK;
  static constexpr bool kAccum = O == Op::kWgradAccum;
  static constexpr bool kZeroEmpty = O == Op::kWgrad || O == Op::kWgradFp32;  // empty experts' d[e] = 0
  using Element = typename ElementOf<D>::type;
  using ElementD = std::conditional_t<kAccum || O == Op::kWgradFp32, float, Element>;
  using ElementC = std::conditional_t<kAccum, float, void>;  // void: no source read, beta is 0
  using LayoutA = typename LayoutsOf<O>::A;
  using LayoutB = typename LayoutsOf<O>::B;
  using LayoutD = cutlass::layout::RowMajor;
  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
  static constexpr int kAlign = 8;                                        // 16 bytes of bf16/fp16
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementD>::value;

  using TileShape = typename CuteShapes<K>::Tile;
  using ClusterShape = typename CuteShapes<K>::Cluster;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      ElementC, LayoutD*, kAlignD, ElementD, LayoutD*, kAlignD,
      typename PtrArraySchedules<K::value.mma>::Epilogue,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, ElementC, float>>::CollectiveOp;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA*, kAlign, Element, LayoutB*, kAlign,
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename PtrArraySchedules<K::value.mma>::Kernel>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using Shape = typename ProblemShape::UnderlyingProblemShape;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideC = typename Kernel::InternalStrideC;
  using StrideD = typename Kernel::InternalStrideD;
  using PtrC = std::conditional_t<kAccum, const float*, const void*>;
};

// The per-group arrays CUTLASS reads, carved out of one workspace ahead of CUTLASS's own; for wgrad also
// `zeros`, one row of each operand (m + n elements) that empty experts' groups read.
template <class C>
struct GroupArrays {
  typename C::Shape* shapes = nullptr;
  const typename C::Element** a = nullptr;
  const typename C::Element** b = nullptr;
  typename C::PtrC* c = nullptr;
  typename C::ElementD** d = nullptr;
  typename C::StrideA* stride_a = nullptr;
  typename C::StrideB* stride_b = nullptr;
  typename C::StrideC* stride_c = nullptr;
  typename C::StrideD* stride_d = nullptr;
  typename C::Element* zeros = nullptr;
  void* cutlass_workspace = nullptr;

  static size_t zeros_bytes(const Problem& p) {
    return C::kZeroEmpty ? (p.m + p.n) * sizeof(typename C::Element) : 0;
  }
  static size_t bytes(const Problem& p) {
    const int64_t e = p.num_experts;
    using W = WorkspaceCarver;
    return W::bytes(e * sizeof(typename C::Shape)) + 4 * W::bytes(e * sizeof(void*)) +
           W::bytes(e * sizeof(typename C::StrideA)) + W::bytes(e * sizeof(typename C::StrideB)) +
           W::bytes(e * sizeof(typename C::StrideC)) + W::bytes(e * sizeof(typename C::StrideD)) +
           W::bytes(zeros_bytes(p));
  }

  GroupArrays() = default;  // unplaced: enough for CUTLASS's workspace query, which reads no pointer
  GroupArrays(void* workspace, const Problem& p) {
    const int64_t e = p.num_experts;
    WorkspaceCarver w{static_cast<char*>(workspace)};
    shapes = w.take<typename C::Shape>(e * sizeof(typename C::Shape));
    a = w.take<const typename C::Element*>(e * sizeof(void*));
    b = w.take<const typename C::Element*>(e * sizeof(void*));
    c = w.take<typename C::PtrC>(e * sizeof(void*));
    d = w.take<typename C::ElementD*>(e * sizeof(void*));
    stride_a = w.take<typename C::StrideA>(e * sizeof(typename C::StrideA));
    stride_b = w.take<typename C::StrideB>(e * sizeof(typename C::StrideB));
    stride_c = w.take<typename C::StrideC>(e * sizeof(typename C::StrideC));
    stride_d = w.take<typename C::StrideD>(e * sizeof(typename C::StrideD));
    zeros = w.take<typename C::Element>(zeros_bytes(p));
    cutlass_workspace = w.next;
  }
};

// A packed 2-D operand's stride with leading dimension `ld`: whichever of the first two modes is not the
// static unit stride gets ld (the batch mode stays 0: groups are addressed by pointer).
template <class Stride>
__device__ __forceinline__ Stride leading_stride(int64_t ld) {
  Stride s{};
  if constexpr (cute::is_static<cute::remove_cvref_t<decltype(cute::get<0>(s))>>::value) cute::get<1>(s) = ld;
  else cute::get<0>(s) = ld;
  return s;
}

// Grid (1 + fill blocks, E); replaces a separate offsets scan, so an op is two launches. Column 0: block
// (0, e) sums the counts before e and its thread 0 writes group e's problem shape, pointers and strides.
// Columns 1.. (wgrad only) write zeros that no GEMM tile covers: the d[e] of an expert whose count is 0,
// streamed at store bandwidth; its group
// gets M = 0 (CUTLASS leaves the accumulators of a zero-length reduction uninitialized: its first wgmma with
// ScaleOut::Zero sits inside `if (k_tile_count > 0)`). An expert whose rows bad counts clamp away (count > 0,
// no rows left) is found only by the prefix sum, which fill blocks skip: its group is instead a full [m, n]
// product over one row of zeros (`g.zeros`, written by expert 0's fill blocks), so the epilogue writes its
// zeros. Accumulating, an empty expert gets M = 0 and stays untouched.
template <class C, class CountT>
__global__ void __launch_bounds__(kPrepareThreads) prepare_groups(GroupArrays<C> g, Problem p) {
  using Element = typename C::Element;
  const auto* counts = static_cast<const CountT*>(p.counts);
  const int64_t e = blockIdx.y;
  auto* d = static_cast<typename C::ElementD*>(p.d);
  if (blockIdx.x > 0) {
    if constexpr (C::kZeroEmpty) {
      constexpr int64_t kBytesD = sizeof(typename C::ElementD);
      if (e == 0) zero_fill(g.zeros, 0, (p.m + p.n) * sizeof(Element), blockIdx.x - 1, gridDim.x - 1);
      if (counts[e] > 0) return;
      zero_fill(d, e * p.m * p.n * kBytesD, (e + 1) * p.m * p.n * kBytesD, blockIdx.x - 1, gridDim.x - 1);
    }
    return;
  }
  const int64_t before = rows_before(counts, e, p.num_rows);
  if (threadIdx.x != 0) return;
  const int64_t count = max(static_cast<int64_t>(counts[e]), int64_t{0});
  const int64_t r0 = min(before, p.num_rows), r1 = min(before + rows_of(counts[e], p.num_rows), p.num_rows);
  const auto* a = static_cast<const Element*>(p.a);
  const auto* b = static_cast<const Element*>(p.b);
  if constexpr (C::kForward) {
    g.shapes[e] = {static_cast<int>(r1 - r0), static_cast<int>(p.n), static_cast<int>(p.k)};
    g.a[e] = a + r0 * p.k;
    g.b[e] = b + e * p.k * p.n;
    g.d[e] = d + r0 * p.n;
    g.stride_a[e] = leading_stride<typename C::StrideA>(p.k);
    g.stride_b[e] = leading_stride<typename C::StrideB>(C::kOp == Op::kForwardKN ? p.n : p.k);
  } else {
    const bool clamped_away = r1 == r0 && count > 0 && !C::kAccum;
    g.shapes[e] = {r1 > r0 || clamped_away ? static_cast<int>(p.m) : 0, static_cast<int>(p.n),
                   clamped_away ? 1 : static_cast<int>(r1 - r0)};
    g.a[e] = clamped_away ? g.zeros : a + r0 * p.m;
    g.b[e] = clamped_away ? g.zeros + p.m : b + r0 * p.n;
    g.d[e] = d + e * p.m * p.n;
    g.stride_a[e] = leading_stride<typename C::StrideA>(p.m);
    g.stride_b[e] = leading_stride<typename C::StrideB>(p.n);
  }
  g.c[e] = reinterpret_cast<typename C::PtrC>(g.d[e]);
  g.stride_c[e] = leading_stride<typename C::StrideC>(p.n);
  g.stride_d[e] = leading_stride<typename C::StrideD>(p.n);
}

template <Dtype D, Op O, class K>
struct Runner<D, O, K, Family::kPtrArray> {
  using C = PtrArrayConfig<D, O, K>;

  static typename C::Gemm::Arguments arguments(const Problem& p, const GroupArrays<C>& g, int sm_count) {
    using RasterOrder = typename C::Kernel::TileScheduler::RasterOrderOptions;
    cutlass::KernelHardwareInfo hw;
    hw.sm_count = sm_count;
    typename C::Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGrouped,
        {static_cast<int>(p.num_experts), g.shapes, nullptr},
        {g.a, g.stride_a, g.b, g.stride_b},
        {{}, g.c, g.stride_c, g.d, g.stride_d},
        hw};
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = C::kAccum ? 1.0f : 0.0f;
    args.scheduler.raster_order = p.schedule.raster == Raster::kAlongN ? RasterOrder::AlongN : RasterOrder::AlongM;
    args.scheduler.max_swizzle_size = p.schedule.swizzle;
    return args;
  }

  static size_t workspace(const Problem& p, int sm_count) {
    return GroupArrays<C>::bytes(p) + C::Gemm::get_workspace_size(arguments(p, GroupArrays<C>{}, sm_count));
  }

  // Fill blocks per expert, exiting at once unless there is something to zero. Wgrad: up to 64 per empty expert
  // stream its d[e] at about store bandwidth. The forward leaves the rows past the counts' sum unwritten, and
  // accumulating wgrad writes no zeros.
  static int fill_blocks(const Problem& p) {
    if (C::kAccum || C::kForward) return 0;
    const int64_t chunks = p.m * p.n * static_cast<int64_t>(sizeof(typename C::ElementD)) / 16;
    return static_cast<int>(std::clamp<int64_t>((chunks + kPrepareThreads * 4 - 1) / (kPrepareThreads * 4), 1, 64));
  }

  // CUTLASS's Params depend only on the workspace address and layout (group arrays, the zero rows, per-SM
  // tensormap slots), E, the SM count and the schedule: the TMA descriptors are built on placeholder
  // addresses and rewritten per group on the device. Building them (descriptor encoding, checks) costs tens
  // of microseconds of host time, so recent ones are kept; the caching allocator hands the same workspace
  // back in steady state.
  struct Key {
    int device = -1;
    void* workspace = nullptr;
    int64_t num_experts = 0;
    size_t zeros_bytes = 0;
    int sm_count = 0;
    Raster raster = Raster::kAlongM;
    int swizzle = 0;
    bool operator==(const Key& o) const {
      return device == o.device && workspace == o.workspace && num_experts == o.num_experts &&
             zeros_bytes == o.zeros_bytes && sm_count == o.sm_count && raster == o.raster && swizzle == o.swizzle;
    }
  };

  static typename C::Gemm::Params params_for(const Problem& p, const GroupArrays<C>& g, void* workspace,
                                             int sm_count, cudaStream_t stream) {
    static std::mutex mutex;
    static std::array<std::pair<Key, typename C::Gemm::Params>, 8> cache;
    static size_t next = 0;
    Key key{-1, workspace, p.num_experts, GroupArrays<C>::zeros_bytes(p), sm_count, p.schedule.raster,
            p.schedule.swizzle};
    C10_CUDA_CHECK(cudaGetDevice(&key.device));
    const std::lock_guard<std::mutex> lock(mutex);
    for (const auto& [cached_key, params] : cache) {
      if (cached_key == key) return params;
    }
    typename C::Gemm gemm;
    const auto args = arguments(p, g, sm_count);
    cutlass::Status status = gemm.can_implement(args);
    TORCH_CHECK(status == cutlass::Status::kSuccess, "grouped_gemm (sm90): CUTLASS cannot implement the problem: ",
                cutlassGetStatusString(status));
    status = gemm.initialize(args, g.cutlass_workspace, stream);  // also raises the kernel's shared memory limit
    TORCH_CHECK(status == cutlass::Status::kSuccess, "grouped_gemm (sm90): CUTLASS initialize failed: ",
                cutlassGetStatusString(status));
    cache[next] = {key, gemm.params()};
    next = (next + 1) % cache.size();
    return gemm.params();
  }

  static void launch(const Problem& p, void* workspace, int sm_count, cudaStream_t stream) {
    GroupArrays<C> g(workspace, p);
    const dim3 grid(1 + fill_blocks(p), static_cast<unsigned>(p.num_experts));
    if (p.counts_int32) prepare_groups<C, int32_t><<<grid, kPrepareThreads, 0, stream>>>(g, p);
    else prepare_groups<C, int64_t><<<grid, kPrepareThreads, 0, stream>>>(g, p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    auto params = params_for(p, g, workspace, sm_count, stream);
    const cutlass::Status status = C::Gemm::run(params, stream);
    TORCH_CHECK(status == cutlass::Status::kSuccess, "grouped_gemm (sm90): CUTLASS run failed: ",
                cutlassGetStatusString(status));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

}  // namespace moe_core::cuda::sm90

#endif  // MOE_CORE_WITH_SM90
