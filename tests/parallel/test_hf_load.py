"""``load_hf_weights`` on 2 gloo ranks: under EP, FSDP2 and both, each rank reads exactly the HF elements it
holds (its experts, its FSDP2 rows, or columns of a gated fc1) and the gathered model equals the single-process
``load_hf`` bitwise; the import tool under EP = 2 writes the checkpoint of the single-process load."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from moe_core.interop.hf import load_hf, load_hf_weights, read_hf_config
from moe_core.interop.hf_config import config_from_hf
from moe_core.models.full_state import gather_full_state_dict
from moe_core.models.gpt import GPTModel
from moe_core.models.param_roles import model_parts
from moe_core.parallel.ddp import apply_ddp
from moe_core.parallel.fsdp import apply_fsdp2
from moe_core.training.checkpoint import load_model_weights
from tests.parallel._common import groups
from tests.parallel._launch import BACKEND, device, run_distributed

NUM_EXPERTS = 8
TOOLS = Path(__file__).resolve().parents[2] / "tools"


def _load_on_rank(path: str, ep: int, wrap: str) -> dict:
    pg = groups(ep, NUM_EXPERTS)
    config = dataclasses.replace(config_from_hf(read_hf_config(path)), expert_model_parallel_size=ep)
    model = GPTModel(config, pg).to(device())
    if wrap != "none":
        (apply_fsdp2 if wrap == "fsdp2" else apply_ddp)(model, pg, model_parts(model))
    rows = load_hf_weights(model, path, pg)
    read = sum(rows.values())
    held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
    full = {name: value.cpu() for name, value in gather_full_state_dict(model, pg).items()}
    return {"rows": rows, "read": read, "held": held, "full": full,
            "experts": pg.local_expert_indices(NUM_EXPERTS)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A Qwen3-MoE with a dense layer and a q/k/v split that FSDP2's halves straddle (q 24, k 8, v 8 rows)."""
    hf_config = Qwen3MoeConfig(
        vocab_size=130, hidden_size=32, num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=1,
        head_dim=8, intermediate_size=40, moe_intermediate_size=16, num_experts=NUM_EXPERTS, num_experts_per_tok=2,
        mlp_only_layers=[1], rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("hf")
    AutoModelForCausalLM.from_config(hf_config).save_pretrained(path, max_shard_size="20KB")
    _, reference = load_hf(path)
    return str(path), reference.state_dict()


@pytest.mark.parametrize("ep,wrap", [(2, "none"), (2, "ddp"), (2, "fsdp2"), (1, "fsdp2")])
def test_each_rank_reads_what_it_holds(checkpoint, ep, wrap):
    path, reference = checkpoint
    ranks = run_distributed(2, _load_on_rank, timeout=120, path=path, ep=ep, wrap=wrap)
    total = sum(v.numel() for v in reference.values())
    for rank, result in enumerate(ranks):
        assert result["read"] == result["held"] < total, (rank, result["read"], result["held"], total)
        experts_read = {int(key.split(".experts.")[1].split(".")[0]) for key in result["rows"] if ".experts." in key}
        assert experts_read <= set(result["experts"])
        assert result["full"].keys() == reference.keys()
        for name, value in reference.items():
            assert torch.equal(result["full"][name], value), (rank, name)
    if ep == 2:
        assert ranks[0]["experts"] == [0, 1, 2, 3] and ranks[1]["experts"] == [4, 5, 6, 7]


def _import_on_rank(path: str, out: str) -> None:
    sys.path.insert(0, str(TOOLS))
    import hf_checkpoint

    hf_checkpoint.import_hf(path, out, expert_model_parallel_size=2)


def _load_weights_on_rank(path: str, checkpoint_dir: str, fsdp2: bool) -> dict:
    """What pretrain --finetune does under EP = 2: the model's weights only, into a wrapped EP model."""
    pg = groups(2, NUM_EXPERTS)
    config = dataclasses.replace(config_from_hf(read_hf_config(path)), expert_model_parallel_size=2)
    model = GPTModel(config, pg).to(device())
    (apply_fsdp2 if fsdp2 else apply_ddp)(model, pg, model_parts(model))
    load_model_weights(checkpoint_dir, model, pg)
    return {name: value.cpu() for name, value in gather_full_state_dict(model, pg).items()}


@pytest.mark.skipif(BACKEND == "nccl", reason="the import tool is a CPU conversion on gloo; this pool runs NCCL")
def test_import_tool_under_ep2_writes_the_single_process_weights(checkpoint, tmp_path):
    path, reference = checkpoint
    run_distributed(2, _import_on_rank, timeout=120, path=path, out=str(tmp_path / "imported"))
    model = GPTModel(config_from_hf(read_hf_config(path)))
    load_model_weights(str(tmp_path / "imported" / "checkpoint"), model)
    assert model.state_dict().keys() == reference.keys()
    for name, value in reference.items():
        assert torch.equal(model.state_dict()[name], value), name
    for fsdp2 in (False, True):
        ranks = run_distributed(2, _load_weights_on_rank, timeout=120, path=path, fsdp2=fsdp2,
                                checkpoint_dir=str(tmp_path / "imported" / "checkpoint"))
        for full in ranks:
            for name, value in reference.items():
                assert torch.equal(full[name], value), (fsdp2, name)
