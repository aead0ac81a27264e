"""tools/bench_moe_layer.py: its peers compute moe_core's function (float64, CPU), and --smoke writes complete rows."""

import dataclasses
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import _bench_common as bench_common  # noqa: E402
import bench_moe_layer as bench  # noqa: E402
from _native_moe import NativeMoE  # noqa: E402

from moe_core.moe.moe_layer import MoELayer  # noqa: E402

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
# (tokens, hidden, ffn, experts, topk); (8, 16, 8, 16, 1) leaves at least 8 experts without a row.
SHAPES = [(37, 16, 8, 8, 2), (8, 16, 8, 16, 1), (23, 16, 12, 4, 4), (64, 32, 16, 16, 8)]


def _layer(spec, dtype=torch.float64, **overrides) -> MoELayer:
    torch.manual_seed(0)
    config = dataclasses.replace(bench.moe_config(*spec), **{"moe_router_dtype": "fp64", **overrides})
    return MoELayer(config).to(dtype)


def _output_and_grads(fn, params, x, dy):
    out = fn(x)
    return (out, *torch.autograd.grad(out, [x, *params], dy))


@pytest.mark.parametrize("spec", SHAPES)
def test_native_layer_equals_moe_core_in_float64(spec):
    layer = _layer(spec)
    native = NativeMoE.from_moe_layer(layer)
    x = torch.randn(spec[0], spec[1], dtype=torch.float64, requires_grad=True)
    dy = torch.randn_like(x)
    params = list(layer.parameters())
    assert {id(p) for p in native.parameters()} == {id(p) for p in params}  # shared, not copied
    expected = _output_and_grads(layer, params, x, dy)
    for got, want in zip(_output_and_grads(native, params, x, dy), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-15)


def test_native_layer_without_renormalisation_is_caught():
    """Negative control: softmax over all experts then top-k without renormalising (moe_router_pre_softmax) is
    another function; the comparison above sees it, and from_moe_layer refuses the config."""
    spec = SHAPES[0]
    layer = _layer(spec, moe_router_pre_softmax=True)
    with pytest.raises(ValueError, match="moe_router_pre_softmax"):
        NativeMoE.from_moe_layer(layer)
    native = NativeMoE(layer.router.weight, layer.experts.linear_fc1.weight, layer.experts.linear_fc2.weight, spec[4])
    x = torch.randn(spec[0], spec[1], dtype=torch.float64)
    assert not torch.allclose(native(x), layer(x), rtol=1e-3, atol=0)


def test_native_grouped_mm_path_equals_the_masked_loop():
    """torch._grouped_mm (CPU kernel, float32) against the CPU stand-in, forward and backward."""
    spec = (48, 32, 16, 8, 2)
    layer = _layer(spec, dtype=torch.float32)
    x = torch.randn(spec[0], spec[1], requires_grad=True)
    dy = torch.randn_like(x)
    params = list(layer.parameters())
    grouped = _output_and_grads(NativeMoE.from_moe_layer(layer, grouped_mm=True), params, x, dy)
    masked = _output_and_grads(NativeMoE.from_moe_layer(layer, grouped_mm=False), params, x, dy)
    for got, want in zip(grouped, masked, strict=True):
        torch.testing.assert_close(got, want)


def test_sequential_provider_equals_moe_core_in_float64():
    spec = SHAPES[0]
    layer = _layer(spec)
    x = torch.randn(spec[0], spec[1], dtype=torch.float64)
    torch.testing.assert_close(bench.sequential_layer(layer)(x), layer(x), rtol=1e-10, atol=1e-15)


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
def test_hf_block_equals_moe_core():
    """The weight mapping into Qwen3MoeSparseMoeBlock (float32: its grouped_mm has no float64 kernel)."""
    spec = (40, 32, 16, 8, 2)
    layer = _layer(spec, dtype=torch.float32)
    x = torch.randn(spec[0], spec[1])
    block = bench.hf_block(layer)
    assert block.experts.config._experts_implementation == "grouped_mm"
    torch.testing.assert_close(block(x.unsqueeze(0)).squeeze(0), layer(x))


