// CPU grouped GEMM: one BLAS call per expert on its contiguous row block, experts spread over threads with
// at::parallel_for. bf16/fp16 blocks are multiplied in fp32 and rounded once, so accumulation is fp32.
#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/library.h>

#include <vector>

#include "grouped_gemm.h"

namespace moe_core {
namespace {

// Row offsets [E + 1] of each expert's block; checks the counts' values (the CPU path may read them): non-negative,
// summing to at most T. Rows past the sum are unused: forward leaves them unwritten and wgrad ignores them.
std::vector<int64_t> row_offsets(const at::Tensor& tokens_per_expert, int64_t num_rows) {
  auto counts = tokens_per_expert.to(at::kCPU, at::kLong).contiguous();
  const int64_t* c = counts.data_ptr<int64_t>();
  std::vector<int64_t> offsets(counts.numel() + 1, 0);
  for (int64_t e = 0; e < counts.numel(); ++e) {
    TORCH_CHECK(c[e] >= 0, "tokens_per_expert: expected non-negative counts, got ", c[e], " for expert ", e);
    TORCH_CHECK(c[e] <= num_rows - offsets[e], "tokens_per_expert: counts sum past T = ", num_rows, " at expert ", e);
    offsets[e + 1] = offsets[e] + c[e];
  }
  return offsets;
}

// Average rows per expert from which one expert's product is big enough to share among BLAS threads.
constexpr int64_t kRowsPerExpertForBlasThreads = 512;

bool is_reduced(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf; }

// out = a @ b, accumulated in fp32 for bf16/fp16 inputs; `out` may be a view (a row block or an expert slice).
void mm_into(at::Tensor out, const at::Tensor& a, const at::Tensor& b) {
  if (is_reduced(a)) {
    out.copy_(at::mm(a.to(at::kFloat), b.to(at::kFloat)));
  } else {
    at::mm_out(out, a, b);
  }
}

// Runs fn(e) for every expert. Many small experts: threads split the experts and BLAS runs serially in each.
// Few large ones: experts run one after another and BLAS threads inside each product, which balances
// skewed counts better.
template <typename Fn>
void for_each_expert(int64_t num_experts, int64_t num_rows, const Fn& fn) {
  const bool split_experts = num_rows < kRowsPerExpertForBlasThreads * num_experts;
  at::parallel_for(0, num_experts, split_experts ? 1 : num_experts, [&](int64_t begin, int64_t end) {
    // A kernel's inner ATen calls must not be recorded by autograd; worker threads don't inherit the
    // caller's dispatch state, so the guard sits here.
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    for (int64_t e = begin; e < end; ++e) fn(e);
  });
}

at::Tensor grouped_gemm_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& tokens_per_expert,
                            bool trans_weight) {
  check_forward_inputs(x, weight, tokens_per_expert);
  const int64_t k = trans_weight ? weight.size(2) : weight.size(1);
  const int64_t n = trans_weight ? weight.size(1) : weight.size(2);
  TORCH_CHECK(x.size(1) == k, "x: expected K = ", k, " columns to match weight ", weight.sizes(),
              " (trans_weight=", trans_weight, "), got ", x.size(1));
  const auto offsets = row_offsets(tokens_per_expert, x.size(0));
  const auto xc = x.contiguous();
  const auto wc = weight.contiguous();
  auto out = at::empty({x.size(0), n}, x.options());
  if (k == 0) return out.zero_();
  for_each_expert(weight.size(0), x.size(0), [&](int64_t e) {
    const int64_t rows = offsets[e + 1] - offsets[e];
    if (rows == 0) return;
    auto w_e = trans_weight ? wc[e].t() : wc[e];
    mm_into(out.narrow(0, offsets[e], rows), xc.narrow(0, offsets[e], rows), w_e);
  });
  return out;
}

// dw[e] = x_e^T dy_e ([K, N]), or its transpose dy_e^T x_e ([N, K]) for a trans_weight weight.
void wgrad_expert(at::Tensor dw_e, const at::Tensor& x_e, const at::Tensor& dy_e, bool trans_weight) {
  if (trans_weight) {
    mm_into(dw_e, dy_e.t(), x_e);
  } else {
    mm_into(dw_e, x_e.t(), dy_e);
  }
}

at::Tensor grouped_gemm_wgrad_cpu(const at::Tensor& x, const at::Tensor& dy, const at::Tensor& tokens_per_expert,
                                  bool trans_weight) {
  check_wgrad_inputs(x, dy, tokens_per_expert);
  const auto offsets = row_offsets(tokens_per_expert, x.size(0));
  const int64_t num_experts = tokens_per_expert.size(0), k = x.size(1), n = dy.size(1);
  auto dw = trans_weight ? at::empty({num_experts, n, k}, x.options()) : at::empty({num_experts, k, n}, x.options());
  const auto xc = x.contiguous();
  const auto dyc = dy.contiguous();
  for_each_expert(num_experts, x.size(0), [&](int64_t e) {
    const int64_t rows = offsets[e + 1] - offsets[e];
    if (rows == 0) {
      dw[e].zero_();  // the promise: an expert without rows gets an exactly-zero gradient
      return;
    }
    wgrad_expert(dw[e], xc.narrow(0, offsets[e], rows), dyc.narrow(0, offsets[e], rows), trans_weight);
  });
  return dw;
}

at::Tensor grouped_gemm_wgrad_fp32_cpu(const at::Tensor& x, const at::Tensor& dy, const at::Tensor& tokens_per_expert,
                                       bool trans_weight) {
  check_wgrad_inputs(x, dy, tokens_per_expert);
  check_wgrad_fp32_inputs(x);
  return grouped_gemm_wgrad_cpu(x.to(at::kFloat), dy.to(at::kFloat), tokens_per_expert, trans_weight);
}

void grouped_gemm_wgrad_accum_cpu(at::Tensor& main_grad, const at::Tensor& x, const at::Tensor& dy,
                                  const at::Tensor& tokens_per_expert, bool trans_weight) {
  check_wgrad_inputs(x, dy, tokens_per_expert);
  const int64_t num_experts = tokens_per_expert.size(0), k = x.size(1), n = dy.size(1);
  TORCH_CHECK(main_grad.scalar_type() == at::kFloat, "main_grad: expected float32, got ", main_grad.scalar_type());
  const std::vector<int64_t> expected = trans_weight ? std::vector<int64_t>{num_experts, n, k}
                                                     : std::vector<int64_t>{num_experts, k, n};
  TORCH_CHECK(main_grad.sizes() == at::IntArrayRef(expected), "main_grad: expected ", at::IntArrayRef(expected),
              ", got ", main_grad.sizes());
  TORCH_CHECK(main_grad.is_contiguous(), "main_grad: expected a contiguous tensor");
  const auto offsets = row_offsets(tokens_per_expert, x.size(0));
  const auto xf = x.contiguous().to(at::kFloat);
  const auto dyf = dy.contiguous().to(at::kFloat);
  for_each_expert(num_experts, x.size(0), [&](int64_t e) {
    const int64_t rows = offsets[e + 1] - offsets[e];
    if (rows == 0) return;  // adds nothing: main_grad[e] keeps its value
    auto x_e = xf.narrow(0, offsets[e], rows);
    auto dy_e = dyf.narrow(0, offsets[e], rows);
    auto g = main_grad[e];
    if (trans_weight) {
      g.addmm_(dy_e.t(), x_e);
    } else {
      g.addmm_(x_e.t(), dy_e);
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(moe_core, CPU, m) {
  m.impl("grouped_gemm", &grouped_gemm_cpu);
  m.impl("grouped_gemm_wgrad", &grouped_gemm_wgrad_cpu);
  m.impl("grouped_gemm_wgrad_fp32", &grouped_gemm_wgrad_fp32_cpu);
  m.impl("grouped_gemm_wgrad_accum_", &grouped_gemm_wgrad_accum_cpu);
}

}  // namespace moe_core
