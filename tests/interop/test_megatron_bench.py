"""tools/bench_megatron_experts.py --smoke on the CPU: a complete row for each provider and pass, every provider's
output equal to SequentialMLP's. In a harness rank: the tool sets up Megatron's parallel state there."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import bench_megatron_experts as bench  # noqa: E402

from tests.interop._megatron_env import DEADLINE_S  # noqa: E402
from tests.parallel._launch import close_pools, run_distributed  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _close_pools():
    yield
    close_pools()


def _smoke(path: str) -> None:
    bench.main(["--smoke", "--json", path])


def test_smoke_writes_a_row_per_provider_and_pass(tmp_path):
    out = tmp_path / "rows.json"
    run_distributed(1, _smoke, timeout=DEADLINE_S, path=str(out))
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["megatron_core"]
    rows = result["rows"]
    assert [(r["provider"], r["pass"]) for r in rows] == [(p, s) for p in bench.PROVIDERS for s in bench.PASSES]
    for row in rows:
        assert "error" not in row, row
        assert row["median_ms"] > 0 and row["speedup"] > 0 and row["tflops"] > 0
        assert row["max_abs_diff"] < 1e-6  # float32, the same weights: the same function
    assert {r["speedup"] for r in rows if r["provider"] == "sequential"} == {1.0}


def test_bad_iteration_counts_are_refused(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--smoke", "--iters", "0"])
    assert "argument --iters: expected at least 1, got 0" in capsys.readouterr().err
