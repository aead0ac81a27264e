// Autocast of moe_core::grouped_gemm, the rule aten::mm follows (autocast's lower_precision_fp policy): inside
// torch.autocast, floating x and weight are cast to the autocast dtype of their device type before the op runs;
// float64 stays float64 and the integer counts pass untouched. Weights go through autocast's cast cache, so a
// weight used by several calls in one autocast region is cast once, and the cast is differentiable: gradients
// reach float32 parameters in float32. The kernel sits below autograd, so the autograd kernel
// (csrc/autograd.cpp) records the casts and the bf16/fp16 op.
#include <ATen/autocast_mode.h>
#include <torch/library.h>

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
  return op.call(at::autocast::cached_cast(dtype, x, kDevice), at::autocast::cached_cast(dtype, weight, kDevice),
                 tokens_per_expert, trans_weight);
}

}  // namespace

TORCH_LIBRARY_IMPL(moe_core, AutocastCUDA, m) {
  m.impl("grouped_gemm", &grouped_gemm_autocast<c10::DeviceType::CUDA, c10::DispatchKey::AutocastCUDA>);
}

TORCH_LIBRARY_IMPL(moe_core, AutocastCPU, m) {
  m.impl("grouped_gemm", &grouped_gemm_autocast<c10::DeviceType::CPU, c10::DispatchKey::AutocastCPU>);
}

}  // namespace moe_core
