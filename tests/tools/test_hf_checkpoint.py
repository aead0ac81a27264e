"""tools/hf_checkpoint.py and --finetune end to end: import a tiny HF checkpoint, fine-tune it with
tools/pretrain_gpt.py --load ... --finetune, export it, and load the export in transformers. Then what the
tool refuses: --finetune of an import under another routing (the import records its config), an export whose
--config differs from the checkpoint's recorded config or whose checkpoint records none, and import targets
that hold anything but an earlier import of the same checkpoint."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from moe_core.config import TransformerConfig
from moe_core.interop.hf import load_hf
from moe_core.models.gpt import GPTModel
from moe_core.training.checkpoint import CheckpointError, load_model_weights, save_checkpoint
from moe_core.training.config import TrainingConfig
from moe_core.training.schedule import build_scheduler
from moe_core.training.step import build_optimizer
from moe_core.training.trainer import pretrain

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import hf_checkpoint  # noqa: E402
import pretrain_gpt  # noqa: E402


def _qwen3(path: Path, **changes) -> Path:
    """A tiny Qwen3-MoE over bytes (vocab 256), with a tokenizer file and token ids to carry through export."""
    config = Qwen3MoeConfig(**{**dict(
        vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=48, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, bos_token_id=1, eos_token_id=2, max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, router_aux_loss_coef=0.001), **changes})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    (path / "tokenizer_config.json").write_text('{"model_max_length": 2048}\n')
    return path


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return _qwen3(tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def imported(hf_dir, tmp_path_factory):
    """The import of ``hf_dir`` (seq_length 32): not to be changed by the tests."""
    out = tmp_path_factory.mktemp("imported") / "imported"
    hf_checkpoint.import_hf(str(hf_dir), str(out), seq_length=32)
    return out


def _corpus(tmp_path: Path) -> list[str]:
    corpus = []
    for i in range(2):  # two documents: one is the validation split
        corpus.append(tmp_path / f"doc{i}.txt")
        corpus[-1].write_text("".join(f"def f{j}(x):\n    return x * {i + j}\n" for j in range(200)))
    return [str(path) for path in corpus]


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

    model_cfg, train_cfg = pretrain_gpt.parse_args([
        "--config", str(imported / "model.yaml"), "--load", str(imported / "checkpoint"), "--finetune",
        "--train-iters", "3", "--micro-batch-size", "4", "--lr", "1e-3", "--eval-iters", "1", "--log-interval", "1",
        "--data-path", *_corpus(tmp_path), "--output-dir", str(tmp_path / "run"), "--save", str(tmp_path / "ft")])
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


def test_import_records_the_model_config(imported):
    """state.json holds the imported model's TransformerConfig, as save_checkpoint records a training run's."""
    config = TransformerConfig.from_yaml(imported / "model.yaml")
    state = json.loads((imported / "checkpoint" / "step_0" / "state.json").read_text())
    assert state["model_config"] == json.loads(json.dumps(dataclasses.asdict(config)))


@pytest.mark.parametrize("flags, field", [
    (["--moe-router-topk", "4"], "moe_router_topk: 2 in the checkpoint, 4 now"),
    (["--moe-router-score-function", "sigmoid"], "moe_router_score_function: 'softmax' in the checkpoint, 'sigmoid'"),
])
def test_finetune_of_an_import_under_another_routing_is_refused(imported, tmp_path, flags, field):
    model_cfg, train_cfg = pretrain_gpt.parse_args([
        "--config", str(imported / "model.yaml"), "--load", str(imported / "checkpoint"), "--finetune", *flags,
        "--train-iters", "1", "--micro-batch-size", "2", "--eval-iters", "1", "--data-path", *_corpus(tmp_path),
        "--output-dir", str(tmp_path / "run")])
    with pytest.raises(CheckpointError, match=f"holds another architecture \\({field}"):
        pretrain(model_cfg, train_cfg, log=lambda *_: None)


def test_export_refuses_a_config_other_than_the_checkpoints(imported, tmp_path):
    """A top-4 YAML over top-2 weights would publish num_experts_per_tok: 4."""
    top4 = tmp_path / "top4.yaml"
    top4.write_text((imported / "model.yaml").read_text().replace("moe_router_topk: 2", "moe_router_topk: 4"))
    with pytest.raises(CheckpointError, match="moe_router_topk: 2 in the checkpoint, 4 now"):
        hf_checkpoint.main(["export", str(tmp_path / "out"), "--config", str(top4), "--load",
                            str(imported / "checkpoint")])
    assert not (tmp_path / "out").exists()


def test_export_refuses_a_checkpoint_without_a_recorded_config(imported, tmp_path):
    config = TransformerConfig.from_yaml(imported / "model.yaml")
    model, training = GPTModel(config), TrainingConfig()
    optimizer = build_optimizer(model, training)
    scheduler = build_scheduler(optimizer, training.lr, training.min_lr, training.lr_warmup_iters,
                                training.train_iters)
    save_checkpoint(tmp_path / "unrecorded", model, optimizer, scheduler, 0, seed=training.seed)  # no model_config
    with pytest.raises(CheckpointError, match="state.json records no model config.*hf_checkpoint.py import"):
        hf_checkpoint.export_hf(str(imported / "model.yaml"), str(tmp_path / "unrecorded"), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_import_refuses_a_directory_holding_anything_else(hf_dir, imported, tmp_path):
    run = tmp_path / "run"  # a training run's save directory
    (run / "step_2").mkdir(parents=True)
    (run / "latest").write_text("step_2\n")
    trained = tmp_path / "trained"  # an import whose checkpoint directory a run saved into
    shutil.copytree(imported, trained)
    shutil.copytree(trained / "checkpoint" / "step_0", trained / "checkpoint" / "step_3")
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "notes.txt").write_text("mine")
    other = _qwen3(tmp_path / "other", num_experts_per_tok=4)
    cases = [(hf_dir, run, "holds a training run's checkpoints \\(latest, step_2\\)"),
             (hf_dir, trained, "holds a training run's checkpoints \\(checkpoint/step_3\\)"),
             (hf_dir, notes, "holds notes.txt, not an earlier import of"),
             (other, imported, f"holds checkpoint, model.yaml, not an earlier import of {other.resolve()}")]
    for source, target, message in cases:
        before = _tree(target)
        with pytest.raises(FileExistsError, match=f"out_dir: {target} {message}"):
            hf_checkpoint.main(["import", str(source), str(target)])
        assert _tree(target) == before


def test_import_replaces_an_earlier_import_of_the_same_checkpoint(hf_dir, imported, tmp_path):
    again = tmp_path / "imported"
    shutil.copytree(imported, again)
    (tmp_path / "imported.tmp").mkdir()  # what a killed import left
    (tmp_path / "imported.tmp" / "model.yaml").write_text("partial")
    hf_checkpoint.import_hf(str(hf_dir), str(again), seq_length=64)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["imported"]
    assert TransformerConfig.from_yaml(again / "model.yaml") == dataclasses.replace(
        TransformerConfig.from_yaml(imported / "model.yaml"), seq_length=64)
    assert sorted(p.name for p in (again / "checkpoint").iterdir()) == ["latest", "step_0"]
