// What the sm_90a kernel families share (grouped_gemm_sm90_{rowtile,rowrange,ptrarray}.cuh): element types and
// layouts, the workspace carver, the counts' row arithmetic, PDL launches, the round walk of the persistent
// schedulers, and the entry points that one generated grouped_gemm_sm90_<family>_*.cu file instantiates each.
#pragma once

#include "grouped_gemm_sm90.h"

#if !defined(MOE_CORE_WITH_SM90)
// Built without the sm_90a target: the instantiation files compile to nothing and compiled() is false.
#define MOE_CORE_SM90_INSTANTIATE(DTYPE, OP, FAMILY, BM, BN, BK, CM, CN, MMA)
#else

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cub/block/block_reduce.cuh>

#include <algorithm>
#include <type_traits>
#include <utility>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"

namespace moe_core::cuda::sm90 {

template <Dtype D> struct ElementOf;
template <> struct ElementOf<Dtype::kBf16> { using type = cutlass::bfloat16_t; };
template <> struct ElementOf<Dtype::kFp16> { using type = cutlass::half_t; };

// Layouts in CUTLASS's (M, N, K) terms. Forward: A = x_e [M_e, K] K-contiguous; B = w_e, N-contiguous ([K, N])
// or K-contiguous ([N, K]); D = y_e [M_e, N]. Wgrad: A = a_e^T with a_e [T_e, m] read M-contiguous,
// B = b_e [T_e, n] N-contiguous, D = d[e] [m, n].
template <Op O> struct LayoutsOf {
  using A = std::conditional_t<O == Op::kForwardKN || O == Op::kForwardNK, cutlass::layout::RowMajor,
                               cutlass::layout::ColumnMajor>;
  using B = std::conditional_t<O == Op::kForwardNK, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
};

// Consecutive 256-byte-aligned arrays in one device workspace: `bytes` sizes them, `take` hands them out in
// the same order.
struct WorkspaceCarver {
  static constexpr size_t kAlign = 256;
  static size_t bytes(size_t array_bytes) { return (array_bytes + kAlign - 1) / kAlign * kAlign; }
  char* next;
  template <class T>
  T* take(size_t array_bytes) {
    T* array = reinterpret_cast<T*>(next);
    next += bytes(array_bytes);
    return array;
  }
};

constexpr int kPrepareThreads = 256;

// An expert's count as rows: negative counts are empty, and none exceeds T, so sums over experts cannot wrap
// (bad counts, unchecked on the device, may mis-assign rows but never reach memory outside the operands).
template <class CountT>
__device__ __forceinline__ int64_t rows_of(CountT count, int64_t num_rows) {
  return min(max(static_cast<int64_t>(count), int64_t{0}), num_rows);
}

// The rows of experts [0, end) summed, on every thread of a block of kPrepareThreads threads.
template <class CountT>
__device__ int64_t rows_before(const CountT* counts, int64_t end, int64_t num_rows) {
  using Reduce = cub::BlockReduce<int64_t, kPrepareThreads>;
  __shared__ typename Reduce::TempStorage temp;
  __shared__ int64_t total;
  int64_t partial = 0;
  for (int64_t i = threadIdx.x; i < end; i += kPrepareThreads) partial += rows_of(counts[i], num_rows);
  const int64_t sum = Reduce(temp).Sum(partial);
  if (threadIdx.x == 0) total = sum;
  __syncthreads();
  return total;
}

// griddepcontrol.wait: returns once the kernels this one depends on (PDL) have finished and their writes are
// visible. The memory clobber keeps the compiler from moving plain loads and stores above it
// (cutlass::arch::wait_on_dependent_grids has none).
__device__ __forceinline__ void wait_for_previous_kernels() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Launches `kernel` as a programmatic dependent of the stream's previous kernel (PDL): its blocks may start
// while that kernel drains, and must run wait_for_previous_kernels() before touching global memory. Hides the
// launch latency of the small kernels that list an op's work.
template <class... Params, class... Args>
void launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{grid, block, 0, stream, &attribute, 1};
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

// Zeros bytes [begin, end) of `base` (16-byte multiples) with `blocks` blocks, of which this is `block`.
__device__ __forceinline__ void zero_fill(void* base, int64_t begin, int64_t end, int64_t block, int64_t blocks) {
  auto* out = static_cast<uint4*>(base);
  const int64_t step = blocks * blockDim.x;
  for (int64_t i = begin / 16 + block * blockDim.x + threadIdx.x; i < end / 16; i += step) {
    out[i] = make_uint4(0, 0, 0, 0);
  }
}

// CUTLASS's static persistent scheduler walking units of our own in rounds of G (the clusters, or CTAs when
// unclustered): in round s, cluster c takes unit s G + c when s is even and s G + G - 1 - c when s is odd. The
// units running at once are those of plain round robin (c, c + G, ...), so L2 sees the same working set, but a
// cluster that drew a round's costliest unit draws its cheapest next: where unit costs fall along the walk (the
// wgrad's experts sorted by rows), the clusters' totals stay level instead of the first clusters' piling up (a
// static, serpentine stand-in for Graham's Longest Processing Time first, 1969, which would hand each unit to
// the least-loaded cluster). `Derived` supplies `fetch(u)` (the part of unit u in global memory), `work(u,
// fetched)` (its WorkTileInfo, invalid from `end()` on) and `end()`. Each fetch is issued one unit ahead, so its
// latency hides behind the current unit's MMAs instead of stalling the consumers between tiles.
template <class Derived, class Fetched>
class AheadWalk : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90 {
 protected:
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;

