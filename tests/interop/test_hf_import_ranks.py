"""The import tool on 2 gloo ranks at EP = 2, when the HF checkpoint is bad in rows only one rank reads (a NaN
in an expert of rank 1): every rank raises, naming the tensor, none waits in a collective for the other."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from tests.interop._common import CASES, build_hf
from tests.parallel._launch import BACKEND, RankFailure, run_distributed

TOOLS = Path(__file__).resolve().parents[2] / "tools"
EXPERT = "model.layers.1.mlp.experts.5.gate_proj.weight"  # expert 5 of 8: rank 1's at EP = 2


def _import_on_rank(path: str, out: str) -> None:
    sys.path.insert(0, str(TOOLS))
    import hf_checkpoint

    hf_checkpoint.import_hf(path, out, expert_model_parallel_size=2)


@pytest.mark.skipif(BACKEND == "nccl", reason="the import tool is a CPU conversion on gloo; this pool runs NCCL")
def test_a_nan_in_one_ranks_experts_fails_every_rank(tmp_path):
    build_hf(CASES["qwen3-gqa-hd16-e8k2"]()).save_pretrained(tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    tensors[EXPERT][0, 0] = float("nan")
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(RankFailure) as failure:
        run_distributed(2, _import_on_rank, timeout=60, path=str(tmp_path / "hf"), out=str(tmp_path / "out"))
    ranks = str(failure.value).split("--- rank ")[1:]
    assert [r[0] for r in ranks] == ["0", "1"]  # both ranks raised: neither is left in a collective
    assert all(f"tensor {EXPERT} holds NaN or Inf" in r for r in ranks)
    assert "rank 1: " in ranks[0]
    assert not (tmp_path / "out").exists()
