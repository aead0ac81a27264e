// Dispatch over the sm_90a kernels this build has (grouped_gemm_sm90_instances.inc).
#include <c10/util/Exception.h>

#include "grouped_gemm_sm90.h"

namespace moe_core::cuda::sm90 {
namespace {

#if defined(MOE_CORE_SM90_TUNING)
constexpr bool kTuningBuilt = true;
#else
constexpr bool kTuningBuilt = false;
#endif

// Runs (bytes == nullptr) or sizes the workspace of kernel K for dtype D and op O if p asks for it; a tuning
// kernel this build left out is never referenced.
template <Dtype D, Op O, class K, bool kTuning>
bool run_if_picked(const Problem& p, void* workspace, int sm_count, cudaStream_t stream, size_t* bytes) {
  if constexpr (kTuning && !kTuningBuilt) {
    return false;
  } else {
    if (p.dtype != D || p.op != O || p.schedule.kernel != K::value) return false;
    if (bytes) *bytes = detail::workspace_bytes<D, O, K>(p, sm_count);
    else detail::launch<D, O, K>(p, workspace, sm_count, stream);
    return true;
  }
}

void dispatch(const Problem& p, void* workspace, int sm_count, cudaStream_t stream, size_t* bytes) {
#if defined(MOE_CORE_WITH_SM90)
  const bool ran =
#define MOE_CORE_SM90_INSTANCE(DTYPE, OP, FAMILY, BM, BN, BK, CM, CN, MMA, TUNING)                             \
  run_if_picked<Dtype::DTYPE, Op::OP, ConfigType<Family::FAMILY, BM, BN, BK, CM, CN, Mma::MMA>, TUNING>(   \
      p, workspace, sm_count, stream, bytes) ||
#include "grouped_gemm_sm90_instances.inc"
#undef MOE_CORE_SM90_INSTANCE
      false;
  if (ran) return;
  bool tuning = false;
  TORCH_CHECK(!listed(p.dtype, p.op, p.schedule.kernel, &tuning) || !tuning, "grouped_gemm (sm90): ",
              describe(p.schedule.kernel), " (forced by MOE_CORE_GEMM_TILE) is a tuning kernel this build leaves "
              "out; rebuild with MOE_CORE_SM90_TUNING=1 to run it");
  TORCH_CHECK(false, "grouped_gemm (sm90): no ", describe(p.schedule.kernel), " kernel is built for ",
              describe(p.op), p.dtype == Dtype::kBf16 ? " in bf16" : " in fp16");
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

size_t workspace_bytes(const Problem& p, int sm_count) {
  size_t bytes = 0;
  dispatch(p, nullptr, sm_count, nullptr, &bytes);
  return bytes;
}

void launch(const Problem& p, void* workspace, int sm_count, cudaStream_t stream) {
  dispatch(p, workspace, sm_count, stream, nullptr);
}

}  // namespace moe_core::cuda::sm90
