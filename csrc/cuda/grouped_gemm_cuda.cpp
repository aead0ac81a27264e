// CUDA implementations of the three grouped GEMM ops (schemas in csrc/ops.cpp, CPU twins in
// csrc/grouped_gemm_cpu.cpp). tokens_per_expert is never read on the host: device kernels turn it into the
// row ranges the GEMM kernels read, so each op is a fixed sequence of launches whatever the counts (T == 0
// and all-empty included) and capturable in a CUDA graph.
//
// Two back ends: on Hopper, bf16/fp16 with 16-byte aligned operands and widths take CUTLASS's sm_90a
// kernels (grouped_gemm_sm90.h); everything else (other GPUs, fp32/fp64, odd widths) takes the
// portable kernels of grouped_gemm_kernels.h. MOE_CORE_GEMM_DEBUG=1 prints the choice per call;
// MOE_CORE_GEMM_PORTABLE=1 forces the portable kernels (for tests and comparisons).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>

#include "grouped_gemm.h"
#include "grouped_gemm_kernels.h"
#include "grouped_gemm_sm90.h"

namespace moe_core {
namespace {

using cuda::GemmKind;
using cuda::GroupedGemmArgs;

void check_on_device(const at::Tensor& t, const char* name, const at::Device& device) {
  TORCH_CHECK(t.device() == device, name, ": expected a tensor on ", device, ", got ", t.device());
}

void check_dtype(const at::Tensor& x) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat || dtype == at::kDouble,
              "x: expected bfloat16, float16, float32 or float64, got ", dtype);
}

// Counts on the GPU stay there; CPU counts are copied over asynchronously (the copy enqueues, no sync on the
// values). Returns them contiguous on x's device.
at::Tensor counts_on(const at::Tensor& tokens_per_expert, const at::Device& device) {
  return tokens_per_expert.to(device, /*non_blocking=*/true).contiguous();
}

// Row offsets [E + 1] then forward tile offsets [E + 1], computed on the device.
at::Tensor device_offsets(const at::Tensor& counts, int64_t num_rows, int64_t tile_rows, cudaStream_t stream) {
  auto workspace = at::empty({2 * counts.numel() + 2}, counts.options().dtype(at::kLong));
  cuda::launch_row_offsets(counts, workspace, num_rows, tile_rows, stream);
  return workspace;
}

// 16-byte vector loads need an aligned base and leading dimension (and expert stride) in whole vectors.
bool vector_ok(const at::Tensor& t, int64_t ld, int64_t stride) {
  const int64_t vec = 16 / static_cast<int64_t>(t.element_size());
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && ld % vec == 0 && stride % vec == 0;
}

int device_attribute(cudaDeviceAttr attr, const at::Device& device) {
  int value = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, attr, device.index()));
  return value;
}

bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && std::strcmp(v, "0") != 0;
}

// Why the sm_90a kernels cannot take this problem, or nullptr when they can: shapes, dtype and alignment only
// (host-known), never the counts. `vector_dims` must be whole 16-byte vectors, like every base pointer (TMA).
const char* sm90_refusal(const at::Tensor& x, std::initializer_list<int64_t> vector_dims,
                         std::initializer_list<const void*> pointers, int64_t num_experts) {
  if (!cuda::sm90::compiled()) return "built without sm_90a";
  if (device_attribute(cudaDevAttrComputeCapabilityMajor, x.device()) != 9 ||
      device_attribute(cudaDevAttrComputeCapabilityMinor, x.device()) != 0) {
    return "not a compute capability 9.0 GPU";
  }
  if (x.scalar_type() != at::kBFloat16 && x.scalar_type() != at::kHalf) return "not bf16/fp16";
  if (env_flag("MOE_CORE_GEMM_PORTABLE")) return "MOE_CORE_GEMM_PORTABLE is set";
  if (num_experts == 0) return "no experts";
  for (int64_t d : vector_dims) {
    if (d % 8 != 0) return "a width is not a multiple of 8";
  }
  for (const void* ptr : pointers) {
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) return "a base is not 16-byte aligned";
  }
  return nullptr;
}

bool use_sm90(const at::Tensor& x, std::initializer_list<int64_t> vector_dims,
              std::initializer_list<const void*> pointers, int64_t num_experts, const char* op) {
  const char* reason = sm90_refusal(x, vector_dims, pointers, num_experts);
  if (reason != nullptr && env_flag("MOE_CORE_GEMM_DEBUG")) {
    std::fprintf(stderr, "[moe_core] %s: portable kernel (%s)\n", op, reason);
  }
  return reason == nullptr;
}

