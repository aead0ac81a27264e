// Hopper (sm_90a) grouped GEMM on CUTLASS 3.x kernels, behind a CUTLASS-free interface for the op layer
// (grouped_gemm_cuda.cpp): three kernel families (Family in grouped_gemm_sm90_schedule.h), one header each.
//
// Sync-free, two launches per op: one small kernel turns the device-side counts into what the GEMM reads
// (CUTLASS's per-group problem shapes, pointers and strides, or row offsets and a work list) and zero-fills what
// no GEMM tile writes, then the persistent CUTLASS kernel reads them; the host passes only E, shapes and
// pointers, never the counts.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "grouped_gemm_sm90_schedule.h"

namespace moe_core::cuda::sm90 {

// True when this build has the sm_90a kernels (the caller checks that the GPU is compute capability 9.0).
bool compiled();

// Bytes of device workspace `launch` needs (group arrays or work lists, and CUTLASS's own workspace).
size_t workspace_bytes(const Problem& p, int sm_count);

// Enqueues the prepare kernel and the grouped GEMM of p.schedule on `stream`; workspace: workspace_bytes(p)
// bytes, 256-byte aligned, from the caching allocator. Throws (TORCH_CHECK) if this build lacks the kernel or
// CUTLASS rejects the problem.
void launch(const Problem& p, void* workspace, int sm_count, cudaStream_t stream);

namespace detail {
// One kernel's entry points for a dtype and op: defined in grouped_gemm_sm90_common.cuh, instantiated by one
// generated grouped_gemm_sm90_<family>_*.cu file each (MOE_CORE_SM90_INSTANTIATE).
template <Dtype D, Op O, class K>
size_t workspace_bytes(const Problem& p, int sm_count);
template <Dtype D, Op O, class K>
void launch(const Problem& p, void* workspace, int sm_count, cudaStream_t stream);
}  // namespace detail

}  // namespace moe_core::cuda::sm90