  // CUTLASS's Params (grid shape and the like) inside the derived scheduler's own.
  template <class DerivedParams, class... Args>
  static DerivedParams base_params(Args const&... args) {
    DerivedParams params;
    static_cast<Base::Params&>(params) = Base::to_underlying_arguments(args...);
    return params;
  }

 public:
  AheadWalk() = default;
  template <class DerivedParams>
  CUTLASS_DEVICE explicit AheadWalk(DerivedParams const& params) : Base(params) {
    // The kernel launches as a programmatic dependent of the one that lists its work (PDL), and every thread
    // reads that list: all wait here, before the derived scheduler's first read (CUTLASS's own waits cover only
    // its load warps, after the scheduler is built).
    wait_for_previous_kernels();
    const dim3 id = cute::cluster_id_in_grid(), clusters = cute::cluster_grid_dims();
    grid_ = uint64_t(clusters.x) * clusters.y * clusters.z;
    const uint64_t cluster = id.x + (uint64_t(id.y) + uint64_t(id.z) * clusters.y) * clusters.x;
    next_ = cluster;
    // From an even round's unit to the next odd round's is 2 G - 1 - 2 c, from there to the next even's 2 c + 1.
    step_ = 2 * (grid_ - cluster) - 1;
  }

  template <class ClusterShape>
  CUTLASS_DEVICE auto initial_work_tile_info(ClusterShape) {
    const Fetched first = self().fetch(next_);
    ahead_ = self().fetch(next_ + step_);
    return self().work(next_, first);
  }

  template <class Work>
  CUTLASS_DEVICE auto fetch_next_work(Work) {
    next_ += step_;
    step_ = 2 * grid_ - step_;
    const auto next = self().work(next_, ahead_);
    ahead_ = self().fetch(next_ + step_);
    return cute::make_tuple(next, true);
  }
  template <class Work, class Pipeline, class PipelineState>
  CUTLASS_DEVICE auto fetch_next_work(Work current, Pipeline&, PipelineState) {
    return fetch_next_work(current);
  }

  // Units grow along a cluster's walk; an even number of rounds ahead keeps the parity (G units per round).
  template <class Work>
  CUTLASS_DEVICE bool is_last_tile(Work&, uint32_t advance = 1) const {
    const uint64_t unit = advance % 2 ? next_ + step_ + grid_ * (advance - 1) : next_ + grid_ * advance;
    return unit >= self().end();
  }

 private:
  CUTLASS_DEVICE Derived& self() { return static_cast<Derived&>(*this); }
  CUTLASS_DEVICE Derived const& self() const { return static_cast<Derived const&>(*this); }

  uint64_t next_ = 0, grid_ = 1, step_ = 1;  // step_: from this cluster's unit to its next
  Fetched ahead_{};
};

// Ends k-tile kt of a consumer's own MMA loop, as CUTLASS's mainloop does: commits its wgmmas, then, once at
// most those are in flight, hands the previous k-tile's stage back to the producer.
template <class Pipeline, class PipelineState, class Accumulators>
CUTLASS_DEVICE void end_k_tile(int kt, Pipeline& pipeline, PipelineState& read, PipelineState& release,
                               Accumulators& accum) {
  cute::warpgroup_commit_batch();
  if (kt > 0) {
    cute::warpgroup_wait<1>();
    cute::warpgroup_fence_operand(accum);
    pipeline.consumer_release(release);
    ++release;
  }
  ++read;
}

// A kernel's host side for a dtype and op: `workspace(p, sm_count)` and `launch(p, workspace, sm_count, stream)`.
// Each family's header specializes it for its Family.
template <Dtype D, Op O, class K, Family F = K::value.family>
struct Runner;

namespace detail {
template <Dtype D, Op O, class K>
size_t workspace_bytes(const Problem& p, int sm_count) { return Runner<D, O, K>::workspace(p, sm_count); }
template <Dtype D, Op O, class K>
void launch(const Problem& p, void* workspace, int sm_count, cudaStream_t stream) {
  Runner<D, O, K>::launch(p, workspace, sm_count, stream);
}
}  // namespace detail

}  // namespace moe_core::cuda::sm90

// The one kernel a generated grouped_gemm_sm90_<family>_*.cu file compiles (grouped_gemm_sm90_instances.inc lists
// them with the same arguments).
#define MOE_CORE_SM90_INSTANTIATE(DTYPE, OP, FAMILY, BM, BN, BK, CM, CN, MMA)                           \
  namespace moe_core::cuda::sm90::detail {                                                             \
  using kInstantiated = ConfigType<Family::FAMILY, BM, BN, BK, CM, CN, Mma::MMA>;                           \
  template size_t workspace_bytes<Dtype::DTYPE, Op::OP, kInstantiated>(const Problem&, int);           \
  template void launch<Dtype::DTYPE, Op::OP, kInstantiated>(const Problem&, void*, int, cudaStream_t); \
  }

#endif  // MOE_CORE_WITH_SM90
