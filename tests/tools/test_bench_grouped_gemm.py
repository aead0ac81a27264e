"""The benchmark's timing order: the compared kernels must follow the same work as often as each other."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import bench_grouped_gemm as bench  # noqa: E402


def _predecessors(plan, configs):
    """(config, config timed just before it) for every timing of the plan but the first."""
    sequence = [configs[i] for _, i in plan]
    return list(zip(sequence[1:], sequence[:-1]))


@pytest.mark.parametrize("extra", [[], [("moe_core", {"MOE_CORE_GEMM_TILE": "rows"})]])
def test_compared_kernels_never_follow_the_loop_and_take_every_place_alike(extra):
    configs = [(p, None) for p in bench.PROVIDERS] + extra
    compared = [c for c in configs if c[0] != "loop"]
    rounds = 2 * len(compared)  # 6 (the full benchmark's) for the three default providers
    plan = bench.timing_plan(configs, rounds, bench.PASSES)
    loop_timings = [k for k, (_, i) in enumerate(plan) if configs[i][0] == "loop"]
    assert loop_timings == list(range(len(loop_timings)))  # all before the compared kernels
    pairs = _predecessors(plan, configs)
    assert all(before[0] != "loop" for after, before in pairs if after[0] not in ("loop", "dense"))
    per_round = len(bench.PASSES) * len(compared)
    orders = [[configs[i] for _, i in plan[len(loop_timings) + r * per_round:][:len(compared)]]
              for r in range(rounds)]
    for place in range(len(compared)):
        assert sorted((order[place] for order in orders), key=str) == sorted(2 * compared, key=str)


def test_every_config_is_timed_once_per_round_and_pass():
    configs = [(p, None) for p in bench.PROVIDERS] + [("moe_core", {"MOE_CORE_GEMM_TILE": "rows"})]
    plan = bench.timing_plan(configs, 6, bench.PASSES)
    assert sorted(plan) == sorted((name, i) for name in bench.PASSES for i in range(len(configs)) for _ in range(6))


def test_skewed_shapes_are_compared_with_the_same_shape_under_uniform_counts():
    def result(t, skew, tflops):
        return dict(name=f"T{t} {skew}", k=2048, n=1536, e=128, t=t, skew=skew,
                    tflops={"moe_core": {"fwd": tflops}})

    results = [result(65536, None, 600.0), result(32768, None, 500.0), result(32768, 0.3, 400.0),
               result(16384, 0.3, 300.0)]  # the last has no uniform twin: no ratio
    assert bench.skewed_vs_uniform(results) == {"T32768 0.3": {"fwd": 0.8}}
    names = [s["name"] for s in bench.shapes(quick=True)]
    assert all(n.removesuffix(" skewed") in names for n in names if n.endswith(" skewed"))