def test_smoke_writes_a_row_per_provider_and_pass(tmp_path):
    out = tmp_path / "rows.json"
    bench.main(["--smoke", "--json", str(out), "--profile-steps", "1"])
    data = json.loads(out.read_text())
    assert data["device"] == "cpu" and data["torch"] == torch.__version__
    providers = [p for p in bench.PROVIDERS if p != "hf" or HAS_TRANSFORMERS]
    rows = {(r["provider"], r["pass"]): r for r in data["rows"]}
    assert sorted(rows) == sorted((p, name) for p in providers for name in bench.PASSES)
    for (provider, _), row in rows.items():
        assert row["shape"] == "smoke"
        if provider == "moe_core_compiled" and row.get("error"):
            continue  # a graph break under fullgraph is recorded, not fatal (it is what the tool reports)
        assert "error" not in row, row.get("error")
        for key in ("median_ms", "min_ms", "max_ms", "spread", "tflops", "gemm_ms", "rest_ms", "max_abs_diff",
                    "speedup_vs_native", "speedup_vs_native_compiled"):
            assert math.isfinite(row[key]) and row[key] >= 0, (provider, key, row[key])
        assert row["min_ms"] <= row["median_ms"] <= row["max_ms"] and row["peak_gib"] is None
        assert 0 <= row["non_gemm_share"] <= 1 and row["gemm_ms"] > 0
        assert row["kernel_ms"] == row["gemm_ms"] + row["rest_ms"]
        assert len(row["top_non_gemm"]) == 5 and {"name", "ms"} <= set(row["top_non_gemm"][0])
        assert row["max_abs_diff"] < 1e-5  # float32, one function
    assert rows[("native", "fwd")]["speedup_vs_native"] == 1.0


def test_a_failing_provider_is_recorded_and_the_others_run(tmp_path):
    out = tmp_path / "rows.json"
    bench.main(["--smoke", "--providers", "native_compiled", "native", "--passes", "fwd", "--profile-steps", "0",
                "--compile-backend", "no_such_backend", "--json", str(out)])
    failed, ran = json.loads(out.read_text())["rows"]
    assert failed["provider"] == "native_compiled" and "no_such_backend" in failed["error"]
    assert ran["provider"] == "native" and "error" not in ran and ran["median_ms"] > 0


def test_rounds_take_the_providers_in_turn():
    """Timed calls split over rounds, provider after provider (each round's warm-up first); a provider that fails
    leaves the later rounds, the others keep their counts."""
    calls = []

    def provider(name: str, fail_on: int | None = None):
        def fn():
            calls.append(name)
            if fail_on is not None and len(calls) >= fail_on:
                raise RuntimeError("out of memory")
        return fn

    args = bench.parse_args(["--smoke", "--rounds", "2", "--warmup", "1"])
    times, errors = bench.timed_in_rounds({"a": provider("a"), "b": provider("b")}, {"a": 3, "b": 2}, args,
                                          torch.device("cpu"))
    assert calls == ["a"] * 3 + ["b"] * 2 + ["a"] * 2 + ["b"] * 2  # warm-up + 2 / 1, then warm-up + 1 / 1
    assert (times["a"]["iters"], times["b"]["iters"], errors) == (3, 2, {})
    calls.clear()
    times, errors = bench.timed_in_rounds({"a": provider("a"), "b": provider("b", fail_on=4)}, {"a": 3, "b": 2},
                                          args, torch.device("cpu"))
    assert calls == ["a"] * 3 + ["b"] + ["a"] * 2 and list(errors) == ["b"] and times["a"]["iters"] == 3


@pytest.mark.gpu
def test_cuda_native_layer_is_as_accurate_as_moe_core_in_bf16():
    """torch._grouped_mm's path on CUDA: its bf16 error against float64 at most twice moe_core's bf16 error.

    Weights and input are bf16 values and both routers run in fp32, so all three route alike."""
    spec = (512, 256, 128, 16, 4)
    layer = _layer(spec, moe_router_dtype="fp32").cuda()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(p.bfloat16())
    x = torch.randn(spec[0], spec[1], device="cuda", dtype=torch.bfloat16)
    expected = layer(x.double())
    layer.to(torch.bfloat16)
    native = NativeMoE.from_moe_layer(layer)
    assert native.grouped_mm is None  # torch._grouped_mm on CUDA
    err_native = (native(x).double() - expected).abs().max().item()
    err_moe_core = (layer(x).double() - expected).abs().max().item()
    assert err_native <= 2 * err_moe_core + 1e-6


@pytest.mark.gpu
def test_cuda_rows_time_profile_and_measure_memory():
    args = bench.parse_args(["--providers", "moe_core", "native", "native_compiled", "sequential", "--iters", "3",
                             "--warmup", "2", "--profile-steps", "1"])
    rows = bench.bench_shape("gpu_test", (1024, 256, 128, 16, 4), args, torch.device("cuda"), torch.bfloat16)
    assert len(rows) == 4 * len(bench.PASSES)
    for row in rows:
        assert "error" not in row, (row["provider"], row.get("error"))
        assert row["gemm_ms"] > 0 and row["rest_ms"] > 0 and row["peak_gib"] > 0 and row["median_ms"] > 0
        # No GEMM among the rest: the same name rule (a kernel's head, setup kernels excluded) as the split.
        assert not any(bench_common.GEMM.search(bench_common.kernel_head(k["name"])) for k in row["top_non_gemm"])
