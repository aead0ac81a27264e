"""router_gating_linear: the router's logits GEMM in float32 / float64 whatever autocast does, with the same
values and gradients as the tensor expression, saving a 16-bit x as it is (no float32 copy held for backward),
eager and compiled.

Legend: T tokens, H hidden, E experts.
"""

import json
import tempfile
import warnings
from pathlib import Path

import pytest
import torch

from moe_core.ops.router_gating import router_gating_linear


def expression(x_TH, weight_EH, dtype):
    """The unfused definition the op replaces."""
    return x_TH.to(dtype) @ weight_EH.to(dtype).t()


@pytest.mark.parametrize("x_dtype,dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                                           (torch.bfloat16, torch.float64)])
@pytest.mark.parametrize("autocast", [False, True], ids=["plain", "bf16_autocast"])
def test_values_and_gradients_equal_the_expression_bitwise(x_dtype, dtype, autocast):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 24, generator=gen).to(x_dtype).requires_grad_()
    weight = torch.randn(8, 24, generator=gen).requires_grad_()
    grad = torch.randn(37, 8, generator=gen, dtype=dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = router_gating_linear(x, weight, dtype)
        got = torch.autograd.grad(out, (x, weight), grad)
    want_out = expression(x, weight, dtype)  # no autocast: the dtype the router asks for
    want = torch.autograd.grad(want_out, (x, weight), grad)
    assert out.dtype == dtype and torch.equal(out, want_out)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w)


def _saved(fn, *args):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((tuple(t.shape), t.dtype)) or t,
                                                  lambda t: t):
        fn(*args)
    return saved


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_16_bit_x_is_saved_as_it_is(compiled):
    x = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(8, 32, requires_grad=True)
    op = torch.compile(router_gating_linear, fullgraph=True) if compiled else router_gating_linear
    saved = _saved(op, x, weight, torch.float32)
    assert ((64, 32), torch.bfloat16) in saved and ((64, 32), torch.float32) not in saved
    # Negative control: the tensor expression holds the float32 copy of x for the weight's gradient.
    assert ((64, 32), torch.float32) in _saved(expression, x, weight, torch.float32)


@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed"])
@pytest.mark.parametrize("output_mask", [(True, True), (True, False), (False, True)])
def test_opcheck(output_mask, transposed):
    """Both ops against their fake kernels (shapes and strides: the results are row-major whatever the inputs'
    layout), autograd registration and tracing. A masked backward runs with no input requiring a gradient, the
    case that honours its mask (a recorded one computes both); the schema check cannot follow its undefined
    output."""
    x = torch.randn(16, 5).t() if transposed else torch.randn(5, 16)
    x, weight, grad = x.to(torch.bfloat16), torch.randn(4, 16), torch.randn(5, 4)
    masked = False in output_mask
    for t in () if masked else (x, weight, grad):
        t.requires_grad_()
    if not masked:
        torch.library.opcheck(torch.ops.moe_core.router_gating_linear, (x, weight, torch.float32))
    utils = ("test_faketensor", "test_aot_dispatch_dynamic") if masked else torch.library._OPCHECK_DEFAULT_UTILS
    torch.library.opcheck(torch.ops.moe_core.router_gating_linear_backward, (grad, x, weight, list(output_mask)),
                          test_utils=utils)


def test_bad_arguments_raise():
    x, weight = torch.randn(5, 16), torch.randn(4, 16)
    with pytest.raises(TypeError, match="dtype"):
        router_gating_linear(x, weight, torch.bfloat16)
    with pytest.raises(ValueError, match="x_TH / weight_EH"):
        router_gating_linear(x, torch.randn(4, 15), torch.float32)