// A Problem for the sm_90a kernels with the device-side counts that split num_rows rows.
cuda::sm90::Problem sm90_problem(cuda::sm90::Op op, const at::Tensor& counts, int64_t num_rows) {
  cuda::sm90::Problem p;
  p.op = op;
  p.num_experts = counts.numel();
  p.num_rows = num_rows;
  p.counts = counts.data_ptr();
  p.counts_int32 = counts.scalar_type() == at::kInt;
  return p;
}

void launch_sm90(cuda::sm90::Problem p, const at::Tensor& like, cudaStream_t stream) {
  p.dtype = like.scalar_type() == at::kBFloat16 ? cuda::sm90::Dtype::kBf16 : cuda::sm90::Dtype::kFp16;
  const int sm_count = device_attribute(cudaDevAttrMultiProcessorCount, like.device());
  p.schedule = cuda::sm90::pick_schedule(p, sm_count);
  const auto workspace = at::empty({static_cast<int64_t>(cuda::sm90::workspace_bytes(p, sm_count))},
                                   like.options().dtype(at::kByte));
  cuda::sm90::launch(p, workspace.data_ptr(), sm_count, stream);
}

at::Tensor grouped_gemm_cuda(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& tokens_per_expert,
                             bool trans_weight) {
  check_forward_inputs(x, weight, tokens_per_expert);
  check_dtype(x);
  const int64_t k = trans_weight ? weight.size(2) : weight.size(1);
  const int64_t n = trans_weight ? weight.size(1) : weight.size(2);
  TORCH_CHECK(x.size(1) == k, "x: expected K = ", k, " columns to match weight ", weight.sizes(),
              " (trans_weight=", trans_weight, "), got ", x.size(1));
  const c10::cuda::CUDAGuard guard(x.device());
  const auto xc = x.contiguous();
  const auto wc = weight.contiguous();
  auto out = at::empty({x.size(0), n}, x.options());
  if (n == 0) return out;  // a shape (no column tiles), not the counts
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const auto counts = counts_on(tokens_per_expert, x.device());
  // K == 0 stays portable: CUTLASS leaves the accumulators of a zero-length reduction unwritten.
  if (k > 0 && use_sm90(x, {k, n}, {xc.data_ptr(), wc.data_ptr(), out.data_ptr()}, weight.size(0), "grouped_gemm")) {
    auto p = sm90_problem(trans_weight ? cuda::sm90::Op::kForwardNK : cuda::sm90::Op::kForwardKN, counts, x.size(0));
    p.a = xc.data_ptr();
    p.b = wc.data_ptr();
    p.d = out.data_ptr();
    p.m = x.size(0);
    p.n = n;
    p.k = k;
    launch_sm90(p, x, stream);
    return out;
  }

  const auto offsets = device_offsets(counts, x.size(0), cuda::forward_tile_rows(x.scalar_type()), stream);
  GroupedGemmArgs args;
  args.a = xc.data_ptr();
  args.b = wc.data_ptr();
  args.c = out.data_ptr();
  args.lda = k;
  args.ldb = trans_weight ? k : n;
  args.b_expert_stride = k * n;
  args.m = x.size(0);
  args.n = n;
  args.k = k;
  args.num_experts = weight.size(0);
  args.row_offsets = offsets.data_ptr<int64_t>();
  args.tile_offsets = args.row_offsets + args.num_experts + 1;
  args.b_row_major = !trans_weight;
  args.vec_a = vector_ok(xc, k, 0);
  args.vec_b = vector_ok(wc, args.ldb, k * n);
  cuda::launch_grouped_gemm(x.scalar_type(), GemmKind::kForward, args, stream);
  return out;
}

