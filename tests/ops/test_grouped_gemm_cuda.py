"""grouped_gemm on CUDA: forward, dgrad and wgrad against float64 references over every expert count, group-size
pattern, dtype and weight layout, on NaN-poisoned memory; the accumulating wgrad, CUDA-graph replay with new
counts, torch.compile parity and the absence of host syncs. On Hopper the aligned bf16/fp16 cases run the
CUTLASS sm_90a kernels (every tile is forced once) and the rest the portable kernels; MOE_CORE_GEMM_PORTABLE
runs both back ends on the same cases.

Legend: T rows, K reduction width, N output width, E experts. All tests need a GPU (marked ``gpu``).
"""

import re
import subprocess
import sys

import pytest
import torch

from moe_core.ops import grouped_gemm
from moe_core.ops.reference import grouped_gemm_ref, grouped_gemm_wgrad_ref
from tests.ops.test_grouped_gemm import EXPERT_COUNTS, PATTERNS, make_counts, rel_err

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (K, N): odd widths take the portable kernel's guarded scalar loads, (136, 130) its vector loads; widths in
# whole 16-byte vectors take the sm_90a CUTLASS kernels on Hopper for bf16/fp16 (the portable one elsewhere).
SHAPES = [(41, 9), (136, 130), (264, 200)]


def poison_allocator() -> None:
    """Fill the caching allocator's free blocks with NaN, so an output row the kernels skip reads back NaN."""
    junk = [torch.full((1 << 22,), float("nan"), device="cuda") for _ in range(8)]
    del junk


def torch_errs(x, w, dy, counts, trans_weight):
    """PyTorch's own same-dtype errors (forward, dgrad, wgrad) against float64: the bar is 2x these."""
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    return (
        rel_err(grouped_gemm_ref(x, w, counts, trans_weight), grouped_gemm_ref(x64, w64, counts, trans_weight)),
        rel_err(grouped_gemm_ref(dy, w, counts, not trans_weight),
                grouped_gemm_ref(dy64, w64, counts, not trans_weight)),
        rel_err(grouped_gemm_wgrad_ref(x, dy, counts, trans_weight),
                grouped_gemm_wgrad_ref(x64, dy64, counts, trans_weight)),
    )


def check_against_float64(counts_cpu, k, n, dtype, trans_weight, counts_device="cuda", count_dtype=torch.int64):
    t = int(counts_cpu.sum())
    num_experts = counts_cpu.numel()
    x = torch.randn(t, k, device="cuda").to(dtype)
    w = (torch.randn((num_experts, n, k) if trans_weight else (num_experts, k, n), device="cuda") / k**0.5).to(dtype)
    dy = torch.randn(t, n, device="cuda").to(dtype)
    x.requires_grad_(True)
    w.requires_grad_(True)
    counts = counts_cpu.to(counts_device, count_dtype)

    poison_allocator()
    y = grouped_gemm(x, w, counts, trans_weight=trans_weight)
    y.backward(dy)
    torch.cuda.synchronize()

    assert y.shape == (t, n) and y.dtype == dtype
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all()
    empty = (counts_cpu == 0).cuda()
    assert torch.equal(w.grad[empty], torch.zeros_like(w.grad[empty])), "empty experts must get exact zeros"
    if t == 0:
        return
    xd, wd = x.detach(), w.detach()
    x64, w64, dy64 = xd.double(), wd.double(), dy.double()
    fwd_bar, dgrad_bar, wgrad_bar = torch_errs(xd, wd, dy, counts_cpu, trans_weight)
    eps = 1e-6
    assert rel_err(y, grouped_gemm_ref(x64, w64, counts_cpu, trans_weight)) <= 2 * fwd_bar + eps
    assert rel_err(x.grad, grouped_gemm_ref(dy64, w64, counts_cpu, not trans_weight)) <= 2 * dgrad_bar + eps
    assert rel_err(w.grad, grouped_gemm_wgrad_ref(x64, dy64, counts_cpu, trans_weight)) <= 2 * wgrad_bar + eps


