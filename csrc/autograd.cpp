// Autograd of moe_core::grouped_gemm and of its wgrads (their double backward), registered at the Autograd dispatch
// key in C++ (the pattern of torchvision's ops) rather than from Python: a Python autograd kernel adds host time to
// every call, which an all-empty call cannot afford (docs/kernels.md), and every backward calls a wgrad. dgrad is
// the forward op with the weight transposed, wgrad grouped_gemm_wgrad (exact zeros for empty experts, never
// undefined); both go through the dispatcher, so the backward also traces under torch.compile (fake kernels in
// moe_core/ops/grouped_gemm.py). The same backward serves autocast's float32-weight path
// (grouped_gemm_float32_weight), with grouped_gemm_wgrad_fp32 as its wgrad.
#include <torch/autograd.h>
#include <torch/library.h>

#include "grouped_gemm.h"

namespace moe_core {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// grouped_gemm and grouped_gemm_wgrad share one schema; calls go through the dispatcher so that tracing and
// the fake kernels see them.
using GemmSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool);
using GemmOp = c10::TypedOperatorHandle<GemmSignature>;

GemmOp find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<GemmSignature>();
}
const GemmOp& grouped_gemm_op() { static const GemmOp op = find_op("moe_core::grouped_gemm"); return op; }
const GemmOp& grouped_gemm_wgrad_op() { static const GemmOp op = find_op("moe_core::grouped_gemm_wgrad"); return op; }

// dx = grouped_gemm(dy, weight, !trans_weight) and dw = wgrad(x, dy) from the saved (x, weight, counts), each only
// where needed.
variable_list gemm_backward(AutogradContext* ctx, const variable_list& grads, const GemmOp& wgrad) {
  const auto saved = ctx->get_saved_variables();
  const bool trans_weight = ctx->saved_data["trans_weight"].toBool();
  const auto dy = grads[0].contiguous();
  at::Tensor dx, dw;
  if (ctx->needs_input_grad(0)) dx = grouped_gemm_op().call(dy, saved[1], saved[2], !trans_weight);
  if (ctx->needs_input_grad(1)) dw = wgrad.call(saved[0], dy, saved[2], trans_weight);
  return {dx, dw, at::Tensor(), at::Tensor()};
}

// Saves (x, weight used, counts) and runs the op below autograd (else this kernel would call itself).
at::Tensor gemm_forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                        const at::Tensor& tokens_per_expert, bool trans_weight) {
  ctx->save_for_backward({x, weight, tokens_per_expert});
  ctx->saved_data["trans_weight"] = trans_weight;
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  return grouped_gemm_op().call(x, weight, tokens_per_expert, trans_weight);
}

class GroupedGemm : public torch::autograd::Function<GroupedGemm> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& tokens_per_expert, bool trans_weight) {
    return gemm_forward(ctx, x, weight, tokens_per_expert, trans_weight);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return gemm_backward(ctx, grads, grouped_gemm_wgrad_op());
  }
};

// The float32 weight under autocast (csrc/autocast.cpp): the weight cast to x's 16-bit dtype inside the forward
// (so autograd records no cast), dx in x's dtype, dweight in float32 from grouped_gemm_wgrad_fp32.
class Float32WeightGemm : public torch::autograd::Function<Float32WeightGemm> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& tokens_per_expert, bool trans_weight) {
    return gemm_forward(ctx, x, weight.to(x.scalar_type()), tokens_per_expert, trans_weight);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const GemmOp wgrad_fp32 = find_op("moe_core::grouped_gemm_wgrad_fp32");
    return gemm_backward(ctx, grads, wgrad_fp32);
  }
};

at::Tensor grouped_gemm_autograd(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& tokens_per_expert,
                                 bool trans_weight) {
  return GroupedGemm::apply(x, weight, tokens_per_expert, trans_weight);
}

// The wgrads' own autograd (double backward): for a gradient G of dw's shape, dx = grouped_gemm(dy, G, !trans_weight)
// and ddy = grouped_gemm(x, G, trans_weight), through the differentiable op so that higher derivatives work too.
// The float32 wgrad's G comes in float32 and is brought to the operands' dtype first.
class GroupedGemmWgrad : public torch::autograd::Function<GroupedGemmWgrad> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& dy,
                            const at::Tensor& tokens_per_expert, bool trans_weight, bool float32) {
    ctx->save_for_backward({x, dy, tokens_per_expert});
    ctx->saved_data["trans_weight"] = trans_weight;
    ctx->saved_data["float32"] = float32;
    static const GemmOp wgrad_fp32 = find_op("moe_core::grouped_gemm_wgrad_fp32");
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    return (float32 ? wgrad_fp32 : grouped_gemm_wgrad_op()).call(x, dy, tokens_per_expert, trans_weight);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const bool trans_weight = ctx->saved_data["trans_weight"].toBool();
    auto grad_dw = grads[0].contiguous();
    if (ctx->saved_data["float32"].toBool()) grad_dw = grad_dw.to(saved[0].scalar_type());
    at::Tensor dx, ddy;
    if (ctx->needs_input_grad(0)) dx = grouped_gemm_op().call(saved[1], grad_dw, saved[2], !trans_weight);
    if (ctx->needs_input_grad(1)) ddy = grouped_gemm_op().call(saved[0], grad_dw, saved[2], trans_weight);
    return {dx, ddy, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor wgrad_autograd(const at::Tensor& x, const at::Tensor& dy, const at::Tensor& tokens_per_expert,
                          bool trans_weight) {
  return GroupedGemmWgrad::apply(x, dy, tokens_per_expert, trans_weight, false);
}

at::Tensor wgrad_fp32_autograd(const at::Tensor& x, const at::Tensor& dy, const at::Tensor& tokens_per_expert,
                               bool trans_weight) {
  return GroupedGemmWgrad::apply(x, dy, tokens_per_expert, trans_weight, true);
}

}  // namespace

at::Tensor grouped_gemm_float32_weight(const at::Tensor& x, const at::Tensor& weight,
                                       const at::Tensor& tokens_per_expert, bool trans_weight) {
  return Float32WeightGemm::apply(x, weight, tokens_per_expert, trans_weight);
}

TORCH_LIBRARY_IMPL(moe_core, Autograd, m) {
  m.impl("grouped_gemm", &grouped_gemm_autograd);
  m.impl("grouped_gemm_wgrad", &wgrad_autograd);
  m.impl("grouped_gemm_wgrad_fp32", &wgrad_fp32_autograd);
}

}  // namespace moe_core
