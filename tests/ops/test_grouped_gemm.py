"""grouped_gemm on the CPU: forward, dgrad and wgrad against float64 references, for every expert count and
group-size pattern, with exact zeros for empty experts, compile parity and every bad input.

Legend: T rows, K reduction width, N output width, E experts.
"""

import numpy as np
import pytest
import torch

from moe_core.ops import grouped_gemm
from moe_core.ops.reference import grouped_gemm_ref, grouped_gemm_wgrad_ref

EXPERT_COUNTS = [1, 2, 3, 4, 8, 16, 32, 64, 128, 256]
PATTERNS = ["uniform", "dirichlet", "some_zero", "one_nonzero", "all_zero", "no_tokens"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
K, N = 41, 9  # odd sizes: no alignment is assumed


def make_counts(pattern: str, num_experts: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    total = int(rng.integers(1, 4 * num_experts + 40))
    if pattern == "uniform":
        counts = np.full(num_experts, total // num_experts)
    elif pattern == "dirichlet":
        counts = rng.multinomial(total, rng.dirichlet(np.full(num_experts, 0.3)))
    elif pattern == "some_zero":
        counts = rng.integers(0, 6, num_experts)
        counts[:: max(num_experts // 3, 1)] = 0
        counts[-1] = max(counts[-1], 1) if num_experts > 1 else counts[-1]
    elif pattern == "one_nonzero":
        counts = np.zeros(num_experts, dtype=np.int64)
        counts[rng.integers(num_experts)] = total
    else:  # all_zero and no_tokens both mean T == 0; all_zero also keeps E > 0 experts with empty blocks
        counts = np.zeros(num_experts, dtype=np.int64)
    return torch.tensor(counts, dtype=torch.int64)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def torch_err(x, w, counts, trans_weight, dtype) -> float:
    """PyTorch's own error for the same product in `dtype` (the bar: ours may be at most 2x this)."""
    ref = grouped_gemm_ref(x.double(), w.double(), counts, trans_weight)
    return rel_err(grouped_gemm_ref(x.to(dtype), w.to(dtype), counts, trans_weight), ref)


def grid():
    # Every E meets every pattern; dtype and layout rotate so the cross product stays small.
    for i, e in enumerate(EXPERT_COUNTS):
        for j, pattern in enumerate(PATTERNS):
            yield e, pattern, DTYPES[(i + j) % 3], bool((i + 2 * j) % 2)


@pytest.mark.parametrize("num_experts,pattern,dtype,trans_weight", list(grid()))
def test_forward_dgrad_wgrad_match_float64(num_experts, pattern, dtype, trans_weight):
    torch.manual_seed(num_experts)
    counts = make_counts(pattern, num_experts, seed=num_experts)
    t = int(counts.sum())
    x = torch.randn(t, K, dtype=dtype, requires_grad=True)
    w_shape = (num_experts, N, K) if trans_weight else (num_experts, K, N)
    w = torch.randn(w_shape, dtype=dtype, requires_grad=True)
    y = grouped_gemm(x, w, counts, trans_weight=trans_weight)
    dy = torch.randn(t, N, dtype=dtype)
    y.backward(dy)

    assert y.shape == (t, N) and y.dtype == dtype
    assert w.grad is not None and x.grad is not None and w.grad.shape == w.shape
    assert torch.isfinite(y).all() and torch.isfinite(w.grad).all()
    empty = counts == 0
    assert torch.equal(w.grad[empty], torch.zeros_like(w.grad[empty])), "empty experts must get exact zeros"
    if t == 0:
        return
    x64, w64, dy64 = x.detach().double(), w.detach().double(), dy.double()
    checks = [
        (y, grouped_gemm_ref(x64, w64, counts, trans_weight), (x.detach(), w.detach(), trans_weight)),
        (x.grad, grouped_gemm_ref(dy64, w64, counts, not trans_weight), (dy, w.detach(), not trans_weight)),
    ]
    for ours, ref, (a, b, tw) in checks:
        assert rel_err(ours, ref) <= 2 * torch_err(a, b, counts, tw, dtype) + 1e-6
    wgrad_ref = grouped_gemm_wgrad_ref(x64, dy64, counts, trans_weight)
    wgrad_torch = grouped_gemm_wgrad_ref(x.detach(), dy, counts, trans_weight)
    assert rel_err(w.grad, wgrad_ref) <= 2 * rel_err(wgrad_torch, wgrad_ref) + 1e-6


def test_every_row_written_over_poisoned_memory():
    # Fill the allocator's free blocks with NaN first: an unwritten output row would read one back.
    for _ in range(3):
        junk = torch.full((4096, N), float("nan"))
        del junk
    counts = torch.tensor([5, 0, 1, 0, 7])
    x, w = torch.randn(13, K), torch.randn(5, K, N)
    y = grouped_gemm(x, w, counts)
    assert not torch.isnan(y).any()
    torch.testing.assert_close(y[:5], x[:5] @ w[0])
    torch.testing.assert_close(y[12:], x[12:] @ w[4])


def test_zero_reduction_width_gives_zeros():
    counts = torch.tensor([2, 3])
    x, w = torch.randn(5, 0, requires_grad=True), torch.randn(2, 0, 4, requires_grad=True)
    y = grouped_gemm(x, w, counts)
    assert torch.equal(y, torch.zeros(5, 4))
    y.sum().backward()
    assert x.grad.shape == (5, 0) and w.grad.shape == (2, 0, 4)


def test_weight_grad_flows_with_no_tokens():
    w = torch.randn(3, K, N, requires_grad=True)
    y = grouped_gemm(torch.randn(0, K), w, torch.zeros(3, dtype=torch.int32))
    (y.sum() + 0.0).backward()
    assert torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize("count_dtype", [torch.int32, torch.int64])
def test_count_dtypes_and_noncontiguous_inputs(count_dtype):
    counts = torch.tensor([3, 0, 4], dtype=count_dtype)
    x = torch.randn(K, 7).t()  # [7, K], non-contiguous
    w = torch.randn(3, N, K).transpose(1, 2)  # [3, K, N], non-contiguous
    assert not x.is_contiguous() and not w.is_contiguous()
    y = grouped_gemm(x, w, counts)
    torch.testing.assert_close(y, grouped_gemm_ref(x, w, counts.long()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("trans_weight", [False, True])
def test_compile_fullgraph_matches_eager(trans_weight):
    counts = torch.tensor([4, 0, 3, 1])
    w_shape = (4, N, K) if trans_weight else (4, K, N)
    x0, w0 = torch.randn(8, K), torch.randn(w_shape)

    def run(fn):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = fn(x, w)
        y.pow(2).sum().backward()
        return y.detach(), x.grad, w.grad

    eager = run(lambda x, w: grouped_gemm(x, w, counts, trans_weight=trans_weight))
    compiled = run(torch.compile(lambda x, w: grouped_gemm(x, w, counts, trans_weight=trans_weight), fullgraph=True))
    for a, b in zip(eager, compiled, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("trans_weight", [False, True])
def test_opcheck_schema_autograd_fake_and_aot(trans_weight):
    # torch.library.opcheck: schema mutation/aliasing, the C++ autograd registration, fake kernels and
    # AOTAutograd (dynamic shapes) against eager, on empty and non-empty experts.
    counts = torch.tensor([4, 0, 3, 1])
    w_shape = (4, N, K) if trans_weight else (4, K, N)
    x, w = torch.randn(8, K, requires_grad=True), torch.randn(w_shape, requires_grad=True)
    torch.library.opcheck(torch.ops.moe_core.grouped_gemm.default, (x, w, counts, trans_weight))
    dy = torch.randn(8, N)
    torch.library.opcheck(torch.ops.moe_core.grouped_gemm_wgrad.default, (x.detach(), dy, counts, trans_weight))


def test_gradient_accumulation_fusion_adds_into_main_grad():
    counts = torch.tensor([2, 0, 3])
    x = torch.randn(5, K, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(3, K, N, dtype=torch.bfloat16, requires_grad=True)
    w.main_grad = torch.full((3, K, N), 0.5)
    hooked = []
    w.register_hook(lambda g: hooked.append(g))
    dy = torch.randn(5, N, dtype=torch.bfloat16)
    grouped_gemm(x, w, counts, gradient_accumulation_fusion=True).backward(dy)
    expected = 0.5 + grouped_gemm_wgrad_ref(x.detach().double(), dy.double(), counts).float()
    torch.testing.assert_close(w.main_grad, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(w.main_grad[1], torch.full((K, N), 0.5)), "an empty expert adds exactly nothing"
    assert hooked and torch.equal(hooked[0], torch.zeros_like(w)) and w.grad_added_to_main_grad
    assert x.grad is not None


def test_gradient_accumulation_fusion_needs_main_grad():
    with pytest.raises(ValueError, match="main_grad"):
        grouped_gemm(torch.randn(2, K), torch.randn(1, K, N), torch.tensor([2]), gradient_accumulation_fusion=True)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("trans_weight", [False, True], ids=["kn", "nk"])
def test_unused_rows_past_the_counts_sum(device, dtype, trans_weight):
    # A static bound on the rows (the sync-free dispatch): counts sum to 11 of T = 300 rows. The unused rows hold
    # NaN and are never read: y and dx over the 11 rows and dweight equal the products over those rows alone (y's
    # and dx's unused rows are unspecified).
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    counts = torch.tensor([4, 0, 7], device=device)
    used, t = 11, 300
    x = torch.randn(t, K, device=device, dtype=dtype)
    x[used:] = float("nan")
    x.requires_grad_()
    w = torch.randn((3, N, K) if trans_weight else (3, K, N), device=device, dtype=dtype, requires_grad=True)
    y = grouped_gemm(x, w, counts, trans_weight=trans_weight)
    dy = torch.randn(t, N, device=device, dtype=dtype)
    dy[used:] = float("nan")
    y.backward(dy)
    x_used, dy_used, w64 = x.detach()[:used].double(), dy[:used].double(), w.detach().double()
    tol = dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(y[:used].double(), grouped_gemm_ref(x_used, w64, counts.cpu(), trans_weight), **tol)
    torch.testing.assert_close(x.grad[:used].double(),
                               grouped_gemm_ref(dy_used, w64, counts.cpu(), not trans_weight), **tol)
    torch.testing.assert_close(w.grad.double(), grouped_gemm_wgrad_ref(x_used, dy_used, counts.cpu(), trans_weight),
                               **tol)
    assert torch.equal(w.grad[1], torch.zeros_like(w.grad[1]))


BAD_INPUTS = [
    (lambda: (torch.randn(2, 3, 4), torch.randn(1, 4, 5), torch.tensor([2])), ValueError, "x"),
    (lambda: (torch.randn(2, 4), torch.randn(4, 5), torch.tensor([2])), ValueError, "weight"),
    (lambda: (torch.randn(2, 3), torch.randn(1, 4, 5), torch.tensor([2])), ValueError, "x: expected K = 4"),
    (lambda: (torch.randn(2, 4), torch.randn(2, 4, 5), torch.tensor([2])), ValueError, "tokens_per_expert"),
    (lambda: (torch.randn(2, 4), torch.randn(2, 4, 5), torch.tensor([3, -1])), ValueError, "non-negative"),
    (lambda: (torch.randn(2, 4), torch.randn(2, 4, 5), torch.tensor([1, 2])), ValueError, "sum to 3"),
    (lambda: (torch.randn(2, 4), torch.randn(1, 4, 5), torch.tensor([2.0])), TypeError, "tokens_per_expert"),
    (lambda: (torch.randn(2, 4), torch.randn(1, 4, 5, dtype=torch.float16), torch.tensor([2])), TypeError, "weight"),
    (lambda: (torch.randn(2, 4), torch.randn(1, 4, 5, device="meta"), torch.tensor([2])), ValueError, "device"),
    (lambda: (torch.randint(0, 3, (2, 4)), torch.randint(0, 3, (1, 4, 5)), torch.tensor([2])), TypeError, "x"),
    (lambda: (torch.randn(2, 4), torch.randn(1, 4, 5), [2]), TypeError, "tokens_per_expert"),
    (lambda: (torch.randn(2, 4), torch.randn(1, 4, 5), torch.tensor([[2]])), ValueError, "tokens_per_expert"),
]


@pytest.mark.parametrize("make,error,message", BAD_INPUTS)
def test_bad_inputs_raise_named_errors(make, error, message):
    with pytest.raises(error, match=message):
        grouped_gemm(*make())


def test_cpp_boundary_checks_carry_messages():
    with pytest.raises(RuntimeError, match="tokens_per_expert: counts sum past T = 2"):
        torch.ops.moe_core.grouped_gemm(torch.randn(2, 4), torch.randn(1, 4, 5), torch.tensor([3]), False)
    with pytest.raises(RuntimeError, match="x and dy"):
        torch.ops.moe_core.grouped_gemm_wgrad(torch.randn(2, 4), torch.randn(3, 5), torch.tensor([2]), False)