@pytest.mark.parametrize("trans_weight", [False, True], ids=["KN", "NK"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("num_experts", EXPERT_COUNTS)
def test_matches_float64(num_experts, pattern, dtype, trans_weight):
    torch.manual_seed(num_experts)
    counts = make_counts(pattern, num_experts, seed=num_experts)
    case = EXPERT_COUNTS.index(num_experts) + PATTERNS.index(pattern)
    k, n = SHAPES[case % 3]
    # Counts alternate between GPU and CPU (the wrapper copies those over), int64 and int32.
    check_against_float64(counts, k, n, dtype, trans_weight, counts_device=("cuda", "cpu")[case % 2],
                          count_dtype=(torch.int64, torch.int32)[(case // 2) % 2])


@pytest.mark.parametrize("portable", [False, True], ids=["default", "portable"])
@pytest.mark.parametrize("trans_weight", [False, True], ids=["KN", "NK"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_groups_spanning_many_tiles(dtype, trans_weight, portable, monkeypatch):
    # Groups longer than one row tile, ragged ends in every dimension, empty groups between them; on Hopper
    # both back ends (MOE_CORE_GEMM_PORTABLE=1 forces the portable kernels).
    if portable:
        monkeypatch.setenv("MOE_CORE_GEMM_PORTABLE", "1")
    torch.manual_seed(1)
    counts = torch.tensor([300, 0, 129, 1, 0, 257, 64])
    check_against_float64(counts, 264, 200, dtype, trans_weight)


SM90_TILES = ["128x256", "128x128", "128x256c21", "128x128pp", "256x128c21", "rows"]
TUNING_TILES = ("128x128pp", "256x128c21")  # built only with MOE_CORE_SM90_TUNING=1 (setup.py)


def forced(tile: str, run) -> None:
    """run() under MOE_CORE_GEMM_TILE=tile, skipping (after checking the error) a tuning kernel the build left out."""
    try:
        run()
    except RuntimeError as err:
        if tile not in TUNING_TILES or "rebuild with MOE_CORE_SM90_TUNING=1" not in str(err):
            raise
        pytest.skip(f"{tile} is a tuning kernel this build leaves out")


@pytest.mark.parametrize("raster,swizzle", [("m", "1"), ("n", "4")])
@pytest.mark.parametrize("tile", SM90_TILES)
@pytest.mark.parametrize("trans_weight", [False, True], ids=["KN", "NK"])
def test_every_sm90_schedule_matches_float64(tile, raster, swizzle, trans_weight, monkeypatch):
    # The heuristics pick one schedule per problem; MOE_CORE_GEMM_TILE/RASTER/SWIZZLE force each tile and
    # both walks of the persistent scheduler (ignored off Hopper).
    monkeypatch.setenv("MOE_CORE_GEMM_TILE", tile)
    monkeypatch.setenv("MOE_CORE_GEMM_RASTER", raster)
    monkeypatch.setenv("MOE_CORE_GEMM_SWIZZLE", swizzle)
    torch.manual_seed(7)
    counts = torch.tensor([0, 700, 5, 0, 300, 1, 0, 130])
    forced(tile, lambda: check_against_float64(counts, 520, 384, torch.bfloat16, trans_weight))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_16_bit_types_take_the_static_descriptor_kernels_by_default(dtype, monkeypatch, capfd):
    # The heuristics' own pick (no MOE_CORE_GEMM_TILE) for a forward and wgrad; the wgrad keeps the
    # pointer-array kernel once the mean expert's rows of x pass 32 MiB (16384 x 1088 x 2 bytes: 34 MiB).
    monkeypatch.delenv("MOE_CORE_GEMM_TILE", raising=False)
    monkeypatch.setenv("MOE_CORE_GEMM_DEBUG", "1")
    torch.manual_seed(8)
    check_against_float64(torch.tensor([1100, 948]), 64, 8192, dtype, False)
    check_against_float64(torch.tensor([16384]), 1088, 64, dtype, False)
    err = capfd.readouterr().err
    if torch.cuda.get_device_capability() == (9, 0) and "built without sm_90a" not in err:
        assert re.search(r"forward \(weight \[E, K, N\]\): E=2 m=2048 n=8192 k=64 -> row-tile 128x256x64 ", err)
        assert re.search(r"wgrad: E=2 m=64 n=8192 .* -> row-range 128x256x32 cooperative cluster 2x1", err)
        assert re.search(r"wgrad: E=1 m=1088 n=64 .* -> pointer-array ", err)


def fp32_wgrad_cases(tiles: list):
    """The cases of the wgrads with fp32 output: x [136, 72] and dy [136, n] of each dtype over counts with empty
    experts, both weight layouts, n = 40 (the sm_90a kernels for bf16/fp16 on Hopper) and 33 (the portable ones),
    each MOE_CORE_GEMM_TILE of ``tiles`` (None: the default schedule). The test gets ``wgrad_case``:
    ``(counts, x, dy)``."""
    tile_ids = [tile or "default" for tile in tiles]
    marks = (pytest.mark.parametrize("tile", tiles, ids=tile_ids), pytest.mark.parametrize("n", [33, 40]),
             pytest.mark.parametrize("trans_weight", [False, True], ids=["KN", "NK"]),
             pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1]))

    def decorate(test):
        for mark in marks:
            test = mark(test)
        return test

    return decorate


@pytest.fixture
def wgrad_case(dtype, n, tile, monkeypatch):
    if tile:
        monkeypatch.setenv("MOE_CORE_GEMM_TILE", tile)
    torch.manual_seed(2)
    counts = torch.tensor([5, 0, 130, 0, 1])
    t = int(counts.sum())
    return counts, torch.randn(t, 72, device="cuda").to(dtype), torch.randn(t, n, device="cuda").to(dtype)


@fp32_wgrad_cases([None, "rows"])
def test_wgrad_accum_adds_into_main_grad(dtype, trans_weight, n, tile, wgrad_case):
    # On sm_90a the pointer-array kernel by default, the row-range kernel with MOE_CORE_GEMM_TILE=rows.
    counts, x, dy = wgrad_case
    k = x.shape[1]
    shape = (5, n, k) if trans_weight else (5, k, n)
    start = torch.randn(shape, device="cuda")
    main_grad = start.clone()
    torch.ops.moe_core.grouped_gemm_wgrad_accum_(main_grad, x, dy, counts.cuda(), trans_weight)
    ref = grouped_gemm_wgrad_ref(x.double(), dy.double(), counts, trans_weight)
    empty = (counts == 0).cuda()
    assert torch.equal(main_grad[empty], start[empty]), "empty experts must leave main_grad untouched"
    torch.testing.assert_close(main_grad.double(), start.double() + ref, rtol=1e-4, atol=1e-4 * k**0.5 * 4)


@fp32_wgrad_cases([None, "128x128", "128x256"])
def test_wgrad_fp32_writes_the_float32_product(dtype, trans_weight, n, tile, wgrad_case, monkeypatch, capfd):
    # The float32 weight gradient of autocast (csrc/autocast.cpp): the product of the given operands in float32,
    # exactly zero for empty experts, on NaN-poisoned memory; on sm_90a row ranges by default, the pointer-array
    # tiles when forced.
    monkeypatch.setenv("MOE_CORE_GEMM_DEBUG", "1")
    counts, x, dy = wgrad_case
    k = x.shape[1]
    poison_allocator()
    dw = torch.ops.moe_core.grouped_gemm_wgrad_fp32(x, dy, counts.cuda(), trans_weight)
    torch.cuda.synchronize()
    ref = grouped_gemm_wgrad_ref(x.double(), dy.double(), counts, trans_weight)
    assert dw.dtype == torch.float32 and dw.shape == ref.shape
    empty = (counts == 0).cuda()
    assert torch.equal(dw[empty], torch.zeros_like(dw[empty])), "empty experts must get exact zeros"
    torch.testing.assert_close(dw.double(), ref, rtol=1e-5, atol=1e-5 * k**0.5)
    err = capfd.readouterr().err
    sm90 = dtype != torch.float32 and n == 40 and torch.cuda.get_device_capability() == (9, 0)
    if sm90 and "built without sm_90a" not in err:
        family = "row-range" if tile is None else f"pointer-array {tile}x64"
        assert re.search(rf"wgrad in fp32: E=5 .* -> {family}", err)


def assert_accum_matches_and_leaves_empty_experts_alone(counts: torch.Tensor, t: int, k: int, n: int,
                                                        x: torch.Tensor | None = None, dy: torch.Tensor | None = None,
                                                        unchecked: tuple[int, ...] = ()) -> None:
    """main_grad += the bf16 wgrad of x [t, k] and dy [t, n] (random unless given) over `counts` (their sum may pass
    t), against float64 element by element for every expert with rows but the `unchecked` ones; an expert left
    without rows keeps its slice bit for bit: it starts as NaN, which any write, even of NaN + 0, would change
    (the GPU's NaN is not torch's)."""
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16) if x is None else x
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16) if dy is None else dy
    rows = torch.diff(counts.cumsum(0).clamp(max=t), prepend=torch.zeros(1, dtype=counts.dtype))
    empty = (rows == 0).cuda()
    start = torch.randn(counts.numel(), k, n, device="cuda")
    start[empty] = float("nan")
    main_grad = start.clone()
    poison_allocator()
    torch.ops.moe_core.grouped_gemm_wgrad_accum_(main_grad, x, dy, counts.cuda(), False)
    assert torch.equal(main_grad[empty].view(torch.int32), start[empty].view(torch.int32)), \
        "an expert without rows must leave its main_grad untouched"
    checked = ~empty
    checked[list(unchecked)] = False
    ref = start.double() + grouped_gemm_wgrad_ref(x.double(), dy.double(), rows)
    torch.testing.assert_close(main_grad[checked].double(), ref[checked], rtol=1e-4, atol=1e-3)


def test_wgrad_accum_on_row_ranges_reads_only_each_experts_rows(monkeypatch):
    # The row-range accumulating wgrad (MOE_CORE_GEMM_TILE=rows; elsewhere the default kernels run): infinities in
    # expert 2's rows, which expert 0's last k-tile loads and masks, stay out of main_grad[0]; expert 3's last
    # k-tile runs past T; empty expert 1 (where expert 2 starts) and expert 4, whose rows the counts' sum past T
    # clamps away, stay untouched; partial k-tiles on both sides of every 16-row step.
    monkeypatch.setenv("MOE_CORE_GEMM_TILE", "rows")
    x, dy = torch.randn(78, 136, device="cuda", dtype=torch.bfloat16), torch.randn(78, 40, device="cuda",
                                                                                    dtype=torch.bfloat16)
    x[5:75], dy[5:75] = float("inf"), float("inf")
    assert_accum_matches_and_leaves_empty_experts_alone(torch.tensor([5, 0, 70, 3, 4]), 78, 136, 40, x, dy,
                                                        unchecked=(2,))
    counts = torch.tensor([1, 15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 64, 65, 80, 81, 127, 0, 5])
    assert_accum_matches_and_leaves_empty_experts_alone(counts, int(counts.sum()), 128, 256)


@pytest.mark.parametrize("num_experts", [200, 257, 1025, 1100])
def test_wgrad_accum_on_row_ranges_walks_every_expert_and_stops_at_the_empty_ones(num_experts, monkeypatch):
    # The row-range accumulating wgrad walks the experts by rows, most first, and a cluster's walk ends at its first
    # empty expert: ranked by counting (to 256 experts) or sorting (to 1024), the empty ones come last; past 1024 the
    # listing moves them last. Every expert with rows must still land in its own slice, every empty one untouched.
    monkeypatch.setenv("MOE_CORE_GEMM_TILE", "rows")
    gen = torch.Generator().manual_seed(num_experts)
    counts = torch.randint(0, 3, (num_experts,), generator=gen) ** 4
    counts[torch.randint(0, num_experts, (4,), generator=gen)] = torch.tensor([700, 300, 130, 64])
    assert_accum_matches_and_leaves_empty_experts_alone(counts, int(counts.sum()), 64, 256)


def test_gradient_accumulation_fusion_on_cuda():
    torch.manual_seed(3)
    counts = torch.tensor([4, 0, 9], device="cuda")
    x = torch.randn(13, 40, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(3, 40, 24, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w.main_grad = torch.ones(3, 40, 24, device="cuda")
    dy = torch.randn(13, 24, device="cuda", dtype=torch.bfloat16)
    grouped_gemm(x, w, counts, gradient_accumulation_fusion=True).backward(dy)
    ref = grouped_gemm_wgrad_ref(x.detach().double(), dy.double(), counts.cpu())
    assert w.grad_added_to_main_grad and torch.equal(w.grad, torch.zeros_like(w))
    assert torch.equal(w.main_grad[1], torch.ones(40, 24, device="cuda"))
    torch.testing.assert_close(w.main_grad.double(), 1 + ref, rtol=1e-3, atol=1e-3)


def test_cuda_graph_replays_with_new_counts():
    torch.manual_seed(4)
    t, k, n, num_experts = 96, 64, 40, 6
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(num_experts, k, n, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    counts = torch.zeros(num_experts, dtype=torch.int64, device="cuda")
    counts[0] = t

    def step():
        return (torch.ops.moe_core.grouped_gemm(x, w, counts, False),
                torch.ops.moe_core.grouped_gemm_wgrad(x, dy, counts, False))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, dw = step()

    for new_counts in ([96, 0, 0, 0, 0, 0], [10, 0, 50, 0, 36, 0], [0, 0, 0, 0, 0, 96], [16] * 6):
        counts.copy_(torch.tensor(new_counts))
        poison_allocator()
        graph.replay()
        torch.cuda.synchronize()
        c = torch.tensor(new_counts)
        torch.testing.assert_close(y.double(), grouped_gemm_ref(x.double(), w.double(), c), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(dw.double(), grouped_gemm_wgrad_ref(x.double(), dy.double(), c),
                                   rtol=2e-2, atol=2e-1)
        empty = (c == 0).cuda()
        assert torch.equal(dw[empty], torch.zeros_like(dw[empty]))


@pytest.mark.parametrize("trans_weight", [False, True], ids=["KN", "NK"])
def test_compile_fullgraph_matches_eager(trans_weight):
    torch.manual_seed(5)
    counts = torch.tensor([40, 0, 3, 21], device="cuda")
    x0 = torch.randn(64, 48, device="cuda")
    w0 = torch.randn((4, 24, 48) if trans_weight else (4, 48, 24), device="cuda")

    def run(fn):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = fn(x, w)
        y.pow(2).sum().backward()
        return y.detach(), x.grad, w.grad

    def fn(x, w):
        return grouped_gemm(x, w, counts, trans_weight=trans_weight)

    eager = run(fn)
    compiled = run(torch.compile(fn, fullgraph=True))
    for a, b in zip(eager, compiled, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_first_backward_in_a_fresh_process():
    # The backward runs on autograd's own thread, where no CUDA runtime call may have made the device's context
    # current yet. Each sm_90a path launches its listing kernel before CUTLASS encodes TMA descriptors (a driver
    # call that needs that context): with the encoding first, a fresh process's first backward crashed.
    script = (
        "import torch\n"
        "from moe_core.ops import grouped_gemm\n"
        "x = torch.randn(300, 520, device='cuda', dtype=torch.bfloat16, requires_grad=True)\n"
        "w = torch.randn(8, 520, 384, device='cuda', dtype=torch.bfloat16, requires_grad=True)\n"
        "counts = torch.tensor([0, 200, 5, 0, 64, 1, 0, 30], device='cuda')\n"
        "grouped_gemm(x, w, counts).backward(torch.ones(300, 384, device='cuda', dtype=torch.bfloat16))\n"
        "torch.cuda.synchronize()\n"
        "assert torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all()\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_forward_backward_has_no_host_sync():
    torch.manual_seed(6)
    counts = torch.tensor([7, 0, 20, 5], device="cuda")
    x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4, 64, 48, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(32, 48, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        grouped_gemm(x, w, counts).backward(dy)
        grouped_gemm(x.detach(), w.detach().transpose(1, 2).contiguous(), counts, trans_weight=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert x.grad is not None and w.grad is not None


def test_back_to_back_calls_match_synchronized_ones():
    # On Hopper each op's small listing kernel and its GEMM start as programmatic dependents (PDL) of the kernel
    # before them. A chain of calls with new counts each time, forward and backward, unsynchronized, must give
    # bitwise what the same calls give with a device sync after each (a GEMM reading its tile list before it is
    # written, or a listing overwriting a freed workspace that the GEMM before still reads, would not).
    gen = torch.Generator().manual_seed(8)
    num_experts, t, k = 16, 4096, 256
    ws = [(torch.randn(num_experts, k, k, generator=gen) / k**0.5).cuda().bfloat16() for _ in range(6)]
    counts = [torch.bincount(torch.randint(0, num_experts // 2, (t,), generator=gen) * 2 + i % 2,
                             minlength=num_experts).cuda() for i in range(len(ws))]  # half the experts empty
    x = torch.randn(t, k, generator=gen).cuda().bfloat16()

    def run(sync):
        leaves = [x.clone().requires_grad_(True)] + [w.clone().requires_grad_(True) for w in ws]
        y = leaves[0]
        for w, c in zip(leaves[1:], counts, strict=True):
            y = grouped_gemm(y, w, c)
            if sync:
                torch.cuda.synchronize()
                y.register_hook(lambda grad: torch.cuda.synchronize())
        y.float().square().sum().backward()
        return [y.detach()] + [leaf.grad for leaf in leaves]

    for a, b in zip(run(sync=True), run(sync=False), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("counts,t,n", [([3, 0, 2], 9, 8), ([9, 0, 40] * 13 + [0], 1000, 512)],
                         ids=["3_experts", "40_experts_many_tiles"])
def test_rows_past_the_counts_sum_are_never_read(dtype, counts, t, n):
    # GPU counts are not checked (that would sync); the rows past a short sum are unused: x's NaN there reaches
    # no row of the experts' (y's rows past the sum are unspecified). 40 experts: the rows past the sum span
    # several 128-row tiles and two 256-column tiles of the sm_90a row-tile kernel.
    counts = torch.tensor(counts, device="cuda")
    x, w = torch.randn(t, 16, device="cuda", dtype=dtype), torch.randn(len(counts), 16, n, device="cuda", dtype=dtype)
    used = int(counts.sum())
    x[used:] = float("nan")
    poison_allocator()
    y = torch.ops.moe_core.grouped_gemm(x, w, counts, False)
    ref = grouped_gemm_ref(x[:used].double(), w.double(), counts.cpu())
    torch.testing.assert_close(y[:used].double(), ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_wgrad_of_experts_past_the_rows_is_zero(dtype):
    # Counts summing past T (unchecked on the GPU): expert 1's rows are clamped away, so it is empty and its
    # weight gradient exactly zero, like expert 2's; expert 0 still gets its rows.
    counts = torch.tensor([9, 3, 0], device="cuda")
    x, dy = torch.randn(9, 16, device="cuda", dtype=dtype), torch.randn(9, 8, device="cuda", dtype=dtype)
    poison_allocator()
    dw = torch.ops.moe_core.grouped_gemm_wgrad(x, dy, counts, False)
    torch.testing.assert_close(dw[0].double(), x.double().t() @ dy.double(), rtol=2e-2, atol=2e-2)
    assert torch.equal(dw[1:], torch.zeros(2, 16, 8, device="cuda", dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_wgrad_of_an_expert_reads_only_its_rows(dtype):
    # dW[e] depends on expert e's rows alone: infinities in expert 2's rows, which the sm_90a row-range kernel
    # loads into expert 0's last k-tile and masks, must not reach dW[0] (0 * inf is NaN); empty expert 1, which
    # starts where they do, gets exact zeros (its one k-tile is read past T); expert 3's last k-tile runs past T.
    counts = torch.tensor([5, 0, 70, 3], device="cuda")
    x, dy = torch.randn(78, 136, device="cuda", dtype=dtype), torch.randn(78, 40, device="cuda", dtype=dtype)
    x[5:75], dy[5:75] = float("inf"), float("inf")
    poison_allocator()
    dw = torch.ops.moe_core.grouped_gemm_wgrad(x, dy, counts, False)
    for e, rows in ((0, slice(0, 5)), (3, slice(75, 78))):
        ref = x[rows].double().t() @ dy[rows].double()
        torch.testing.assert_close(dw[e].double(), ref, rtol=2e-2, atol=2e-2)
    assert torch.equal(dw[1], torch.zeros(136, 40, device="cuda", dtype=dtype))


def assert_wgrad_matches_element_by_element(counts: torch.Tensor, k: int, n: int) -> None:
    """The bf16 wgrad of random x [T, k] and dy [T, n] against float64, element by element, on poisoned memory."""
    x = torch.randn(int(counts.sum()), k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(x.shape[0], n, device="cuda", dtype=torch.bfloat16)
    poison_allocator()
    dw = torch.ops.moe_core.grouped_gemm_wgrad(x, dy, counts.cuda(), False)
    ref = grouped_gemm_wgrad_ref(x.double(), dy.double(), counts, False)
    torch.testing.assert_close(dw.double(), ref, rtol=2e-2, atol=2e-2)


def test_wgrad_partial_k_tiles_keep_every_row():
    # The sm_90a row-range wgrad runs an expert's last, partial 32-row k-tile with only the 16-row wgmmas that
    # hold its rows: counts on both sides of every 16-row step, within one k-tile and after full ones. A wgmma
    # skipped one step too early drops up to 16 rows' products, far beyond the tolerance.
    counts = torch.tensor([1, 15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 64, 65, 80, 81, 127, 0, 5])
    assert_wgrad_matches_element_by_element(counts, 128, 256)


@pytest.mark.parametrize("num_experts", [200, 256, 257, 1024, 1025, 1100])
def test_wgrad_walks_every_expert_whatever_its_place(num_experts):
    # The sm_90a row-range wgrad walks the experts by rows, most first (ranked by counting up to 256 experts,
    # kCountedExperts, by a radix sort up to 1024, kSortedExperts), else in their own order: every expert's
    # gradient must land in its own slot either way, on both sides of each limit. Skewed counts with ties (many
    # 0s and 1s) and a few heavy experts.
    gen = torch.Generator().manual_seed(num_experts)
    counts = torch.randint(0, 3, (num_experts,), generator=gen) ** 4
    counts[torch.randint(0, num_experts, (4,), generator=gen)] = torch.tensor([700, 300, 130, 64])
    check_against_float64(counts, 64, 256, torch.bfloat16, trans_weight=False)
    # Element by element too: a one-row expert's gradient in another's slot would barely move the norms above.
    assert_wgrad_matches_element_by_element(counts, 64, 256)


def assert_forward_and_dgrad_match_element_by_element(counts: torch.Tensor, k: int, n: int,
                                                       trans_weight: bool) -> None:
    """The bf16 forward of random x [T, k] and its dgrad from dy [T, n] against float64, element by element, on
    poisoned memory; w is [E, n, k] when trans_weight, else [E, k, n]."""
    x = torch.randn(int(counts.sum()), k, device="cuda", dtype=torch.bfloat16)
    shape = (counts.numel(), n, k) if trans_weight else (counts.numel(), k, n)
    w = torch.randn(shape, device="cuda", dtype=torch.bfloat16) / k**0.5
    dy = torch.randn(x.shape[0], n, device="cuda", dtype=torch.bfloat16)
    poison_allocator()
    y = torch.ops.moe_core.grouped_gemm(x, w, counts.cuda(), trans_weight)
    dx = torch.ops.moe_core.grouped_gemm(dy, w, counts.cuda(), not trans_weight)
    torch.testing.assert_close(y.double(), grouped_gemm_ref(x.double(), w.double(), counts, trans_weight),
                               rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(dx.double(), grouped_gemm_ref(dy.double(), w.double(), counts, not trans_weight),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("num_experts", [7, 9, 1024, 1025, 3000])
def test_forward_lists_every_expert_whatever_its_warp(num_experts):
    # The sm_90a row-tile forward and dgrad list their work tiles in min(ceil(E / 8), 128) blocks of 8 warps, a
    # warp per expert, wrapping past 1024 experts (kMaxListBlocks x kListTileWarps): every expert's rows must
    # come from its own weight on both sides of each limit, walked down the rows (300) and across the columns
    # (700 rows > N), with partial row tiles (129) and column tiles (N = 520).
    gen = torch.Generator().manual_seed(num_experts)
    counts = torch.randint(0, 3, (num_experts,), generator=gen) ** 4
    counts[torch.randint(0, num_experts, (3,), generator=gen)] = torch.tensor([700, 300, 129])
    assert_forward_and_dgrad_match_element_by_element(counts, 64, 520, trans_weight=False)


@pytest.mark.parametrize("trans_weight", [False, True], ids=["KN", "NK"])
def test_forward_half_row_tiles_keep_every_row(trans_weight):
    # The sm_90a row-tile forward and dgrad run an expert's last row tile as a 64-row half tile (the warpgroups
    # side by side along N, stacked in the epilogue's buffers) when it holds at most 64 of the expert's rows:
    # counts on both sides of 64 within the first row tile and after one and two full ones, a partial last
    # column tile (N = 520) and a partial last k-tile (K = 200), element by element on NaN-poisoned memory.
    torch.manual_seed(11)
    counts = torch.tensor([1, 63, 64, 65, 127, 128, 129, 191, 192, 193, 0, 7, 320, 321])
    assert_forward_and_dgrad_match_element_by_element(counts, 200, 520, trans_weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_counts_summing_past_int64_do_not_wrap(dtype):
    # Unchecked GPU counts whose sum overflows int64: each count is clamped to T before the prefix sums, so
    # expert 0 takes every row and the others are empty instead of negative offsets reaching outside memory.
    counts = torch.tensor([1 << 62, 1 << 62, 1 << 62, 3], device="cuda")
    x, dy = torch.randn(10, 64, device="cuda", dtype=dtype), torch.randn(10, 32, device="cuda", dtype=dtype)
    w = torch.randn(4, 64, 32, device="cuda", dtype=dtype) / 8
    poison_allocator()
    y = torch.ops.moe_core.grouped_gemm(x, w, counts, False)
    dw = torch.ops.moe_core.grouped_gemm_wgrad(x, dy, counts, False)
    torch.testing.assert_close(y.double(), x.double() @ w[0].double(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(dw[0].double(), x.double().t() @ dy.double(), rtol=2e-2, atol=2e-2)
    assert torch.equal(dw[1:], torch.zeros(3, 64, 32, device="cuda", dtype=dtype))


def test_zero_reduction_width_and_no_experts():
    x, w = torch.randn(5, 0, device="cuda"), torch.randn(2, 0, 4, device="cuda")
    assert torch.equal(grouped_gemm(x, w, torch.tensor([2, 3], device="cuda")), torch.zeros(5, 4, device="cuda"))
    dw = torch.ops.moe_core.grouped_gemm_wgrad(torch.randn(0, 8, device="cuda"), torch.randn(0, 4, device="cuda"),
                                               torch.zeros(3, dtype=torch.int32, device="cuda"), False)
    assert torch.equal(dw, torch.zeros(3, 8, 4, device="cuda"))


def sanitizer_smoke() -> None:
    """A few small calls with empty experts through every back end, for compute-sanitizer (memcheck,
    racecheck): ``compute-sanitizer --tool memcheck python3 -m tests.ops.test_grouped_gemm_cuda``."""
    import os

    counts = torch.tensor([0, 37, 0, 200, 3, 0], device="cuda")
    t = int(counts.sum())
    for portable in ("0", "1"):
        os.environ["MOE_CORE_GEMM_PORTABLE"] = portable
        for dtype, (k, n) in ((torch.bfloat16, (72, 40)), (torch.bfloat16, (41, 9)), (torch.float32, (72, 40))):
            x = torch.randn(t, k, device="cuda", dtype=dtype, requires_grad=True)
            w = torch.randn(6, k, n, device="cuda", dtype=dtype, requires_grad=True)
            grouped_gemm(x, w, counts).backward(torch.randn(t, n, device="cuda", dtype=dtype))
            main_grad = torch.zeros(6, k, n, device="cuda")
            torch.ops.moe_core.grouped_gemm_wgrad_accum_(main_grad, x.detach(), x.new_ones(t, n), counts, False)
        os.environ["MOE_CORE_GEMM_TILE"] = "rows"  # the row-range accumulating wgrad, where sm_90a runs
        x = torch.randn(t, 64, device="cuda", dtype=torch.bfloat16)
        torch.ops.moe_core.grouped_gemm_wgrad_accum_(torch.zeros(6, 64, 32, device="cuda"), x, x[:, :32], counts, False)
        del os.environ["MOE_CORE_GEMM_TILE"]
        torch.ops.moe_core.grouped_gemm(torch.empty(0, 64, device="cuda", dtype=torch.bfloat16),
                                        torch.randn(6, 64, 32, device="cuda", dtype=torch.bfloat16),
                                        torch.zeros(6, dtype=torch.int64, device="cuda"), False)
        # sm_90a: the wgrad's experts radix-sorted by rows; the forward's listing over 300 experts, with 150
        # unused rows past the counts' sum.
        many = torch.randint(0, 3, (300,), device="cuda")
        x = torch.randn(int(many.sum()) + 150, 64, device="cuda", dtype=torch.bfloat16)
        torch.ops.moe_core.grouped_gemm_wgrad(x, x[:, :32], many, False)
        torch.ops.moe_core.grouped_gemm(x, torch.randn(300, 64, 32, device="cuda", dtype=torch.bfloat16), many, False)
    torch.cuda.synchronize()
    print("sanitizer smoke: done")


if __name__ == "__main__":
    sanitizer_smoke()
