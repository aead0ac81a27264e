// Autocast of moe_core::grouped_gemm, the rule aten::mm follows (autocast's lower_precision_fp policy): inside
// torch.autocast, floating x and weight are cast to the autocast dtype of their device type before the op runs;
// float64 stays float64 and the integer counts pass untouched. Autocast dispatches ahead of autograd, so what
// this kernel calls is recorded by autograd.
//
// A float32 weight that requires grad, with x cast to a 16-bit autocast dtype (mixed-precision training over
// float32 parameters): grouped_gemm_float32_weight (csrc/autograd.cpp) casts the weight inside its forward and
// returns the weight's gradient in float32 straight from the wgrad kernel's float32 accumulators
// (grouped_gemm_wgrad_fp32), where the generic path writes a 16-bit gradient and widens it (ToCopyBackward) at
// twice the memory traffic. That cast skips autocast's cast cache: each call casts its weight.
//
// Any other weight goes through autocast's cast cache (a weight used by several calls in one autocast region is
// cast once) and the differentiable cast, so gradients still reach float32 parameters in float32.
#include <ATen/autocast_mode.h>
#include <torch/library.h>

#include "grouped_gemm.h"

namespace moe_core {
namespace {

using GemmSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool);

template <c10::DeviceType kDevice, c10::DispatchKey kAutocastKey>
at::Tensor grouped_gemm_autocast(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& tokens_per_expert,
                                 bool trans_weight) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(kAutocastKey);
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("moe_core::grouped_gemm", "")
                             .typed<GemmSignature>();
  const auto dtype = at::autocast::get_autocast_dtype(kDevice);
  const auto x_cast = at::autocast::cached_cast(dtype, x, kDevice);
  const bool float32_weight_grad = weight.scalar_type() == at::kFloat && weight.requires_grad() &&
                                   at::GradMode::is_enabled() && x_cast.scalar_type() == dtype &&
                                   (dtype == at::kBFloat16 || dtype == at::kHalf);
  if (float32_weight_grad) return grouped_gemm_float32_weight(x_cast, weight, tokens_per_expert, trans_weight);
  return op.call(x_cast, at::autocast::cached_cast(dtype, weight, kDevice), tokens_per_expert, trans_weight);
}

}  // namespace

TORCH_LIBRARY_IMPL(moe_core, AutocastCUDA, m) {
  m.impl("grouped_gemm", &grouped_gemm_autocast<c10::DeviceType::CUDA, c10::DispatchKey::AutocastCUDA>);
}

TORCH_LIBRARY_IMPL(moe_core, AutocastCPU, m) {
  m.impl("grouped_gemm", &grouped_gemm_autocast<c10::DeviceType::CPU, c10::DispatchKey::AutocastCPU>);
}

}  // namespace moe_core
