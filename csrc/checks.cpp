#include "grouped_gemm.h"

namespace moe_core {

static void check_counts(const at::Tensor& tokens_per_expert) {
  TORCH_CHECK(tokens_per_expert.dim() == 1, "tokens_per_expert: expected [E], got ", tokens_per_expert.sizes());
  TORCH_CHECK(tokens_per_expert.scalar_type() == at::kLong || tokens_per_expert.scalar_type() == at::kInt,
              "tokens_per_expert: expected int32 or int64, got ", tokens_per_expert.scalar_type());
}

void check_forward_inputs(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& tokens_per_expert) {
  TORCH_CHECK(x.dim() == 2, "x: expected [T, K], got ", x.sizes());
  TORCH_CHECK(weight.dim() == 3, "weight: expected [E, K, N] or [E, N, K], got ", weight.sizes());
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight: dtypes differ (", x.scalar_type(), " vs ",
              weight.scalar_type(), ")");
  TORCH_CHECK(x.device() == weight.device(), "x and weight: devices differ (", x.device(), " vs ", weight.device(), ")");
  check_counts(tokens_per_expert);
  TORCH_CHECK(tokens_per_expert.size(0) == weight.size(0), "tokens_per_expert: expected ", weight.size(0),
              " entries (weight's E), got ", tokens_per_expert.size(0));
}

void check_wgrad_inputs(const at::Tensor& x, const at::Tensor& dy, const at::Tensor& tokens_per_expert) {
  TORCH_CHECK(x.dim() == 2, "x: expected [T, K], got ", x.sizes());
  TORCH_CHECK(dy.dim() == 2, "dy: expected [T, N], got ", dy.sizes());
  TORCH_CHECK(x.size(0) == dy.size(0), "x and dy: row counts differ (", x.size(0), " vs ", dy.size(0), ")");
  TORCH_CHECK(x.scalar_type() == dy.scalar_type(), "x and dy: dtypes differ (", x.scalar_type(), " vs ",
              dy.scalar_type(), ")");
  TORCH_CHECK(x.device() == dy.device(), "x and dy: devices differ (", x.device(), " vs ", dy.device(), ")");
  check_counts(tokens_per_expert);
}

void check_wgrad_fp32_inputs(const at::Tensor& x) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "x: expected float32, bfloat16 or float16 (the float32 gradient of autocast's operands), got ", dtype);
}

}  // namespace moe_core
