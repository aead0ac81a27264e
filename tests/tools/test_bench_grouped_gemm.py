"""The benchmark's timing order: the compared kernels must follow the same work as often as each other."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import bench_grouped_gemm as bench  # noqa: E402


def _predecessors(configs, rounds):
    """(provider, provider timed just before it) for every timing of `rounds` rounds, passes included."""
    sequence = [configs[i] for r in range(rounds) for _ in bench.PASSES for i in bench.round_order(configs, r)]
    return list(zip(sequence[1:], sequence[:-1]))


@pytest.mark.parametrize("extra", [[], [("moe_core", {"MOE_CORE_GEMM_TILE": "rows"})]])
def test_grouped_kernels_never_follow_the_loop_and_alternate(extra):
    configs = [(p, None) for p in bench.PROVIDERS] + extra
    pairs = _predecessors(configs, rounds=6)
    grouped = [c for c in configs if c[0] not in bench.BASELINES]
    assert all(before[0] != "loop" for after, before in pairs if after in grouped)
    # Each grouped kernel comes first in the grouped block (right after dense) equally often.
    firsts = [after for after, before in pairs if before[0] == "dense"]
    assert firsts.count(grouped[0]) == firsts.count(grouped[-1]) > 0


def test_every_config_is_timed_once_per_round_and_pass():
    configs = [(p, None) for p in bench.PROVIDERS]
    for r in range(4):
        assert sorted(bench.round_order(configs, r)) == list(range(len(configs)))


def test_skewed_shapes_are_compared_with_the_same_shape_under_uniform_counts():
    def result(t, skew, tflops):
        return dict(name=f"T{t} {skew}", k=2048, n=1536, e=128, t=t, skew=skew,
                    tflops={"moe_core": {"fwd": tflops}})

    results = [result(65536, None, 600.0), result(32768, None, 500.0), result(32768, 0.3, 400.0),
               result(16384, 0.3, 300.0)]  # the last has no uniform twin: no ratio
    assert bench.skewed_vs_uniform(results) == {"T32768 0.3": {"fwd": 0.8}}
    names = [s["name"] for s in bench.shapes(quick=True)]
    assert all(n.removesuffix(" skewed") in names for n in names if n.endswith(" skewed"))
