"""tools/hf_checkpoint.py and --finetune end to end: import a tiny HF checkpoint, fine-tune it with
tools/pretrain_gpt.py --load ... --finetune, export it, and load the export in transformers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from moe_core.config import TransformerConfig
from moe_core.interop.hf import load_hf
from moe_core.models.gpt import GPTModel
from moe_core.training.checkpoint import load_model_weights
from moe_core.training.config import TrainingConfig
from moe_core.training.trainer import pretrain

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import hf_checkpoint  # noqa: E402
import pretrain_gpt  # noqa: E402


@pytest.fixture
def hf_dir(tmp_path):
    """A tiny Qwen3-MoE over bytes (vocab 256), with a tokenizer file and token ids to carry through export."""
    config = Qwen3MoeConfig(
        vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=48, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, bos_token_id=1, eos_token_id=2, max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, router_aux_loss_coef=0.001)
    torch.manual_seed(0)
    path = tmp_path / "hf"
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    (path / "tokenizer_config.json").write_text('{"model_max_length": 2048}\n')
    return path


def test_import_finetune_export(tmp_path, hf_dir, capsys):
    imported = tmp_path / "imported"
    hf_checkpoint.main(["import", str(hf_dir), str(imported), "--seq-length", "32"])
    assert "--finetune" in capsys.readouterr().out
    config = TransformerConfig.from_yaml(imported / "model.yaml")
    expected_config, expected = load_hf(hf_dir)
    assert config.seq_length == 32 and config.moe_aux_loss_coeff == pytest.approx(0.001 * 2 / 2)
    model = GPTModel(config)
    load_model_weights(str(imported / "checkpoint"), model)
    for name, value in expected.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name

    corpus = []
    for i in range(2):  # two documents: one is the validation split
        corpus.append(tmp_path / f"doc{i}.txt")
        corpus[-1].write_text("".join(f"def f{j}(x):\n    return x * {i + j}\n" for j in range(200)))
    model_cfg, train_cfg = pretrain_gpt.parse_args([
        "--config", str(imported / "model.yaml"), "--load", str(imported / "checkpoint"), "--finetune",
        "--train-iters", "3", "--micro-batch-size", "4", "--lr", "1e-3", "--eval-iters", "1", "--log-interval", "1",
        "--data-path", *map(str, corpus), "--output-dir", str(tmp_path / "run"), "--save", str(tmp_path / "ft")])
    assert train_cfg.finetune and model_cfg == config
    summary = pretrain(model_cfg, train_cfg, log=lambda *_: None)
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps[0] == 0 and steps[-1] == 3  # a fresh run: step 0 to train_iters
    assert len(summary.train_losses) == 3

    out = tmp_path / "exported"
    hf_checkpoint.main(["export", str(out), "--config", str(imported / "model.yaml"), "--load",
                        str(tmp_path / "ft"), "--reference", str(hf_dir)])
    tuned = GPTModel(config).eval()
    load_model_weights(str(tmp_path / "ft"), tuned)
    assert not torch.equal(tuned.embedding.weight, expected.embedding.weight)  # fine-tuning moved the weights
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert (reloaded.config.bos_token_id, reloaded.config.eos_token_id) == (1, 2)
    assert reloaded.config.max_position_embeddings == 2048
    assert reloaded.config.router_aux_loss_coef == pytest.approx(0.001, rel=1e-12)
    assert (out / "tokenizer_config.json").read_text() == (hf_dir / "tokenizer_config.json").read_text()
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (reloaded(ids).logits - tuned(ids)).abs().max() <= 1e-5


def test_finetune_needs_load():
    with pytest.raises(ValueError, match="finetune"):
        TrainingConfig(finetune=True)


def test_finetune_keeps_the_checkpoint_vocabulary(tmp_path):
    """An imported model's vocabulary may be padded past its tokenizer's: --finetune keeps the config's."""
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]")).save(str(tmp_path / "tok.json"))
    flags = ["--config", str(ROOT / "configs" / "tiny.yaml"), "--tokenizer", str(tmp_path / "tok.json")]
    assert pretrain_gpt.parse_args(flags)[0].vocab_size == 3
    assert pretrain_gpt.parse_args(flags + ["--load", "ckpt", "--finetune"])[0].vocab_size == 256
