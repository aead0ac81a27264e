"""grouped_gemm under torch.autocast: the op runs in the autocast dtype (as aten::mm does), gradients reach
float32 parameters in float32 (a float32 weight's straight from the wgrad's float32 accumulators), float64 is
left alone, and on Hopper the 16-bit kernels run."""

import pytest
import torch

from moe_core.ops import grouped_gemm
from moe_core.ops.reference import grouped_gemm_wgrad_ref


def inputs(device="cpu"):
    torch.manual_seed(0)
    x = torch.randn(40, 64, device=device, requires_grad=True)
    w = torch.randn(4, 64, 32, device=device, requires_grad=True)
    return x, w, torch.tensor([13, 0, 27, 0], device=device)


@pytest.mark.parametrize("trans_weight", [False, True])
def test_cpu_autocast_runs_the_op_in_bfloat16(trans_weight):
    x, w, counts = inputs()
    weight = w.transpose(1, 2).contiguous().detach().requires_grad_() if trans_weight else w
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = grouped_gemm(x, weight, counts, trans_weight=trans_weight)
    assert y.dtype == torch.bfloat16
    # The same op fed bf16 by hand: bitwise the same product.
    assert torch.equal(y, grouped_gemm(x.bfloat16(), weight.bfloat16(), counts, trans_weight=trans_weight))
    y.float().square().sum().backward()
    assert x.grad.dtype == torch.float32 and weight.grad.dtype == torch.float32
    assert torch.equal(weight.grad[1], torch.zeros_like(weight.grad[1]))  # empty expert: exact zero


@pytest.mark.parametrize("trans_weight", [False, True])
def test_float32_weight_gradient_is_not_rounded_to_16_bits(trans_weight):
    # The gradient of a float32 weight is the float32 product of the bf16 operands: within float32 rounding of the
    # float64 one. The negative control, the same weight cast by hand (autocast's generic path), gets a bf16
    # gradient widened, about 2^-9 off: the bar sits between the two.
    x, w, counts = inputs()
    weight = w.transpose(1, 2).contiguous().detach().requires_grad_() if trans_weight else w
    dy = torch.randn(x.shape[0], 32).bfloat16()
    grads = []
    for by_hand in (False, True):
        weight.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = grouped_gemm(x, weight.bfloat16() if by_hand else weight, counts, trans_weight=trans_weight)
        y.backward(dy)
        grads.append(weight.grad)
    ref = grouped_gemm_wgrad_ref(x.detach().bfloat16().double(), dy.double(), counts, trans_weight)
    scale = ref.abs().max()
    direct, widened = ((g.double() - ref).abs().max() / scale for g in grads)
    assert grads[0].dtype == torch.float32 and direct < 1e-6 < 1e-4 < widened
    assert torch.equal(grads[0][1], torch.zeros_like(grads[0][1]))  # empty expert: exact zero


def test_float32_weight_double_backward():
    # Gradients of the float32 weight gradient (grouped_gemm_wgrad_fp32's autograd) match the generic path's.
    results = []
    for by_hand in (False, True):
        x, w, counts = inputs()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = grouped_gemm(x, w.bfloat16() if by_hand else w, counts)
        (dw,) = torch.autograd.grad(y.float().square().sum(), w, create_graph=True)
        dw.square().sum().backward()
        results.append(x.grad)
    torch.testing.assert_close(results[0], results[1], rtol=2e-2, atol=1e-2 * results[1].abs().max().item())


def test_float64_and_disabled_autocast_are_left_alone():
    x, w, counts = inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert grouped_gemm(x.double(), w.double(), counts).dtype == torch.float64
        with torch.autocast("cpu", enabled=False):
            assert grouped_gemm(x, w, counts).dtype == torch.float32


def test_autocast_traces_under_compile():
    x, w, counts = inputs()

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(x, w):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return grouped_gemm(x, w, counts)

    y = f(x, w)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert w.grad.dtype == torch.float32
    compiled_grad, w.grad = w.grad, None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        grouped_gemm(x, w, counts).float().sum().backward()
    assert torch.equal(compiled_grad, w.grad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_autocast_reaches_the_16_bit_kernels(monkeypatch, capfd):
    monkeypatch.setenv("MOE_CORE_GEMM_DEBUG", "1")
    x, w, counts = inputs("cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = grouped_gemm(x, w, counts)
    y.float().sum().backward()
    torch.cuda.synchronize()
    err = capfd.readouterr().err
    assert y.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    assert "portable kernel (not bf16/fp16)" not in err
    if torch.cuda.get_device_capability() == (9, 0) and "built without sm_90a" not in err:
        assert "portable kernel" not in err and "tile" in err


def test_mixed_input_dtypes_are_accepted_only_under_autocast():
    x, w, counts = inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert grouped_gemm(x.bfloat16(), w, counts).dtype == torch.bfloat16
    with pytest.raises(TypeError, match="weight: expected x's dtype"):
        grouped_gemm(x.bfloat16(), w, counts)
