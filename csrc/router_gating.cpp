// moe_core::router_gating_linear: the router's logits x @ weight^T in `dtype` (float32 or float64) with autocast
// off, Megatron's router_gating_linear. It saves x and the weight as they come and its backward remakes their
// `dtype` copies, so a 16-bit x keeps no float32 copy alive from forward to backward (torch.compile's partitioner
// would save the copy of a tensor expression: it keeps a cast whose consumer is a GEMM on the forward side). In
// C++, forward, backward and autograd, so that eager and compiled layers call it without Python dispatch.
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

namespace moe_core {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor gating_forward(const at::Tensor& x, const at::Tensor& weight, at::ScalarType dtype) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  return at::mm(x.to(dtype), weight.to(dtype).t());
}

// grad [T, E] in the forward's dtype -> (grad_x in x's dtype, grad_weight in the weight's), each only where
// output_mask asks (an undefined tensor otherwise: a frozen router skips its weight's GEMM and x's float32 copy). One
// statement each: a temporary lives to the end of its full expression, and the two [T, H] `dtype` temporaries must
// not coexist.
std::tuple<at::Tensor, at::Tensor> gating_backward(const at::Tensor& grad, const at::Tensor& x,
                                                   const at::Tensor& weight, std::array<bool, 2> output_mask) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const auto dtype = grad.scalar_type();
  at::Tensor grad_x, grad_weight;
  if (output_mask[0]) grad_x = at::mm(grad, weight.to(dtype)).to(x.scalar_type());
  if (output_mask[1]) grad_weight = at::mm(grad.t(), x.to(dtype)).to(weight.scalar_type());
  return {std::move(grad_x), std::move(grad_weight)};
}

class RouterGating : public torch::autograd::Function<RouterGating> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            at::ScalarType dtype) {
    ctx->save_for_backward({x, weight});
    ctx->saved_data["dtype"] = dtype;
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("moe_core::router_gating_linear", "")
                               .typed<at::Tensor(const at::Tensor&, const at::Tensor&, at::ScalarType)>();
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    return op.call(x, weight, dtype);
  }

  // Through the dispatcher, so that the backward traces under torch.compile.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("moe_core::router_gating_linear_backward", "")
            .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                      std::array<bool, 2>)>();
    const auto saved = ctx->get_saved_variables();
    const auto dtype = ctx->saved_data["dtype"].toScalarType();
    auto [grad_x, grad_weight] =
        op.call(grads[0].to(dtype), saved[0], saved[1], {ctx->needs_input_grad(0), ctx->needs_input_grad(1)});
    return {grad_x, grad_weight, at::Tensor()};
  }
};

at::Tensor gating_autograd(const at::Tensor& x, const at::Tensor& weight, at::ScalarType dtype) {
  return RouterGating::apply(x, weight, dtype);
}

}  // namespace

TORCH_LIBRARY_IMPL(moe_core, CompositeExplicitAutograd, m) { m.impl("router_gating_linear", &gating_forward); }

// The backward is ATen ops all the way down: autograd differentiates through them (double backward) and tracing
// decomposes it.
TORCH_LIBRARY_IMPL(moe_core, CompositeImplicitAutograd, m) {
  m.impl("router_gating_linear_backward", &gating_backward);
}

TORCH_LIBRARY_IMPL(moe_core, Autograd, m) { m.impl("router_gating_linear", &gating_autograd); }

}  // namespace moe_core
