// The op schemas (one place) and the Python module stub that loads them: `import moe_core._C`.
#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(moe_core, m) {
  m.def("grouped_gemm(Tensor x, Tensor weight, Tensor tokens_per_expert, bool trans_weight) -> Tensor");
  m.def("grouped_gemm_wgrad(Tensor x, Tensor dy, Tensor tokens_per_expert, bool trans_weight) -> Tensor");
  m.def("grouped_gemm_wgrad_fp32(Tensor x, Tensor dy, Tensor tokens_per_expert, bool trans_weight) -> Tensor");
  m.def("grouped_gemm_wgrad_accum_(Tensor(a!) main_grad, Tensor x, Tensor dy, Tensor tokens_per_expert, "
        "bool trans_weight) -> ()");
  m.def("router_gating_linear(Tensor x, Tensor weight, ScalarType dtype) -> Tensor");
  m.def("router_gating_linear_backward(Tensor grad, Tensor x, Tensor weight, bool[2] output_mask) -> (Tensor, Tensor)");
}

extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "moe_core kernels (registered as torch.ops.moe_core)",
                               -1, nullptr};
  return PyModule_Create(&module);
}
