// Autocast of moe_core::grouped_gemm, the rule aten::mm follows (autocast's lower_precision_fp policy): inside
// torch.autocast, floating x and weight are cast to the autocast dtype of their device type before the op runs;
// float64 stays float64 and the integer counts pass untouched. Autocast dispatches ahead of autograd, so what
// this kernel calls is recorded by autograd.
//
// A float32 weight that requires grad, with x cast to a 16-bit autocast dtype (mixed-precision training over
// float32 parameters): Float32WeightGemm casts the weight inside its forward and returns the weight's gradient
// in float32 straight from the wgrad kernel's float32 accumulators (grouped_gemm_wgrad_fp32), where the generic
// path writes a 16-bit gradient and widens it (ToCopyBackward) at twice the memory traffic. That cast skips
// autocast's cast cache: each call casts its weight.
//
// Any other weight goes through autocast's cast cache (a weight used by several calls in one autocast region is
// cast once) and the differentiable cast, so gradients still reach float32 parameters in float32.
#include <ATen/autocast_mode.h>
#include <torch/autograd.h>
#include <torch/library.h>

namespace moe_core {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using GemmSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool);
using GemmOp = c10::TypedOperatorHandle<GemmSignature>;

GemmOp find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<GemmSignature>();
}

// y = grouped_gemm(x, weight cast to x's dtype); dx in x's dtype, dweight in float32. x arrives in the autocast
// dtype (cached_cast outside, so a float32 x still gets its gradient through that cast).
class Float32WeightGemm : public torch::autograd::Function<Float32WeightGemm> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& tokens_per_expert, bool trans_weight) {
    static const GemmOp op = find_op("moe_core::grouped_gemm");
    const auto weight_lp = weight.to(x.scalar_type());
    ctx->save_for_backward({x, weight_lp, tokens_per_expert});
    ctx->saved_data["trans_weight"] = trans_weight;
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    return op.call(x, weight_lp, tokens_per_expert, trans_weight);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const GemmOp op = find_op("moe_core::grouped_gemm");
    static const GemmOp wgrad_fp32 = find_op("moe_core::grouped_gemm_wgrad_fp32");
    const auto saved = ctx->get_saved_variables();
    const bool trans_weight = ctx->saved_data["trans_weight"].toBool();
    const auto dy = grads[0].contiguous();
    at::Tensor dx, dw;
    if (ctx->needs_input_grad(0)) dx = op.call(dy, saved[1], saved[2], !trans_weight);
    if (ctx->needs_input_grad(1)) dw = wgrad_fp32.call(saved[0], dy, saved[2], trans_weight);
    return {dx, dw, at::Tensor(), at::Tensor()};
  }
};

template <c10::DeviceType kDevice, c10::DispatchKey kAutocastKey>
at::Tensor grouped_gemm_autocast(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& tokens_per_expert,
                                 bool trans_weight) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(kAutocastKey);
  static const GemmOp op = find_op("moe_core::grouped_gemm");
  const auto dtype = at::autocast::get_autocast_dtype(kDevice);
  const auto x_cast = at::autocast::cached_cast(dtype, x, kDevice);
  const bool float32_weight_grad = weight.scalar_type() == at::kFloat && weight.requires_grad() &&
                                   at::GradMode::is_enabled() && x_cast.scalar_type() == dtype &&
                                   (dtype == at::kBFloat16 || dtype == at::kHalf);
  if (float32_weight_grad) return Float32WeightGemm::apply(x_cast, weight, tokens_per_expert, trans_weight);
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
