"""SFT with packed, document-masked conversations across ranks: EP = 2 over two DP ranks (the loss over the labels
that count on every rank, one all-reduce) and TP = 2 with sequence parallelism (masks and positions over the
whole sequence) follow the single-process run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_core.config import TransformerConfig
from moe_core.training.config import TrainingConfig
from moe_core.training.trainer import pretrain
from tests.parallel._common import groups
from tests.parallel._launch import run_distributed
from tests.training._tokenizers import build_tokenizer_dir

CHAT = Path(__file__).resolve().parents[2] / "examples" / "chat_sft.jsonl"


def _configs(tokenizer: str, output_dir: str, ep: int = 1, tp: int = 1) -> tuple[TransformerConfig, TrainingConfig]:
    model = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=2, ffn_hidden_size=64,
                              vocab_size=512, seq_length=128, num_moe_experts=4, moe_router_topk=2,
                              moe_ffn_hidden_size=32, expert_model_parallel_size=ep, tensor_model_parallel_size=tp,
                              sequence_parallel=tp > 1)
    train = TrainingConfig(micro_batch_size=8 // ep, global_batch_size=8, train_iters=3, lr=3e-3, log_interval=1,
                           eval_iters=2, output_dir=output_dir, bf16=False, sft=True, data_path=[str(CHAT)],
                           tokenizer=tokenizer, split="9,1")
    return model, train


def _pretrain(tokenizer: str, output_dir: str, ep: int, tp: int) -> dict:
    model_cfg, train_cfg = _configs(tokenizer, output_dir, ep, tp)
    summary = pretrain(model_cfg, train_cfg, log=lambda *_: None, pg_collection=groups(ep, 4, tp, tp))
    return {"start": summary.start_valid_loss, "end": summary.end_valid_loss, "train": summary.train_losses}


@pytest.mark.parametrize("ep, tp", [(2, 1), (1, 2)], ids=["ep2-dp2", "tp2-sp"])
def test_sft_across_ranks_follows_single_process(tmp_path, ep, tp):
    tokenizer = str(build_tokenizer_dir(tmp_path / "tokenizer") / "tokenizer.json")
    single = pretrain(*_configs(tokenizer, str(tmp_path / "single")), log=lambda *_: None)
    ranks = run_distributed(2, _pretrain, timeout=180, tokenizer=tokenizer, output_dir=str(tmp_path / "ranks"),
                            ep=ep, tp=tp)
    assert ranks[0] == ranks[1]
    torch.testing.assert_close(ranks[0]["start"], single.start_valid_loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(ranks[0]["train"]), torch.tensor(single.train_losses), rtol=1e-4, atol=0)
    torch.testing.assert_close(ranks[0]["end"], single.end_valid_loss, rtol=1e-4, atol=0)
