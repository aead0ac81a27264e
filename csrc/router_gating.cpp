// moe_core::router_gating_linear: the router's logits x @ weight^T in `dtype` (float32 or float64) with autocast
// off, Megatron's router_gating_linear. It saves x and the weight as they come and its backward remakes their
// `dtype` copies, so a 16-bit x keeps no float32 copy alive from forward to backward (torch.compile's partitioner
// would save the copy of a tensor expression: it keeps a cast whose consumer is a GEMM on the forward side). In
// C++, forward, backward and autograd, so that eager and compiled layers call it without Python dispatch.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <array>
#include <tuple>

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
// statement each, since a temporary lives to the end of its full expression: the two [T, H] `dtype` temporaries (x's
// copy, the widened grad_x) never coexist. A kernel of its own, not a composite, so that tracing keeps them inside it:
// as ATen ops, Inductor would schedule x's copy at the start of the backward and hold it through the expert GEMMs.
std::tuple<at::Tensor, at::Tensor> gating_backward(const at::Tensor& grad, const at::Tensor& x,
                                                   const at::Tensor& weight, std::array<bool, 2> output_mask) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const auto dtype = grad.scalar_type();
  at::Tensor grad_x, grad_weight;
  if (output_mask[1]) grad_weight = at::mm(grad.t(), x.to(dtype)).to(weight.scalar_type());
  if (output_mask[0]) grad_x = at::mm(grad, weight.to(dtype)).to(x.scalar_type());
  return {std::move(grad_x), std::move(grad_weight)};
}

using BackwardFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                       std::array<bool, 2>);

// The backward op through the dispatcher: its autograd (below) for double backward, one node when traced.
const c10::TypedOperatorHandle<BackwardFn>& backward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("moe_core::router_gating_linear_backward", "")
                             .typed<BackwardFn>();
  return op;
}

// The backward's autograd (double backward, a gradient penalty through the router): grad_x = grad @ W and
// grad_weight = grad^T @ x are bilinear, so their gradients are four GEMMs, in ATen ops that autograd records again.
class RouterGatingBackward : public torch::autograd::Function<RouterGatingBackward> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& grad, const at::Tensor& x,
                               const at::Tensor& weight) {
    ctx->save_for_backward({grad, x, weight});
    ctx->set_materialize_grads(false);  // an output with no gradient costs no GEMMs
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [grad_x, grad_weight] = backward_op().call(grad, x, weight, {true, true});
    return {grad_x, grad_weight};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const auto saved = ctx->get_saved_variables();
    const auto &grad = saved[0], &x = saved[1], &weight = saved[2];
    const auto dtype = grad.scalar_type();
    const auto &d_grad_x = grads[0], &d_grad_weight = grads[1];  // undefined where no gradient flows
    at::Tensor d_grad, d_x, d_weight;
    if (d_grad_x.defined()) {
      if (ctx->needs_input_grad(0)) d_grad = at::mm(d_grad_x.to(dtype), weight.to(dtype).t());
      if (ctx->needs_input_grad(2)) d_weight = at::mm(grad.t(), d_grad_x.to(dtype)).to(weight.scalar_type());
    }
    if (d_grad_weight.defined()) {
      if (ctx->needs_input_grad(0)) {
        auto term = at::mm(x.to(dtype), d_grad_weight.to(dtype).t());
        d_grad = d_grad.defined() ? d_grad + term : term;
      }
      if (ctx->needs_input_grad(1)) d_x = at::mm(grad, d_grad_weight.to(dtype)).to(x.scalar_type());
    }
    return {d_grad, d_x, d_weight};
  }
};

// Records the backward only where a gradient of it can be asked for (create_graph). A recorded function's outputs
// must all be defined, so there it computes both and drops the masked one.
std::tuple<at::Tensor, at::Tensor> gating_backward_autograd(const at::Tensor& grad, const at::Tensor& x,
                                                            const at::Tensor& weight,
                                                            std::array<bool, 2> output_mask) {
  const bool record =
      at::GradMode::is_enabled() && (grad.requires_grad() || x.requires_grad() || weight.requires_grad());
  if (!record) {
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    return backward_op().call(grad, x, weight, output_mask);
  }
  auto outputs = RouterGatingBackward::apply(grad, x, weight);
  return {output_mask[0] ? outputs[0] : at::Tensor(), output_mask[1] ? outputs[1] : at::Tensor()};
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

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto dtype = ctx->saved_data["dtype"].toScalarType();
    auto [grad_x, grad_weight] = backward_op().call(grads[0].to(dtype), saved[0], saved[1],
                                                    {ctx->needs_input_grad(0), ctx->needs_input_grad(1)});
    return {grad_x, grad_weight, at::Tensor()};
  }
};

at::Tensor gating_autograd(const at::Tensor& x, const at::Tensor& weight, at::ScalarType dtype) {
  return RouterGating::apply(x, weight, dtype);
}

}  // namespace

TORCH_LIBRARY_IMPL(moe_core, CompositeExplicitAutograd, m) {
  m.impl("router_gating_linear", &gating_forward);
  m.impl("router_gating_linear_backward", &gating_backward);
}

TORCH_LIBRARY_IMPL(moe_core, Autograd, m) {
  m.impl("router_gating_linear", &gating_autograd);
  m.impl("router_gating_linear_backward", &gating_backward_autograd);
}

}  // namespace moe_core