// dw[e] = x_e^T dy_e ([K, N]) or dy_e^T x_e ([N, K]): `left`'s columns become dw[e]'s rows, `right`'s its
// columns; both are read from each expert's rows. Picks the back end and launches `op`: kWgrad (dw in x's dtype),
// kWgradAccum (fp32 dw +=) or kWgradFp32 (fp32 dw =, which the portable kernels compute as zeros then +=).
void launch_wgrad(const at::Tensor& xc, const at::Tensor& dyc, bool trans_weight, const at::Tensor& tokens_per_expert,
                  const at::Tensor& out, cuda::sm90::Op op, const char* name) {
  const auto& left = trans_weight ? dyc : xc;
  const auto& right = trans_weight ? xc : dyc;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const auto counts = counts_on(tokens_per_expert, xc.device());
  const int64_t num_experts = counts.numel();
  if (use_sm90(xc, {left.size(1), right.size(1)}, {left.data_ptr(), right.data_ptr(), out.data_ptr()}, num_experts,
               name)) {
    auto p = sm90_problem(op, counts, xc.size(0));
    p.a = left.data_ptr();
    p.b = right.data_ptr();
    p.d = out.data_ptr();
    p.m = left.size(1);
    p.n = right.size(1);
    return launch_sm90(p, xc, stream);
  }
  if (op == cuda::sm90::Op::kWgradFp32) C10_CUDA_CHECK(cudaMemsetAsync(out.data_ptr(), 0, out.nbytes(), stream));
  const auto offsets = device_offsets(counts, xc.size(0), 1, stream);
  GroupedGemmArgs args;
  args.a = left.data_ptr();
  args.b = right.data_ptr();
  args.c = out.data_ptr();
  args.lda = left.size(1);
  args.ldb = right.size(1);
  args.m = left.size(1);
  args.n = right.size(1);
  args.num_experts = num_experts;
  args.row_offsets = offsets.data_ptr<int64_t>();
  args.vec_a = vector_ok(left, args.lda, 0);
  args.vec_b = vector_ok(right, args.ldb, 0);
  const auto kind = op == cuda::sm90::Op::kWgrad ? GemmKind::kWgrad : GemmKind::kWgradAccum;
  cuda::launch_grouped_gemm(xc.scalar_type(), kind, args, stream);
}

at::Tensor grouped_gemm_wgrad_cuda(const at::Tensor& x, const at::Tensor& dy, const at::Tensor& tokens_per_expert,
                                   bool trans_weight) {
  check_wgrad_inputs(x, dy, tokens_per_expert);
  check_dtype(x);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t num_experts = tokens_per_expert.size(0), k = x.size(1), n = dy.size(1);
  auto dw = trans_weight ? at::empty({num_experts, n, k}, x.options()) : at::empty({num_experts, k, n}, x.options());
  if (dw.numel() == 0) return dw;  // shapes only: no expert or an empty weight
  launch_wgrad(x.contiguous(), dy.contiguous(), trans_weight, tokens_per_expert, dw, cuda::sm90::Op::kWgrad,
               "grouped_gemm_wgrad");
  return dw;
}

at::Tensor grouped_gemm_wgrad_fp32_cuda(const at::Tensor& x, const at::Tensor& dy,
                                        const at::Tensor& tokens_per_expert, bool trans_weight) {
  check_wgrad_inputs(x, dy, tokens_per_expert);
  check_wgrad_fp32_inputs(x);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t num_experts = tokens_per_expert.size(0), k = x.size(1), n = dy.size(1);
  const auto options = x.options().dtype(at::kFloat);
  auto dw = trans_weight ? at::empty({num_experts, n, k}, options) : at::empty({num_experts, k, n}, options);
  if (dw.numel() == 0) return dw;
  launch_wgrad(x.contiguous(), dy.contiguous(), trans_weight, tokens_per_expert, dw, cuda::sm90::Op::kWgradFp32,
               "grouped_gemm_wgrad_fp32");
  return dw;
}

void grouped_gemm_wgrad_accum_cuda(at::Tensor& main_grad, const at::Tensor& x, const at::Tensor& dy,
                                   const at::Tensor& tokens_per_expert, bool trans_weight) {
  check_wgrad_inputs(x, dy, tokens_per_expert);
  check_dtype(x);
  const int64_t num_experts = tokens_per_expert.size(0), k = x.size(1), n = dy.size(1);
  TORCH_CHECK(main_grad.scalar_type() == at::kFloat, "main_grad: expected float32, got ", main_grad.scalar_type());
  check_on_device(main_grad, "main_grad", x.device());
  const std::vector<int64_t> expected = trans_weight ? std::vector<int64_t>{num_experts, n, k}
                                                     : std::vector<int64_t>{num_experts, k, n};
  TORCH_CHECK(main_grad.sizes() == at::IntArrayRef(expected), "main_grad: expected ", at::IntArrayRef(expected),
              ", got ", main_grad.sizes());
  TORCH_CHECK(main_grad.is_contiguous(), "main_grad: expected a contiguous tensor");
  if (main_grad.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  launch_wgrad(x.contiguous(), dy.contiguous(), trans_weight, tokens_per_expert, main_grad,
               cuda::sm90::Op::kWgradAccum, "grouped_gemm_wgrad_accum_");
}

}  // namespace

TORCH_LIBRARY_IMPL(moe_core, CUDA, m) {
  m.impl("grouped_gemm", &grouped_gemm_cuda);
  m.impl("grouped_gemm_wgrad", &grouped_gemm_wgrad_cuda);
  m.impl("grouped_gemm_wgrad_fp32", &grouped_gemm_wgrad_fp32_cuda);
  m.impl("grouped_gemm_wgrad_accum_", &grouped_gemm_wgrad_accum_cuda);
}

}  // namespace moe_core