def _memory_mib(fn) -> tuple[float, float]:
    """``(peak, allocated)`` of ``fn()`` on the CPU in MiB: the peak above what was allocated when it started, and
    the sum of its allocations (the profiler's memory events)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        events = json.loads(Path(f"{tmp}/trace.json").read_text())["traceEvents"]
    memory = sorted((e["args"] for e in events if e.get("name") == "[memory]"), key=lambda a: a["Total Allocated"])
    start = min(a["Total Allocated"] - a["Bytes"] for a in memory)
    peak = max(a["Total Allocated"] for a in memory) - start
    return peak / 2**20, sum(a["Bytes"] for a in memory if a["Bytes"] > 0) / 2**20


def test_backward_holds_one_float32_copy_at_a_time():
    """grad_x's and grad_weight's float32 [T, H] temporaries (the widened product, then x's copy) never coexist:
    peak = one copy (16 MiB) + grad_x in bf16 (8 MiB), where both copies would make it 40 MiB."""
    x = torch.randn(4096, 1024, dtype=torch.bfloat16)
    weight, grad = torch.randn(16, 1024), torch.randn(4096, 16)
    peak, _ = _memory_mib(lambda: torch.ops.moe_core.router_gating_linear_backward(grad, x, weight, [True, True]))
    assert 16 <= peak < 32, peak


def test_compiled_backward_holds_one_float32_copy_at_a_time():
    """Compiled, the backward's float32 [T, H] temporaries still come one at a time, though Inductor schedules what
    surrounds the op: peak = one copy (16 MiB) + grad_x in bf16 (8 MiB), where both copies would make it 40 MiB."""
    x = torch.randn(4096, 1024, dtype=torch.bfloat16, requires_grad=True)
    weight, grad = torch.randn(16, 1024, requires_grad=True), torch.randn(4096, 16)
    grad_y = torch.randn(4096, 1024, dtype=torch.bfloat16)

    def layer(x, weight):  # x's gradient sums the router's and a second path's, as in a transformer block
        return router_gating_linear(x, weight, torch.float32), x * 2

    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        out = torch.compile(layer, fullgraph=True)(x, weight)
    peak, _ = _memory_mib(lambda: torch.autograd.grad(out, (x, weight), (grad, grad_y)))
    assert 16 <= peak < 32, peak


@pytest.mark.parametrize("case", ["frozen_weight", "transposed_x"])
def test_compiled_backward_equals_eager(case):
    """Compiled with Inductor, the backward gives the eager op's gradients: with the weight frozen (the backward's
    fake kernel and its masked output traced) and with a transposed x (the fake's strides against the kernel's)."""
    x = torch.randn(32, 64).t() if case == "transposed_x" else torch.randn(64, 32)
    x = x.to(torch.bfloat16).requires_grad_()
    weight = torch.randn(8, 32, requires_grad=case != "frozen_weight")
    grad = torch.randn(64, 8)
    inputs = (x, weight) if weight.requires_grad else (x,)
    want = torch.autograd.grad(router_gating_linear(x, weight, torch.float32), inputs, grad)
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        out = torch.compile(router_gating_linear, fullgraph=True)(x, weight, torch.float32)
    got = torch.autograd.grad(out, inputs, grad)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w)


def test_compiled_backward_is_one_node():
    """Traced, the backward stays the op: were it its ATen ops, Inductor could schedule x's float32 copy at the
    start of the layer's backward (it did on the GPU) and hold it through the expert GEMMs."""
    from torch._dynamo.backends.common import aot_autograd

    backward_ops = []

    def capture_backward(graph, example_inputs):
        backward_ops.extend(node.target for node in graph.graph.nodes if node.op == "call_function")
        return graph

    x = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(8, 32, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(router_gating_linear, fullgraph=True,
                             backend=aot_autograd(fw_compiler=lambda g, _: g, bw_compiler=capture_backward))
    compiled(x, weight, torch.float32).sum().backward()
    assert torch.ops.moe_core.router_gating_linear_backward.default in backward_ops
    assert torch.ops.aten.mm.default not in backward_ops, backward_ops


@pytest.mark.parametrize("x_dtype,dtype,penalised,wrt", [
    (torch.float64, torch.float64, "both", "both"),
    (torch.bfloat16, torch.float32, "both", "both"),
    (torch.float64, torch.float64, "grad_x", "weight"),
    (torch.float64, torch.float64, "grad_weight", "x"),
    (torch.float64, torch.float64, "frozen_weight", "x"),
], ids=["float64", "bf16_x", "grad_x_wrt_weight", "grad_weight_wrt_x", "frozen_weight"])
def test_double_backward_equals_the_expression(x_dtype, dtype, penalised, wrt):
    """Gradients of gradients (a gradient penalty through the router) go through the backward op's autograd: the
    expression's values, and no autograd fallback warning. Penalising one first-order gradient and differentiating
    by one input reaches each of the four GEMMs alone; a frozen weight runs the output mask under create_graph."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 4, generator=gen, dtype=torch.float64).to(x_dtype).requires_grad_()
    weight = torch.randn(3, 4, generator=gen, dtype=torch.float64).to(dtype)
    weight.requires_grad_(penalised != "frozen_weight")
    first = (x, weight) if weight.requires_grad else (x,)
    second = {"both": (x, weight), "x": (x,), "weight": (weight,)}[wrt]

    def penalty(fn):
        grads = torch.autograd.grad(fn(x, weight, dtype).square().sum(), first, create_graph=True)
        kept = {"grad_x": grads[:1], "grad_weight": grads[1:]}.get(penalised, grads)
        return torch.autograd.grad(sum(g.float().square().sum() for g in kept), second)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = penalty(router_gating_linear)
    for g, w in zip(got, penalty(expression), strict=True):
        assert g.dtype == w.dtype
        # A bf16 x's gradient: the op narrows each of its two contributions, the expression their sum (an ulp apart).
        tolerance = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else {}
        torch.testing.assert_close(g, w, **tolerance)


def test_a_frozen_router_skips_its_weight_gradient():
    """Only the gradients autograd asks for are computed: with the weight frozen, no float32 copy of x is made and
    no weight GEMM runs, and x's gradient is unchanged."""
    x = torch.randn(4096, 1024, dtype=torch.bfloat16, requires_grad=True)
    weight, grad = torch.randn(16, 1024), torch.randn(4096, 16)
    out = router_gating_linear(x, weight, torch.float32)
    _, allocated = _memory_mib(lambda: out.backward(grad))
    # grad_x: the float32 product (16 MiB) and its bf16 copy (8 MiB); x's float32 copy would add 16 MiB.
    assert 24 <= allocated < 32, allocated
    assert torch.equal(x.grad, torch.autograd.grad(expression(x, weight, torch.float32), x, grad)[0])
