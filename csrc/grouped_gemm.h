// Grouped GEMM shared declarations: the op contract and its boundary checks, used by the CPU and CUDA kernels.
//
// Contract (T routed rows, K reduction width, N output width, E experts):
//   grouped_gemm(x [T, K], weight [E, K, N] or [E, N, K] if trans_weight, tokens_per_expert [E]) -> y [T, N]
//     y[rows of e] = x[rows of e] @ weight[e]  (weight[e]^T when trans_weight); rows are expert-major.
//   grouped_gemm_wgrad(x [T, K], dy [T, N], tokens_per_expert [E], trans_weight) -> dw [E, K, N] ([E, N, K])
//     dw[e] = x_e^T @ dy_e, exactly zero for an expert without rows.
//   grouped_gemm_wgrad_fp32(x, dy, tokens_per_expert, trans_weight) -> dw float32, x and dy float32/bf16/fp16
//     the same product written in float32 from the float32 accumulators: the gradient of a float32 weight that
//     autocast cast to 16 bits (csrc/autocast.cpp), without a 16-bit copy to widen.
//   grouped_gemm_wgrad_accum_(main_grad fp32 [E, K, N] ([E, N, K]), x, dy, tokens_per_expert, trans_weight)
//     main_grad[e] += x_e^T @ dy_e (Megatron's gradient_accumulation_fusion); empty experts add nothing.
#pragma once

#include <ATen/ATen.h>

namespace moe_core {

// Checks shared by every backend; the Python wrapper raises friendlier errors first, these guard direct calls.
void check_forward_inputs(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& tokens_per_expert);
void check_wgrad_inputs(const at::Tensor& x, const at::Tensor& dy, const at::Tensor& tokens_per_expert);
void check_wgrad_fp32_inputs(const at::Tensor& x);  // and check_wgrad_inputs

// grouped_gemm of x (16-bit) and a float32 weight, differentiable: the weight is cast to x's dtype inside, and its
// gradient comes back in float32 from grouped_gemm_wgrad_fp32 (csrc/autograd.cpp; autocast's path, csrc/autocast.cpp).
at::Tensor grouped_gemm_float32_weight(const at::Tensor& x, const at::Tensor& weight,
                                       const at::Tensor& tokens_per_expert, bool trans_weight);

}  // namespace moe_core
